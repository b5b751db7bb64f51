"""Train K data-parallel steps with memplan and with PyTorch's own ``DistributedDataParallel``
(gradient_as_bucket_view False and True) on every rank, from the same state and seed; compare
loss and parameters after every step, on every rank and across ranks, and measure memory and
time. Runs inside a process group (``torchrun``); :func:`compare_with_ddp` returns every
rank's report on rank 0.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import torch
from memplan.errors import MemplanError
from memplan.torch.capture import call_model
from memplan.torch.distributed.step import DataParallelStep
from memplan.torch.distributed.timeline import overlap, profile_step
from memplan.torch.measure import allocator_peak_bytes, optimizer_state_tensors, resident_bytes
from memplan.torch.zoo import build_workload, make_optimizer

DDP_VARIANTS = {"ddp": False, "ddp-view": True}  # name -> gradient_as_bucket_view


@dataclass
class Variant:
    """One way of running the data-parallel step on this rank."""

    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    run: Any  # batch -> loss
    seconds: list[float] = field(default_factory=list)
    peak_bytes: int = 0
    resident_bytes: int = 0
    max_abs_diff: float = 0.0  # to memplan's numbers, after every step


def _ddp_runner(ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer, loss_fn: Any) -> Any:
    def run(batch: Any) -> torch.Tensor:
        inputs, target = batch
        loss = loss_fn(call_model(ddp, inputs), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return run


def _max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x.dtype.is_floating_point:
            worst = max(worst, float((x.detach() - y.detach()).abs().max()) if x.numel() else 0.0)
        elif not torch.equal(x, y):
            worst = float("inf")
    return worst


def _state(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def _spread_over_ranks(tensors: list[torch.Tensor], group: Any) -> float:
    """The largest difference of any element of ``tensors`` between this rank and rank 0."""
    worst = 0.0
    for t in tensors:
        reference = t.detach().clone()
        dist.broadcast(reference, group=group, group_src=0)
        if t.dtype.is_floating_point:
            worst = max(worst, float((t.detach() - reference).abs().max()) if t.numel() else 0.0)
        elif not torch.equal(t, reference):
            worst = float("inf")
    spread = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=group)
    return float(spread)


def _ddp_bucket_bytes(model: torch.nn.Module) -> int:
    """What DDP's reducer holds in its buckets for the model's life: every gradient once (its
    buckets are flat tensors allocated at construction and again when it rebuilds them)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def ddp_buckets(ddp: DistributedDataParallel) -> list[list[int]] | None:
    """DDP's rebuilt buckets, as parameter indices (``model.parameters()`` order); ``None``
    before DDP has logged them (it rebuilds at its second forward, logs a step later)."""
    text = ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices", "")
    buckets = [[int(i) for i in part.split()] for part in str(text).split(",") if part.strip()]
    return buckets or None


def compare_with_ddp(
    model_name: str,
    batch_size: int,
    steps: int = 3,
    optimizer_name: str = "sgd",
    *,
    bucket_cap_mb: float | None = None,
    waits: str = "next-bucket",
    time_limit_seconds: float = 10.0,
    seed: int = 0,
    variants: tuple[str, ...] = ("ddp", "ddp-view"),
    group: Any = None,
    trace: str | None = None,
) -> list[dict[str, Any]] | None:
    """Every rank's report (on rank 0; ``None`` elsewhere): numerics against each DDP variant,
    the spread of parameters over the ranks, measured and planned peaks, step seconds, buckets.
    With ``trace``, one more step of each is profiled: its events (one lane per stream) are in
    each report, and how much of the all-reduce time overlapped computation."""
    rank = dist.get_rank(group)
    # each rank builds its own model and data (another seed): the constructors broadcast rank 0's
    # parameters and buffers, as DDP's does
    w = build_workload(model_name, batch_size, seed=seed + rank)
    batch = (w.inputs, w.target)
    w.model.train()
    runs: list[Variant] = []
    memplan_model = copy.deepcopy(w.model)
    memplan_opt = make_optimizer(optimizer_name, memplan_model.parameters())
    start = time.perf_counter()
    step = DataParallelStep(
        memplan_model,
        memplan_opt,
        w.loss_fn,
        process_group=group,
        bucket_cap_mb=bucket_cap_mb,
        waits=waits,
        time_limit_seconds=time_limit_seconds,
        record_events=True,
    )
    runner = step.runner_for(batch)
    plan_seconds = time.perf_counter() - start
    runs.append(Variant("memplan", memplan_model, memplan_opt, step))
    ddps = {}
    for name in variants:
        model = copy.deepcopy(w.model)
        ddp = DistributedDataParallel(
            model, process_group=group, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=DDP_VARIANTS[name]
        )
        optimizer = make_optimizer(optimizer_name, model.parameters())
        ddps[name] = ddp
        runs.append(Variant(name, model, optimizer, _ddp_runner(ddp, optimizer, w.loss_fn)))
    del w

    loss_diff = 0.0
    spread = 0.0
    traces: dict[str, list] = {}
    phases = ["timed"] * steps + ["memory"] + (["trace"] if trace else [])
    for k, phase in enumerate(phases):
        losses = []
        for v in runs:
            torch.manual_seed(seed + 1000 * (rank + 1) + k)
            dist.barrier(group=group)
            t0 = time.perf_counter()
            if phase == "memory":  # under the profiler's memory events
                loss, v.peak_bytes = allocator_peak_bytes(v.run, batch)
            elif phase == "trace":
                loss, traces[v.name] = profile_step(v.run, batch)
            else:
                loss = v.run(batch)
                v.seconds.append(time.perf_counter() - t0)
            losses.append(loss)
        for v, loss in zip(runs[1:], losses[1:], strict=True):
            loss_diff = max(loss_diff, _max_abs_diff([losses[0]], [loss]))
            v.max_abs_diff = max(v.max_abs_diff, _max_abs_diff(_state(runs[0].model), _state(v.model)))
        for v in runs:  # buffers (BatchNorm's statistics) differ by rank after a step, in DDP too
            spread = max(spread, _spread_over_ranks(list(v.model.parameters()), group))

    plan = step.plans[next(iter(step.plans))]
    for v in runs:
        extra = [runner.arena] if v.name == "memplan" else []
        v.resident_bytes = resident_bytes(_state(v.model), optimizer_state_tensors(v.optimizer), batch, *extra)
    names = [n for n, _ in runs[0].model.named_parameters()]
    planned_buckets = [[names.index(p) for p in b.parameters] for b in plan.buckets]
    report = {
        "model": model_name,
        "batch_size": batch_size,
        "optimizer": optimizer_name,
        "rank": rank,
        "world_size": dist.get_world_size(group),
        "steps": steps,
        "compared_steps": len(phases),
        "waits": waits,
        "plan_seconds": round(plan_seconds, 3),
        "plan": plan.report,
        "loss_max_abs_diff": loss_diff,
        "param_spread_over_ranks": spread,
        "buckets_as_ddp": {
            n: None if ddp_buckets(d) is None else planned_buckets == ddp_buckets(d) for n, d in ddps.items()
        },
        "claimed_peak_bytes": runner.claimed_peak_bytes(),
        "runner": {
            "out_bytes": runner.stats.out_bytes,
            "copied_bytes": runner.stats.copied_bytes,
            "allocator_bytes": runner.stats.allocator_bytes,
            "max_scratch_bytes": runner.stats.max_scratch_bytes,
        },
        "comm_events": [vars(e) for e in runner.events],
        "trace_events": traces,
        "variants": {
            v.name: {
                "max_abs_diff": v.max_abs_diff,
                "resident_bytes": v.resident_bytes,
                "step_peak_bytes": v.peak_bytes,
                "step_seconds": sorted(v.seconds)[len(v.seconds) // 2] if v.seconds else 0.0,
                "all_step_seconds": v.seconds,
                "bucket_bytes": 0 if v.name == "memplan" else _ddp_bucket_bytes(v.model),
                "overlap": overlap(traces[v.name]) if v.name in traces else None,
            }
            for v in runs
        },
    }
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, report, group=group)
    return gathered if rank == 0 else None


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise MemplanError(f"/proc/self/status has no {field} (memory is measured on Linux only)")


def reset_peak_rss() -> None:
    """Reset this process's peak resident set (VmHWM) to its current one (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def measure_rss(
    model_name: str,
    batch_size: int,
    variant: str,
    optimizer_name: str = "sgd",
    *,
    bucket_cap_mb: float | None = None,
    waits: str = "next-bucket",
    time_limit_seconds: float = 10.0,
    seed: int = 0,
    warmup_steps: int = 3,
    group: Any = None,
) -> list[dict[str, Any]] | None:
    """This process's peak resident set (what ``top`` and the OOM killer see) during one
    steady-state data-parallel step of ``variant`` ("memplan", "ddp", "ddp-view") alone, every
    rank's report on rank 0. ``base_bytes`` is the resident set after the imports (OR-Tools, and
    what creating an optimizer imports: about 70 MB) and the process group, before the model
    exists; the peak is read from VmHWM, reset just before the step."""
    import gc

    rank = dist.get_rank(group)
    # both variants carry the same libraries: the solvers' and what an optimizer imports
    import ortools.sat.python.cp_model  # noqa: F401

    make_optimizer(optimizer_name, [torch.zeros(1, requires_grad=True)])
    gc.collect()
    base = _status_bytes("VmRSS")
    w = build_workload(model_name, batch_size, seed=seed + rank)
    w.model.train()
    batch = (w.inputs, w.target)
    optimizer = make_optimizer(optimizer_name, w.model.parameters())
    claimed = None
    if variant == "memplan":
        step = DataParallelStep(
            w.model,
            optimizer,
            w.loss_fn,
            process_group=group,
            bucket_cap_mb=bucket_cap_mb,
            waits=waits,
            time_limit_seconds=time_limit_seconds,
        )
        run = step
        claimed = step.runner_for(batch).claimed_peak_bytes()
    else:
        ddp = DistributedDataParallel(
            w.model, process_group=group, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=DDP_VARIANTS[variant]
        )
        run = _ddp_runner(ddp, optimizer, w.loss_fn)
    for k in range(warmup_steps):
        torch.manual_seed(seed + 1000 * (rank + 1) + k)
        run(batch)
    gc.collect()
    dist.barrier(group=group)
    reset_peak_rss()
    before = _status_bytes("VmRSS")
    torch.manual_seed(seed + 1000 * (rank + 1) + warmup_steps)
    run(batch)
    peak = _status_bytes("VmHWM")
    report = {
        "model": model_name,
        "batch_size": batch_size,
        "variant": variant,
        "rank": rank,
        "base_bytes": base,
        "before_step_bytes": before,
        "peak_bytes": peak,
        "peak_above_base_bytes": peak - base,
        "claimed_peak_bytes": claimed,
    }
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, report, group=group)
    return gathered if rank == 0 else None
