"""Exact stage-cut bounds, a few stages at a time: what closes the gap where the optimum is small.

The stage cuts (:func:`memplan.remat.moccasin._stage_cuts`) bound the compute of every plan whose
first runs keep program order: at the first run of node ``v`` (Checkmate's memory constraint,
Eq. 4.4, at one stage), each part made before ``v`` and read after it is resident or its
producer runs again after ``v`` (Eq. 4.9: a re-run costs ``C_p``), and so on back through what
those re-runs read. The portfolio solves the cuts of all its chosen stages together
(:func:`memplan.remat.moccasin.stage_cut_relaxation`): their LP in seconds, their branch and
bound seldom in the time a solve has. Where the optimum is a few whole re-runs the LP is weak
(it re-runs a fraction of a node): the random 500-node layered DAG at 0.9 of its peak, LP
+0.842% of compute against a plan at +0.899%; the MILP over all 14 chosen stages proves +0.904%,
but only after 19 s on 2 loaded cores.

Most of that value comes from one stage or a few. The cuts of any subset of stages are a
relaxation of the cuts of all of them (fewer constraints, the same objective), so each subset's
MILP optimum is a lower bound on every plan of the scope. One stage's cuts are a small covering
problem (a flag per node that may run again after it, a residence flag per part), which SCIP
solves exactly in tenths of a second: the DAG above, stage 414 alone, +0.899% in 0.3 s (the
plan's cost: proven). :func:`stage_mip_bound` solves the stages one at a time, in the order of
the LP of their direct knapsack covers (:func:`memplan.remat.bounds.lp_cover`), every stage over
the budget (not only the :data:`memplan.remat.moccasin.STAGE_CUT_PAIRS` the whole model takes),
then the stages with the highest bounds together, 2, 4, 8, ... at once (the three best there:
+0.904% in 2 s), until the time is spent or the bound reaches ``enough``. The answer is the
highest of these optima: never above the cuts' own optimum, so never above the cheapest plan of
the scope (tested against brute force on small graphs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from memplan.remat.bounds import lp_cover
from memplan.remat.coarsen import SolverGraph
from memplan.remat.moccasin import (
    Part,
    RerunWindows,
    Stage,
    _movable_closure,
    _relaxation_model,
    build_events,
    memory_units,
    node_reads,
    over_budget_stages,
    part_units,
)
from memplan.remat.problem import RematProblem, RematSchedule
from memplan.solvers import solve_as_mip

STAGE_SECONDS = 2.0
"""The most time one stage's MILP gets (most take tenths of a second)."""
SINGLES_SHARE = 0.5
"""The single stages stop after this share of the time; the joint models get the rest."""
MIN_SECONDS = 0.05
"""No model is started with less time than this left."""
SCOPE = "plans whose first runs keep program order (stage cuts, a few stages at a time, solved exactly)"
"""What :func:`stage_mip_bound` speaks for: the stage cuts' scope."""


@dataclass(frozen=True)
class StageBound:
    """``bound``: no plan of :data:`SCOPE` costs less (cost units of the solver graph, the plain
    step included; None without one); ``stages``: the single stages solved; ``joint``: the most
    stages one solved model held together; ``at``: the stage of the best single-stage bound
    (-1 without one)."""

    bound: float | None
    stages: int
    joint: int
    at: int
    seconds: float


def stage_mip_bound(
    sg: SolverGraph, budget_bytes: int, persistent_bytes: int, seconds: float, *, enough: float | None = None
) -> StageBound:
    """The highest optimum of the stage cuts' MILP over one stage (in the order of
    :func:`_direct_cover`, for :data:`SINGLES_SHARE` of the time), then over the best 2, 4, 8,
    ... stages together, the last model all of them (see the module docstring), found in
    ``seconds``; it stops early once the bound reaches ``enough`` (cost units: a bound that
    settles the caller's question)."""
    start = time.perf_counter()

    def left() -> float:
        return seconds - (time.perf_counter() - start)

    reads = node_reads(sg)
    events = build_events(sg, reads)
    windows = RerunWindows(sg, reads)
    units = memory_units(sg, budget_bytes, persistent_bytes)
    plain = float(sum(sg.cost))
    size = part_units(sg, units)
    over = over_budget_stages(sg, reads, units, size)
    closures = {v: _movable_closure(events, reads, v, crossing) for _excess, v, _fixed, crossing in over}
    over.sort(key=lambda s: -_direct_cover(sg, size, s[0], s[3], set(closures[s[1]])))
    best: float | None = None
    at, joint = -1, 0
    solved: list[tuple[float, Stage]] = []

    def settled() -> bool:
        return best is not None and enough is not None and best >= enough

    def solve(stages: list[Stage], limit: float) -> float | None:
        cuts = _relaxation_model(sg, reads, events, windows, units, reader_windows=False, stages=stages)
        status, _ = solve_as_mip(cuts.model, limit)
        return cuts.in_cost_units(status.bound, plain)

    singles_end = SINGLES_SHARE * seconds
    for _excess, v, fixed, crossing in over:
        if left() < MIN_SECONDS or settled() or time.perf_counter() - start > singles_end:
            break
        movable = closures[v]
        if not movable:
            continue  # nothing may run again: the memory floor speaks for this stage
        stage = (v, fixed, crossing, movable)
        bound = solve([stage], min(left(), STAGE_SECONDS))
        if bound is None:
            continue
        solved.append((bound, stage))
        if best is None or bound > best:
            best, at, joint = bound, v, 1
    ranked = [stage for _, stage in sorted(solved, key=lambda s: -s[0])]
    k = min(2, len(ranked))
    while k > 1 and left() >= MIN_SECONDS and not settled():
        bound = solve(ranked[:k], left())
        if bound is not None and (best is None or bound > best):
            best, joint = bound, k
        k = 0 if k == len(ranked) else min(2 * k, len(ranked))  # the last model holds every stage solved
    return StageBound(best, len(solved), joint, at, time.perf_counter() - start)


def _direct_cover(
    sg: SolverGraph, size: dict[Part, int], excess: int, crossing: list[Part], movable: set[int]
) -> float:
    """The order the stages are solved in: the LP of the knapsack cover of a stage's excess by
    re-runs of the producers of its crossing parts (:func:`memplan.remat.bounds.lp_cover`,
    without the recursion through what the re-runs read): a quick guess at where the bound is."""
    freed: dict[int, int] = {}
    for part in crossing:
        if part[0] in movable:
            freed[part[0]] = freed.get(part[0], 0) + size.get(part, 0)
    return lp_cover(excess, [(float(sg.cost[p]), b) for p, b in freed.items()])


class _Run(Protocol):
    """What :func:`near_proof` needs of the portfolio's state (:class:`memplan.remat.portfolio._Portfolio`)."""

    problem: RematProblem
    whole: SolverGraph
    best: RematSchedule | None
    attempts: list[dict[str, object]]
    reorder: bool
    gap_limit: float

    def gap(self) -> float | None: ...
    def left(self) -> float: ...
    def done(self) -> bool: ...
    def report(self, text: str) -> None: ...
    def take_bound(self, bound: object, scope: str, sg: SolverGraph) -> None: ...


NEAR_GAP = 0.01
""":func:`near_proof` runs only where the gap is at most this (1% of compute): there a few whole
re-runs separate the plan from the LP's bound, and exact stage bounds close it; where it is
wider (the 250-node DAG at 0.8: 6.7% after the relaxation, its exact stages +9.19% against a plan
at +12.4%) the time goes to better plans."""
SHARE = 0.5
"""The share of the time left :func:`near_proof` may use ..."""
MAX_SECONDS = 8.0
"""... and at most this long."""
NODES_PER_SECOND = 250
"""It runs only with at least a second per this many nodes: building the events and reads of the
model is not cut at the time limit (the 500-node DAG: about 1 s on 2 loaded cores; 2000 nodes: 7 s)."""
ATTEMPT = "exact stage cuts"
"""Its name in the portfolio's ``details["attempts"]``."""


def near_proof(run: _Run) -> None:
    """The portfolio's use of :func:`stage_mip_bound`: once per solve, when the best plan is
    within :data:`NEAR_GAP` of the bound, in program order only, with ``enough`` the plan's
    cost less the gap limit's share (:data:`SHARE` of the time left, at most :data:`MAX_SECONDS`)."""
    gap = run.gap()
    if run.reorder or run.best is None or gap is None or gap > NEAR_GAP or run.done():
        return
    if any(attempt.get("name") == ATTEMPT for attempt in run.attempts):
        return  # once per solve
    seconds = min(SHARE * run.left(), MAX_SECONDS)
    if seconds < max(0.5, run.whole.size / NODES_PER_SECOND):
        return  # its preparation (the model's events) cannot be cut short
    run.report(f"exact stage cuts on {run.whole.size} nodes ({seconds:.0f} s)")
    enough = run.best.compute_cost * (1 - run.gap_limit)
    problem = run.problem
    found = stage_mip_bound(run.whole, problem.budget_bytes, problem.graph.persistent_bytes, seconds, enough=enough)
    run.attempts.append(
        {
            "name": ATTEMPT,
            "nodes": run.whole.size,
            "seconds": round(found.seconds, 3),
            "bound": found.bound,
            "stages": found.stages,
            "joint": found.joint,
            "at": found.at,
        }
    )
    run.take_bound(found.bound, SCOPE, run.whole)
