"""Calls of the user's stateful objects inside a step function, marked in the traced program.

A step function mixes tensor ops, which the traced program replays, with calls whose effect
lives in Python state: ``optimizer.step()`` reads its step counts and learning rates,
``scaler.step(optimizer)`` skips the update when a gradient is not finite, ``scaler.update()``
grows or backs off the scale, ``scheduler.step()`` changes the learning rate. Replaying the
traced ops of such a call would freeze its Python decisions at capture time; so the runtime
calls the real method instead, at the call's place in the planned order, with the gradients
of that moment bound to the parameters' ``.grad``.

During capture each such call is wrapped in a ``record_function`` span named
``memplan::call:<index>``, so the traced program says which ops it made; a call made inside
another (``scaler.step`` calls ``optimizer.step``) belongs to the outer one. Every
``backward()`` is wrapped in a ``memplan::backward`` span, so capture knows which ops are the
backward.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

import torch
from memplan.torch.capture.marks import BACKWARD_MARK, CALL_MARK
from memplan.torch.tensors import storage_key

# method names run for real at their place in the step, per kind of object
OPTIMIZER_METHODS = ("step", "zero_grad")
SCALER_METHODS = ("step", "update", "unscale_")
SCHEDULER_METHODS = ("step",)


@dataclass
class CallRegion:
    """One call of a stateful object's method in the step, as capture saw it.

    ``grads`` maps each parameter holding a gradient when the call began to that gradient's
    storage, shape, stride and offset, so the runtime can bind the same tensor to ``.grad``.
    """

    index: int
    kind: str  # "optimizer.step", "optimizer.zero_grad", "scaler.step", ... (type role + method)
    owner: Any  # the user's real object
    method: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    grads: dict[str, tuple] = field(default_factory=dict)
    optimizer: torch.optim.Optimizer | None = None  # the optimizer the call updates, if any

    def call(self) -> Any:
        return getattr(self.owner, self.method)(*self.args, **self.kwargs)


GRADIENT_METHODS = frozenset({"step", "unscale_"})
"""Methods that read the gradients of their optimizer's parameters (``optimizer.step``,
``scaler.step(optimizer)``, ``scaler.unscale_(optimizer)``)."""


class RegionRecorder:
    """Wraps the methods of the step's stateful objects while capture runs (see the module
    docstring); ``regions`` lists the calls of the last run, outermost calls only."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        scaler: Any = None,
        schedulers: Sequence[Any] = (),
    ) -> None:
        self.model = model
        self.targets: list[tuple[Any, str, str]] = []
        for opt in optimizers:
            self.targets += [(opt, "optimizer", m) for m in OPTIMIZER_METHODS]
        if scaler is not None:
            self.targets += [(scaler, "scaler", m) for m in SCALER_METHODS]
        for scheduler in schedulers:
            self.targets += [(scheduler, "scheduler", m) for m in SCHEDULER_METHODS]
        self.scaler = scaler
        self.regions: list[CallRegion] = []
        self.stand_ins = 0  # tensor values the calls read that capture could not know (OptimizerScalars)
        self._depth = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[RegionRecorder]:
        """Wrap every target method (instance attributes, removed afterwards) and every
        ``torch.autograd.backward``."""
        saved: list[tuple[Any, str, Any, bool]] = []
        original_backward = torch.autograd.backward
        try:
            for owner, role, method in self.targets:
                had = method in vars(owner)
                saved.append((owner, method, vars(owner).get(method), had))
                setattr(owner, method, self._wrap(owner, role, method, getattr(owner, method)))
            torch.autograd.backward = _marked_backward(original_backward)
            yield self
        finally:
            torch.autograd.backward = original_backward
            for owner, method, value, had in reversed(saved):
                if had:
                    setattr(owner, method, value)
                else:
                    delattr(owner, method)

    def reset(self) -> None:
        self.regions = []
        self.stand_ins = 0

    def outside_calls(self) -> bool:
        """No call of a stateful object is running (its ops are its own, made for real at run time)."""
        return self._depth == 0

    def _wrap(self, owner: Any, role: str, method: str, bound: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return bound(*args, **kwargs)
            optimizer = owner if role == "optimizer" else _optimizer_argument(args, kwargs)
            grads = self._grads(optimizer if method in GRADIENT_METHODS else None)
            region = CallRegion(len(self.regions), f"{role}.{method}", owner, method, args, kwargs, grads)
            region.optimizer = optimizer
            self.regions.append(region)
            self._depth += 1
            scalars = OptimizerScalars()
            try:
                with torch.autograd.profiler.record_function(f"{CALL_MARK}{region.index}"), scalars:
                    if role == "scaler" and method == "step":
                        return _traced_scaler_step(owner, *args, **kwargs)
                    if role == "scheduler":
                        return None  # Python state only (learning rates): made for real at run time
                    if role == "optimizer" and method == "step" and _per_parameter_steps(owner, bound, args, kwargs):
                        return None
                    return bound(*args, **kwargs)
            finally:
                self._depth -= 1
                self.stand_ins += scalars.stand_ins

        return wrapper

    def _grads(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, tuple]:
        """The gradients the call may read: with ``optimizer``, those of its parameters only
        (a GAN's discriminator update runs while the generator still holds the gradients its
        previous call left, which the step clears later); else every parameter's."""
        owned = None if optimizer is None else {id(p) for g in optimizer.param_groups for p in g["params"]}
        out = {}
        for name, p in self.model.named_parameters():
            if p.grad is not None and (owned is None or id(p) in owned):
                g = p.grad
                out[name] = (storage_key(g), tuple(g.shape), tuple(g.stride()), g.storage_offset())
        return out


@contextlib.contextmanager
def only_params(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]):
    """Let ``optimizer.step()`` see only ``params``, each in its own param group with that
    group's hyper-parameters, in the group's order (the group dicts are the user's, restored
    afterwards); a parameter no group holds is left out."""
    saved_groups = optimizer.param_groups
    chosen: dict[int, list[torch.Tensor]] = {}
    found = {(i, j): p for i, j, p in _positions(optimizer, params)}  # a parameter given twice counts once
    for (i, _), p in sorted(found.items(), key=lambda item: item[0]):
        chosen.setdefault(i, []).append(p)
    saved_params = [(saved_groups[i], saved_groups[i]["params"]) for i in chosen]
    try:
        for i, group_params in chosen.items():
            saved_groups[i]["params"] = group_params
        optimizer.param_groups = [saved_groups[i] for i in chosen]
        yield
    finally:
        for group, group_params in saved_params:
            group["params"] = group_params
        optimizer.param_groups = saved_groups


# optimizer -> id(param) -> (group, position): where only_params finds a parameter without
# scanning every group (the runtime calls it once per early update, hundreds of times a step)
_PARAM_POSITIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _positions(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list[tuple[int, int, Any]]:
    """``(group, position, param)`` of each of ``params`` that a param group holds. Every
    position is checked against the groups as they are now; the index is built again when one
    is stale or missing (groups edited since), so the answer is always the groups' own."""
    groups = optimizer.param_groups
    index = _PARAM_POSITIONS.get(optimizer)
    if index is not None:
        found = [_checked(groups, index, p) for p in params]
        if None not in found:
            return found  # type: ignore[return-value]
    index = {id(p): (i, j) for i, g in enumerate(groups) for j, p in enumerate(g["params"])}
    _PARAM_POSITIONS[optimizer] = index
    return [at for at in (_checked(groups, index, p) for p in params) if at is not None]


def _checked(groups: list[dict], index: dict[int, tuple[int, int]], p: torch.Tensor) -> tuple[int, int, Any] | None:
    """``p``'s place per ``index`` if the groups still hold it there."""
    at = index.get(id(p))
    if at is None or at[0] >= len(groups):
        return None
    group_params = groups[at[0]]["params"]
    return (*at, p) if at[1] < len(group_params) and group_params[at[1]] is p else None


def _per_parameter_steps(optimizer: torch.optim.Optimizer, step: Callable, args: tuple, kwargs: dict) -> bool:
    """Trace ``optimizer.step()`` one parameter at a time where that is what the runtime will
    run (OLLA 4.3's early updates): a ``foreach`` step of a ``torch.optim`` optimizer that
    updates parameters independently, every parameter on the CPU, no closure. There a foreach
    op is a loop over its tensors (ATen's per-tensor fallback), so a list of one computes each
    parameter's update with the same kernels and scalars as the list of all; the traced ops
    then read one parameter each and :mod:`memplan.torch.run.updates` finds one group per
    parameter instead of one over all (tested bit for bit by the optimizer matrix). Returns
    whether it did."""
    from memplan.torch.run.updates import updates_are_independent

    groups = optimizer.param_groups
    params = [p for g in groups for p in g["params"]]
    if args or kwargs or not updates_are_independent(optimizer) or not params:
        return False
    if not any(g.get("foreach") for g in groups) or any(g.get("fused") for g in groups):
        return False
    if any(p.device.type != "cpu" for p in params):
        return False
    for param in params:
        with only_params(optimizer, [param]):
            step()
    return True


def _optimizer_argument(args: tuple, kwargs: dict) -> torch.optim.Optimizer | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.optim.Optimizer):
            return value
    return None


def _traced_scaler_step(scaler: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
    """What ``GradScaler.step`` does when every gradient is finite, which is what the plan
    budgets for: unscale (unless the step already did), then the optimizer's step. The real
    ``scaler.step`` runs at run time and skips the update when a gradient is not finite."""
    from torch.amp.grad_scaler import OptState

    if not scaler.is_enabled():
        return optimizer.step(*args, **kwargs)
    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.READY:
        scaler.unscale_(optimizer)
    state["stage"] = OptState.STEPPED
    return optimizer.step(*args, **kwargs)


def _marked_backward(original: Callable) -> Callable:
    def backward(*args: Any, **kwargs: Any) -> Any:
        with torch.autograd.profiler.record_function(BACKWARD_MARK):
            return original(*args, **kwargs)

    return backward


class OptimizerScalars(TorchDispatchMode):
    """While a call is traced, a tensor value it reads in Python (ASGD's ``mu.item()``,
    Adafactor's parameter norm) is a stand-in (1) where the fake tensor does not know it. The
    traced call is only the plan's account of the call's memory and of what it reads: the
    runtime makes the real call, which reads the real values. ``stand_ins`` counts them (a
    branch they decide may be traced the other way)."""

    def __init__(self) -> None:
        super().__init__()
        self.stand_ins = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and getattr(args[0], "constant", None) is None:
            self.stand_ins += 1
            return True if args[0].dtype == torch.bool else 1 if not args[0].is_floating_point() else 1.0
        return func(*args, **kwargs)
