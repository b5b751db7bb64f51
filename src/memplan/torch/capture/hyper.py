"""A step that changes its optimizers' hyper-parameters by itself is refused: memplan replays
the step's ops and calls the optimizer with the learning rate its param groups hold.

The runtime calls the user's ``optimizer.step()``, which reads ``lr``, ``betas``,
``weight_decay`` ... from its param groups at every call, so a learning rate set *between*
calls (a scheduler the user steps outside the step, a manual warm-up) trains as eager does,
and so does a scheduler given to ``memplan.compile(..., scheduler=...)``, which the runtime
steps for real at every call. What the step's Python code does to those values *inside* the
step runs only while capture runs it on fakes, so two patterns would train differently from
eager, silently:

* an LR scheduler the step calls but memplan was not given: capture's two runs stepped it
  twice and no planned step steps it again, so the learning rate stays where capture left it;
* a learning rate the step sets itself from a counter or a schedule (nanoGPT's
  ``for g in optimizer.param_groups: g["lr"] = get_lr(it)``), frozen at its capture value.

:func:`watching_hyperparameters` refuses the first before it steps (the scheduler is left as
it was) and the second where two runs of the step leave other values (a step that sets the
same values every time, a constant, trains as eager and is kept); after a refusal the param
groups are put back as the user had them.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from memplan.errors import UnsupportedOp
from memplan.torch.capture.frames import user_location

SCHEDULER_CLASSES = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
"""Classes whose ``step`` is watched (ReduceLROnPlateau defines its own)."""

Hyper = list[list[dict[str, Any]]]
"""Per optimizer, per param group: every entry but ``params``."""


def hyperparameters(optimizers: Sequence[torch.optim.Optimizer]) -> Hyper:
    """A copy of every optimizer's param groups without their parameters."""
    return [
        [{k: copy.deepcopy(v) for k, v in group.items() if k != "params"} for group in opt.param_groups]
        for opt in optimizers
    ]


def first_change(before: Hyper, after: Hyper) -> str | None:
    """``optimizer I, param group J, 'key': A -> B`` for the first value that differs, or None."""
    for i, (groups_before, groups_after) in enumerate(zip(before, after, strict=False)):
        if len(groups_before) != len(groups_after):
            return f"optimizer {i}: {len(groups_before)} -> {len(groups_after)} param groups"
        for j, (a, b) in enumerate(zip(groups_before, groups_after, strict=True)):
            for key in sorted(set(a) | set(b)):
                if not _same(a.get(key), b.get(key)):
                    return f"optimizer {i}, param group {j}, {key!r}: {a.get(key)!r} -> {b.get(key)!r}"
    if len(before) != len(after):
        return f"{len(before)} -> {len(after)} optimizers"
    return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and bool(torch.equal(a, b))
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


class HyperparameterWatch:
    """See :func:`watching_hyperparameters`."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any]) -> None:
        self.optimizers = list(optimizers)
        self.declared = {id(s) for s in schedulers}
        self.user = hyperparameters(self.optimizers)
        self.last: Hyper | None = None

    def after_run(self, may_set: bool) -> None:
        """After each of capture's runs: refuse values that differ from the previous run's.
        ``may_set``: the first of two runs, which may set values (a step that sets the same
        ones every call trains as eager); a capture's only run (at another shape, or in a
        restarted process) compares with what the user had before it, as a step that sets the
        same values every time has set them already in the run that showed it."""
        now = hyperparameters(self.optimizers)
        change = first_change(self.last if self.last is not None else self.user, now)
        self.last = now
        if change is not None and not may_set:
            raise UnsupportedOp(
                f"the step changes its optimizer's hyper-parameters from one call to the next ({change}); memplan "
                "calls the optimizer with the values its param groups hold, so set them between calls (outside the "
                "step function) or step an LR scheduler given as memplan.compile(..., scheduler=...)"
            )

    def refuse_undeclared(self, scheduler: Any) -> None:
        if id(scheduler) in self.declared:
            return
        where = user_location(traceback.extract_stack()[:-2])
        at = f" at {where}" if where else ""
        name = type(scheduler).__name__
        raise UnsupportedOp(
            f"the step calls {name}.step(){at}, an LR scheduler memplan was not given: its learning rate would "
            f"stay where capture left it; pass it as memplan.compile(..., scheduler=...) (or step it outside the "
            "step function)"
        )


@contextmanager
def watching_hyperparameters(
    optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any]
) -> Iterator[HyperparameterWatch]:
    """For the time of a capture: the ``step`` of every LR scheduler class refuses an instance
    not among ``schedulers`` before it steps (a declared one is never reached here: capture
    runs its calls as regions), and :meth:`HyperparameterWatch.after_run` checks the param
    groups after each run; on any error the param groups are put back as they were."""
    watch = HyperparameterWatch(optimizers, schedulers)
    originals = {cls: cls.__dict__["step"] for cls in SCHEDULER_CLASSES}

    def guarded(original: Any) -> Any:
        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            watch.refuse_undeclared(self)
            return original(self, *args, **kwargs)

        return step

    for cls, original in originals.items():
        cls.step = guarded(original)
    try:
        yield watch
    except BaseException:
        for opt, groups in zip(watch.optimizers, watch.user, strict=True):
            for group, saved in zip(opt.param_groups, groups, strict=False):
                group.update(saved)
        raise
    finally:
        for cls, original in originals.items():
            cls.step = original
