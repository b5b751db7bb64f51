"""The ordered passes of memplan: reorder, then place (placement runs last because every
earlier pass changes lifetimes). Each pass states what it requires and checks what it ensures.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from memplan.graph.analysis import peak_lower_bound
from memplan.graph.check import validate_graph, validate_order
from memplan.graph.ir import Graph, OpId, TensorId
from memplan.graph.liveness import lifetimes, peak_bytes

ARENA_ALIGNMENT_BYTES = 64  # the default; CUDA tensors use 512 (memplan.torch.run.allocator)
# The relative gap at which the compile path's reorder stops proving (issue 37): an order proven
# within 0.5% of the best there is (its peak within 0.5% of a proven lower bound; 1.1 MB on the
# MLP's 227 MB step). The last 0.1% can take the solver's whole time limit: the MLP at batch 8
# spent 10 s there, on a step eager runs in 0.15 s. Relative, not a byte floor, so it means the
# same on a 100 MB and a 10 GB step. The `memplan optimize` command proves to the end (0).
COMPILE_REORDER_GAP = 0.005


@dataclass(frozen=True)
class MemoryPlan:
    """An order of the graph's ops and a byte offset in one arena for every planned tensor
    (non-persistent, non-empty), with the report of how they were found."""

    order: list[OpId]
    offsets: dict[TensorId, int]
    arena_bytes: int
    report: dict[str, Any] = field(default_factory=dict)


def make_plan(
    graph: Graph,
    *,
    time_limit_seconds: float = 10.0,
    reorder: bool = True,
    atomic_groups: Sequence[Sequence[int]] = (),
    allocator_tensors: Collection[int] = frozenset(),
    alignment_bytes: int = ARENA_ALIGNMENT_BYTES,
    reorder_gap: float = COMPILE_REORDER_GAP,
) -> MemoryPlan:
    """Reorder (OLLA 3.2) then place (OLLA 3.3) ``graph``; every result is validated.

    ``atomic_groups`` lists ops that the runtime runs together, at the position of the last
    of them (an optimizer's update of one parameter): the order is made to say so before
    lifetimes are measured and tensors placed. ``allocator_tensors`` are left out of the
    arena (the runtime cannot make their op write into it): the plan's peak then counts the
    whole arena plus those tensors' own resident bytes over time. Offsets, the arena and its
    lower bound count every size padded to ``alignment_bytes`` (512 for CUDA, as its caching
    allocator rounds). ``reorder_gap``: the reorder stops once its order is within that fraction
    of a proven lower bound (:data:`COMPILE_REORDER_GAP`; 0 proves).
    """
    validate_graph(graph)
    program = graph.program_order()
    program_peak = peak_bytes(graph, program)
    order, schedule = _reorder(graph, time_limit_seconds, reorder_gap) if reorder else (program, _identity_schedule())
    order = make_groups_contiguous(order, atomic_groups)
    validate_order(graph, order)
    optimized_peak = peak_bytes(graph, order)
    offsets, arena, placement = _place(graph, order, time_limit_seconds, allocator_tensors, alignment_bytes)
    padded_bound = _padded_peak(graph, order, allocator_tensors, alignment_bytes)
    outside = _resident_peak(graph, order, allocator_tensors)
    report = {
        "num_ops": graph.num_ops,
        "persistent_bytes": graph.persistent_bytes,
        "program_order_peak_bytes": program_peak,
        "optimized_order_peak_bytes": optimized_peak,
        "lower_bound_bytes": peak_lower_bound(graph),
        "alignment_bytes": alignment_bytes,
        "arena_bytes": arena,
        "arena_lower_bound_bytes": padded_bound,
        "allocator_tensor_bytes": sum(graph.tensors[t].size_bytes for t in allocator_tensors),
        "allocator_peak_bytes": outside,
        "planned_peak_bytes": graph.persistent_bytes + arena + outside,
        "fragmentation": _fragmentation(arena, padded_bound),
        "schedule": schedule,
        "placement": placement,
    }
    return MemoryPlan(list(order), offsets, arena, report)


def make_groups_contiguous(order: Sequence[int], groups: Sequence[Sequence[int]]) -> list[OpId]:
    """Move every member of each group to the position of the group's last member, in program
    order (op id order): the runtime runs a group as one call of the user's code (an optimizer
    update), which runs its ops in program order whatever order a solver chose, so the
    lifetimes the plan is placed by must be that order's. Members only move later, so an order
    stays topological as long as no op outside a group reads what a member makes before the
    group's end (checked by the caller)."""
    if not groups:
        return [OpId(v) for v in order]
    position = {v: i for i, v in enumerate(order)}
    group_end: dict[int, int] = {}
    for group in groups:
        last = max(group, key=position.__getitem__)
        for v in group:
            group_end[v] = last
    members: dict[int, list[int]] = {}
    for v in order:
        if v in group_end:
            members.setdefault(group_end[v], []).append(v)
    result: list[OpId] = []
    for v in order:
        if v not in group_end:
            result.append(OpId(v))
        elif group_end[v] == v:
            result.extend(OpId(m) for m in sorted(members[v]))
    return result


def _identity_schedule() -> dict[str, Any]:
    return {"method": "program-order", "status": "heuristic", "seconds": 0.0, "gap": None}


def _reorder(graph: Graph, time_limit_seconds: float, gap_limit: float) -> tuple[list[OpId], dict[str, Any]]:
    from memplan.schedule import optimize_order

    result = optimize_order(graph, time_limit_seconds=time_limit_seconds, relative_gap_limit=gap_limit)
    schedule = {"method": result.method, "status": result.status, "seconds": result.seconds, "gap": result.gap}
    schedule["gap_limit"] = gap_limit
    return list(result.order), schedule


def _place(
    graph: Graph, order: list[OpId], time_limit_seconds: float, exclude: Collection[int], alignment_bytes: int
) -> tuple[dict[TensorId, int], int, dict]:
    offsets, placement = place_order(graph, order, time_limit_seconds, exclude, alignment_bytes)
    summary = {
        "method": placement.method,
        "status": placement.status,
        "seconds": round(placement.seconds, 3),
        "gap": round(placement.gap, 6),
    }
    return offsets, placement.arena_bytes, summary


def place_order(
    graph: Graph,
    order: list[OpId],
    time_limit_seconds: float = 10.0,
    exclude: Collection[int] = frozenset(),
    alignment_bytes: int = ARENA_ALIGNMENT_BYTES,
) -> tuple[dict[TensorId, int], Any]:
    """Static offsets (OLLA 3.3, Sekiyama 3.2) for every planned tensor of ``graph`` run in
    ``order``, aligned to ``alignment_bytes``; checked by the placement validator and again,
    independently, against the estimator's lifetimes."""
    from memplan.placement import place, problem_from_graph, validate_placement

    problem = problem_from_graph(graph, order, alignment=alignment_bytes, exclude=exclude)
    placement = place(problem, time_limit_seconds=time_limit_seconds)
    validate_placement(problem, placement)
    index = graph.tensor_index
    offsets = {index[name]: offset for name, offset in zip(problem.names, placement.offsets_bytes, strict=True)}
    _check_no_overlap(graph, order, offsets)
    return offsets, placement


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


def _padded_peak(graph: Graph, order: list[OpId], exclude: Collection[int], alignment_bytes: int) -> int:
    """The arena's lower bound: the largest total of planned sizes, each padded to the
    alignment, resident at once (with nothing excluded: ``peak_bytes(graph, order,
    alignment_bytes)`` minus the padded persistent bytes)."""
    from memplan.placement import lower_bound_bytes, problem_from_graph

    return lower_bound_bytes(problem_from_graph(graph, order, alignment=alignment_bytes, exclude=exclude))


def _resident_peak(graph: Graph, order: list[OpId], tensors: Collection[int]) -> int:
    """The most bytes of ``tensors`` resident at once in ``order`` (the estimator's lifetimes)."""
    if not tensors:
        return 0
    delta = [0] * (len(order) + 1)
    for life in lifetimes(graph, order):
        if life.tensor in tensors:
            delta[life.start] += graph.tensors[life.tensor].size_bytes
            delta[life.end] -= graph.tensors[life.tensor].size_bytes
    peak = resident = 0
    for d in delta:
        resident += d
        peak = max(peak, resident)
    return peak


def _fragmentation(arena_bytes: int, lower_bound_bytes: int) -> float:
    """OLLA 5.4: (arena - lower bound) / arena."""
    return 0.0 if arena_bytes == 0 else max(0.0, (arena_bytes - lower_bound_bytes) / arena_bytes)
