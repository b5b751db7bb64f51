"""Measure what memplan's SAC policy saves in a plain eager PyTorch loop: the same zoo model
trained K steps eagerly and eagerly with the policy applied to its repeated layers, from the
same state and seed; numerics compared after every step, peaks measured the way the user's
tools show them (resident parameters, buffers, optimizer state and batch, plus the CPU
allocator's peak during one steady-state step, read from the profiler's memory events), and
set against the peak the remat plan claims for its budget.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from memplan.torch.capture import Capture, call_model
from memplan.torch.export.sac import SACPolicy


def without_kv_cache(model: torch.nn.Module) -> torch.nn.Module:
    """Turn off an HF model's key/value cache (``config.use_cache``), as HF does itself under
    gradient checkpointing: a training step has no use for it, and a checkpointed region that
    appends to a cache during the forward would find it changed when it is replayed."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", False):
            config.use_cache = False
    return model


def capture_for_sac(model_name: str, batch_size: int, optimizer_name: str = "sgd") -> Capture:
    """Capture a zoo model's training step the way it will run with checkpointing (no KV cache)."""
    from memplan.torch.capture import capture_train_step
    from memplan.torch.capture.fake import new_fake_mode
    from memplan.torch.zoo import build_workload, make_optimizer

    mode = new_fake_mode()
    w = build_workload(model_name, batch_size, fake_mode=mode)
    without_kv_cache(w.model).train()
    with mode:
        optimizer = make_optimizer(optimizer_name, w.model.parameters())
    name = f"{model_name}-b{batch_size}-train-{optimizer_name}"
    # SAC runs eager's functional ops: the capture keeps them (no writes over dying inputs)
    return capture_train_step(w.model, optimizer, w.loss_fn, (w.inputs, w.target), name=name, write_into_dying=False)


def compare_sac_with_eager(
    model_name: str,
    batch_size: int,
    budget: float,
    strategy: str = "best",
    steps: int = 2,
    optimizer_name: str = "sgd",
    *,
    time_limit_seconds: float = 30.0,
    seed: int = 0,
    regions: list[str] | None = None,
    capture: Capture | None = None,
    schedule: Any = None,
) -> dict[str, Any]:
    """Plan ``model_name`` within ``budget`` (bytes, or a fraction of the checkpoint-all peak),
    turn the plan into a :class:`SACPolicy`, and train ``steps`` steps plus one measured step
    eagerly with and without it. Returns numerics, peaks and step times. ``capture`` and
    ``schedule``: use that plan (of :func:`capture_for_sac`'s capture) instead of planning."""
    from memplan.remat import sequence_peak_bytes
    from memplan.torch.compare import _max_abs_diff
    from memplan.torch.measure import allocator_peak_bytes, optimizer_state_tensors, resident_bytes
    from memplan.torch.run.remat import plan_remat
    from memplan.torch.zoo import build_workload, make_optimizer

    capture = capture or capture_for_sac(model_name, batch_size, optimizer_name)
    started = time.perf_counter()
    if schedule is None:
        schedule, budget_bytes, top = plan_remat(capture, budget, strategy, time_limit_seconds)
    else:
        budget_bytes, top = schedule.budget_bytes, None
    plan_seconds = time.perf_counter() - started
    planned = sequence_peak_bytes(capture.graph, schedule.steps)
    policy = SACPolicy.from_schedule(capture, schedule, model=model_name, batch_size=batch_size)

    w = build_workload(model_name, batch_size, seed=seed)
    eager_model = without_kv_cache(w.model).train()
    sac_model = copy.deepcopy(eager_model).train()
    eager_opt = make_optimizer(optimizer_name, eager_model.parameters())
    sac_opt = make_optimizer(optimizer_name, sac_model.parameters())
    used_regions = policy.apply(sac_model, w.inputs, regions)
    batch = (w.inputs, w.target)

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        loss = w.loss_fn(call_model(model, w.inputs), w.target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    max_diff = 0.0
    seconds: dict[str, list[float]] = {"eager": [], "sac": []}
    peaks = {"eager": 0, "sac": 0}
    for k in range(steps + 1):  # the last step runs under the profiler, in steady state
        measured = k == steps
        for side, model, optimizer in (("eager", eager_model, eager_opt), ("sac", sac_model, sac_opt)):
            torch.manual_seed(seed + 1000 + k)
            policy.reset_stats()
            start = time.perf_counter()
            if measured:
                loss, peaks[side] = allocator_peak_bytes(step, model, optimizer)
            else:
                loss = step(model, optimizer)
                seconds[side].append(time.perf_counter() - start)
            if side == "eager":
                eager_loss = loss
        max_diff = max(max_diff, _max_abs_diff(eager_loss, loss))
        max_diff = max(max_diff, _max_abs_diff(_state(eager_model), _state(sac_model)))

    def resident(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
        return resident_bytes(_state(model), optimizer_state_tensors(optimizer), batch)

    eager_peak = resident(eager_model, eager_opt) + peaks["eager"]
    sac_peak = resident(sac_model, sac_opt) + peaks["sac"]
    return {
        "model": model_name,
        "batch_size": batch_size,
        "optimizer": optimizer_name,
        "steps": steps,
        "strategy": schedule.strategy,
        "budget_bytes": budget_bytes,
        "checkpoint_all_peak_bytes": top,
        "planned_peak_bytes": planned,
        "plan_overhead": round(schedule.overhead, 4),
        "plan_seconds": round(plan_seconds, 3),
        "regions": used_regions,
        "policy": policy.summary(),
        "unaligned_calls": dict(policy.stats.unaligned),
        "eager_peak_bytes": eager_peak,
        "sac_peak_bytes": sac_peak,
        "sac_vs_plan": round(sac_peak / planned, 4) if planned else None,
        "sac_vs_eager": round(sac_peak / eager_peak, 4) if eager_peak else None,
        "max_abs_diff": max_diff,
        "eager_step_seconds": _median(seconds["eager"]),
        "sac_step_seconds": _median(seconds["sac"]),
    }


def _state(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def _median(values: list[float]) -> float:
    ordered = sorted(values) or [0.0]
    return ordered[len(ordered) // 2]


__all__ = ["capture_for_sac", "compare_sac_with_eager", "without_kv_cache"]
