"""Which parameters' updates the runtime runs together, and when (OLLA 4.3, early weight updates).

The runtime never replays the traced optimizer ops: it calls the user's own
``optimizer.step()``, so the Python-side scalars (bias corrections, learning rates a scheduler
changed, RAdam's rectification branch) are the optimizer's own and numerics stay eager's. What
the plan decides is *when* each update runs and *which parameters* one call covers.

An update group is the set of parameters whose traced optimizer ops read each other's tensors:
a for-loop optimizer touches one parameter per op, so each parameter is its own group and can
update as soon as its gradient is ready; a ``foreach`` or ``fused`` optimizer reads every
parameter of a param group in one op, so the whole param group is one group. Groups are the
connected components of "an optimizer op reads a tensor owned by parameter p" (a union-find
over the traced ops): the grouping follows what the optimizer actually does, never an
assumption about it.

A group runs as one ``optimizer.step()`` over its parameters only. That equals eager only when
the optimizer updates parameters independently given their own state, which holds for every
``torch.optim`` optimizer but L-BFGS. An optimizer of another class, or one with step hooks
(which would fire once per group), gets a single group: one ``step()`` over everything at the
end of the step, exactly eager's call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.fx
from torch.utils import _pytree as pytree

import torch
from memplan.errors import UnsupportedOp
from memplan.torch.capture import Capture
from memplan.torch.tensors import storage_key, tensor_leaves

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
REFUSED_OPTIMIZERS = {
    "LBFGS": "needs a closure that re-evaluates the model several times per step",
    "SparseAdam": "needs sparse gradients, which a planned step does not produce",
}


@dataclass(frozen=True)
class UpdateGroup:
    """Parameters updated by one ``optimizer.step()`` call, the fx nodes holding their
    gradients, and the traced optimizer ops of their update (program order)."""

    params: tuple[str, ...]
    grad_nodes: tuple[str, ...]
    ops: tuple[int, ...]
    whole: bool = False  # one step() over every parameter (the optimizer is not known to be independent)


def check_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    """Refuse, in one line, an optimizer whose step a plan cannot run exactly as eager does."""
    name = type(optimizer).__name__
    if name in REFUSED_OPTIMIZERS and type(optimizer).__module__.startswith("torch.optim"):
        raise UnsupportedOp(f"optimizer {name} is not supported: it {REFUSED_OPTIMIZERS[name]}")
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for param_name, param in model.named_parameters():
        if param.requires_grad and id(param) not in owned:
            raise UnsupportedOp(
                f"parameter {param_name!r} requires grad but the optimizer does not own it, so eager would "
                "accumulate its .grad across steps; add it to the optimizer or set requires_grad=False"
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


def update_groups(capture: Capture, *, independent: bool) -> list[UpdateGroup]:
    """The update groups of a captured training step (see the module docstring).

    Every parameter the traced optimizer reads belongs to exactly one group; with
    ``independent=False`` there is one group of every parameter.
    """
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
    for op_id, op in enumerate(graph.ops):
        if capture.op_phase[op_id] != "optimizer":
            continue
        roots = sorted({find(owner[t]) for t in op.inputs if t in owner})
        if not roots:
            continue  # a constant the optimizer makes (``torch.tensor(1.0)``): it makes it again
        for other in roots[1:]:
            parent[find(other)] = roots[0]
        op_owner[op_id] = roots[0]
        for t in op.outputs:
            owner[t] = roots[0]
    if not independent:
        names = sorted(parent)
        for p in names[1:]:
            parent[find(p)] = find(names[0])
    members: dict[str, list[str]] = {}
    for p in parent:
        members.setdefault(find(p), []).append(p)
    ops: dict[str, list[int]] = {}
    for op_id, p in op_owner.items():
        ops.setdefault(find(p), []).append(op_id)
    nodes = {n.name: n for n in capture.gm.graph.nodes}
    groups = []
    for root, group_ops in ops.items():
        params = tuple(sorted(members[root]))
        op_nodes = [nodes[capture.node_of_op[o]] for o in group_ops]
        grads = tuple(_grad_node(op_nodes, p, capture.grad_storage_by_param.get(p)) for p in params)
        groups.append(UpdateGroup(params, grads, tuple(sorted(group_ops)), whole=not independent))
    _check_every_gradient_is_read(capture, groups)
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


def _grad_node(nodes: Sequence[torch.fx.Node], param: str, grad_key: int | None) -> str:
    for node in nodes:
        for arg in _nodes_in((node.args, node.kwargs)):
            if any(storage_key(v) == grad_key for v in tensor_leaves(arg.meta.get("val"))):
                return arg.name
    raise UnsupportedOp(f"could not find the gradient the optimizer reads for parameter {param!r}")


def _nodes_in(value: object) -> list[torch.fx.Node]:
    return [a for a in pytree.tree_leaves(value) if isinstance(a, torch.fx.Node)]


def _check_every_gradient_is_read(capture: Capture, groups: Sequence[UpdateGroup]) -> None:
    """Every parameter that gets a gradient is updated by some group, or the plan would skip
    its update; capture recorded the gradients apart from the optimizer ops, so this holds the
    grouping to an independent account."""
    grouped = {p for g in groups for p in g.params}
    for param in capture.grad_storage_by_param:
        if param not in grouped:
            raise UnsupportedOp(
                f"parameter {param!r} gets a gradient but no traced optimizer op reads it; "
                "memplan cannot tell when its update runs"
            )
