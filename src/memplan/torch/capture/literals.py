"""Literals: tensors a step makes from Python values (``torch.tensor(0)``, ``torch.tensor([])``).

``make_fx`` keeps each as a constant of the traced program, with the value it had while the
step was traced, and the program copies it (``lift_fresh_copy``). A literal made from a value
that changes from one step to the next (a Python counter, ``random.random()``) would be frozen
in the plan, silently stale. Capture runs the step once untraced before tracing it, and
:func:`check_literals_repeat` refuses a plan whose traced literals (those read outside the
optimizer, which the runtime never runs traced) the earlier run did not make with the same
dtype, shape and bits. A step traced again at another batch shape without that untraced run
(issue 37) must make the very literals the capture at the first shape made instead
(:func:`same_literals`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch.fx

import torch
from memplan.errors import CaptureError


def is_literal(node: torch.fx.Node) -> bool:
    """A ``get_attr`` node of a literal: every user copies it (``lift_fresh_copy``)."""
    return bool(node.users) and all(user.target is torch.ops.aten.lift_fresh_copy.default for user in node.users)


def literal_key(t: torch.Tensor) -> tuple[Any, ...]:
    """A literal's dtype, shape and bits."""
    flat = t.detach().contiguous().reshape(-1)
    return (t.dtype, tuple(t.shape), tuple(flat.view(torch.uint8).tolist()) if flat.numel() else ())


def check_literals_repeat(
    gm: torch.fx.GraphModule, op_phase: dict[str, str], earlier: list[torch.Tensor] | None
) -> None:
    """Raise :class:`CaptureError` when a literal the traced step reads outside the optimizer
    was not made, with the same value, by the untraced run before (``earlier``; None: not
    recorded, nothing to check). ``op_phase`` maps an fx node name to its phase."""
    if earlier is None:
        return
    available = Counter(literal_key(t) for t in earlier)
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not is_literal(node):
            continue
        if all(op_phase.get(user.name) == "optimizer" for user in node.users):
            continue  # the runtime runs the user's optimizer, which makes its own
        value = getattr(gm, node.target)
        key = literal_key(value)
        if available[key] == 0:
            raise CaptureError(
                f"the step makes a tensor from Python values ({_short(value)}) that differ between two runs of the "
                "step (a counter, a Python random draw?); a plan would freeze it: pass it in the batch or keep it "
                "in a buffer"
            )
        available[key] -= 1


def step_literals(gm: torch.fx.GraphModule, op_phase: dict[str, str]) -> list[torch.Tensor]:
    """The literals of ``gm`` the check covers: those read outside the optimizer."""
    return [
        getattr(gm, node.target)
        for node in gm.graph.nodes
        if node.op == "get_attr"
        and is_literal(node)
        and not all(op_phase.get(user.name) == "optimizer" for user in node.users)
    ]


def same_literals(gm: torch.fx.GraphModule, op_phase: dict[str, str], like: Any) -> bool:
    """Whether ``gm`` makes the same literals (dtype, shape and bits, as many of each) outside
    the optimizer as ``like`` (a :class:`~memplan.torch.capture.trace.Capture` whose literals
    passed :func:`check_literals_repeat`), so that check holds for ``gm`` too."""
    like_phase = dict(zip(like.node_of_op, like.op_phase, strict=True))
    ours = Counter(literal_key(t) for t in step_literals(gm, op_phase))
    return ours == Counter(literal_key(t) for t in step_literals(like.gm, like_phase))


def _short(t: torch.Tensor) -> str:
    if t.numel() <= 4:
        return f"torch.tensor({t.tolist()!r}, dtype={t.dtype})"
    return f"a {tuple(t.shape)} {t.dtype} tensor"


def check_scalars_repeat(earlier: list[tuple[Any, tuple]] | None, later: list[tuple[Any, tuple]] | None) -> None:
    """Raise :class:`CaptureError` when two runs of the step (the untraced one, then the traced
    one) made the same ops outside the optimizers' calls but passed one of them other Python
    numbers: the step reads Python state that changes from call to call (a counter it keeps,
    an annealed temperature), which a plan would freeze at its capture value. Runs that made
    other ops (a cache the first run filled, a lazy module) are not compared; ops given no
    numbers are left out of both (the modes a run is traced in add some: ``prim.device``,
    ``detach``). ``None``: not logged, nothing to check."""
    if earlier is None or later is None:
        return
    earlier, later = [e for e in earlier if e[1]], [e for e in later if e[1]]
    if [op for op, _ in earlier] != [op for op, _ in later]:
        return
    for (op, before), (_, after) in zip(earlier, later, strict=True):
        if before != after:
            raise CaptureError(
                f"the step passes {op} other Python numbers in two runs ({_numbers(before, after)}): it reads Python "
                "state that changes from call to call (a counter, an annealed value?); a plan would freeze it: pass "
                "it in the batch as a tensor or keep it in a buffer"
            )


def _numbers(before: tuple, after: tuple) -> str:
    changed = [(a, b) for a, b in zip(before, after, strict=False) if a != b] or [(before, after)]
    return f"{changed[0][0]!r}, then {changed[0][1]!r}"
