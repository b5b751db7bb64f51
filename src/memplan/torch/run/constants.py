"""The tensors a traced step reads that are not in its batch (fx ``get_attr`` nodes), bound to
real values for every planned step.

Each is bound by where it comes from, so that none holds a value the step would no longer
read (never a stale copy):

- a parameter or buffer of the model: the model's own tensor, looked up in its module at
  every step (a buffer the model reassigns, such as a rotary table, is read anew);
- the ``GradScaler``'s scale and growth tracker: the scaler's own tensors, at every step;
- optimizer state, or a value only the traced optimizer reads: nothing (the runtime runs the
  user's own optimizer, which reads its own);
- a tensor held as a plain attribute of one of the model's modules (not registered as a
  buffer): lifted to an input, read from that attribute at every step;
- a literal the step makes from Python values (``torch.tensor(0)``, ``torch.tensor([])``: a
  real tensor that make_fx records and the program copies with ``lift_fresh_copy``): kept by
  value, a private copy. Capture checked that the untraced run before the traced one made
  the same literal (:mod:`memplan.torch.capture.literals`), so it does not change from step
  to step;
- any other real tensor (a module-level or closure tensor): the object itself, so what is
  written into it between steps is read;
- a fake tensor whose value the fake mode kept (small literals made inside the mode), or an
  empty one: that value;
- anything else, a fake tensor of unknown value (a cache a previous run left on a module), is
  refused with one line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.fx

import torch
from memplan.errors import UnsupportedOp
from memplan.torch.capture import Capture
from memplan.torch.capture.literals import is_literal
from memplan.torch.tensors import storage_key


@dataclass(frozen=True)
class ConstantBinding:
    """How one ``get_attr`` node gets its value: ``kind`` says from where (see the module
    docstring); ``fetch()`` returns the value for the next step."""

    node: str
    kind: str  # "param", "buffer", "unread", "attribute", "literal", "object", "known", "empty"
    fetch: Callable[[], Any]
    static: bool  # the same value at every step: fetched once


def bind_constants(
    capture: Capture, model: torch.nn.Module, device: torch.device, scaler: Any = None
) -> list[ConstantBinding]:
    """A binding for every ``get_attr`` node of the traced program (raises
    :class:`UnsupportedOp` for a tensor whose value capture could not know); ``scaler`` is the
    step's ``GradScaler``, whose scale the step reads."""
    phases = dict(zip(capture.node_of_op, capture.op_phase, strict=True))
    attributes = _plain_tensor_attributes(model)
    return [
        _binding(capture, node, model, device, phases, attributes, scaler)
        for node in capture.gm.graph.nodes
        if node.op == "get_attr"
    ]


def written_outside_state(capture: Capture, model: torch.nn.Module) -> list[torch.Tensor]:
    """The real tensors the step writes that are no parameter, buffer or optimizer state of
    it: closure or module-level tensors and plain tensor attributes of its modules (an EMA's
    parameters, a step counter). What a run of the step for another purpose (measuring its
    kernels' workspace, a verifying rerun) must put back besides the training state."""
    out: dict[int, torch.Tensor] = {}
    for tensor in written_outside_state_by_id(capture, model).values():
        out.setdefault(id(tensor), tensor)
    return list(out.values())


def written_outside_state_by_id(capture: Capture, model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """:func:`written_outside_state` by the graph's tensor id of each."""
    written = {t for op in capture.graph.ops for t in op.mutates}
    targets = {node.name: node.target for node in capture.gm.graph.nodes if node.op == "get_attr"}
    out: dict[int, torch.Tensor] = {}
    for binding in bind_constants(capture, model, torch.device("cpu")):
        if binding.kind not in ("object", "attribute"):
            continue
        value = getattr(capture.gm, targets[binding.node])  # a second read of one tensor is node "x_1" of target "x"
        t = capture.tensor_of_storage.get(storage_key(value))
        if t in written:
            out.setdefault(t, binding.fetch())
    return out


def _binding(
    capture: Capture,
    node: torch.fx.Node,
    model: torch.nn.Module,
    device: torch.device,
    phases: dict[str, str],
    attributes: dict[int, tuple[torch.nn.Module, str]],
    scaler: Any,
) -> ConstantBinding:
    from torch._subclasses.fake_tensor import is_fake

    value = getattr(capture.gm, node.target)
    t = capture.tensor_of_storage.get(storage_key(value)) if isinstance(value, torch.Tensor) else None
    label = capture.graph.tensors[t].name if t is not None else ""
    kind, _, name = label.partition(":")
    if kind in ("param", "buffer"):
        return _module_tensor(node.name, kind, model, name)
    if kind == "scaler":  # the GradScaler's scale or growth tracker, read at every step
        return ConstantBinding(node.name, kind, lambda: getattr(scaler, name), static=False)
    if kind == "state" or _read_by_optimizer_only(node, phases):
        return ConstantBinding(node.name, "unread", lambda: None, static=True)
    if not isinstance(value, torch.Tensor):
        return ConstantBinding(node.name, "known", lambda: value, static=True)
    if not is_fake(value):
        if id(value) in attributes:
            return _attribute(node.name, value, *attributes[id(value)])
        if is_literal(node):
            kept = value.detach().clone()
            return ConstantBinding(node.name, "literal", lambda: kept, static=True)
        return ConstantBinding(node.name, "object", lambda: value, static=True)
    constant = getattr(value, "constant", None)
    if constant is not None:
        return ConstantBinding(node.name, "known", lambda: constant, static=True)
    if value.numel() == 0:
        empty = torch.empty(value.shape, dtype=value.dtype, device=device)
        return ConstantBinding(node.name, "empty", lambda: empty, static=True)
    raise UnsupportedOp(
        f"the step reads a tensor {node.target} {tuple(value.shape)} {value.dtype} that is no parameter, buffer or "
        "literal of the step, and whose value capture cannot know (a cache an earlier call left on a module?): "
        "register it as a buffer, or build it inside the step"
    )


def _module_tensor(node: str, kind: str, model: torch.nn.Module, name: str) -> ConstantBinding:
    """A parameter or buffer, read from its module's dict at every step."""
    module_path, _, attr = name.rpartition(".")
    module = model.get_submodule(module_path)
    table = module._parameters if kind == "param" else module._buffers
    return ConstantBinding(node, kind, lambda: table[attr], static=False)


def _attribute(node: str, traced: torch.Tensor, module: torch.nn.Module, attr: str) -> ConstantBinding:
    """A plain tensor attribute of a module, read at every step; it must keep the traced
    shape and dtype (a new plan is needed otherwise)."""
    shape, dtype = traced.shape, traced.dtype

    def fetch() -> torch.Tensor:
        value = getattr(module, attr)
        if not isinstance(value, torch.Tensor) or value.shape != shape or value.dtype != dtype:
            raise UnsupportedOp(
                f"the tensor attribute {attr!r} of {type(module).__name__} is no longer a {tuple(shape)} {dtype} "
                "tensor as when the step was planned: make a new plan"
            )
        return value

    return ConstantBinding(node, "attribute", fetch, static=False)


def _plain_tensor_attributes(model: torch.nn.Module) -> dict[int, tuple[torch.nn.Module, str]]:
    """``id(tensor) -> (module, attribute)`` for tensors held as plain attributes (not
    parameters or buffers) of the model's modules."""
    found: dict[int, tuple[torch.nn.Module, str]] = {}
    for module in model.modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                found.setdefault(id(value), (module, attr))
    return found


def _read_by_optimizer_only(node: torch.fx.Node, phases: dict[str, str]) -> bool:
    """A constant only the traced optimizer reads (``torch.tensor(1.0)`` in foreach Adam):
    the real optimizer makes its own, so its value is never needed."""
    return all(phases.get(user.name) == "optimizer" for user in node.users)
