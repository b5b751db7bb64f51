"""Train K steps with memplan and K steps with eager PyTorch from the same initial state and
seed; compare loss and parameters after every step, and measured memory and time."""

from __future__ import annotations

import copy
import gc
import multiprocessing
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from memplan.api import CompiledStep
from memplan.errors import MemplanError
from memplan.pipeline import MemoryPlan
from memplan.torch.capture import call_model
from memplan.torch.measure import allocator_peak_bytes, optimizer_state_tensors, resident_bytes
from memplan.torch.rss import peak_rss_bytes, reset_peak_rss, rss_bytes
from memplan.torch.run.interpreter import StepRunner
from memplan.torch.run.replay import MAX_RECORDINGS, ReplayedStep
from memplan.torch.zoo import Workload, build_workload, make_optimizer


@dataclass
class Side:
    """One way of running the step, with its measurements."""

    peak_bytes: int = 0
    step_seconds: list[float] | None = None

    def median_seconds(self) -> float:
        times = sorted(self.step_seconds or [0.0])
        return times[len(times) // 2]


def _eager_step(w: Workload, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Any:
    if optimizer is None:
        with torch.no_grad():
            return call_model(model, w.inputs)
    loss = w.loss_fn(call_model(model, w.inputs), w.target)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _max_abs_diff(a: Any, b: Any) -> float:
    if isinstance(a, torch.Tensor):
        if a.dtype.is_floating_point:
            return float((a.detach() - b.detach()).abs().max()) if a.numel() else 0.0
        return 0.0 if torch.equal(a, b) else float("inf")
    return max((_max_abs_diff(x, y) for x, y in zip(a, b, strict=True)), default=0.0)


def _state(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def compare_with_eager(
    model_name: str,
    batch_size: int,
    steps: int = 3,
    mode: str = "train",
    optimizer_name: str = "sgd",
    *,
    time_limit_seconds: float = 10.0,
    seed: int = 0,
    allocator: str = "auto",
    recompute_copies: bool = True,
    memory_budget: int | float | str | None = None,
    max_overhead: float | None = None,
    executor: str = "generated",
    time_interpreter: bool = False,
    rss: bool = False,
    rss_repeats: int = 1,
) -> dict[str, Any]:
    """The report of ``memplan run``: numerics, measured peak bytes and step seconds of both.
    ``memory_budget``/``max_overhead``: plan within them (:mod:`memplan.torch.run.budget`);
    the report's ``budget`` then compares the measured peak with the budget.
    ``time_interpreter``: a third copy of the model runs the same plan with the interpreted
    executor, timed in the same steps (``memplan.interpreted_step_seconds``) and compared too.
    ``rss``: also the peak resident set of a steady-state step of each, each measured in a
    process of its own (:func:`steady_state_rss`); ``rss_repeats`` processes per side, the
    median kept (:func:`median_steady_state_rss`)."""
    train = mode == "train"
    # first, while this process holds no model: a large model's three copies here (eager,
    # memplan, interpreted) beside a measuring process can exhaust the machine's memory
    rss_report = (
        _rss_report(
            model_name, batch_size, allocator, rss_repeats, optimizer_name, time_limit_seconds, seed, recompute_copies
        )
        if rss and train
        else {}
    )
    w = build_workload(model_name, batch_size, seed=seed)
    eager_model = w.model
    memplan_model = copy.deepcopy(w.model)
    for m in (eager_model, memplan_model):
        m.train(train)
    eager_opt = make_optimizer(optimizer_name, eager_model.parameters()) if train else None
    memplan_opt = make_optimizer(optimizer_name, memplan_model.parameters()) if train else None
    twin_model = copy.deepcopy(w.model) if time_interpreter else None
    twin_opt = make_optimizer(optimizer_name, twin_model.parameters()) if train and twin_model is not None else None
    batch = (w.inputs, w.target) if train else w.inputs

    # eager's first step before memplan plans: what it creates (AdamW's moments, the kernels'
    # caches) is then held before memplan's account of its own bytes starts, not counted as
    # their growth under a byte budget (eager's twin is this harness's, not memplan's)
    torch.manual_seed(seed + 1000)
    first_eager = _run(lambda: _eager_step(w, eager_model, eager_opt), False)

    start = time.perf_counter()
    step = CompiledStep.of_loss(
        memplan_model,
        memplan_opt,
        w.loss_fn,
        time_limit_seconds=time_limit_seconds,
        allocator=allocator,
        recompute_copies=recompute_copies,
        memory_budget=memory_budget,
        max_overhead=max_overhead,
        executor=executor,
    )
    runner = step.runner_for(batch)
    plan_seconds = time.perf_counter() - start
    twin = _interpreted_twin(runner, twin_model, twin_opt, time_limit_seconds) if twin_model is not None else None

    eager, memplan, interpreted = Side(step_seconds=[]), Side(step_seconds=[]), Side(step_seconds=[])
    max_diff = 0.0
    k = 0

    def compared_step(measure: bool = False, timed: bool = True) -> None:
        nonlocal k, max_diff
        if k == 0 and not measure:
            out_eager, peak_eager, t_eager = first_eager
        else:
            torch.manual_seed(seed + 1000 + k)
            out_eager, peak_eager, t_eager = _run(lambda: _eager_step(w, eager_model, eager_opt), measure)
        torch.manual_seed(seed + 1000 + k)
        out_memplan, peak_memplan, t_memplan = _run(lambda: step(batch), measure)
        if twin is not None and not measure:
            torch.manual_seed(seed + 1000 + k)
            out_twin, _, t_twin = _run(lambda: twin(batch), False)
            if timed:
                interpreted.step_seconds.append(t_twin)
            max_diff = max(max_diff, _max_abs_diff(out_eager, out_twin), _max_abs_diff(out_memplan, out_twin))
            max_diff = max(max_diff, _max_abs_diff(_state(twin_model), _state(memplan_model)))
        if measure:
            eager.peak_bytes, memplan.peak_bytes = peak_eager, peak_memplan
        elif timed:
            eager.step_seconds.append(t_eager)
            memplan.step_seconds.append(t_memplan)
        max_diff = max(max_diff, _max_abs_diff(out_eager, out_memplan))
        max_diff = max(max_diff, _max_abs_diff(_state(eager_model), _state(memplan_model)))
        k += 1

    # the planned allocator records steps until their allocations repeat (untimed), then replays
    recordings = getattr(runner, "max_recording_steps", MAX_RECORDINGS)  # a budgeted step may re-plan
    while not (getattr(runner, "replaying", True) and getattr(twin, "replaying", True)) and k < recordings:
        compared_step(timed=False)
    for _ in range(steps):
        compared_step()
    compared_step(measure=True)  # in steady state, under the profiler, to measure memory

    resident_eager = resident_bytes(_state(eager_model), optimizer_state_tensors(eager_opt) if train else [], batch)
    resident_memplan = resident_bytes(
        _state(memplan_model), optimizer_state_tensors(memplan_opt) if train else [], batch, runner.arena
    )
    plan = step.plans[next(iter(step.plans))]
    memplan_report = _runner_report(runner, plan)
    peak_memplan = resident_memplan + memplan.peak_bytes
    budget = plan.report.get("budget")
    if budget is not None:
        budget = {
            **budget,
            "measured_peak_bytes": peak_memplan,
            "within_budget": budget["budget_bytes"] is None or peak_memplan <= budget["budget_bytes"],
            "step_time_ratio": round(memplan.median_seconds() / eager.median_seconds(), 4)
            if eager.median_seconds()
            else None,
        }
    return {
        "model": model_name,
        "batch_size": batch_size,
        "mode": mode,
        "optimizer": optimizer_name if train else None,
        "steps": steps,
        "compared_steps": k,  # with the untimed recording steps of the planned allocator and the measured one
        "allocator": step.allocator,
        "max_abs_diff": max_diff,
        "plan_seconds": round(plan_seconds, 3),
        "plan": plan.report,
        "budget": budget,
        "memplan": {
            "peak_bytes": peak_memplan,
            "persistent_bytes": plan.report["persistent_bytes"],
            **memplan_report,
            "step_seconds": memplan.median_seconds(),
            "executor": executor,
            **({"interpreted_step_seconds": interpreted.median_seconds()} if twin is not None else {}),
        },
        "eager": {"peak_bytes": resident_eager + eager.peak_bytes, "step_seconds": eager.median_seconds()},
        **rss_report,
    }


RSS_MEASURED_STEPS = 2


def _rss_report(
    model_name: str,
    batch_size: int,
    allocator: str,
    repeats: int,
    optimizer_name: str,
    time_limit_seconds: float,
    seed: int,
    recompute_copies: bool,
) -> dict[str, Any]:
    """Peak RSS of eager's and memplan's steady-state steps, each side in fresh processes."""
    options = {"optimizer_name": optimizer_name, "time_limit_seconds": time_limit_seconds, "seed": seed}
    return {
        "rss": {
            "eager": median_steady_state_rss(model_name, batch_size, "eager", repeats, **options),
            "memplan": median_steady_state_rss(
                model_name, batch_size, allocator, repeats, recompute_copies=recompute_copies, **options
            ),
        }
    }


def median_steady_state_rss(
    model_name: str, batch_size: int, side: str, repeats: int, **options: Any
) -> dict[str, Any]:
    """:func:`steady_state_rss` in ``repeats`` fresh processes: the median of each reading, and
    every run's peak in ``peak_rss_runs``. An eager process's resident set varies from process to
    process by tens of MiB (where the C library's heap ends up after its frees), so one run can
    decide a comparison that the median does not."""
    runs = [steady_state_rss(model_name, batch_size, side, **options) for _ in range(max(1, repeats))]
    return {
        "rss_before_bytes": int(statistics.median(r["rss_before_bytes"] for r in runs)),
        "peak_rss_bytes": int(statistics.median(r["peak_rss_bytes"] for r in runs)),
        "peak_rss_runs": [r["peak_rss_bytes"] for r in runs],
    }


def steady_state_rss(
    model_name: str,
    batch_size: int,
    side: str,
    *,
    optimizer_name: str = "adam",
    time_limit_seconds: float = 10.0,
    seed: int = 0,
    recompute_copies: bool = True,
) -> dict[str, int]:
    """Memory as the operating system sees it: train ``model_name`` in a fresh process (spawned,
    so nothing of this one is shared) with ``side`` = "eager" or a memplan allocator ("views",
    "replay"); after the warm-up (memplan: until the plan replays, then one step more) reset the
    process's peak RSS (``VmHWM``, via ``/proc/self/clear_refs``) and run
    ``RSS_MEASURED_STEPS`` steady-state steps. Returns ``rss_before_bytes`` (resident after the
    warm-up: the process, the model, the optimizer state, the batch, memplan's arena and plans)
    and ``peak_rss_bytes`` (the most resident during the steps)."""
    context = multiprocessing.get_context("spawn")
    args = (model_name, batch_size, side, optimizer_name, time_limit_seconds, seed, recompute_copies)
    with context.Pool(1) as pool:
        return pool.apply(_rss_in_this_process, args)


def _rss_in_this_process(
    model_name: str,
    batch_size: int,
    side: str,
    optimizer_name: str,
    time_limit_seconds: float,
    seed: int,
    recompute_copies: bool,
) -> dict[str, int]:
    w = build_workload(model_name, batch_size, seed=seed)
    w.model.train()
    optimizer = make_optimizer(optimizer_name, w.model.parameters())
    batch = (w.inputs, w.target)
    if side == "eager":

        def run() -> Any:
            return _eager_step(w, w.model, optimizer)

        warmup = 2
    else:
        step = CompiledStep.of_loss(
            w.model,
            optimizer,
            w.loss_fn,
            time_limit_seconds=time_limit_seconds,
            allocator=side,
            recompute_copies=recompute_copies,
        )
        runner = step.runner_for(batch)

        def run() -> Any:
            return step(batch)

        warmup = 2
        while not getattr(runner, "replaying", True) and warmup < MAX_RECORDINGS + 2:
            torch.manual_seed(seed + warmup)
            run()
            warmup += 1
    for k in range(warmup):
        torch.manual_seed(seed + k)
        run()
    gc.collect()
    before = rss_bytes()
    reset_peak_rss()
    for k in range(RSS_MEASURED_STEPS):
        torch.manual_seed(seed + 100 + k)
        run()
    return {"rss_before_bytes": before, "peak_rss_bytes": peak_rss_bytes()}


def _runner_report(runner: StepRunner | ReplayedStep, plan: MemoryPlan) -> dict[str, Any]:
    """What the plan claims and where the step's bytes went, for either allocator."""
    if isinstance(runner, ReplayedStep):
        stats, placed = runner.last_stats, runner.placement
        if stats is None or placed is None:
            raise MemplanError("the planned allocator never replayed the step; run more steps")
        return {
            "arena_bytes": placed.arena_bytes,
            "graph_arena_bytes": plan.arena_bytes,
            "fallback_bytes": stats.fallback_bytes,
            "served_bytes": stats.served_bytes,
            "allocations": stats.allocations,
            "fallback_allocations": stats.fallback,
            "blocked_allocations": stats.blocked,
            "diverged_at": stats.diverged_at,
            "arena_lower_bound_bytes": placed.lower_bound_bytes,
            "arena_method": placed.method,
            "planned_peak_bytes": plan.report["persistent_bytes"] + placed.arena_bytes,
            "graph_planned_peak_bytes": plan.report["planned_peak_bytes"],
            "copied_bytes": 0,
            "max_scratch_bytes": 0,
            "copied_ops": {},
        }
    return {
        "arena_bytes": plan.arena_bytes,
        "fallback_bytes": runner.stats.allocator_bytes,
        "copied_bytes": runner.stats.copied_bytes,
        "max_scratch_bytes": runner.stats.max_scratch_bytes,
        "planned_peak_bytes": plan.report["planned_peak_bytes"] + runner.stats.max_scratch_bytes,
        "graph_planned_peak_bytes": plan.report["planned_peak_bytes"],
        "out_bytes": runner.stats.out_bytes,
        "copied_ops": dict(sorted(runner.stats.copied_ops.items(), key=lambda kv: -kv[1])),
    }


def _interpreted_twin(
    runner: StepRunner | ReplayedStep, model: torch.nn.Module, optimizer: Any, time_limit_seconds: float
) -> StepRunner | ReplayedStep:
    """``runner``'s plan run by the interpreted executor on another copy of the model."""
    base = runner.run if isinstance(runner, ReplayedStep) else runner
    twin = StepRunner(
        base.capture, base.plan, model, [optimizer] if optimizer is not None else [], executor="interpreted"
    )
    return ReplayedStep(twin, time_limit_seconds=time_limit_seconds) if isinstance(runner, ReplayedStep) else twin


def _run(fn: Any, measure_memory: bool) -> tuple[Any, int, float]:
    """Run one step; with ``measure_memory``, under the profiler (then its time is not used)."""
    start = time.perf_counter()
    result, peak = allocator_peak_bytes(fn) if measure_memory else (fn(), 0)
    return result, peak, time.perf_counter() - start
