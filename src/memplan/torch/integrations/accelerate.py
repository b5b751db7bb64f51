"""Accelerate: a user's own loop after ``accelerator.prepare(...)``, planned by memplan.

:func:`memplan.compile` takes the objects ``prepare()`` returned, unchanged, and the step the
user writes for Accelerate stays as it is::

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    @memplan.compile(model=model, optimizer=optimizer, scheduler=scheduler)
    def train_step(batch):
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        return loss

(:func:`compile` here is the same call, for code that wants to say it is Accelerate's.) What
makes it work: ``prepare()`` wraps the optimizer in an ``AcceleratedOptimizer``, which has none
of a ``torch.optim`` optimizer's insides (step hooks, the per-parameter update memplan splits),
and the scheduler in an ``AcceleratedScheduler``. :func:`memplan.compile` sees either wrapper and
calls :func:`unwrap`, which hands memplan the ``torch.optim`` optimizer inside (the wrapper's
``step()`` and ``zero_grad()`` call it, so the traced step makes the same calls) and keeps the
``AcceleratedScheduler``, whose ``step()`` memplan makes for real each step (its "was the
optimizer step skipped" and per-process logic included). The model ``prepare()`` returns on one
process is the user's own module, bf16 autocast put around its ``forward`` included (traced,
bit for bit). Refused in one line: ``gradient_accumulation_steps > 1`` on the ``Accelerator``
(whether a call steps the optimizer then changes from call to call: loop over the micro-batches
inside the step instead, as ``examples/accelerate_loop.py`` does), fp16 with Accelerate's
``GradScaler`` (use bf16, or plan your own ``torch.amp.GradScaler`` with
``memplan.compile(scaler=...)``), and, by :func:`memplan.compile` itself, a model ``prepare()``
wrapped for several processes (DDP, FSDP), named. ``memory_budget`` and every other option of
:func:`memplan.compile` work as without Accelerate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from memplan.errors import MemplanError

ACCELERATE_OPTIMIZER = "AcceleratedOptimizer"
ACCELERATE_SCHEDULER = "AcceleratedScheduler"


def is_accelerate_object(obj: Any) -> bool:
    """Whether ``obj`` is one of the wrappers ``accelerator.prepare()`` returns for an optimizer
    or a scheduler (checked by type name, so Accelerate is never imported here)."""
    return type(obj).__module__.startswith("accelerate.") and type(obj).__name__ in (
        ACCELERATE_OPTIMIZER,
        ACCELERATE_SCHEDULER,
    )


def unwrap(
    model: torch.nn.Module,
    optimizer: Any | Sequence[Any] = (),
    scheduler: Any | Sequence[Any] = (),
) -> tuple[torch.nn.Module, list[torch.optim.Optimizer], list[Any]]:
    """The objects memplan plans with, from what ``accelerator.prepare()`` returned: the model
    as it is (a wrapper for several processes is refused by :func:`memplan.compile`, by name),
    each ``torch.optim`` optimizer inside its ``AcceleratedOptimizer``, and the schedulers as
    they are. Raises :class:`MemplanError` with one line for what memplan does not plan (see
    the module docstring)."""
    optimizers = [_unwrap_optimizer(o) for o in _as_list(optimizer)]
    schedulers = _as_list(scheduler)
    for sched in schedulers:
        if type(sched).__name__ == ACCELERATE_SCHEDULER and getattr(sched, "gradient_state", None) is not None:
            _check_gradient_state(sched.gradient_state)
    return model, optimizers, schedulers


def adapt(
    model: torch.nn.Module, optimizers: list[Any], schedulers: list[Any]
) -> tuple[torch.nn.Module, list[torch.optim.Optimizer], list[Any]]:
    """:func:`unwrap` where one of the objects came from ``accelerator.prepare()``; the objects
    as they are otherwise (what :func:`memplan.compile` calls)."""
    if any(is_accelerate_object(o) for o in [*optimizers, *schedulers]):
        return unwrap(model, optimizers, schedulers)
    return model, optimizers, schedulers


def _unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    if type(optimizer).__name__ != ACCELERATE_OPTIMIZER:
        return optimizer
    if getattr(optimizer, "scaler", None) is not None:
        raise MemplanError(
            "the Accelerator runs fp16 with its own GradScaler, which memplan does not plan through Accelerate; "
            "use mixed_precision='bf16', or memplan.compile(..., scaler=torch.amp.GradScaler()) in your own step"
        )
    _check_gradient_state(optimizer.gradient_state)
    inner = optimizer.optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise MemplanError(f"the AcceleratedOptimizer wraps a {type(inner).__name__}, not a torch.optim optimizer")
    return inner


def _check_gradient_state(state: Any) -> None:
    steps = int(getattr(state, "num_steps", 1) or 1)
    if steps > 1:
        raise MemplanError(
            f"the Accelerator accumulates gradients over {steps} calls (gradient_accumulation_steps={steps}), so "
            "whether a call steps the optimizer changes from call to call; give memplan the whole step: loop over "
            "the micro-batches inside it and keep gradient_accumulation_steps=1"
        )


def _as_list(value: Any | Sequence[Any]) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def compile(  # memplan.compile for the objects accelerator.prepare() returned
    fn: Callable[[Any], Any] | None = None,
    *,
    model: torch.nn.Module,
    optimizer: Any | Sequence[Any] = (),
    scheduler: Any | Sequence[Any] = (),
    **options: Any,
) -> Any:
    """:func:`memplan.compile` for a step written against ``accelerator.prepare()``'s objects
    (which :func:`memplan.compile` also takes as they are): ``model``, ``optimizer`` and
    ``scheduler`` as ``prepare()`` returned them (:func:`unwrap`). Every other keyword
    (``memory_budget``, ``max_overhead``, ``scaler``, ...) is :func:`memplan.compile`'s. A
    decorator when ``fn`` is omitted."""
    import memplan

    model, optimizers, schedulers = unwrap(model, optimizer, scheduler)
    return memplan.compile(fn, model=model, optimizer=optimizers, scheduler=schedulers, **options)
