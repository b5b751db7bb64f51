"""Which parameters' updates the runtime runs together, and when (OLLA 4.3, early weight updates).

The runtime never replays the traced optimizer ops: it calls the user's own
``optimizer.step()``, so the Python-side scalars (bias corrections, learning rates a scheduler
changed, RAdam's rectification branch) are the optimizer's own and numerics stay eager's. What
the plan decides is *when* each update runs and *which parameters* one call covers.

An update group is the set of parameters whose traced optimizer ops read each other's tensors:
a for-loop optimizer touches one parameter per op, so each parameter is its own group and can
update as soon as its gradient is ready (inside ``scaler.step(optimizer)`` too, once
``unscale_`` has checked every gradient: see :func:`scaler_step_splits`); a ``foreach`` or
``fused`` optimizer reads every parameter of a param group in one op, so the whole param group
is one group. Groups are the connected components of "an optimizer op reads a tensor owned by
parameter p" (a union-find over the traced ops): the grouping follows what the optimizer
actually does, never an assumption about it.

A group runs as one ``optimizer.step()`` over its parameters only. That equals eager only when
the optimizer updates parameters independently given their own state, which holds for every
``torch.optim`` optimizer but L-BFGS. An optimizer of another class, or one with step hooks
(which would fire once per group), gets a single group: one ``step()`` over everything at the
end of the step, exactly eager's call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx

import torch
from memplan.errors import UnsupportedOp
from memplan.torch.capture import Capture
from memplan.torch.capture.marks import CALL_KIND, CALL_MARK
from memplan.torch.tensors import storage_key

# torch.optim optimizers whose step() updates each parameter from its own gradient and state
# only (hyper-parameters come from its param group): a step over a subset of parameters
# updates that subset exactly as a step over all of them would.
INDEPENDENT_OPTIMIZERS = frozenset(
    {
        "SGD",
        "Adam",
        "AdamW",
        "Adamax",
        "NAdam",
        "RAdam",
        "Adagrad",
        "Adadelta",
        "RMSprop",
        "Rprop",
        "ASGD",
        "Adafactor",
    }
)
GRADIENT_CALLS = frozenset({"optimizer.step", "scaler.step", "scaler.unscale_"})  # calls that read .grad
REFUSED_OPTIMIZERS = {
    "LBFGS": "needs a closure that re-evaluates the model several times per step",
    "SparseAdam": "needs sparse gradients, which a planned step does not produce",
}


@dataclass(frozen=True)
class UpdateGroup:
    """Ops the runtime runs as one call at the position of the last of them: the parameters
    whose ``.grad`` the call needs, the fx nodes holding those gradients, the traced ops
    (program order), the call (index into ``Capture.regions``) and whether the call is an
    ``optimizer.step()`` split by parameter (run on ``params`` only) or the whole call."""

    params: tuple[str, ...]
    grad_nodes: tuple[str, ...]
    ops: tuple[int, ...]
    region: int
    split: bool = False


def check_optimizers(optimizers: Sequence[torch.optim.Optimizer], model: torch.nn.Module) -> None:
    """Refuse, in one line, an optimizer whose step a plan cannot run exactly as eager does."""
    owned: set[int] = set()
    for optimizer in optimizers:
        name = type(optimizer).__name__
        if name in REFUSED_OPTIMIZERS and type(optimizer).__module__.startswith("torch.optim"):
            raise UnsupportedOp(f"optimizer {name} is not supported: it {REFUSED_OPTIMIZERS[name]}")
        owned |= {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module_name, module in model.named_modules():
        sparse = isinstance(module, torch.nn.Embedding | torch.nn.EmbeddingBag) and module.sparse
        if sparse and module.weight.requires_grad:
            raise UnsupportedOp(
                f"module {module_name or type(module).__name__!r} is an {type(module).__name__} with sparse=True: "
                "memplan plans dense gradients only; construct it with sparse=False"
            )
    in_model = {id(p) for p in model.parameters()}
    for index, optimizer in enumerate(optimizers):
        outside = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in in_model]
        if outside:
            name, shape = type(optimizer).__name__, tuple(outside[0].shape)
            raise UnsupportedOp(
                f"optimizer {index} ({name}) updates {len(outside)} parameter(s) that are not in the model given to "
                f"memplan (the first of shape {shape}): give a module that holds every parameter the step trains, "
                "e.g. model=torch.nn.ModuleDict({'backbone': backbone, 'head': head})"
            )
    for param_name, param in model.named_parameters():
        if param.requires_grad and id(param) not in owned:
            raise UnsupportedOp(
                f"parameter {param_name!r} requires grad but no optimizer owns it, so eager would "
                "accumulate its .grad across steps; add it to an optimizer or set requires_grad=False"
            )


def updates_are_independent(optimizer: torch.optim.Optimizer) -> bool:
    """True when a step over a subset of parameters equals eager's step on that subset: a
    ``torch.optim`` optimizer known to update parameters independently, with no step hooks
    (a hook would run once per group instead of once per step)."""
    from torch.optim import optimizer as optim_module

    cls = type(optimizer)
    known = cls.__module__.startswith("torch.optim") and cls.__name__ in INDEPENDENT_OPTIMIZERS
    hooks = (
        optimizer._optimizer_step_pre_hooks,
        optimizer._optimizer_step_post_hooks,
        optim_module._global_optimizer_pre_hooks,
        optim_module._global_optimizer_post_hooks,
    )
    return known and not any(hooks)


def scaler_step_splits(region: Any) -> bool:
    """``scaler.step(optimizer)`` may run as one ``optimizer.step()`` per group of parameters:
    its optimizer updates parameters independently and does not unscale by itself (a fused
    one does, ``_step_supports_amp_scaling``), and no closure is given. GradScaler's step is
    ``if no gradient was inf: optimizer.step()`` (``_maybe_opt_step``), and every group reads the
    same found-inf flags, which ``unscale_`` set before it; if the step unscales by itself
    instead (no ``unscale_`` call before it), the traced unscale op reads every gradient and
    the split finds a single group."""
    optimizer = region.optimizer
    return (
        optimizer is not None
        and bool(region.args)
        and region.args[0] is optimizer
        and updates_are_independent(optimizer)
        and not getattr(optimizer, "_step_supports_amp_scaling", False)
        and "closure" not in region.kwargs
    )


def _splits(region: Any) -> bool:
    if region.kind == "optimizer.step":
        return updates_are_independent(region.owner)
    return region.kind == "scaler.step" and scaler_step_splits(region)


def update_groups(capture: Capture) -> list[UpdateGroup]:
    """The update groups of a captured training step (see the module docstring): each call of
    a stateful object is one group, except an ``optimizer.step()`` of an optimizer that
    updates parameters independently, which is split into the connected components of what
    its traced ops read."""
    grad_nodes = region_grad_nodes(capture)
    groups: list[UpdateGroup] = []
    for region in capture.regions:
        ops = [op for op, r in enumerate(capture.op_region) if r == region.index]
        bound = grad_nodes.get(region.index, {})
        if _splits(region):
            groups += _split_by_parameter(capture, region.index, ops, bound)
        else:
            params = tuple(sorted(bound))
            groups.append(UpdateGroup(params, tuple(bound[p] for p in params), tuple(ops), region.index))
    _check_every_gradient_is_read(capture, groups)
    return groups


def region_grad_nodes(capture: Capture) -> dict[int, dict[str, str]]:
    """For each call, ``param name -> fx node`` holding the gradient the parameter had when
    the call began (the node that last produced that exact tensor: same storage and layout)."""
    latest: dict[tuple, str] = {}
    found: dict[int, dict[str, str]] = {}
    for node in capture.gm.graph.nodes:
        span = _call_span(node)
        if span is not None and span < len(capture.regions) and capture.regions[span].kind in GRADIENT_CALLS:
            region = capture.regions[span]
            missing = [p for p, key in region.grads.items() if key not in latest]
            if missing:
                raise UnsupportedOp(f"could not find the gradient of {missing[0]!r} that {region.kind}() reads")
            found[span] = {p: latest[key] for p, key in region.grads.items()}
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            key = (storage_key(value), tuple(value.shape), tuple(value.stride()), value.storage_offset())
            latest[key] = node.name
    return found


def _call_span(node: torch.fx.Node) -> int | None:
    if node.op != "call_function" or node.target is not torch.ops.profiler._record_function_enter_new.default:
        return None
    name = node.args[0] if node.args else ""
    return int(name[len(CALL_MARK) :]) if isinstance(name, str) and name.startswith(CALL_MARK) else None


def _split_by_parameter(capture: Capture, region: int, ops: list[int], grads: dict[str, str]) -> list[UpdateGroup]:
    """Union-find over the call's traced ops: parameters whose update ops read each other's
    tensors (a foreach or fused op reads a whole param group) update together."""
    graph = capture.graph
    owner = _tensor_owners(capture)
    parent: dict[str, str] = {}

    def find(p: str) -> str:
        parent.setdefault(p, p)
        while parent[p] != p:
            parent[p] = parent[parent[p]]
            p = parent[p]
        return p

    op_owner: dict[int, str] = {}
    for op_id in ops:
        op = graph.ops[op_id]
        if op.kind == CALL_KIND:  # the call's start and end: they order calls, they update nothing
            continue
        roots = sorted({find(owner[t]) for t in op.inputs if t in owner})
        if not roots:
            continue  # a marker, or a constant the optimizer makes (``torch.tensor(1.0)``): it makes it again
        for other in roots[1:]:
            parent[find(other)] = roots[0]
        op_owner[op_id] = roots[0]
        for t in op.outputs:
            owner[t] = roots[0]
    for p in grads:
        find(p)
    members: dict[str, list[str]] = {}
    for p in parent:
        members.setdefault(find(p), []).append(p)
    group_ops: dict[str, list[int]] = {}
    for op_id, p in op_owner.items():
        group_ops.setdefault(find(p), []).append(op_id)
    groups = []
    for root, member_ops in group_ops.items():
        params = tuple(sorted(p for p in members[root] if p in grads))
        groups.append(UpdateGroup(params, tuple(grads[p] for p in params), tuple(sorted(member_ops)), region, True))
    return groups


def _tensor_owners(capture: Capture) -> dict[int, str]:
    """``tensor -> parameter name`` for parameters, their optimizer state and gradients."""
    graph = capture.graph
    grads = {key: name for name, key in capture.grad_storage_by_param.items()}
    owner: dict[int, str] = {}
    for key, t in capture.tensor_of_storage.items():
        kind, _, label = graph.tensors[t].name.partition(":")
        if kind == "param":
            owner[t] = label
        elif kind == "state":
            owner[t] = label.rsplit(".", 1)[0]
        elif key in grads:
            owner[t] = grads[key]
    return owner


def _check_every_gradient_is_read(capture: Capture, groups: Sequence[UpdateGroup]) -> None:
    """Every parameter that gets a gradient is updated by some group, or the plan would skip
    its update; capture recorded the gradients apart from the optimizer ops, so this holds the
    grouping to an independent account."""
    grouped = {p for g in groups if capture.regions[g.region].optimizer is not None for p in g.params}
    for param in capture.grad_storage_by_param:
        if param not in grouped:
            raise UnsupportedOp(
                f"parameter {param!r} gets a gradient but no traced optimizer op reads it; "
                "memplan cannot tell when its update runs"
            )
