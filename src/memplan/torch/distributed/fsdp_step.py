"""The FSDP2 step API: :func:`compile_fsdp_step` (see :mod:`memplan.torch.distributed.fsdp`).

Every rank captures the step of its shard model; the captures must have the same structure
(checked). Rank 0 orders the ops (solvers are not deterministic under time limits, and every
rank must run the collectives in the same order) and broadcasts the order; each rank places
its own tensors for that order (its shards may be smaller than rank 0's) and runs the plan on
its own arena with memplan's runtime (:class:`memplan.torch.run.interpreter.StepRunner`), whose
all-gathers and reduce-scatters call gloo at their planned place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

import torch
from memplan.api import shape_key
from memplan.errors import MemplanError
from memplan.torch.capture import Capture
from memplan.torch.distributed.fsdp import (
    capture_fsdp_step,
    link_state,
    read_layout,
    refuse_foreign_collectives,
    shard_model,
    structure_fingerprint,
    twin_optimizer,
)
from memplan.torch.distributed.step import require_process_group
from memplan.torch.rss import release_free_memory
from memplan.torch.run.interpreter import Plan, StepRunner, allocator_tensors, optimizer_update_groups


class FsdpStep:
    """A planned FSDP2 training step of one rank; call it with this rank's batch."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        time_limit_seconds: float = 10.0,
        reorder: bool = True,
        recompute_copies: bool = True,
    ) -> None:
        require_process_group()
        if any(t.device.type != "cpu" for t in [*model.parameters(), *model.buffers()]):
            raise MemplanError("memplan's FSDP2 step runs on CPU (gloo) for now; shard the model on a 'cpu' mesh")
        self.layout = read_layout(model)
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.time_limit_seconds = time_limit_seconds
        self.reorder = reorder
        self.recompute_copies = recompute_copies
        self.shards = shard_model(model, self.layout)
        self.twin = twin_optimizer(optimizer, self.shards, self.layout)
        self.process_group = self.layout.group
        self.rank, self.world_size = self.layout.rank, self.layout.world
        self.runners: dict[tuple, StepRunner] = {}
        self.reports: dict[tuple, dict[str, Any]] = {}

    def __call__(self, batch: Any) -> Any:
        for user, twin in zip(self.optimizer.param_groups, self.twin.param_groups, strict=True):
            twin.update({k: v for k, v in user.items() if k != "params"})  # a scheduler's lr, set on the user's
        loss = self.runner_for(batch)(batch)
        link_state(self.optimizer, self.twin, self.layout)  # the state the first step created
        return loss

    def runner_for(self, batch: Any) -> StepRunner:
        """The runner for this batch's shapes, planned on first use."""
        key = shape_key(batch)
        if key not in self.runners:
            capture = capture_fsdp_step(
                self.shards, self.twin, self.loss_fn, batch, self.layout, recompute_copies=self.recompute_copies
            )
            refuse_foreign_collectives(capture)
            plan, report = self._shared_plan(capture)
            self.reports[key] = report
            self.runners[key] = StepRunner(capture, plan, self.shards, [self.twin])
            release_free_memory()
        return self.runners[key]

    @property
    def report(self) -> dict[str, Any]:
        """The report of the most recent plan."""
        return list(self.reports.values())[-1] if self.reports else {}

    def _shared_plan(self, capture: Capture) -> tuple[Plan, dict[str, Any]]:
        from memplan.isolate import in_child
        from memplan.pipeline import _resident_peak, make_plan, place_order

        fingerprints: list[Any] = [None] * self.world_size
        dist.all_gather_object(fingerprints, structure_fingerprint(capture), group=self.process_group)
        differ = [r for r, f in enumerate(fingerprints) if f != fingerprints[0]]
        if differ:
            raise MemplanError(
                f"rank(s) {differ} captured another step than rank 0: every rank needs the same model, optimizer "
                "and batch shapes (as FSDP2 does)"
            )
        exclude = allocator_tensors(capture)
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                plan = in_child(
                    make_plan,
                    capture.graph,
                    time_limit_seconds=self.time_limit_seconds,
                    reorder=self.reorder,
                    atomic_groups=optimizer_update_groups(capture),
                    allocator_tensors=exclude,
                )
                box[0] = (list(plan.order), plan.report)
            except MemplanError as err:
                box[0] = err
        dist.broadcast_object_list(box, group=self.process_group, group_src=0)
        if isinstance(box[0], MemplanError):
            raise type(box[0])(f"rank 0 could not plan the step: {box[0]}")
        order, report = box[0]
        offsets, placement = place_order(capture.graph, order, self.time_limit_seconds, exclude)
        report = {**report, "rank": self.rank, "arena_bytes": placement.arena_bytes}
        report["allocator_peak_bytes"] = _resident_peak(capture.graph, order, exclude)
        report["planned_peak_bytes"] = (
            capture.graph.persistent_bytes + placement.arena_bytes + report["allocator_peak_bytes"]
        )
        return Plan(tuple(order), offsets, placement.arena_bytes), report


def compile_fsdp_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    example_batch: Any,
    *,
    time_limit_seconds: float = 10.0,
    reorder: bool = True,
    recompute_copies: bool = True,
) -> FsdpStep:
    """Plan one rank's FSDP2 training step ``loss = loss_fn(model(inputs), target);
    loss.backward(); optimizer.step(); optimizer.zero_grad()`` and return it as a callable
    ``step(batch)``; every rank of the model's mesh must call this together."""
    step = FsdpStep(
        model,
        optimizer,
        loss_fn,
        time_limit_seconds=time_limit_seconds,
        reorder=reorder,
        recompute_copies=recompute_copies,
    )
    step.runner_for(example_batch)
    return step
