"""Verify a replayed step by running it again on the ordinary allocator.

The planned CUDA allocator cannot be tested bit for bit where no GPU is lent, so on a GPU the
runtime holds its first replayed step of every plan to account itself: the training state
(parameters, buffers, gradients, optimizer and scaler state, schedulers, random generators) is
copied to the host, the step runs replayed, the state is put back and the same step runs on
PyTorch's own allocator. Both must leave the same bits and return the same bits; otherwise the
replay is refused with one line and the state is the ordinary run's, so no step trains wrongly.
It costs one step and a host copy of the training state, once per plan.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils import _pytree as pytree

import torch
from memplan.errors import MemplanError


@dataclass
class TrainingState:
    """A host copy of everything a training step changes."""

    tensors: list[torch.Tensor | None]
    optimizer_extras: list[Any]
    scheduler_states: list[dict[str, Any]]
    rng: tuple[torch.Tensor, list[torch.Tensor]]


@dataclass(frozen=True)
class StepObjects:
    """What a step changes: the model and the objects its step function calls."""

    model: torch.nn.Module
    optimizers: Sequence[torch.optim.Optimizer] = ()
    scaler: Any = None
    schedulers: Sequence[Any] = ()
    others: Sequence[torch.Tensor] = ()  # other tensors the step writes (an EMA, a counter)

    @classmethod
    def of(cls, run: Any, schedulers: Sequence[Any] = ()) -> StepObjects:
        """From a runner (:class:`memplan.torch.run.interpreter.StepRunner` or a subclass)."""
        from memplan.torch.run.constants import written_outside_state

        capture = getattr(run, "capture", None)
        others = written_outside_state(capture, run.model) if capture is not None else []
        optimizers = list(getattr(run, "optimizers", ()))
        return cls(run.model, optimizers, getattr(run, "scaler", None), list(schedulers), others)

    def slots(self) -> list[tuple[Any, str]]:
        """Every (holder, key) whose tensor a step may replace or write, in a fixed order."""
        found: list[tuple[Any, str]] = []
        for module in self.model.modules():
            found += [(module._parameters, name) for name in module._parameters]
            found += [(module._buffers, name) for name in module._buffers]
        found += [(p, "grad") for p in self.model.parameters()]
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                found += [(state, key) for key in sorted(state, key=str) if isinstance(state[key], torch.Tensor)]
        if self.scaler is not None:
            found += [(self.scaler.__dict__, k) for k in ("_scale", "_growth_tracker") if k in self.scaler.__dict__]
        others = dict(enumerate(self.others))
        found += [(others, k) for k in others]
        return found


def _get(holder: Any, key: str) -> Any:
    return holder[key] if isinstance(holder, dict) else getattr(holder, key)


def _host(value: Any) -> Any:
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else None


def snapshot(objects: StepObjects) -> TrainingState:
    """Copy the step's state to the host."""
    extras = []
    for optimizer in objects.optimizers:
        plain = [
            {k: copy.deepcopy(v) for k, v in s.items() if not isinstance(v, torch.Tensor)}
            for s in optimizer.state.values()
        ]
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        extras.append((plain, groups))
    schedules = [copy.deepcopy(s.state_dict()) for s in objects.schedulers]
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    return TrainingState(
        [_host(_get(h, k)) for h, k in objects.slots()], extras, schedules, (torch.get_rng_state(), cuda_rng)
    )


def restore(objects: StepObjects, state: TrainingState) -> None:
    """Write ``state`` back in place (tensors keep their identity, which plans bind)."""
    slots = objects.slots()
    if len(slots) != len(state.tensors):
        raise MemplanError(
            "the replayed step added or removed state tensors, so it cannot be verified; run with allocator='views'"
        )
    with torch.no_grad():
        for (holder, key), saved in zip(slots, state.tensors, strict=True):
            current = _get(holder, key)
            if saved is None or current is None:
                if key == "grad":
                    holder.grad = None if saved is None else saved.to(holder.device)
                continue
            current.copy_(saved)
    for optimizer, (plain, groups) in zip(objects.optimizers, state.optimizer_extras, strict=True):
        for s, saved in zip(optimizer.state.values(), plain, strict=True):
            s.update(copy.deepcopy(saved))
        for g, saved in zip(optimizer.param_groups, groups, strict=True):
            g.update(copy.deepcopy(saved))
    for scheduler, saved in zip(objects.schedulers, state.scheduler_states, strict=True):
        scheduler.load_state_dict(copy.deepcopy(saved))
    torch.set_rng_state(state.rng[0])
    if state.rng[1]:
        torch.cuda.set_rng_state_all(state.rng[1])


def first_difference(a: TrainingState, b: TrainingState) -> str | None:
    """Where two states' bits differ (None when they do not)."""
    if len(a.tensors) != len(b.tensors):
        return "the number of state tensors"
    for k, (x, y) in enumerate(zip(a.tensors, b.tensors, strict=True)):
        if not same_bits(x, y):
            return f"state tensor {k}"
    if not same_results(a.optimizer_extras, b.optimizer_extras):
        return "the optimizer's other state"
    if not same_results(a.scheduler_states, b.scheduler_states):
        return "a scheduler's state"
    if not same_results(a.rng, b.rng):
        return "the random generators"
    return None


def same_bits(x: Any, y: Any) -> bool:
    """Bitwise equality of two tensors (NaN equals the same NaN), or equality of two non-tensors."""
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        return type(x) is type(y) and bool(x == y)
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    bytes_x = x.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(bytes_x, y.detach().cpu().contiguous().reshape(-1).view(torch.uint8))


def same_results(a: Any, b: Any) -> bool:
    """Same structure and the same bits in every leaf."""
    leaves_a, spec_a = pytree.tree_flatten(a)
    leaves_b, spec_b = pytree.tree_flatten(b)
    return spec_a == spec_b and all(same_bits(x, y) for x, y in zip(leaves_a, leaves_b, strict=True))


def verify_by_rerun(
    objects: StepObjects, replayed: Callable[[], Any], ordinary: Callable[[], Any]
) -> tuple[Any, str | None]:
    """Run ``replayed``, put the state back, run ``ordinary``; returns the ordinary run's result
    and None when both left and returned the same bits, else a one-line reason (the state is
    then the ordinary run's)."""
    before = snapshot(objects)
    replayed_result = replayed()
    after_replay = snapshot(objects)
    restore(objects, before)
    result = ordinary()
    after = snapshot(objects)
    where = first_difference(after_replay, after)
    if where is None and not same_results(replayed_result, result):
        where = "the step's result"
    if where is None:
        return result, None
    return result, f"the replayed step differed from the same step on PyTorch's allocator ({where})"
