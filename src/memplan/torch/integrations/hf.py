"""HF ``Trainer``: the step the Trainer runs, planned by memplan, with one changed line::

    from memplan.torch.integrations.hf import MemplanTrainer

    trainer = MemplanTrainer(model=model, args=args, train_dataset=train, memory_budget=None)  # was: Trainer(...)
    trainer.train()

Why a ``Trainer`` subclass, and not a callback or an argument: memplan plans a whole optimizer
step (every micro-batch's forward and backward, the clipping, ``optimizer.step()``, the
scheduler's step, ``zero_grad``) as one graph, and must run it as one call. A callback sees the
step only between its parts, after they ran; an argument would need a change in transformers. A
subclass can take over exactly the calls the Trainer's loop makes for a step and leave the loop
itself (logging, evaluation, checkpoints, resuming, callbacks, the data loading) to the Trainer.

How: the loop (``Trainer._run_epoch`` in transformers 5) fetches the micro-batches of one
optimizer step up front (``get_batch_samples``), calls ``training_step`` per micro-batch, then
clips (``_clip_grad_norm``), calls ``optimizer.step()``, ``lr_scheduler.step()`` and
``model.zero_grad()``. :class:`MemplanTrainer` runs the planned step at the first
``training_step`` of each optimizer step: a step function that calls the Trainer's own
``training_step`` on each micro-batch (its loss scaling for accumulation, ``accelerator.backward``,
the autocast ``prepare()`` put around ``forward``), its own ``_clip_grad_norm`` /
``_get_grad_norm``, the ``torch.optim`` optimizer inside the ``AcceleratedOptimizer`` and the
scheduler, as the Trainer sets them up. It hands each micro-batch's loss and the gradient norm
back to the loop at the place the loop asks for them, and, during training, the loop's own
``optimizer.step()`` and ``lr_scheduler.step()`` are no-ops (the plan made them, for real, at
their place in the step). The learning rate it logs is the one the step used, as the Trainer
logs it. So a run trains bit for bit like ``Trainer`` from the same seed (loss, parameters,
optimizer and scheduler state), and checkpoints and resuming are the Trainer's.

Supported: gradient accumulation, ``max_grad_norm`` (clipping, or the norm alone with 0),
every ``torch.optim`` optimizer memplan plans (the Trainer's default AdamW included), the LR
schedulers (``ReduceLROnPlateau`` is stepped by the Trainer after evaluation, as usual),
dropout, evaluation between steps (the model's mode gets its own plan), ``bf16=True`` on the
CPU (accelerate's autocast around ``forward``). ``memory_budget`` / ``max_overhead`` (see
:func:`memplan.compile`) trade compute for memory; ``memplan_options`` passes any other
keyword of :func:`memplan.compile` (``time_limit_seconds``, ``allocator``, ...).

Refused in one line (:class:`~memplan.errors.MemplanError`): ``fp16=True`` (its GradScaler
runs inside accelerate's optimizer wrapper), DeepSpeed, FSDP, several processes or GPUs
(DDP, DataParallel), ``torch_compile=True``, ``activation_checkpointing`` / ``gradient_checkpointing`` (give
``memory_budget`` instead: memplan's recomputation, planned over the whole step), and what
memplan itself refuses in a step (a data-dependent Python branch in the model, ...).
Differences from ``Trainer`` one can see: callbacks' ``on_pre_optimizer_step`` and
``on_optimizer_step`` run after the planned step made the update (a callback that changes
gradients there changes nothing), and a callback that stops training in the middle of an
accumulation finds that step already made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from memplan.errors import MemplanError

try:
    from transformers import Trainer
except ImportError as err:  # pragma: no cover - the extra is installed with memplan[transformers]
    raise ImportError("memplan.torch.integrations.hf needs transformers: pip install memplan[transformers]") from err

PLATEAU_SCHEDULERS = ("ReduceLROnPlateau", "GreedyLR")  # the Trainer steps these after evaluation, with a metric


def check_arguments(args: Any) -> None:
    """Refuse, in one line, what a :class:`MemplanTrainer` cannot plan in ``TrainingArguments``."""
    refusals = [
        (getattr(args, "fp16", False), "fp16=True (its GradScaler runs inside accelerate's optimizer wrapper)", "bf16"),
        (getattr(args, "deepspeed", None), "DeepSpeed", "plain Trainer"),
        (getattr(args, "fsdp", None), "FSDP", "plain Trainer"),
        (getattr(args, "torch_compile", False), "torch_compile=True", "one of the two"),
        (
            getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False),
            "activation (gradient) checkpointing",
            "memory_budget=... (memplan's recomputation, planned over the whole step)",
        ),
        (getattr(args, "world_size", 1) > 1 or getattr(args, "n_gpu", 0) > 1, "several processes or GPUs", "one"),
    ]
    for found, what, instead in refusals:
        if found:
            raise MemplanError(f"MemplanTrainer does not plan {what}; use {instead} instead")


LOOP_METHODS = ("_run_epoch", "get_batch_samples", "training_step", "_clip_grad_norm", "_get_grad_norm")


def check_trainer_loop() -> None:
    """Refuse a transformers whose Trainer loop lacks the methods :class:`MemplanTrainer` takes
    over (written against transformers 5's ``Trainer._run_epoch``)."""
    missing = [name for name in LOOP_METHODS if not callable(getattr(Trainer, name, None))]
    if missing:
        import transformers

        raise MemplanError(
            f"MemplanTrainer needs a transformers 5 Trainer loop; transformers {transformers.__version__}'s Trainer "
            f"has no {', '.join(missing)}: upgrade transformers, or plan your own loop with memplan.compile"
        )


class _SchedulerCall:
    """The scheduler as memplan sees it: its own ``step()``. The scheduler watches the
    ``AcceleratedOptimizer`` while memplan steps the ``torch.optim`` optimizer inside it, so the
    call first marks the watched one as stepped, as its own ``step()`` would have (else PyTorch
    warns that the scheduler stepped before the optimizer)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def step(self) -> None:
        watched = getattr(self.scheduler, "optimizer", None)
        if watched is not None:
            watched._opt_called = True
        self.scheduler.step()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)


class _StepMade:
    """The scheduler as the Trainer's loop sees it during training: everything is the
    scheduler's, except ``step()``, which the planned step already made."""

    def __init__(self, scheduler: Any) -> None:
        object.__setattr__(self, "_scheduler", scheduler)

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._scheduler, name, value)


def _made_by_plan(*args: Any, **kwargs: Any) -> None:
    """``optimizer.step()`` in the Trainer's loop: the planned step made it."""
    return None


_made_by_plan._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # as the wrapper it stands for


class MemplanTrainer(Trainer):
    """``transformers.Trainer`` whose optimizer steps memplan plans and runs (module docstring).

    ``memory_budget`` and ``max_overhead`` are :func:`memplan.compile`'s; ``memplan_options``
    any of its other keywords. ``memplan_step`` is the :class:`memplan.api.CompiledStep` (its
    ``report`` says what was planned) once training has begun.
    """

    def __init__(
        self,
        *args: Any,
        memory_budget: int | float | str | None = None,
        max_overhead: float | None = None,
        memplan_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        check_trainer_loop()
        check_arguments(self.args)
        self.memplan_options = {"memory_budget": memory_budget, "max_overhead": max_overhead, **(memplan_options or {})}
        self.memplan_step: Any = None
        self._memplan_key: tuple = ()
        self._tracing = False
        self._samples: tuple[list, Any] = ([], None)
        self._pending: list[tuple[Any, torch.Tensor]] = []  # (micro-batch, its loss) the planned step ran
        self._grad_norm: Any = None
        self._step_lr: float | None = None

    # ------------------------------------------------------------------ the loop's calls

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int, device: torch.device) -> tuple[list, Any]:
        """The Trainer's, and kept: the planned step runs on these micro-batches."""
        samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._samples = (samples, num_items)
        self._pending = []
        return samples, num_items

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
        """Inside the planned step, the Trainer's own; in the loop, the loss of ``inputs`` from
        the planned step, which runs (the whole optimizer step) at its first micro-batch."""
        if self._tracing:
            return super().training_step(model, inputs, num_items_in_batch)
        if not self._pending:
            self._run_planned_step(model)
        micro, loss = self._pending.pop(0)
        if micro is not inputs:
            raise MemplanError("MemplanTrainer: training_step got a batch get_batch_samples did not fetch")
        return loss

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        return super()._clip_grad_norm(model) if self._tracing else self._grad_norm

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        return super()._get_grad_norm(model, grad_norm) if self._tracing else self._grad_norm

    def _get_learning_rate(self) -> float:
        return super()._get_learning_rate() if self._step_lr is None else self._step_lr

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        with self._planned_calls():
            return super()._run_epoch(*args, **kwargs)

    # ------------------------------------------------------------------ the planned step

    @contextlib.contextmanager
    def _planned_calls(self) -> Iterator[None]:
        """While the loop runs: its ``optimizer.step()`` and ``lr_scheduler.step()`` are the
        planned step's (no-ops in the loop); everything else of both objects is theirs."""
        optimizer, scheduler = self.optimizer, self.lr_scheduler
        if type(optimizer).__name__ != "AcceleratedOptimizer":
            raise MemplanError(
                f"MemplanTrainer expects the optimizer accelerate prepared, got {type(optimizer).__name__}"
            )
        saved_step = vars(optimizer).get("step")  # the LR scheduler's wrapper, when it made one
        optimizer.step = _made_by_plan
        if _scheduler_in_step(scheduler):
            self.lr_scheduler = _StepMade(scheduler)
        try:
            yield
        finally:
            if saved_step is None:
                del optimizer.step
            else:
                optimizer.step = saved_step
            self.lr_scheduler = scheduler
            self._step_lr = None

    def _run_planned_step(self, model: torch.nn.Module) -> None:
        samples, num_items = self._samples
        if not samples:
            raise MemplanError("MemplanTrainer: training_step was called before get_batch_samples fetched a batch")
        model.train()  # as the Trainer's training_step does first: the plan is for training mode
        step = self._compiled(model)
        self._step_lr = None
        self._step_lr = self._get_learning_rate()  # the rate this step uses, as the Trainer logs it
        state = self.accelerator.gradient_state
        was_syncing = state.sync_gradients
        state._set_sync_gradients(True)  # where the Trainer clips and steps
        try:
            *losses, self._grad_norm = step((samples, num_items))  # the planned step's outputs, flat
        finally:
            state._set_sync_gradients(was_syncing)
        self._pending = list(zip(samples, losses, strict=True))

    def _compiled(self, model: torch.nn.Module) -> Any:
        """The compiled step for this model, optimizer and scheduler (made again when ``train()``
        made new ones)."""
        import memplan

        optimizer = self.optimizer.optimizer  # the torch.optim optimizer inside AcceleratedOptimizer
        scheduler = self.lr_scheduler._scheduler if isinstance(self.lr_scheduler, _StepMade) else None
        key = (id(model), id(optimizer), id(scheduler))
        if self.memplan_step is not None and key == self._memplan_key:
            return self.memplan_step
        if model is not self.model:
            raise MemplanError(f"MemplanTrainer plans the model itself, not wrapped in {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise MemplanError(f"MemplanTrainer plans torch.optim optimizers, not {type(optimizer).__name__}")
        call = _SchedulerCall(scheduler) if scheduler is not None else None

        def trainer_step(batch: tuple[list, Any]) -> list:
            micro_batches, items = batch
            self._tracing = True
            try:
                losses = [self.training_step(model, micro, items) for micro in micro_batches]
                grad_norm = self._clip_grad_norm(model) if self.args.max_grad_norm > 0 else None
                grad_norm = self._get_grad_norm(model, grad_norm)
            finally:
                self._tracing = False
            optimizer.step()
            if call is not None:
                call.step()
            model.zero_grad()
            return [*losses, grad_norm]

        self.memplan_step = memplan.compile(
            trainer_step,
            model=model,
            optimizer=optimizer,
            scheduler=[call] if call is not None else [],
            **self.memplan_options,
        )
        self._memplan_key = key
        return self.memplan_step


def _scheduler_in_step(scheduler: Any) -> bool:
    """Whether the Trainer steps ``scheduler`` every optimizer step (not after evaluation)."""
    return scheduler is not None and type(scheduler).__name__ not in PLATEAU_SCHEDULERS
