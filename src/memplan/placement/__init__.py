"""Location optimisation: static offsets in one arena (OLLA 2.3, 3.3-3.4, 4.5; Sekiyama et al. 3).

Typical use::

    problem = problem_from_graph(graph, order)
    placement = place(problem, time_limit_seconds=10)
    validate_placement(problem, placement)
    fragmentation(placement.arena_bytes, lower_bound_bytes(problem))
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from memplan.errors import MemplanError
from memplan.placement.check import (
    ContiguityBroken,
    FixedOffsetIgnored,
    InvalidPlacement,
    MisalignedOffset,
    MissingBuffer,
    OutsideArena,
    OverlappingBuffers,
    placement_failures,
    validate_placement,
)
from memplan.placement.formats import (
    CsvInstance,
    PlacementFormatError,
    format_placement_csv,
    parse_placement_csv,
    read_placement_csv,
    write_placement_csv,
)
from memplan.placement.heuristics import best_fit_skyline, greedy_by_size, portfolio, pyramid_offsets
from memplan.placement.problem import (
    ConflictRelation,
    IntervalConflicts,
    PairConflicts,
    Placement,
    PlacementError,
    PlacementProblem,
    arena_bytes,
    fragmentation,
    lower_bound_bytes,
    problem_from_graph,
)

METHODS = ("auto", "heuristic", "exact")


def solve_exact(problem: PlacementProblem, time_limit_seconds: float = 10.0, **options: Any) -> Placement:
    """:func:`memplan.placement.exact.solve_exact`, imported on first use: it brings OR-Tools
    (and pandas, through CP-SAT's helpers), about 57 MiB and a second of start-up that a training
    process which only replays a plan never needs."""
    from memplan.placement.exact import solve_exact as solve

    return solve(problem, time_limit_seconds, **options)


def place_from_heuristic(problem: PlacementProblem, exact: Callable[[Placement], Placement]) -> Placement:
    """:func:`place` with the heuristic portfolio run here first: where it meets the lower bound
    (the most bytes live at once, OLLA 5.4) it is optimal, proven by the bound itself, and the
    answer, in milliseconds, without OR-Tools; else ``exact(start)`` goes on from it (e.g.
    :func:`solve_exact` in a child process, :func:`memplan.isolate.in_child`: on the zoo's
    recorded steps the fork and OR-Tools' import cost about 0.25 s of the first replayed step
    that a placement at the bound never needed, issue 37)."""
    best = portfolio(problem)
    bound, cap = problem.lower_bound_bytes, problem.capacity_bytes
    if best.arena_bytes <= bound and (cap is None or best.arena_bytes <= cap):
        return replace(best, status="optimal", gap=0.0, bound_bytes=bound)
    return exact(best)


class UnknownMethod(MemplanError, ValueError):
    pass


def place(
    problem: PlacementProblem, time_limit_seconds: float = 10.0, method: str = "auto", *, workers: int = 2
) -> Placement:
    """Place ``problem``'s buffers in one arena.

    "heuristic": the best of the heuristic portfolio. "exact" and "auto": the portfolio, then,
    unless it already meets the lower bound, :func:`solve_exact` within ``time_limit_seconds``:
    on lifetime conflicts MiniMalloc's canonical search (:mod:`memplan.placement.search`)
    alongside exact windows and CP-SAT (OLLA eq. 15); on general conflicts or contiguous groups
    (SOMAS) CP-SAT. Without a capacity it looks for the smallest arena it can reach, proving
    smaller ones impossible where it can; with ``problem.capacity_bytes`` the status says
    whether the arena fits: "infeasible" (proven that nothing fits) or "unknown" (nothing found
    that fits).
    """
    if method not in METHODS:
        raise UnknownMethod(f"unknown placement method {method!r}; choose one of {', '.join(METHODS)}")
    if method == "heuristic":
        return _heuristic(problem)

    def exact(start: Placement) -> Placement:
        return solve_exact(problem, time_limit_seconds, workers=workers, start=start)

    return place_from_heuristic(problem, exact)


def _heuristic(problem: PlacementProblem) -> Placement:
    t0 = time.perf_counter()
    best = portfolio(problem)
    cap = problem.capacity_bytes
    status = best.status
    if cap is not None and best.arena_bytes > cap:
        status = "infeasible" if best.bound_bytes > cap else "unknown"
    return replace(best, status=status, seconds=time.perf_counter() - t0)


def placement_fragmentation(problem: PlacementProblem, placement: Placement) -> float:
    """OLLA 5.4's fragmentation of ``placement``: (arena - lower bound) / arena."""
    return fragmentation(placement.arena_bytes, lower_bound_bytes(problem))


__all__ = [
    "METHODS",
    "ConflictRelation",
    "ContiguityBroken",
    "CsvInstance",
    "FixedOffsetIgnored",
    "IntervalConflicts",
    "InvalidPlacement",
    "MisalignedOffset",
    "MissingBuffer",
    "OutsideArena",
    "OverlappingBuffers",
    "PairConflicts",
    "Placement",
    "PlacementError",
    "PlacementFormatError",
    "PlacementProblem",
    "UnknownMethod",
    "arena_bytes",
    "best_fit_skyline",
    "format_placement_csv",
    "fragmentation",
    "greedy_by_size",
    "lower_bound_bytes",
    "parse_placement_csv",
    "place",
    "place_from_heuristic",
    "placement_failures",
    "placement_fragmentation",
    "portfolio",
    "problem_from_graph",
    "pyramid_offsets",
    "read_placement_csv",
    "solve_exact",
    "validate_placement",
    "write_placement_csv",
]
