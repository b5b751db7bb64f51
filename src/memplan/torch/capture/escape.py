"""A step that keeps a tensor it made outside itself is refused: memplan replays its ops only.

``history.append(loss.detach())`` in the step, or a forward hook that stores a layer's output
in a dict for monitoring, runs only while capture runs the step on fakes: the user's list ends
up holding capture's fake tensors, and no planned step adds to it, silently. Capture's fake
mode keeps a weak reference to every tensor the step's ops make in its first (untraced) run
(:class:`memplan.torch.capture.fake.CaptureFakeMode`); once capture is over and its own
references are gone, one still alive is held by the user's objects (the model, the optimizers'
state and the gradients are put back by then), and the step is refused in one line that names
the container where one is found. A step that returns the tensor instead trains as eager.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Sequence

import torch.fx

import torch
from memplan.errors import UnsupportedOp
from memplan.torch.tensors import tensor_leaves


def held_by_program(gm: torch.fx.GraphModule) -> set[int]:
    """Ids of the fake tensors the traced program holds: its nodes' values and its constants."""
    held = {id(t) for node in gm.graph.nodes for t in tensor_leaves(node.meta.get("val"))}
    held |= {id(t) for t in gm.__dict__.values() if isinstance(t, torch.Tensor)}
    held |= {id(t) for _, t in gm.named_buffers()} | {id(t) for _, t in gm.named_parameters()}
    return held


def refuse_escaped(made: Sequence[weakref.ref], held: set[int]) -> None:
    """Raise :class:`UnsupportedOp` if a tensor of ``made`` is still alive and not in ``held``
    (see the module docstring)."""
    if not any((t := ref()) is not None and id(t) not in held for ref in made):
        return
    gc.collect()
    alive = [t for ref in made if (t := ref()) is not None and id(t) not in held]
    if not alive:
        return
    where = _where(alive[0], alive)
    raise UnsupportedOp(
        f"the step keeps {len(alive)} tensor(s) it made outside itself{where}: memplan replays the step's ops and "
        "cannot put tensors there at each call; return them from the step instead (a monitoring hook: remove it "
        "while the step is compiled)"
    )


def _where(tensor: torch.Tensor, ours: list[torch.Tensor]) -> str:
    """`` (in a list of N items)``, `` (in a dict, key 'k')`` or ``''`` (``ours``: the list of
    the tensors found, not the user's)."""
    for holder in gc.get_referrers(tensor):
        if holder is ours:
            continue
        if isinstance(holder, list):
            return f" (in a list of {len(holder)} items)"
        if isinstance(holder, dict):
            key = next((k for k, v in holder.items() if v is tensor), None)
            if key is not None and not str(key).startswith("__"):
                return f" (in a dict or an object's attribute, key {key!r})"
    return ""
