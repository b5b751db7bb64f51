"""The ordered passes of memplan: reorder, then place (placement runs last because every
earlier pass changes lifetimes). Each pass states what it requires and checks what it ensures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from memplan.graph.analysis import peak_lower_bound
from memplan.graph.check import validate_graph, validate_order
from memplan.graph.ir import Graph, OpId, TensorId
from memplan.graph.liveness import lifetimes, peak_bytes

ARENA_ALIGNMENT_BYTES = 64


@dataclass(frozen=True)
class MemoryPlan:
    """An order of the graph's ops and a byte offset in one arena for every planned tensor
    (non-persistent, non-empty), with the report of how they were found."""

    order: list[OpId]
    offsets: dict[TensorId, int]
    arena_bytes: int
    report: dict[str, Any] = field(default_factory=dict)


def make_plan(graph: Graph, *, time_limit_seconds: float = 10.0, reorder: bool = True) -> MemoryPlan:
    """Reorder (OLLA 3.2) then place (OLLA 3.3) ``graph``; every result is validated."""
    validate_graph(graph)
    program = graph.program_order()
    program_peak = peak_bytes(graph, program)
    order, schedule = _reorder(graph, time_limit_seconds) if reorder else (program, _identity_schedule())
    validate_order(graph, order)
    optimized_peak = peak_bytes(graph, order)
    offsets, arena, placement = _place(graph, order, time_limit_seconds)
    report = {
        "num_ops": graph.num_ops,
        "persistent_bytes": graph.persistent_bytes,
        "program_order_peak_bytes": program_peak,
        "optimized_order_peak_bytes": optimized_peak,
        "lower_bound_bytes": peak_lower_bound(graph),
        "arena_bytes": arena,
        "fragmentation": _fragmentation(arena, optimized_peak - graph.persistent_bytes),
        "schedule": schedule,
        "placement": placement,
    }
    return MemoryPlan(list(order), offsets, arena, report)


def _identity_schedule() -> dict[str, Any]:
    return {"method": "program-order", "status": "heuristic", "seconds": 0.0, "gap": None}


def _reorder(graph: Graph, time_limit_seconds: float) -> tuple[list[OpId], dict[str, Any]]:
    from memplan.schedule import optimize_order

    result = optimize_order(graph, time_limit_seconds=time_limit_seconds)
    schedule = {"method": result.method, "status": result.status, "seconds": result.seconds, "gap": result.gap}
    return list(result.order), schedule


def _place(graph: Graph, order: list[OpId], time_limit_seconds: float) -> tuple[dict[TensorId, int], int, dict]:
    """One offset per planned tensor; no two tensors live at once overlap (checked)."""
    start = time.perf_counter()
    offsets, arena = _no_reuse_offsets(graph)
    _check_no_overlap(graph, order, offsets)
    seconds = time.perf_counter() - start
    return offsets, arena, {"method": "no-reuse", "status": "heuristic", "seconds": seconds, "gap": None}


def _no_reuse_offsets(graph: Graph) -> tuple[dict[TensorId, int], int]:
    offsets: dict[TensorId, int] = {}
    cursor = 0
    for t, tensor in enumerate(graph.tensors):
        if not tensor.persistent and tensor.size_bytes > 0:
            offsets[TensorId(t)] = cursor
            cursor += _align(tensor.size_bytes)
    return offsets, cursor


def _align(n: int) -> int:
    return -(-n // ARENA_ALIGNMENT_BYTES) * ARENA_ALIGNMENT_BYTES


def _check_no_overlap(graph: Graph, order: list[OpId], offsets: dict[TensorId, int]) -> None:
    """Sweep over time: tensors resident together must occupy disjoint byte ranges."""
    lives = {life.tensor: life for life in lifetimes(graph, order)}
    events = sorted(offsets, key=lambda t: lives[t].start)
    active: list[TensorId] = []
    for t in events:
        active = [a for a in active if lives[a].end > lives[t].start]
        lo, hi = offsets[t], offsets[t] + graph.tensors[t].size_bytes
        for a in active:
            if offsets[a] < hi and lo < offsets[a] + graph.tensors[a].size_bytes:
                raise AssertionError(f"placement overlaps {graph.tensors[a].name} and {graph.tensors[t].name}")
        active.append(t)


def _fragmentation(arena_bytes: int, lower_bound_bytes: int) -> float:
    """OLLA 5.4: (arena - lower bound) / arena."""
    return 0.0 if arena_bytes == 0 else max(0.0, (arena_bytes - lower_bound_bytes) / arena_bytes)
