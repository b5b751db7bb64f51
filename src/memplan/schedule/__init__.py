"""Lifetime optimisation by operator reordering (OLLA sections 3.2-3.5 and 4.1-4.4).

``optimize_order(graph)`` returns the order of the ops with the smallest peak it can find,
as measured by the one estimator (:func:`memplan.graph.liveness.peak_bytes`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from memplan.graph.analysis import Reachability, peak_lower_bound
from memplan.graph.ir import Graph
from memplan.graph.liveness import peak_bytes
from memplan.schedule.early_updates import enforce_early_weight_updates
from memplan.schedule.heuristics import best_heuristic, greedy_lpmf, portfolio
from memplan.schedule.ilp import Spans, combine_by_segments, optimize_ilp
from memplan.schedule.problem import ScheduleProblem, ScheduleResult, relative_gap, validate_schedule

__all__ = [
    "ScheduleProblem",
    "ScheduleResult",
    "best_heuristic",
    "enforce_early_weight_updates",
    "greedy_lpmf",
    "optimize_order",
    "portfolio",
    "solve",
    "validate_schedule",
]

AUTO_ILP_MAX_OPS = 20_000


def optimize_order(
    graph: Graph,
    time_limit_seconds: float = 30.0,
    method: str = "auto",
    progress: bool = False,
    *,
    workers: int = 2,
    relative_gap_limit: float = 0.0,
) -> ScheduleResult:
    """The best order found for ``graph``: "heuristic" runs the portfolio only; "ilp" and
    "auto" then run the exact search over ideals (:mod:`memplan.schedule.ideals`: a cap
    bisection from the lower bound, segment by segment, which finds the optimum and proves it on
    most training steps), the cut and ordering bounds (:mod:`memplan.schedule.bounds`) where a
    gap is left, the search again from a raised bound, and the CP-SAT model (OLLA eq. 14)
    warm-started from the best order with the time left ("auto" falls back to the portfolio on
    graphs too large for the model). ``relative_gap_limit`` (e.g. 0.005) stops as soon as the
    best order is within that fraction of a proven lower bound (status "feasible", its gap
    reported); 0 proves to the end or to the time limit."""
    problem = ScheduleProblem(
        graph,
        time_limit_seconds=time_limit_seconds,
        method=method,  # type: ignore[arg-type]
        progress=progress,
        workers=workers,
        relative_gap_limit=relative_gap_limit,
    )
    return solve(problem)


def solve(problem: ScheduleProblem) -> ScheduleResult:
    """Run ``problem`` and check the answer against the estimator before returning it."""
    report = _console_reporter() if problem.progress else None
    if problem.method == "heuristic" or (problem.method == "auto" and problem.graph.num_ops > AUTO_ILP_MAX_OPS):
        result = heuristic_result(problem.graph)
    else:
        result = optimize_ilp(problem, report)
    validate_schedule(problem.graph, result)
    return result


def heuristic_result(graph: Graph) -> ScheduleResult:
    """The portfolio, combined segment by segment (segments are independent, OLLA 4.4)."""
    start = time.perf_counter()
    candidates = portfolio(graph)
    reach = Reachability.of(graph)
    order = combine_by_segments(graph, Spans.of(graph, reach), [c.order for c in candidates])
    order_bytes = peak_bytes(graph, order)
    if order_bytes > candidates[0].peak_bytes:
        order, order_bytes = list(candidates[0].order), candidates[0].peak_bytes
    lower_bytes = min(peak_lower_bound(graph, reach), order_bytes)
    gap = relative_gap(order_bytes, lower_bytes)
    return ScheduleResult(
        tuple(order), order_bytes, "heuristic", "heuristic", time.perf_counter() - start, gap, lower_bytes
    )


def _console_reporter() -> Callable[[str], None]:
    from rich.console import Console

    console = Console(stderr=True)
    return lambda message: console.log(message)
