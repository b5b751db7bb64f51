"""Measured per-op costs and workspace of a captured training step (``memplan remat --cost profile``).

Checkmate (section 4.9) takes the cost ``C_i`` of each op from FLOPs or from profiling; this
module does the profiling. The captured step is run on the real model, op by op, in program
order, by the remat runtime (:class:`memplan.torch.remat_runtime.RematRunner`, every op once):

* **seconds** (:attr:`OpProfile.seconds`): each op's wall-clock time (``time.perf_counter``
  around the call, argument lookup included), the median over ``repeats`` steps that follow
  one warm-up step (which creates the optimizer state and oneDNN's primitives). A
  parameter's whole optimizer update is charged to the op at which it runs; placeholders and
  releases cost 0;
* **workspace** (:attr:`OpProfile.workspace_bytes`): bytes an op allocates beyond its outputs
  while it runs, freed before it returns (a kernel's scratch, such as the activation-sized
  blocked-layout reorders oneDNN makes inside ``convolution_backward``). One more step runs
  under the PyTorch profiler with ``profile_memory=True``, each op inside a
  ``record_function`` span; an op's workspace is the highest "Total Allocated" inside its span,
  minus the total just before its first allocation, minus its outputs' bytes (clamped at 0).
  Optimizer updates are not measured (their temporaries are ops of the graph already). An
  output the kernel returns in a larger storage than traced (CPU ``mse_loss``: its 0-dim loss in
  the unreduced loss's storage) is copied to its traced size inside the span by the runner
  (:class:`memplan.torch.run.remat.Shrink`), so the larger storage is counted here, while the op
  runs, and not held past it (issue 33).

The graph is captured on FakeTensors, so it has no scratch; with the workspace,
:func:`memplan.remat.lower.sequence_peak_bytes` and the solvers count it while the op runs.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from memplan.graph.ir import Graph
from memplan.remat.lower import steps_for_order
from memplan.remat.problem import Step
from memplan.torch.capture import Capture
from memplan.torch.run.interpreter import _Call, _Update
from memplan.torch.run.remat import RematRunner

SPAN_PREFIX = "memplan.op."


@dataclass(frozen=True)
class OpProfile:
    """Per op of the captured graph: median seconds and workspace bytes (see module docstring)."""

    seconds: tuple[float, ...]
    workspace_bytes: tuple[int, ...]
    repeats: int
    profile_seconds: float = 0.0

    def costs(self) -> tuple[float, ...]:
        """Checkmate's ``C_i`` as measured seconds (a 0 only where the op runs no kernel)."""
        return self.seconds


class _ProfilingRunner(RematRunner):
    """The step in program order, each op timed and, when ``annotate``, inside a profiler span."""

    def __init__(
        self,
        capture: Capture,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
        steps: Sequence[Step] | None = None,
    ) -> None:
        """``steps``: the step sequence to run (a remat plan's; every op runs at least once,
        a recompute's span counts like its first run's); program order when ``None``."""
        if steps is None:
            steps = steps_for_order(capture.graph, range(len(capture.graph.ops)))
        super().__init__(capture, steps, model, optimizer)
        self.samples: list[list[float]] = [[] for _ in capture.graph.ops]
        self.annotate = False

    def _run(self, ins: _Call, env: dict[str, Any], recompute: bool) -> Any:
        op_id = self.plan.order[ins.position]
        span = torch.profiler.record_function(f"{SPAN_PREFIX}{op_id}") if self.annotate else contextlib.nullcontext()
        start = time.perf_counter()
        with span:
            result = super()._run(ins, env, recompute)
        self._sample(op_id, start)
        return result

    def _update(self, ins: _Update, env: dict[str, Any]) -> None:
        start = time.perf_counter()
        super()._update(ins, env)
        self._sample(self.plan.order[ins.position], start)

    def _sample(self, op_id: int, start: float) -> None:
        if not self.annotate:
            self.samples[op_id].append(time.perf_counter() - start)


def profile_capture(
    capture: Capture,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    batch: Any,
    *,
    repeats: int = 3,
    workspace: bool = True,
) -> OpProfile:
    """Profile ``capture`` on ``model``: one warm-up step, ``repeats`` timed steps, and (with
    ``workspace``) one step under the profiler. The model and optimizer are trained by it."""
    started = time.perf_counter()
    runner = _ProfilingRunner(capture, model, optimizer)
    runner(batch)  # warm-up: optimizer state, oneDNN primitives
    runner.samples = [[] for _ in capture.graph.ops]
    for _ in range(repeats):
        runner(batch)
    seconds = tuple(_median(s) for s in runner.samples)
    scratch = _measure_workspace(runner, batch) if workspace else (0,) * len(seconds)
    return OpProfile(seconds, scratch, repeats, time.perf_counter() - started)


def profile_model(
    model_name: str,
    batch_size: int,
    optimizer_name: str = "sgd",
    *,
    repeats: int = 3,
    workspace: bool = True,
    seed: int = 0,
    capture: Capture | None = None,
) -> tuple[Capture, OpProfile]:
    """Capture (unless given) and profile a zoo model's training step on a fresh copy of it."""
    from memplan.torch.zoo import build_workload, capture_model, make_optimizer

    capture = capture if capture is not None else capture_model(model_name, batch_size, "train", optimizer_name)
    w = build_workload(model_name, batch_size, seed=seed)
    w.model.train()
    optimizer = make_optimizer(optimizer_name, w.model.parameters())
    profile = profile_capture(capture, w.model, optimizer, (w.inputs, w.target), repeats=repeats, workspace=workspace)
    return capture, profile


def _median(samples: Sequence[float]) -> float:
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return ordered[len(ordered) // 2]


def _measure_workspace(runner: _ProfilingRunner, batch: Any) -> tuple[int, ...]:
    from torch.profiler import ProfilerActivity, profile

    from memplan.torch.measure import quiet_profiler

    quiet_profiler()
    runner.annotate = True
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
            runner(batch)
    finally:
        runner.annotate = False
    return workspace_from_trace(_trace_events(prof), runner.graph)


def _trace_events(prof: Any) -> list[dict[str, Any]]:
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)


def workspace_from_trace(events: Sequence[dict[str, Any]], graph: Graph) -> tuple[int, ...]:
    """Per op: the highest allocator total inside its ``memplan.op.<id>`` span, minus the total
    before the span's first allocation, minus the op's output bytes (at least 0)."""
    memory = sorted(
        (float(e["ts"]), int(e["args"]["Bytes"]), int(e["args"]["Total Allocated"]))
        for e in events
        if e.get("name") == "[memory]" and {"Bytes", "Total Allocated"} <= e.get("args", {}).keys()
    )
    stamps = [m[0] for m in memory]
    workspace = [0] * len(graph.ops)
    for e in events:
        name = str(e.get("name", ""))
        if not name.startswith(SPAN_PREFIX) or e.get("ph") != "X":
            continue
        op_id = int(name[len(SPAN_PREFIX) :])
        lo = bisect.bisect_left(stamps, float(e["ts"]))
        hi = bisect.bisect_right(stamps, float(e["ts"]) + float(e["dur"]))
        if lo == hi:
            continue
        base = memory[lo][2] - memory[lo][1]
        peak = max(total for _, _, total in memory[lo:hi])
        outputs = sum(graph.tensors[t].size_bytes for t in graph.ops[op_id].outputs)
        workspace[op_id] = max(workspace[op_id], peak - base - outputs)
    return tuple(workspace)


__all__ = ["OpProfile", "profile_capture", "profile_model", "workspace_from_trace"]
