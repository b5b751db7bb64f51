"""The peer memplan's remat proofs are measured against: Moccasin's CP model as the paper solves it.

Bartan et al. (ICML 2023) give each node at most ``C`` compute intervals, tie the tensors'
retention intervals to a cumulative constraint against the budget and solve with CP-SAT in
two phases: phase 1 minimises the memory *excess* over the budget (an elastic capacity), from
the checkpoint-all plan, until a plan within the budget is found; phase 2 minimises the
compute, hinted with that plan. Nothing else: no stage cuts, no objective floor, no baseline
warm start, no relaxation, no neighbourhood search, CP-SAT with its default parameters
(presolve on) and ``workers`` workers.

The model is :func:`memplan.remat.moccasin.build_model` with ``stage_cuts=False`` over the
whole solver graph (the same graph memplan's portfolio decides over), ``C = 2``; its status
and bound speak for plans with at most ``C`` runs per node whose first runs keep program
order. The plan it returns is lowered and measured by the same estimator as every strategy
(:func:`memplan.remat.lower.schedule_from_decisions`), so a peer plan over the budget would
show as "over-budget", never as a solution.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from memplan.remat.coarsen import SolverGraph, coarsen
from memplan.remat.lower import schedule_from_decisions
from memplan.remat.moccasin import RUNS_PER_NODE, add_hints, build_model, rows_from_solution
from memplan.remat.problem import RematProblem, RematSchedule
from memplan.solvers import SolveStatus, solve_cp_sat

WHOLE = 10**9
"""``max_solver_nodes`` that keeps every unit (as the portfolio's ``WHOLE``)."""


@dataclass
class PeerResult:
    """The peer's answer: ``status`` ("optimal", "feasible", "infeasible", "unknown"),
    ``objective``/``bound`` in the problem's cost units (the plain step included), ``gap``
    relative to the objective, ``seconds`` (the whole call), ``proof_seconds`` (seconds from
    the call's start to the proof of optimality, or to the gap limit; None without a proof),
    ``phase1_seconds`` and the lowered ``plan`` (None without one)."""

    status: str
    objective: float | None
    bound: float | None
    gap: float | None
    seconds: float
    proof_seconds: float | None
    phase1_seconds: float
    plan: RematSchedule | None


def solve_peer(
    problem: RematProblem,
    time_limit_seconds: float,
    *,
    workers: int = 2,
    gap_limit: float = 0.0,
    runs_per_node: int = RUNS_PER_NODE,
    presolve: bool = True,
) -> PeerResult:
    """Moccasin's two phases on the whole solver graph of ``problem`` within ``time_limit_seconds``
    (see the module docstring). ``gap_limit``: phase 2 stops once proven within it (relative).
    ``presolve=False`` turns CP-SAT's presolve off in both phases (memplan's own CP solves do)."""
    start = time.perf_counter()
    sg = coarsen(problem, WHOLE)
    persistent = problem.graph.persistent_bytes
    settings: dict[str, object] = {} if presolve else {"cp_model_presolve": False}
    rows, phase1 = _phase1(sg, problem.budget_bytes, persistent, runs_per_node, time_limit_seconds, workers, settings)
    phase1_seconds = time.perf_counter() - start
    if rows is None:
        status = "infeasible" if phase1 == "infeasible" else "unknown"
        return PeerResult(status, None, None, None, phase1_seconds, None, phase1_seconds, None)
    cm = build_model(sg, problem.budget_bytes, persistent, runs_per_node, stage_cuts=False)
    add_hints(cm, sg, rows)
    left = max(0.05, time_limit_seconds - (time.perf_counter() - start))
    parameters = {**settings, "relative_gap_limit": gap_limit}
    solver, status = solve_cp_sat(cm.model, left, workers=workers, parameters=parameters)
    seconds = time.perf_counter() - start
    if status.status not in ("optimal", "feasible"):
        return PeerResult(status.status, None, None, None, seconds, None, phase1_seconds, None)
    objective, bound = _in_cost_units(status, cm.cost_unit)
    gap = (objective - bound) / objective if objective else 0.0
    proven = status.status == "optimal" or gap <= gap_limit
    decisions = rows_from_solution(cm, solver, sg.size)
    plan = schedule_from_decisions(problem, sg, decisions, "moccasin-peer", status.status)
    return PeerResult(status.status, objective, bound, gap, seconds, seconds if proven else None, phase1_seconds, plan)


def _phase1(
    sg: SolverGraph,
    budget: int,
    persistent: int,
    runs_per_node: int,
    seconds: float,
    workers: int,
    settings: dict[str, object],
) -> tuple[list[list[int]] | None, str]:
    """Moccasin's phase 1: the least excess over the budget from checkpoint-all; the plan's
    decisions once the excess is 0 (None otherwise) and the solver's status."""
    cm = build_model(sg, budget, persistent, runs_per_node, elastic=True, stage_cuts=False)
    add_hints(cm, sg, [[t] for t in range(sg.size)])
    solver, status = solve_cp_sat(cm.model, max(0.05, seconds), workers=workers, parameters=settings)
    if status.status in ("optimal", "feasible") and status.objective == 0:
        return rows_from_solution(cm, solver, sg.size), status.status
    if status.status == "optimal":
        return None, "infeasible"  # the least excess is above 0: no plan with C runs per node
    return None, status.status


def _in_cost_units(status: SolveStatus, unit: float) -> tuple[float, float]:
    objective = float(status.objective or 0.0) * unit
    bound = float(status.bound if status.bound is not None else 0.0) * unit
    return objective, min(bound, objective)
