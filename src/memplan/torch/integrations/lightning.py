"""Lightning: ``MemplanCallback`` plans a ``LightningModule``'s automatic-optimization step.

::

    trainer = lightning.Trainer(max_steps=1000, callbacks=[MemplanCallback(memory_budget=None)])
    trainer.fit(module, datamodule)

Why a callback that swaps the optimization loop, and not a strategy or a precision plugin:
Lightning's automatic step is a closure (``training_step``, ``zero_grad``, ``backward``) that the
optimizer's ``step(closure)`` calls through the strategy and the precision plugin, and under
``accumulate_grad_batches`` the closure of every batch but the last of a window runs outside
any ``optimizer_step``. A strategy or a precision plugin sees one batch's closure at a time, so
it cannot hold the whole accumulation window as one step; memplan plans whole steps (they must
end with ``zero_grad``). The loop object that makes the closures,
``trainer.fit_loop.epoch_loop.automatic_optimization``, sees every batch and knows when
Lightning steps (``_should_accumulate``). ``on_fit_start`` replaces it with
:class:`_PlannedOptimization`, which shares the original's progress counters (``global_step``,
checkpoints and resuming read them), holds the batches of a window until its last one, and then
runs one planned step: for each batch ``training_step`` (through the strategy, in the
precision plugin's context), the loss divided by ``accumulate_grad_batches``,
``on_before_zero_grad``/``optimizer_zero_grad`` on the first, ``backward`` with its hooks;
then ``on_before_optimizer_step`` and ``configure_gradient_clipping`` (``gradient_clip_val``,
``gradient_clip_algorithm``), ``optimizer.step()`` and ``zero_grad(set_to_none=True)``:
the calls, in the order, that Lightning's closure makes. The arena is given back while
validation runs and at the end of the fit (the next step maps it again). The step is a
:class:`memplan.api.CompiledStep`, traced once per batch shape on fakes; the LR scheduler,
validation, logging, checkpoints and every other hook stay Lightning's own, outside the step.
It swaps the loop back in ``teardown``.

What the planned step keeps and what it changes, against the plain Lightning run:

- Loss, parameters, optimizer state and the random generator are Lightning's bit for bit. A
  parameter's gradient is cleared at the end of the step (Lightning clears it at the start of
  the next window), so gradients are not held between steps: part of the memory saved.
- ``self.log`` calls inside the step (in ``training_step`` and the hooks it runs) are recorded
  at capture, their tensors returned by the plan, and replayed for real after each step with
  the same arguments; under accumulation all the window's calls are replayed at its last batch,
  which is when Lightning logs step metrics anyway. A logged Python number is refused (the plan
  cannot recompute it); log a tensor, or log it in ``on_train_batch_end``.
- Like every traced step, the Python of ``training_step`` and of the hooks above runs at
  capture only: their tensor ops and ``self.log`` calls happen every step, a counter or a print
  does not. ``training_step`` that reads ``batch_idx`` is refused in one line.
- With ``accumulate_grad_batches > 1``, ``on_train_batch_end`` of a batch that is not the
  window's last gets ``{}`` as its outputs (the loss is not computed yet).

Precisions ``32-true``, ``bf16-mixed`` and ``16-mixed`` (its GradScaler planned with the step:
unscale, hooks and clipping, ``scaler.step``, ``scaler.update``, as Lightning's
``MixedPrecision`` runs them). Refused in one line (:class:`LightningNotPlanned`): manual
optimization, no optimizer (several are Lightning's own refusal), a strategy other than one
device (DDP, FSDP, DeepSpeed), other precision plugins (``bf16-true``, ``64-true``,
Transformer Engine), a module that overrides ``optimizer_step`` (its Python would run at capture
only), a ``training_step`` that takes ``dataloader_iter``, returns ``None``, reads ``batch_idx``,
or logs a Python number.

Built on Lightning 2.6's loop internals (``_AutomaticOptimization``, ``call``, the precision
plugin's ``_after_closure``), read from its source; ``tests/torch/test_integrations_lightning.py``
checks them against plain Lightning.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from torch.utils import _pytree as pytree

import torch
from memplan.api import DEFAULT_MAX_PLANS, CompiledStep, mode_key, shape_key
from memplan.errors import MemplanError
from memplan.torch.rss import release_free_memory

try:
    import lightning.pytorch as pl
    from lightning.pytorch.core.optimizer import _MockOptimizer
    from lightning.pytorch.loops.optimization.automatic import ClosureResult, _AutomaticOptimization
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from lightning.pytorch.plugins.precision.amp import _optimizer_handles_unscaling
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from lightning.pytorch.trainer import call
except ImportError as err:  # pragma: no cover - the extra is installed where this module is used
    raise ImportError("memplan's Lightning callback needs Lightning: pip install memplan[lightning]") from err


class LightningNotPlanned(MemplanError):
    """A Lightning setup the callback does not plan; the message says what and why."""


class MemplanCallback(pl.Callback):
    """Train a ``LightningModule`` (automatic optimization) with memplan's planned step.

    ``memory_budget`` and ``max_overhead`` are :func:`memplan.compile`'s (bytes, ``"2GiB"``, a
    fraction of the checkpoint-all peak); ``time_limit_seconds``, ``allocator``, ``executor`` and
    ``max_plans`` too. ``report`` is the latest plan's report, ``compiled`` the
    :class:`~memplan.api.CompiledStep` (``None`` before the first step).
    """

    def __init__(
        self,
        *,
        memory_budget: int | float | str | None = None,
        max_overhead: float | None = None,
        time_limit_seconds: float = 10.0,
        allocator: str = "auto",
        executor: str = "generated",
        max_plans: int = DEFAULT_MAX_PLANS,
    ) -> None:
        self.options: dict[str, Any] = {
            "memory_budget": memory_budget,
            "max_overhead": max_overhead,
            "time_limit_seconds": time_limit_seconds,
            "allocator": allocator,
            "executor": executor,
            "max_plans": max_plans,
        }
        if memory_budget is not None or max_overhead is not None:
            from memplan.torch.run.budget import check_max_overhead, parse_memory_budget

            check_max_overhead(max_overhead)
            if memory_budget is not None:
                parse_memory_budget(memory_budget, 1)  # a malformed budget is refused here, not mid-fit
        self.compiled: CompiledStep | None = None
        self.steps_planned = 0  # optimizer steps the plan ran
        self._original: _AutomaticOptimization | None = None
        self.arena_released = False  # given back while no step ran; the next step maps it again

    @property
    def report(self) -> dict[str, Any]:
        """The report of the most recent plan (empty before the first step)."""
        return self.compiled.report if self.compiled is not None else {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_plannable(trainer, pl_module)
        loop = trainer.fit_loop.epoch_loop
        self._original = loop.automatic_optimization
        loop.automatic_optimization = _PlannedOptimization(trainer, self, self._original)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.release_arena()

    def release_arena(self) -> None:
        """Give the planned step's arena back while no step runs (validation, the end of the fit).
        With the planned allocator (``allocator="replay"``, the CPU default) no arena allocation
        outlives a step (the replay checks it) and every step reserves the arena again, so this
        is safe; the next step maps it again once. With arena views the plans keep their block."""
        if self.compiled is not None and self.compiled.allocator == "replay" and self.compiled.arena.nbytes:
            self.compiled.arena.release()
            self.arena_released = True

    def before_step(self) -> None:
        """Before a step maps the released arena again: what validation and checkpointing freed
        goes back to the OS first (glibc keeps freed blocks in its heap; Lightning's own steps
        reuse them, a newly mapped arena would not)."""
        if self.arena_released:
            release_free_memory()
            self.arena_released = False

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.release_arena()
        if self._original is not None:
            trainer.fit_loop.epoch_loop.automatic_optimization = self._original
            self._original = None

    def compiled_for(self, trainer: pl.Trainer, step: _WindowStep) -> CompiledStep:
        """The planned step, made on the first optimizer step of this fit."""
        module, optimizer = trainer.lightning_module, trainer.optimizers[0]
        if self.compiled is None or self.compiled.model is not module or self.compiled.optimizer is not optimizer:
            self.compiled = CompiledStep(step, module, [optimizer], scaler=_scaler(trainer), **self.options)
        return self.compiled


def check_plannable(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    """Raise :class:`LightningNotPlanned` (one line) for what the planned step cannot run."""
    name = "MemplanCallback"
    if not module.automatic_optimization:
        raise LightningNotPlanned(
            f"{name}: manual optimization (automatic_optimization=False) is not planned: the callback plans "
            "Lightning's automatic step; use automatic optimization, or memplan.compile on a step in your own loop"
        )
    if len(trainer.optimizers) != 1:
        raise LightningNotPlanned(
            f"{name}: found {len(trainer.optimizers)} optimizers; the planned step runs exactly one "
            "(configure_optimizers must return one optimizer, with or without a scheduler)"
        )
    if isinstance(trainer.optimizers[0], _MockOptimizer):
        raise LightningNotPlanned(
            f"{name}: configure_optimizers returned no optimizer, so there is no training step to plan; "
            "return an optimizer, or train without the callback"
        )
    strategy = trainer.strategy
    if type(strategy) is not SingleDeviceStrategy:
        raise LightningNotPlanned(
            f"{name}: strategy {type(strategy).__name__} is not planned: the callback plans one-device training; "
            "use strategy='auto' on one device (memplan.compile_data_parallel_step plans DDP in your own loop)"
        )
    precision = trainer.precision_plugin
    if type(precision) not in (Precision, MixedPrecision):
        raise LightningNotPlanned(
            f"{name}: precision {getattr(precision, 'precision', type(precision).__name__)!r} is not planned; "
            "use precision='32-true', 'bf16-mixed' or '16-mixed'"
        )
    if type(module).optimizer_step is not pl.LightningModule.optimizer_step:
        raise LightningNotPlanned(
            f"{name}: {type(module).__name__} overrides optimizer_step, whose Python would run at capture only; "
            "move what it does (an LR warm-up) into an LR scheduler returned by configure_optimizers"
        )


def _scaler(trainer: pl.Trainer) -> torch.amp.GradScaler | None:
    """The GradScaler of ``precision='16-mixed'`` (None for 32-true and bf16-mixed)."""
    return getattr(trainer.precision_plugin, "scaler", None)


class _PlannedOptimization(_AutomaticOptimization):
    """Lightning's automatic optimization, each accumulation window run as one planned step.

    Shares the replaced loop's progress counters, so ``global_step``, checkpoints and resuming
    see the same counts as with Lightning's loop.
    """

    def __init__(self, trainer: pl.Trainer, callback: MemplanCallback, original: _AutomaticOptimization) -> None:
        super().__init__(trainer)
        self.optim_progress = original.optim_progress
        self._skip_backward = original._skip_backward
        self.callback = callback
        self.window: list[Any] = []  # the batches of the current accumulation window
        self.step_fn = _WindowStep(trainer)

    def run(self, optimizer: torch.optim.Optimizer, batch_idx: int, kwargs: OrderedDict) -> dict[str, Any]:
        if "batch" not in kwargs:
            raise LightningNotPlanned(
                "MemplanCallback: a training_step that takes dataloader_iter is not planned (it reads batches inside "
                "the step); take batch (and batch_idx) instead"
            )
        self.step_fn.takes_batch_idx = "batch_idx" in kwargs
        if not self.window:  # Lightning zeroes the gradients in the first batch of a window
            zero_grad = self.optim_progress.optimizer.zero_grad
            zero_grad.increment_ready()
            zero_grad.increment_started()
            zero_grad.increment_completed()
        self.window.append(kwargs["batch"])
        if not self.trainer.strategy.handles_gradient_accumulation and self.trainer.fit_loop._should_accumulate():
            return {}  # the window's step runs at its last batch
        window, self.window = self.window, []
        self.optim_progress.optimizer.step.increment_ready()
        compiled = self.callback.compiled_for(self.trainer, self.step_fn)
        self.callback.before_step()
        steps = {"accumulate": self.trainer.accumulate_grad_batches, "batches": window}  # a plan per divisor too
        losses, extras = self.step_fn.outputs(steps, compiled(steps))
        self.optim_progress.optimizer.step.increment_completed()
        self.callback.steps_planned += 1
        return {"loss": losses[-1], **extras[-1]}


class _WindowStep:
    """The step function memplan traces: one accumulation window, as Lightning's closure and
    ``optimizer_step`` run it. Returns ``(losses, extras, logged tensors)``."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.takes_batch_idx = True
        self.traced: dict[tuple, _Traced] = {}  # per plan key (shapes, modes): what the trace returned and logged

    def __call__(self, steps: dict[str, Any]) -> list[torch.Tensor]:
        trainer = self.trainer
        window, accumulate = steps["batches"], steps["accumulate"]
        module = trainer.lightning_module
        optimizer = trainer.optimizers[0]
        recorder = _LogRecorder(module)
        losses, extras = [], []
        with recorder:
            for i, batch in enumerate(window):
                args = (batch, _TracedIndex(i)) if self.takes_batch_idx else (batch,)
                output = call._call_strategy_hook(trainer, "training_step", *args)
                trainer.strategy.post_training_step()
                if output is None:
                    raise LightningNotPlanned(
                        "MemplanCallback: training_step returned None (a skipped step), which a planned step cannot "
                        "decide; return the loss every step"
                    )
                result = ClosureResult.from_training_step_output(output, accumulate)
                if i == 0:
                    call._call_callback_hooks(trainer, "on_before_zero_grad", optimizer)
                    call._call_lightning_module_hook(trainer, "on_before_zero_grad", optimizer)
                    call._call_lightning_module_hook(
                        trainer, "optimizer_zero_grad", trainer.current_epoch, _TracedIndex(i), optimizer
                    )
                call._call_strategy_hook(trainer, "backward", result.closure_loss, optimizer)
                losses.append(result.loss)
                extras.append(result.extra)
            scaler = _scaler(trainer)
            if scaler is not None and not _optimizer_handles_unscaling(optimizer):
                scaler.unscale_(optimizer)  # before the hooks and clipping, as MixedPrecision.optimizer_step
            trainer.precision_plugin._after_closure(module, optimizer)  # on_before_optimizer_step, clipping
            if scaler is not None:
                scaler.step(optimizer)  # skipped when a gradient is not finite
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        leaves, spec = pytree.tree_flatten((losses, extras, recorder.values))
        constants = {i: leaf for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)}
        self.traced[self.key(steps)] = _Traced(spec, constants, recorder.calls)
        return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]

    def key(self, steps: dict[str, Any]) -> tuple:
        return shape_key(steps), mode_key(self.trainer.lightning_module)

    def outputs(self, steps: dict[str, Any], result: Any) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
        """The losses and extra outputs of the window's steps, from the plan's flat result;
        the step's ``self.log`` calls made for real with the values the plan computed."""
        traced = self.traced[self.key(steps)]
        tensors = iter(list(result) if isinstance(result, (list, tuple)) else [result])
        leaves = [
            traced.constants[i] if i in traced.constants else next(tensors) for i in range(traced.spec.num_leaves)
        ]
        losses, extras, logged = pytree.tree_unflatten(leaves, traced.spec)
        module = self.trainer.lightning_module
        previous = module._current_fx_name
        try:
            for (fx, name, arguments), value in zip(traced.log_calls, logged, strict=True):
                module._current_fx_name = fx
                pl.LightningModule.log(module, name, value, **arguments)
        finally:
            module._current_fx_name = previous
        return losses, extras


@dataclass
class _Traced:
    """What a traced window step returns (its output's structure and non-tensor leaves) and logs."""

    spec: pytree.TreeSpec
    constants: dict[int, Any]
    log_calls: list[tuple[str, str, dict[str, Any]]]


_LOG_SIGNATURE = inspect.signature(pl.LightningModule.log)


class _LogRecorder:
    """Stands in for ``module.log`` while the step is traced: records each call's hook, name
    and arguments, and keeps the logged tensor so the plan returns it."""

    def __init__(self, module: pl.LightningModule) -> None:
        self.module = module
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.values: list[torch.Tensor] = []

    def __enter__(self) -> _LogRecorder:
        self.module.log = self.log  # log_dict calls self.log per key
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.module.log

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        bound = _LOG_SIGNATURE.bind(self.module, name, value, *args, **kwargs)
        arguments = {k: v for k, v in bound.arguments.items() if k not in ("self", "name", "value")}
        if not isinstance(value, torch.Tensor):
            raise LightningNotPlanned(
                f"MemplanCallback: self.log({name!r}, ...) inside the step logs a {type(value).__name__}, which the "
                "plan cannot recompute each step; log a tensor, or log it in on_train_batch_end"
            )
        self.calls.append((self.module._current_fx_name or "training_step", name, arguments))
        self.values.append(value.detach())


class _TracedIndex(int):
    """``batch_idx`` while the step is traced: the plan runs the same ops for every batch, so a
    step that reads its value is refused."""

    def _refuse(self, *args: Any) -> Any:
        raise LightningNotPlanned(
            "MemplanCallback: training_step reads batch_idx, but a planned step is traced once per batch shape and "
            "runs the same ops for every batch; move what depends on batch_idx to on_train_batch_start"
        )

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __mod__ = __rmod__ = __floordiv__ = __rfloordiv__ = __truediv__ = __rtruediv__ = _refuse
    __bool__ = __index__ = __float__ = __format__ = __str__ = __repr__ = _refuse
    __hash__ = int.__hash__
