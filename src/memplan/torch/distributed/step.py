"""The data-parallel API: the user's plain model and optimizer, and a process group.

::

    dist.init_process_group("gloo")                       # torchrun sets the rank and world size
    step = memplan.compile_data_parallel_step(model, optimizer, loss_fn, example_batch)
    for batch in loader:                                  # this rank's share of the data
        loss = step(batch)

It trains exactly as ``DistributedDataParallel(model, process_group=..., bucket_cap_mb=...,
broadcast_buffers=...)`` with the same optimizer would: the parameters and buffers of rank 0
are broadcast to every rank at construction, the buffers again before every step, and every
gradient is averaged over the ranks in DDP's buckets before the optimizer reads it. The
keyword arguments are DDP's, with DDP's defaults.

Why the plain model and not a ``DistributedDataParallel``: DDP allocates its gradient buckets
when it is constructed (a second copy of every gradient, which stays allocated for the model's
life) and hooks into autograd, which a planned step does not run; memplan does DDP's work
itself, in the arena. The process group, as everywhere in ``torch.distributed``, defaults to
the default group.

Every rank captures the step on fake tensors; the captures must be identical (same model,
batch shapes and optimizer), which is checked. Rank 0 plans (solvers are not deterministic
under time limits, and every rank must launch the same collectives in the same order) and
broadcasts the plan; each rank then runs it on its own arena.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import torch
from memplan.api import shape_key
from memplan.errors import MemplanError
from memplan.torch.capture import Capture, capture_train_step
from memplan.torch.distributed.plan import DataParallelPlan, bucket_caps, capture_fingerprint, plan_data_parallel
from memplan.torch.distributed.runner import DataParallelRunner
from memplan.torch.rss import release_free_memory
from memplan.torch.run.interpreter import allocator_tensors, optimizer_update_groups
from memplan.torch.run.updates import check_optimizers


def require_process_group() -> None:
    """A one-line error unless torch.distributed is initialized (every planned parallel step needs it)."""
    if not dist.is_available() or not dist.is_initialized():
        raise MemplanError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group() first "
            "(torchrun sets up the rank and world size)"
        )


class DataParallelStep:
    """A planned data-parallel training step of one rank; call it with this rank's batch."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        broadcast_buffers: bool = True,
        waits: str = "next-bucket",
        time_limit_seconds: float = 10.0,
        reorder: bool = True,
        recompute_copies: bool = True,
        record_events: bool = False,
    ) -> None:
        if isinstance(model, DistributedDataParallel):
            raise MemplanError(
                "pass the plain module (ddp.module, with process_group=ddp.process_group), not the "
                "DistributedDataParallel wrapper: memplan does DDP's bucketing itself, and the wrapper's own "
                "buckets would keep a second copy of every gradient allocated"
            )
        require_process_group()
        if any(t.device.type != "cpu" for t in [*model.parameters(), *model.buffers()]):
            raise MemplanError("memplan's data-parallel step runs on CPU (gloo) for now; keep the model on the CPU")
        check_optimizers([optimizer], model)
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.process_group = process_group
        self.bucket_cap_bytes, self.first_bucket_cap_bytes = bucket_caps(bucket_cap_mb)
        self.broadcast_buffers = broadcast_buffers
        self.waits = waits
        self.time_limit_seconds = time_limit_seconds
        self.reorder = reorder
        self.recompute_copies = recompute_copies
        self.record_events = record_events
        self.runners: dict[tuple, DataParallelRunner] = {}
        self.plans: dict[tuple, DataParallelPlan] = {}
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self._sync(list(model.parameters()) + list(model.buffers()))  # DDP's _sync_module_states

    def __call__(self, batch: Any) -> Any:
        runner = self.runner_for(batch)
        if self.broadcast_buffers:
            self._sync(list(self.model.buffers()))  # DDP: rank 0's buffers before every forward
        return runner(batch)

    def runner_for(self, batch: Any) -> DataParallelRunner:
        """The runner for this batch's shapes, planned (on rank 0) on first use."""
        key = shape_key(batch)
        if key not in self.runners:
            capture = capture_train_step(
                self.model, self.optimizer, self.loss_fn, batch, recompute_copies=self.recompute_copies
            )
            plan = self._shared_plan(capture)
            self.plans[key] = plan
            self.runners[key] = DataParallelRunner(
                capture, plan, self.model, self.optimizer, self.process_group, record_events=self.record_events
            )
            release_free_memory()
        return self.runners[key]

    @property
    def report(self) -> dict[str, Any]:
        """The report of the most recent plan."""
        return list(self.plans.values())[-1].report if self.plans else {}

    def _sync(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's values of ``tensors`` on every rank, in place."""
        with torch.no_grad():
            for t in tensors:
                dist.broadcast(t.detach(), group=self.process_group, group_src=0)

    def _shared_plan(self, capture: Capture) -> DataParallelPlan:
        """Rank 0's plan, after checking that every rank captured the same step."""
        fingerprints: list[Any] = [None] * self.world_size
        dist.all_gather_object(fingerprints, capture_fingerprint(capture), group=self.process_group)
        differ = [r for r, f in enumerate(fingerprints) if f != fingerprints[0]]
        if differ:
            raise MemplanError(
                f"rank(s) {differ} captured another step than rank 0: every rank needs the same model, optimizer "
                "and batch shapes (as DDP does)"
            )
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = plan_data_parallel(
                    capture,
                    update_groups=optimizer_update_groups(capture),
                    allocator_tensors=allocator_tensors(capture),
                    bucket_cap_bytes=self.bucket_cap_bytes,
                    first_bucket_cap_bytes=self.first_bucket_cap_bytes,
                    waits=self.waits,
                    reorder=self.reorder,
                    time_limit_seconds=self.time_limit_seconds,
                )
            except MemplanError as err:
                box[0] = err
        dist.broadcast_object_list(box, group=self.process_group, group_src=0)
        if isinstance(box[0], MemplanError):
            raise type(box[0])(f"rank 0 could not plan the step: {box[0]}")
        plan: DataParallelPlan = box[0]
        if plan.fingerprint != fingerprints[0]:
            raise MemplanError("the plan rank 0 sent is for another capture; please report it")
        return plan


def compile_data_parallel_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    example_batch: Any,
    *,
    process_group: Any = None,
    bucket_cap_mb: float | None = None,
    broadcast_buffers: bool = True,
    waits: str = "next-bucket",
    time_limit_seconds: float = 10.0,
    reorder: bool = True,
    recompute_copies: bool = True,
) -> DataParallelStep:
    """Plan one rank's data-parallel training step (module docstring) and return it as a
    callable ``step(batch)``; every rank of ``process_group`` must call this together."""
    step = DataParallelStep(
        model,
        optimizer,
        loss_fn,
        process_group=process_group,
        bucket_cap_mb=bucket_cap_mb,
        broadcast_buffers=broadcast_buffers,
        waits=waits,
        time_limit_seconds=time_limit_seconds,
        reorder=reorder,
        recompute_copies=recompute_copies,
    )
    step.runner_for(example_batch)
    return step
