"""The Python API in three lines::

    step = memplan.compile_step(model, optimizer, loss_fn, example_batch)
    for batch in loader:
        loss = step(batch)

``compile_step`` captures the step on fake copies of the model and optimizer, plans it
(order, then one arena with a static offset for every tensor) and returns a callable that runs
the plan on the real model and optimizer. A batch of another shape gets its own plan (cached
per shape); numerics equal eager PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils import _pytree as pytree

import torch
from memplan.errors import MemplanError
from memplan.pipeline import MemoryPlan, make_plan
from memplan.torch.capture import Capture, capture_infer_step, capture_train_step
from memplan.torch.run.interpreter import Plan, StepRunner, allocator_tensors, optimizer_update_groups
from memplan.torch.run.replay import ReplayedStep
from memplan.torch.run.updates import check_optimizer


def optimize(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    example_batch: Any,
    *,
    time_limit_seconds: float = 10.0,
    reorder: bool = True,
    allocator: str = "views",
    recompute_copies: bool = True,
) -> tuple[Capture, MemoryPlan]:
    """Capture and plan one step; returns the capture and the plan (with its report).

    With an optimizer and a loss function the step is a training step on
    ``example_batch = (inputs, target)``; without, an inference step on ``example_batch``.
    ``allocator="views"`` keeps the outputs of ops without an arena kernel out of the arena
    (the allocator holds them); ``"replay"`` plans one pool, as the planned allocator serves
    every allocation. ``recompute_copies`` runs a forward copy (``cat``, ``clone``) again in
    the backward where that lowers the peak: same bits, a copy's worth of time.
    """
    if optimizer is None:
        capture = capture_infer_step(model, example_batch)
    else:
        if loss_fn is None:
            raise TypeError("a training step needs loss_fn(output, target)")
        check_optimizer(optimizer, model)
        capture = capture_train_step(model, optimizer, loss_fn, example_batch, recompute_copies=recompute_copies)
    groups = optimizer_update_groups(capture, optimizer) if capture.mode == "train" else []
    plan = make_plan(
        capture.graph,
        time_limit_seconds=time_limit_seconds,
        reorder=reorder,
        atomic_groups=groups,
        allocator_tensors=allocator_tensors(capture) if allocator == "views" else frozenset(),
    )
    plan.report["recomputed_copies"] = list(capture.recomputed)
    return capture, plan


ALLOCATORS = ("auto", "replay", "views")


def resolve_allocator(name: str) -> str:
    """ "auto" is "replay" where the planned CPU allocator builds here, else "views"."""
    if name not in ALLOCATORS:
        raise MemplanError(f"unknown allocator {name!r}; choose one of {', '.join(ALLOCATORS)}")
    if name != "auto":
        return name
    from memplan.torch.run import allocator

    return "replay" if allocator.available() else "views"


class CompiledStep:
    """A planned training (or inference) step; call it with a batch."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        *,
        time_limit_seconds: float = 10.0,
        reorder: bool = True,
        allocator: str = "auto",
        recompute_copies: bool = True,
    ) -> None:
        on_cpu = all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])
        if allocator == "replay" and not on_cpu:
            raise MemplanError("allocator='replay' serves CPU memory only; use allocator='views' on this device")
        self.allocator = resolve_allocator(allocator) if on_cpu else "views"
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.time_limit_seconds = time_limit_seconds
        self.reorder = reorder
        self.recompute_copies = recompute_copies
        self.runners: dict[tuple, StepRunner | ReplayedStep] = {}
        self.plans: dict[tuple, MemoryPlan] = {}

    def __call__(self, batch: Any) -> Any:
        return self.runner_for(batch)(batch)

    def runner_for(self, batch: Any) -> StepRunner | ReplayedStep:
        """The runner for this batch's shapes and the model's modes, planned on first use."""
        key = (shape_key(batch), mode_key(self.model))
        if key not in self.runners:
            capture, plan = optimize(
                self.model,
                self.optimizer,
                self.loss_fn,
                batch,
                time_limit_seconds=self.time_limit_seconds,
                reorder=self.reorder,
                allocator=self.allocator,
                recompute_copies=self.recompute_copies,
            )
            self.plans[key] = plan
            if self.allocator == "replay":
                runner = StepRunner(capture, Plan(tuple(plan.order)), self.model, self.optimizer)
                self.runners[key] = ReplayedStep(runner, time_limit_seconds=self.time_limit_seconds)
            else:
                self.runners[key] = StepRunner(
                    capture, Plan(tuple(plan.order), plan.offsets, plan.arena_bytes), self.model, self.optimizer
                )
        return self.runners[key]

    @property
    def report(self) -> dict[str, Any]:
        """The report of the most recent plan."""
        if not self.plans:
            return {}
        return list(self.plans.values())[-1].report


def shape_key(batch: Any) -> tuple:
    """What a plan is made for: the batch's structure, each tensor's shape and dtype, and each
    other leaf's value (``None``, a flag), which the traced step has fixed."""
    leaves, spec = pytree.tree_flatten(batch)
    shapes = tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else _leaf_key(x) for x in leaves)
    return (str(spec), shapes)


def mode_key(model: torch.nn.Module) -> tuple:
    """What the traced step fixed about the model that a training loop changes between steps:
    each module's ``training`` flag (``model.eval()``) and each parameter's ``requires_grad``
    (freezing, unfreezing). Another mode gets another plan, never a stale one."""
    return (
        tuple(m.training for m in model.modules()),
        tuple(p.requires_grad for p in model.parameters()),
    )


def _leaf_key(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value), value)
    return type(value)


def compile_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    example_batch: Any,
    *,
    time_limit_seconds: float = 10.0,
    reorder: bool = True,
    allocator: str = "auto",
    recompute_copies: bool = True,
) -> CompiledStep:
    """Plan ``loss = loss_fn(model(inputs), target); loss.backward(); optimizer.step();
    optimizer.zero_grad(set_to_none=True)`` and return it as a callable ``step(batch)``.
    ``recompute_copies=False`` keeps every forward copy instead of running it again in the
    backward (:mod:`memplan.torch.capture.recompute`)."""
    step = CompiledStep(
        model,
        optimizer,
        loss_fn,
        time_limit_seconds=time_limit_seconds,
        reorder=reorder,
        allocator=allocator,
        recompute_copies=recompute_copies,
    )
    step.runner_for(example_batch)
    return step


def compile_inference(
    model: torch.nn.Module, example_inputs: Any, *, time_limit_seconds: float = 10.0, allocator: str = "auto"
) -> CompiledStep:
    """Plan ``with torch.no_grad(): model(inputs)`` and return it as a callable."""
    step = CompiledStep(model, None, None, time_limit_seconds=time_limit_seconds, allocator=allocator)
    step.runner_for(example_inputs)
    return step
