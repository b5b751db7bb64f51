"""Timelines of data-parallel steps, one lane per stream, from PyTorch's own profiler.

The compute stream is the thread that runs the step (forward, backward, updates; memplan's
waits show as ``memplan.wait:bucketK``); the communication stream is the process group's worker
threads, where gloo runs each all-reduce (``gloo:all_reduce``). :func:`profile_step` keeps the
events of one profiled step; :func:`overlap` says how much of the all-reduce time the compute
thread spent computing; :func:`write_chrome_trace` and :func:`plot_timeline` draw them.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

COMPUTE, COMM = "compute stream", "communication stream"


def profile_step(fn: Callable[..., Any], *args: Any) -> tuple[Any, list[dict[str, Any]]]:
    """Run ``fn(*args)`` under ``torch.profiler`` and return its result and the step's events
    as ``{"lane", "name", "start_us", "dur_us"}``: the top-level ops and memplan's
    waits/launches on the calling thread (compute), ``gloo:all_reduce`` elsewhere (comm)."""
    from torch.profiler import ProfilerActivity, profile

    me = threading.get_native_id()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = fn(*args)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        raw = json.loads(Path(path).read_text()).get("traceEvents", [])
    finally:
        os.unlink(path)
    spans = [e for e in raw if e.get("ph") == "X" and "dur" in e]
    if not spans:
        return result, []
    t0 = min(float(e["ts"]) for e in spans)
    comm_threads: dict[Any, int] = {}
    events = []
    for e in spans:
        name = str(e.get("name", ""))
        if e.get("tid") == me and (name.startswith(("aten::", "memplan.")) or "Optimizer.step" in name):
            lane = COMPUTE
        elif name.startswith("gloo:"):
            lane = COMM
        else:
            continue
        thread = comm_threads.setdefault(e.get("tid"), len(comm_threads)) if lane == COMM else 0
        events.append(
            {"lane": lane, "name": name, "start_us": float(e["ts"]) - t0, "dur_us": float(e["dur"]), "thread": thread}
        )
    return result, _top_level(events)


def _top_level(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Compute events not inside another compute event (nested ops would double count)."""
    compute = sorted((e for e in events if e["lane"] == COMPUTE), key=lambda e: (e["start_us"], -e["dur_us"]))
    kept, end = [], -1.0
    for e in compute:
        if e["start_us"] >= end:
            kept.append(e)
            end = e["start_us"] + e["dur_us"]
    return kept + [e for e in events if e["lane"] == COMM]


def _union(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def _length(intervals: Sequence[tuple[float, float]]) -> float:
    return sum(hi - lo for lo, hi in intervals)


def overlap(events: Sequence[dict[str, Any]]) -> dict[str, float]:
    """How much of the time some all-reduce ran the compute thread was computing (an op that is
    not one of memplan's waits, nor an FSDP2 collective's launch, ``memplan.launch:*``: the call
    that hands it to gloo): ``comm_us``, ``overlapped_us``, ``fraction``, ``step_us``."""
    comm = _union([(e["start_us"], e["start_us"] + e["dur_us"]) for e in events if e["lane"] == COMM])
    busy = _union(
        [
            (e["start_us"], e["start_us"] + e["dur_us"])
            for e in events
            if e["lane"] == COMPUTE and not e["name"].startswith(("memplan.wait", "memplan.launch"))
        ]
    )
    both = 0.0
    i = j = 0
    while i < len(comm) and j < len(busy):
        lo, hi = max(comm[i][0], busy[j][0]), min(comm[i][1], busy[j][1])
        both += max(0.0, hi - lo)
        if comm[i][1] < busy[j][1]:
            i += 1
        else:
            j += 1
    total = _length(comm)
    step = max((e["start_us"] + e["dur_us"] for e in events), default=0.0)
    return {"comm_us": total, "overlapped_us": both, "fraction": both / total if total else 0.0, "step_us": step}


def write_chrome_trace(path: str | Path, runs: dict[str, Sequence[dict[str, Any]]]) -> None:
    """One Chrome trace (chrome://tracing, Perfetto) with a process per run and a thread per lane."""
    trace: list[dict[str, Any]] = []
    for pid, (label, events) in enumerate(runs.items()):
        trace.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": label}})
        threads = sorted({e.get("thread", 0) for e in events if e["lane"] == COMM})
        lanes = [(0, COMPUTE)] + [(1 + k, f"{COMM} (process group thread {k})") for k in threads]
        for tid, lane in lanes:
            trace.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": lane}})
        for e in events:
            tid = 0 if e["lane"] == COMPUTE else 1 + e.get("thread", 0)
            trace.append(
                {"ph": "X", "pid": pid, "tid": tid, "name": e["name"], "ts": e["start_us"], "dur": e["dur_us"]}
            )
    Path(path).write_text(json.dumps({"traceEvents": trace}))


def plot_timeline(path: str | Path, runs: dict[str, Sequence[dict[str, Any]]], title: str = "") -> None:
    """A PNG per run with a compute lane (ops blue, memplan's waits red) and a communication
    lane (each all-reduce orange; a sub-row per process group thread, which may overlap)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 1.6 * len(runs) + 0.8), squeeze=False)
    span = max((e["start_us"] + e["dur_us"] for ev in runs.values() for e in ev), default=1.0) / 1e6
    for ax, (label, events) in zip(axes[:, 0], runs.items(), strict=True):
        for kind, color in (("op", "tab:blue"), ("wait", "tab:red")):
            bars = [(e["start_us"] / 1e6, e["dur_us"] / 1e6) for e in events if _kind(e) == kind]
            if bars:
                ax.broken_barh(bars, (0.6, 0.8), facecolors=color)
        threads = sorted({e.get("thread", 0) for e in events if e["lane"] == COMM}) or [0]
        height = 0.8 / len(threads)
        for k in threads:
            bars = [
                (e["start_us"] / 1e6, e["dur_us"] / 1e6)
                for e in events
                if e["lane"] == COMM and e.get("thread", 0) == k
            ]
            if bars:
                ax.broken_barh(bars, (-0.4 + k * height, height), facecolors="tab:orange", edgecolors="white")
        ax.set_yticks([1, 0], ["compute", "comm"])
        ax.set_xlim(0, span)
        ax.set_title(label, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds into the step")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _kind(event: dict[str, Any]) -> str:
    if event["lane"] == COMM:
        return "comm"
    return "wait" if event["name"].startswith("memplan.wait") else "op"
