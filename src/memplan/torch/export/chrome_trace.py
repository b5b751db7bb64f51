"""A plan as a Chrome/Perfetto trace (the JSON trace event format: chrome://tracing,
https://ui.perfetto.dev): one lane per stream with the ops in their planned order, and a
counter track of the bytes resident at each op (:func:`memplan.graph.liveness.memory_timeline`,
the one estimator, persistent bytes included).

Times: measured per-op seconds when given (``op_seconds[op]``, e.g. from
:func:`memplan.torch.run.profile.profile_capture`, which times each op of the captured step on
the real model), else estimated from the op's FLOPs at :data:`ESTIMATED_FLOPS_PER_SECOND`
(at least :data:`MIN_ESTIMATED_MICROSECONDS` per op). The trace says which in its
``otherData``. An op starts when the previous op of its stream has finished and the ops it
reads from have (a stream runs its ops in the planned order, one at a time, and waits for
the data it reads), so ops of different streams overlap where the graph allows it; the
counter is set at each op's start to the estimator's resident bytes at that op.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from memplan.errors import MemplanError
from memplan.graph.ir import Graph
from memplan.graph.liveness import memory_timeline

ESTIMATED_FLOPS_PER_SECOND = 1e10  # a CPU core's order of magnitude; only the shape of the trace depends on it
MIN_ESTIMATED_MICROSECONDS = 1.0
PROCESS_ID = 1
COUNTER_NAME = "resident bytes (memplan estimate)"


def op_durations_us(graph: Graph, op_seconds: Sequence[float] | None = None) -> list[float]:
    """Each op's duration in microseconds: measured if given, else estimated from FLOPs."""
    if op_seconds is not None:
        if len(op_seconds) != graph.num_ops:
            raise MemplanError(f"{len(op_seconds)} op times for a graph of {graph.num_ops} ops")
        return [max(0.0, s) * 1e6 for s in op_seconds]
    return [max(MIN_ESTIMATED_MICROSECONDS, op.flops / ESTIMATED_FLOPS_PER_SECOND * 1e6) for op in graph.ops]


def op_start_times_us(graph: Graph, order: Sequence[int], durations_us: Sequence[float]) -> list[float]:
    """Start of each op (indexed by op id) when each stream runs its ops of ``order`` one after
    another and every op waits for the ops it reads from (list scheduling in issue order)."""
    start = [0.0] * graph.num_ops
    end = [0.0] * graph.num_ops
    stream_free: dict[int, float] = {}
    for v in order:
        ready = max((end[p] for p in graph.predecessors[v]), default=0.0)
        start[v] = max(ready, stream_free.get(graph.ops[v].stream, 0.0))
        end[v] = start[v] + durations_us[v]
        stream_free[graph.ops[v].stream] = end[v]
    return start


def plan_trace(
    graph: Graph,
    order: Sequence[int],
    *,
    op_seconds: Sequence[float] | None = None,
    phases: Sequence[str] | None = None,
    recomputed: Mapping[int, int] | None = None,
    title: str = "",
) -> dict[str, Any]:
    """The trace of ``graph`` run in ``order`` (module docstring). ``phases[op]`` becomes the
    event's category; ``recomputed[op]`` (runs beyond the first) goes into its args."""
    durations = op_durations_us(graph, op_seconds)
    starts = op_start_times_us(graph, order, durations)
    resident = memory_timeline(graph, order)
    streams = sorted({graph.ops[v].stream for v in order})
    name = title or str(graph.meta.get("model", graph.name) or "graph")
    events: list[dict[str, Any]] = [_meta("process_name", {"name": f"memplan plan: {name}"})]
    for s in streams:
        events.append(_meta("thread_name", {"name": f"stream {s}"}, tid=s))
        events.append(_meta("thread_sort_index", {"sort_index": s}, tid=s))
    for position, v in enumerate(order):
        op = graph.ops[v]
        args = {
            "op": v,
            "position": position,
            "kind": op.kind,
            "flops": op.flops,
            "output_bytes": sum(graph.tensors[t].size_bytes for t in op.outputs),
            "resident_bytes": resident[position],
        }
        if recomputed and recomputed.get(v):
            args["recomputed_runs"] = recomputed[v]
        events.append(
            {
                "name": op.name,
                "cat": phases[v] if phases is not None else op.kind.split(".")[0],
                "ph": "X",
                "ts": round(starts[v], 3),
                "dur": round(durations[v], 3),
                "pid": PROCESS_ID,
                "tid": op.stream,
                "args": args,
            }
        )
        events.append(
            {
                "name": COUNTER_NAME,
                "ph": "C",
                "ts": round(starts[v], 3),
                "pid": PROCESS_ID,
                "args": {"bytes": resident[position]},
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "source": "memplan",
            "graph": graph.name,
            "op_times": _times_source(op_seconds),
            "peak_bytes": max(resident, default=graph.persistent_bytes),
            "num_ops": len(order),
            "streams": streams,
        },
    }


def _times_source(op_seconds: Sequence[float] | None) -> str:
    return "measured" if op_seconds is not None else f"estimated: FLOPs at {ESTIMATED_FLOPS_PER_SECOND:g}/s"


def _meta(name: str, args: dict[str, Any], tid: int = 0) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": PROCESS_ID, "tid": tid, "args": args}


def check_trace(trace: Mapping[str, Any], graph: Graph, order: Sequence[int]) -> None:
    """Check a trace from first principles: one complete event per op of ``order`` on its
    stream's lane, never two at once on a lane, none before the ops it reads from have
    ended, and counter values equal to the estimator's resident bytes. Raises MemplanError."""
    ops = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    if [e["args"]["op"] for e in ops] != list(order):
        raise MemplanError("the trace's op events are not the order's ops")
    end = {e["args"]["op"]: e["ts"] + e["dur"] for e in ops}
    lanes: dict[int, float] = {}
    for e in ops:
        v = e["args"]["op"]
        if e["tid"] != graph.ops[v].stream:
            raise MemplanError(f"op {graph.ops[v].name} is on lane {e['tid']}, its stream is {graph.ops[v].stream}")
        if e["ts"] + 1e-6 < lanes.get(e["tid"], 0.0):
            raise MemplanError(f"op {graph.ops[v].name} starts before the previous op of its stream ends")
        if any(e["ts"] + 1e-6 < end[p] for p in graph.predecessors[v]):
            raise MemplanError(f"op {graph.ops[v].name} starts before an op it reads from ends")
        lanes[e["tid"]] = e["ts"] + e["dur"]
    counters = [e["args"]["bytes"] for e in trace["traceEvents"] if e.get("ph") == "C"]
    if counters != memory_timeline(graph, order):
        raise MemplanError("the trace's counter is not the estimator's resident bytes")


def write_trace(trace: Mapping[str, Any], path: str | Path) -> Path:
    path = Path(path)
    if path.exists() and path.suffix != ".json":
        raise MemplanError(f"refusing to overwrite {path}: a trace must be a .json file")
    path.write_text(json.dumps(trace) + "\n")
    return path


__all__ = ["check_trace", "op_durations_us", "op_start_times_us", "plan_trace", "write_trace"]
