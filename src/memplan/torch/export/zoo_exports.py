"""The exports of ``memplan run MODEL --snapshot out.pickle --trace out.json``: a zoo model's
step planned and run with memplan, and run eagerly, each written in a format PyTorch's own
tools open.

Files written for ``--snapshot out.pickle``:

* ``out.pickle``: the memplan step as it ran: with the planned CPU allocator, the recorded
  allocations at the arena offsets they are replayed at (:func:`replay_snapshot`); with arena
  views, the plan (:func:`plan_snapshot`);
* ``out.plan.pickle``: the plan, tensor by tensor, with the ops that make them (written too
  when the first file is the allocator's);
* ``out.eager.pickle``: one steady-state eager step of the same model, as PyTorch's CPU
  allocator served it (:func:`eager_snapshot`).

``--trace out.json``: the plan as a Chrome/Perfetto trace with each op's time measured by
running the captured step op by op on a copy of the model (:func:`profile_capture`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from memplan.torch.export.chrome_trace import plan_trace, write_trace
from memplan.torch.export.snapshot import (
    check_snapshot,
    eager_snapshot,
    plan_snapshot,
    replay_snapshot,
    write_snapshot,
)


def sibling(path: Path, tag: str) -> Path:
    """``out.pickle`` -> ``out.<tag>.pickle``."""
    return path.with_name(f"{path.stem}.{tag}{path.suffix}")


def persistent_tensors(model: torch.nn.Module, optimizer: Any, batch: Any) -> dict[str, Any]:
    named: dict[str, Any] = {f"param:{n}": p for n, p in model.named_parameters()}
    named.update({f"buffer:{n}": b for n, b in model.named_buffers()})
    if optimizer is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        for p, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    named[f"state:{names.get(id(p), '?')}.{key}"] = value
    named["batch"] = batch
    return named


def export_zoo_step(
    model_name: str,
    batch_size: int,
    optimizer_name: str = "sgd",
    mode: str = "train",
    *,
    snapshot: Path | None = None,
    trace: Path | None = None,
    allocator: str = "auto",
    time_limit_seconds: float = 10.0,
    seed: int = 0,
    stage: Callable[[str], Any] | None = None,
) -> dict[str, Any]:
    """Plan and run ``model_name`` with memplan and eagerly and write the exports (module
    docstring). ``stage(label)`` is a context manager shown around each long stage. Returns
    what was written, with each snapshot's checked peaks."""
    import contextlib

    from memplan.api import CompiledStep
    from memplan.torch.capture import call_model
    from memplan.torch.run.replay import MAX_RECORDINGS, ReplayedStep
    from memplan.torch.zoo import build_workload, make_optimizer

    stage = stage or (lambda label: contextlib.nullcontext())
    train = mode == "train"
    w = build_workload(model_name, batch_size, seed=seed)
    w.model.train(train)
    models = {"memplan": copy.deepcopy(w.model), "eager": w.model}
    optimizers = {k: make_optimizer(optimizer_name, m.parameters()) if train else None for k, m in models.items()}
    batch = (w.inputs, w.target) if train else w.inputs
    written: dict[str, Any] = {}

    with stage(f"planning {model_name}"):
        step = CompiledStep.of_loss(
            models["memplan"],
            optimizers["memplan"],
            w.loss_fn if train else None,
            time_limit_seconds=time_limit_seconds,
            allocator=allocator,
        )
        runner = step.runner_for(batch)
    plan = step.plans[next(iter(step.plans))]
    capture = runner.run.capture if isinstance(runner, ReplayedStep) else runner.capture
    graph = capture.graph

    def eager_step() -> Any:
        model, optimizer = models["eager"], optimizers["eager"]
        if not train:
            with torch.no_grad():
                return call_model(model, w.inputs)
        loss = w.loss_fn(call_model(model, w.inputs), w.target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    if snapshot is not None:
        with stage("running the memplan step until its allocations repeat"):
            for _ in range(MAX_RECORDINGS + 1):
                step(batch)
                if getattr(runner, "replaying", True):
                    break
            step(batch)  # one replayed (or planned) step, the one the snapshot shows
        plan_snap = plan_snapshot(graph, plan.order, plan.offsets, plan.arena_bytes, phases=capture.op_phase)
        memplan_persistent = persistent_tensors(models["memplan"], optimizers["memplan"], batch)
        if isinstance(runner, ReplayedStep):
            written["memplan"] = _write(replay_snapshot(runner, memplan_persistent), snapshot)
            written["plan"] = _write(plan_snap, sibling(snapshot, "plan"))
        else:
            written["memplan"] = _write(plan_snap, snapshot)
        with stage("observing one eager step"):
            eager_step()  # creates the optimizer state: the snapshot shows a steady-state step
            eager = persistent_tensors(models["eager"], optimizers["eager"], batch)
            snap, _ = eager_snapshot(eager_step, eager)
        written["eager"] = _write(snap, sibling(snapshot, "eager"))
    if trace is not None:
        timed = _timed_trace(model_name, batch_size, optimizer_name, mode, seed, capture, plan, stage)
        write_trace(timed, trace)
        info = timed["otherData"]
        written["trace"] = {"path": str(trace), "op_times": info["op_times"], "peak_bytes": info["peak_bytes"]}
    written["planned_peak_bytes"] = plan.report["planned_peak_bytes"]
    return written


def _write(snapshot: dict[str, Any], path: Path) -> dict[str, Any]:
    numbers = check_snapshot(snapshot)
    write_snapshot(snapshot, path)
    return {"path": str(path), **numbers}


def _timed_trace(
    model_name: str,
    batch_size: int,
    optimizer_name: str,
    mode: str,
    seed: int,
    capture: Any,
    plan: Any,
    stage: Callable[[str], Any],
) -> dict[str, Any]:
    """The plan's trace with every op timed on a fresh copy of the model (training steps: the
    profiler runs the training step op by op); an inference plan gets estimated times."""
    seconds = None
    if mode == "train":
        from memplan.torch.run.profile import profile_capture
        from memplan.torch.zoo import build_workload, make_optimizer

        with stage("timing each op of the step"):
            w = build_workload(model_name, batch_size, seed=seed)
            w.model.train()
            optimizer = make_optimizer(optimizer_name, w.model.parameters())
            profile = profile_capture(capture, w.model, optimizer, (w.inputs, w.target), repeats=1, workspace=False)
            seconds = profile.seconds
    return plan_trace(capture.graph, plan.order, op_seconds=seconds, phases=capture.op_phase, title=model_name)


__all__ = ["export_zoo_step", "persistent_tensors", "sibling"]
