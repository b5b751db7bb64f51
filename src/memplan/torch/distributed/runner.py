"""Run a planned data-parallel step: the interpreter of :mod:`memplan.torch.run.interpreter`,
plus each bucket's all-reduce and wait at their planned places.

* ``memplan.all_reduce`` of a bucket: the bucket is one contiguous block of the arena (its
  gradients back to back), so the collective runs on a flat view of that block, in place, with
  no copy. As DDP does without a communication hook, each gradient is first multiplied by
  ``1 / world_size`` (DDP's ``mul_out(bucket_view, grad, 1 / div_factor)``), then summed over
  the ranks: ``dist.all_reduce(flat, async_op=True)``, which returns at once while the process
  group's worker threads reduce; the backward goes on meanwhile.
* ``memplan.wait`` of a bucket: ``work.wait()``, before the first op that reads a reduced gradient.

The padding between members (each padded to the arena's 64-byte alignment) is reduced too: it
belongs to the bucket's block, so no other tensor is there, and nobody reads it.

Gloo's process group runs collectives on two worker threads, so two all-reduces may overlap:
the communication "stream" is not serial. The plan does not need it to be: every op that reads
a bucket after its reduction (its updates, its gradients' releases) waits for that bucket's
own work, so no reuse of its bytes rests on the order of two collectives.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.fx
from torch.profiler import record_function
from torch.utils import _pytree as pytree

import torch
from memplan.errors import MemplanError
from memplan.graph.liveness import lifetimes
from memplan.streams import is_collective, is_wait
from memplan.torch.capture import Capture
from memplan.torch.distributed.plan import DataParallelPlan
from memplan.torch.run.interpreter import Plan, RunHook, StepRunner, _Call, _scratch_bytes


@dataclass
class CommEvent:
    """When one bucket's collective was launched, finished (its future completed, on the process
    group's thread) and waited for (``wait_start`` to ``wait_end`` on the compute thread), in
    ``time.perf_counter`` seconds."""

    bucket: str
    size_bytes: int
    launched: float = 0.0
    done: float = 0.0
    wait_start: float = 0.0
    wait_end: float = 0.0


@dataclass
class _Launch(RunHook):
    after: int  # position in the capture order after which it runs
    bucket: int
    position: int = -1

    def run(self, runner: StepRunner, env: dict[str, Any]) -> None:
        assert isinstance(runner, DataParallelRunner)
        runner.launch(self.bucket)


@dataclass
class _Wait(RunHook):
    after: int
    bucket: int
    position: int = -1

    def run(self, runner: StepRunner, env: dict[str, Any]) -> None:
        assert isinstance(runner, DataParallelRunner)
        runner.wait(self.bucket)


@dataclass
class _Pending:
    work: Any
    event: CommEvent | None = None


class DataParallelRunner(StepRunner):
    """A :class:`StepRunner` for one rank of a :class:`DataParallelPlan`, whose all-reduces run
    on ``process_group`` (``None``: the default group). ``record_events`` keeps a
    :class:`CommEvent` per bucket of the latest step in ``events``."""

    def __init__(
        self,
        capture: Capture,
        plan: DataParallelPlan,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        process_group: Any = None,
        *,
        record_events: bool = False,
    ) -> None:
        self.dp_plan = plan
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.record_events = record_events
        self.events: list[CommEvent] = []
        self._pending: dict[int, _Pending] = {}
        capture_order, self._hooks = _split(capture, plan)
        super().__init__(capture, Plan(tuple(capture_order), plan.offsets, plan.arena_bytes), model, optimizer)
        params = dict(model.named_parameters())
        self._flat = [self._bucket_view(b, params) for b in plan.buckets]
        # made once: a Python number would be wrapped into a new tensor at every launch; the
        # kernel reads it as the bucket's dtype either way, as DDP's wrapped 1 / world_size
        self._scale = torch.tensor(1.0 / self.world_size, dtype=torch.float64)

    def _bucket_view(self, bucket, params: dict[str, torch.Tensor]) -> torch.Tensor:
        dtypes = {params[p].dtype for p in bucket.parameters}
        if len(dtypes) != 1:
            raise MemplanError(f"bucket {bucket.name} mixes gradient dtypes {sorted(map(str, dtypes))}; DDP does not")
        dtype = dtypes.pop()
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if bucket.offset_bytes % itemsize or bucket.size_bytes % itemsize:
            raise MemplanError(f"bucket {bucket.name} is not aligned to its dtype {dtype}")
        return self.arena[bucket.offset_bytes : bucket.offset_bytes + bucket.size_bytes].view(dtype)

    def _compile(self) -> list:
        """The interpreter's instructions with each collective and wait after the instruction at
        its planned position."""
        return merge_hooks(super()._compile(), self._hooks)

    def claimed_peak_bytes(self) -> int:
        """What the plan claims this rank's step holds at its fullest: persistent tensors, the
        arena, and at each op the tensors left to the allocator that are resident then (the
        one estimator's lifetimes, :mod:`memplan.graph.liveness`) plus the op's own scratch
        outside the arena (a result computed before its copy into the arena, a CPU
        convolution's copy of its weight: :func:`memplan.torch.run.interpreter._scratch_bytes`)."""
        step, order = self.dp_plan.step, self.dp_plan.order
        outside = set(self.dp_plan.outside_tensors)
        delta = [0] * (len(order) + 1)
        for life in lifetimes(step, order):
            if life.tensor in outside:
                delta[life.start] += step.tensors[life.tensor].size_bytes
                delta[life.end] -= step.tensors[life.tensor].size_bytes
        resident = list(itertools.accumulate(delta))
        at_step = [v for v, op in enumerate(order) if not is_collective(step.ops[op]) and not is_wait(step.ops[op])]
        scratch = [0] * len(order)
        for ins in self.instructions:
            if isinstance(ins, _Call):
                meta_args = pytree.tree_map_only(torch.fx.Node, lambda n: n.meta.get("val"), ins.node.args)
                scratch[at_step[ins.position]] = _scratch_bytes(ins, meta_args)
        transient = max((r + s for r, s in zip(resident, scratch, strict=False)), default=0)
        return step.persistent_bytes + self.dp_plan.arena_bytes + transient

    def launch(self, k: int) -> None:
        """Start bucket ``k``'s all-reduce: DDP's average, asynchronously, in place."""
        bucket = self.dp_plan.buckets[k]
        with record_function(f"memplan.all_reduce:{bucket.name}"):
            flat = self._flat[k]
            flat.mul_(self._scale)
            event = None
            if self.record_events:
                event = CommEvent(bucket.name, bucket.size_bytes, launched=time.perf_counter())
                self.events.append(event)
            work = dist.all_reduce(flat, group=self.process_group, async_op=True)
            if event is not None:
                work.get_future().add_done_callback(lambda _f, e=event: setattr(e, "done", time.perf_counter()))
        self._pending[k] = _Pending(work, event)

    def wait(self, k: int) -> None:
        """Wait until bucket ``k``'s all-reduce is done (its gradients are averaged)."""
        pending = self._pending.pop(k, None)
        if pending is None:
            raise MemplanError(f"bucket {self.dp_plan.buckets[k].name} is waited for before its all-reduce started")
        start = time.perf_counter()
        with record_function(f"memplan.wait:{self.dp_plan.buckets[k].name}"):
            pending.work.wait()
        if pending.event is not None:
            pending.event.wait_start, pending.event.wait_end = start, time.perf_counter()

    def run_step(self, batch: Any) -> Any:
        self.events = []
        try:
            result = super().run_step(batch)
        finally:
            left = list(self._pending)
            for k in left:  # a failed step: do not leave collectives running over the arena
                self._pending.pop(k).work.wait()
        if left:
            raise MemplanError(f"{len(left)} bucket(s) were never waited for; the plan is broken (please report it)")
        return result


def _split(capture: Capture, plan: DataParallelPlan) -> tuple[list[int], list[RunHook]]:
    """The plan's order as capture op ids (collectives and waits left out) and a hook for each
    collective and wait, placed after the capture position it followed."""
    capture_id = capture.graph.op_index
    bucket_of = {b.all_reduce: k for k, b in enumerate(plan.buckets)}
    bucket_of.update({b.wait: k for k, b in enumerate(plan.buckets)})
    order: list[int] = []
    hooks: list[RunHook] = []
    for v in plan.order:
        op = plan.step.ops[v]
        if is_collective(op):
            hooks.append(_Launch(len(order) - 1, bucket_of[v]))
        elif is_wait(op):
            hooks.append(_Wait(len(order) - 1, bucket_of[v]))
        else:
            order.append(capture_id[op.name])
    return order, hooks


def merge_hooks(instructions: list, hooks: Sequence[RunHook]) -> list:
    """``instructions`` with each hook after the instruction at its planned position (``after``),
    hooks at one position in their given order."""
    ordered = sorted(hooks, key=lambda h: h.after)
    merged: list = []
    k = 0
    for ins in instructions:
        while k < len(ordered) and ordered[k].after < ins.position:
            merged.append(ordered[k])
            k += 1
        merged.append(ins)
    merged.extend(ordered[k:])
    return merged
