"""Checkmate's optimal rematerialisation MILP (section 4.5) in OR-Tools CP-SAT.

Variables over the solver graph (:mod:`memplan.remat.coarsen`), stages ``t`` and nodes
``i <= t``: ``R[t, i]`` (run ``i`` in stage ``t``), ``S[t, i]`` (``i`` resident at the start of
stage ``t``), ``U[t, k]`` (memory while node ``k`` of stage ``t`` runs) and ``Free[t, i, k]``.

* objective (4.3): ``min sum C_i R[t, i]``;
* (4.3b) ``R[t, j] <= R[t, i] + S[t, i]`` for every edge ``(i, j)``;
* (4.3c) ``S[t, i] <= R[t-1, i] + S[t-1, i]``; (4.3d) ``R[t, t] = 1`` (frontier-advancing);
* (1) ``U[t, 0] = persistent + sum_i S[t, i] M_i + R[t, 0] M_0``;
* (2) ``U[t, k] = U[t, k-1] - mem_freed_t(k-1) + R[t, k] M_k``, with
  ``mem_freed_t(k) = sum_{i in DEPS[k] + {k}} M_i Free[t, i, k]`` (3);
* (4)-(6) ``Free[t, i, k] => R[t, k] and not S[t+1, i] and not R[t, j]`` for the users ``j > k``
  of ``i``. Only this direction is posted (CP-SAT's enforced bool-and replaces the big-M
  casts 6a-6c): leaving ``Free`` at 0 can only overstate memory, and the solver sets it
  to 1 wherever the budget needs it, so the optimum is the paper's;
* ``U[t, k] + R[t, k] (peak_k - M_k) <= M_budget``: the group's own temporaries while it runs.

Memory is integer-scaled (sizes rounded up, the budget down, in one common unit) and cost
is scaled to integers. Variables that cannot be 1 are not created: a node is re-run only
in its window and only up to the last stage that can still need it, and kept only that long.

The answer is lowered on the real graph and re-measured by
:func:`memplan.remat.lower.sequence_peak_bytes`; the budget check is done there. The solve
is warm-started (hints) from the cheapest feasible baseline, and if the MILP's plan is not
cheaper, that baseline's plan is returned (status "fallback").

``solver="highs"`` solves the same model with HiGHS instead: :mod:`memplan.remat.highs`
exports it as a plain MILP (the hints become a MIP start) and runs HiGHS in a child process.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ortools.sat.python import cp_model

from memplan.errors import MemplanError
from memplan.remat.baselines import BASELINES, run_baselines, solver_graph
from memplan.remat.coarsen import SolverGraph
from memplan.remat.highs import require_highs, solve_highs
from memplan.remat.lower import schedule_from_decisions
from memplan.remat.problem import RematProblem, RematSchedule
from memplan.solvers import Found, SolveStatus, solve_cp_sat

MEMORY_STEPS = 50_000_000
COST_STEPS = 100_000
SOLVERS = ("cp-sat", "highs")


Lit = cp_model.IntVar | int


@dataclass
class _Model:
    model: cp_model.CpModel
    R: dict[tuple[int, int], cp_model.IntVar]
    S: dict[tuple[int, int, int], cp_model.IntVar]
    U: dict[tuple[int, int], cp_model.IntVar]
    free: dict[tuple[int, int, int], cp_model.IntVar]
    unit_bytes: int
    infeasible: bool = False
    cost_unit: float = 1.0

    def r(self, t: int, i: int) -> Lit:
        return 1 if i == t else self.R.get((t, i), 0)

    def s(self, t: int, i: int, q: int) -> Lit:
        return self.S.get((t, i, q), 0)


def needed_until(sg: SolverGraph) -> tuple[list[int], list[list[int]]]:
    """Last stage in which node ``i`` (and each of its parts) can be read: through its
    readers, which may themselves be re-run until their window closes."""
    last = list(range(sg.size))
    last_part: list[list[int]] = [[] for _ in range(sg.size)]
    for i in range(sg.size - 1, -1, -1):
        for _, readers in sg.parts[i]:
            until = max(j if not sg.recomputable(j) else min(sg.limit[j] - 1, max(j, last[j])) for j in readers)
            last_part[i].append(until)
            last[i] = max(last[i], until)
    return last, last_part


def part_of(sg: SolverGraph, i: int, j: int) -> int | None:
    """Which part of node ``i`` node ``j`` reads (None: only persistent tensors)."""
    for q, (_, readers) in enumerate(sg.parts[i]):
        if j in readers:
            return q
    return None


def build_model(sg: SolverGraph, budget_bytes: int, persistent_bytes: int) -> _Model:
    """Checkmate (4.5) over ``sg`` (see module docstring)."""
    unit = max(1, budget_bytes // MEMORY_STEPS)
    mem = [[math.ceil(b / unit) for b, _ in parts] for parts in sg.parts]
    work = [max(0, math.ceil(p / unit) - sum(m)) for p, m in zip(sg.peak_bytes, mem, strict=True)]
    outputs = [math.ceil(b / unit) for b in sg.output_bytes]
    budget = budget_bytes // unit
    last, last_part = needed_until(sg)
    mm = _Model(cp_model.CpModel(), {}, {}, {}, {}, unit)
    for t in range(sg.size):
        for i in range(t):
            if sg.may_run(t, i) and t <= last[i]:
                mm.R[t, i] = mm.model.new_bool_var(f"R{t}_{i}")
            for q, until in enumerate(last_part[i]):
                if t <= until:
                    mm.S[t, i, q] = mm.model.new_bool_var(f"S{t}_{i}_{q}")
    _dependency_rows(mm, sg)
    constant = math.ceil(persistent_bytes / unit)
    for t in range(sg.size):
        _memory_rows(mm, sg, t, mem, work, budget, constant)
        constant += outputs[t]
    cost_unit = max(max(sg.cost, default=1.0), 1.0) / COST_STEPS
    mm.cost_unit = cost_unit
    plain = sum(max(1, round(c / cost_unit)) for c in sg.cost)  # R[t, t] = 1: every node's first run
    mm.model.minimize(plain + sum(max(1, round(sg.cost[i] / cost_unit)) * var for (_, i), var in mm.R.items()))
    return mm


def _post(mm: _Model, lhs: Lit, rhs: list[Lit]) -> None:
    """``lhs <= sum(rhs)`` over 0/1 literals, folding constants."""
    if isinstance(lhs, int) and lhs == 0:
        return
    terms = [x for x in rhs if not isinstance(x, int)]
    if any(isinstance(x, int) and x for x in rhs):
        return
    if not terms:
        if isinstance(lhs, int):
            mm.infeasible = True
        else:
            mm.model.add(lhs == 0)
        return
    mm.model.add(lhs <= sum(terms))


def _dependency_rows(mm: _Model, sg: SolverGraph) -> None:
    """(4.3b) and (4.3c)."""
    for t in range(sg.size):
        for j in range(t + 1):
            if isinstance(mm.r(t, j), int) and not mm.r(t, j):
                continue
            for p in sg.preds[j]:
                q = part_of(sg, p, j)
                if q is not None:
                    _post(mm, mm.r(t, j), [mm.r(t, p), mm.s(t, p, q)])
        for i in range(t):
            for q in range(len(sg.parts[i])):
                if (t, i, q) in mm.S:
                    _post(mm, mm.S[t, i, q], [mm.r(t - 1, i), mm.s(t - 1, i, q)])


def _memory_rows(
    mm: _Model, sg: SolverGraph, t: int, mem: list[list[int]], work: list[int], budget: int, constant: int
) -> None:
    """Constraints (1), (2), (3)-(6) and the budget for stage ``t``."""
    model = mm.model
    active = [k for k in range(t + 1) if not (isinstance(mm.r(t, k), int) and not mm.r(t, k))]
    expr = constant + sum(b * mm.s(t, i, q) for i in range(t) for q, b in enumerate(mem[i]) if b)
    for k in active:
        u = model.new_int_var(0, budget, f"U{t}_{k}")
        model.add(u == expr + sum(mem[k]) * mm.r(t, k))
        mm.U[t, k] = u
        if work[k]:
            model.add(u + work[k] * mm.r(t, k) <= budget)
        freed = []
        for i in (*sg.preds[k], k):
            for q, b in enumerate(mem[i]):
                readers = sg.parts[i][q][1]
                if b and (i == k or k in readers):
                    free = _free_var(mm, t, i, q, k, readers)
                    if free is not None:
                        freed.append(b * free)
        expr = u - sum(freed) if freed else u


def _free_var(mm: _Model, t: int, i: int, q: int, k: int, readers: tuple[int, ...]) -> cp_model.IntVar | None:
    """Free[t, i, k] (eq. 4) for part ``q`` of ``i``: k runs, the part is not kept, no later reader runs."""
    lits = [mm.r(t, k), _negate(mm.s(t + 1, i, q))]
    lits += [_negate(mm.r(t, j)) for j in readers if k < j <= t]
    if any(isinstance(x, int) and not x for x in lits):
        return None
    free = mm.model.new_bool_var(f"F{t}_{i}_{q}_{k}")
    terms = [x for x in lits if not isinstance(x, int)]
    if terms:
        mm.model.add_bool_and(terms).only_enforce_if(free)
    mm.free[t, i, k * 1000 + q] = free
    return free


def _negate(x: Lit) -> Lit:
    return 1 - x if isinstance(x, int) else x.Not()


def implied_keep(sg: SolverGraph, rows_: list[list[int]]) -> set[tuple[int, int, int]]:
    """The least S for R (4.6): part ``q`` of ``i`` is resident at the start of ``t`` iff a
    stage from ``t`` on reads the value computed before ``t`` (no run of ``i`` in between)."""
    keep: set[tuple[int, int, int]] = set()
    row_sets = [set(r) for r in rows_]
    for t in range(sg.size - 1, 0, -1):
        for i in range(t):
            if i in row_sets[t]:
                continue
            for q, (_, readers) in enumerate(sg.parts[i]):
                if (t + 1, i, q) in keep or any(j in row_sets[t] for j in readers):
                    keep.add((t, i, q))
    return keep


def complete_hints(mm: _Model, sg: SolverGraph, rows_: list[list[int]], seconds: float) -> bool:
    """Hint every variable: fix R and S to the plan in a copy of the model, solve it (only U
    and Free are left to find) and hint the whole answer. False if the plan does not fit."""
    row_sets = [set(r) for r in rows_]
    keep = implied_keep(sg, rows_)
    if not all((t, i) in mm.R for t, r in enumerate(row_sets) for i in r if i != t):
        return False
    if not all(key in mm.S for key in keep):
        return False
    copy = mm.model.clone()
    for (t, i), var in mm.R.items():
        copy.add(copy.get_bool_var_from_proto_index(var.index) == int(i in row_sets[t]))
    for key, var in mm.S.items():
        copy.add(copy.get_bool_var_from_proto_index(var.index) == int(key in keep))
    copy.clear_objective()
    solver, status = solve_cp_sat(copy, seconds, workers=1)
    if status.status not in ("optimal", "feasible"):
        return False
    for var in [*mm.R.values(), *mm.S.values(), *mm.U.values(), *mm.free.values()]:
        mm.model.add_hint(var, solver.value(var))
    return True


def rows_from_solution(mm: _Model, solver: cp_model.CpSolver, n: int) -> list[list[int]]:
    return rows_from_values(mm, solver.value, n)


def rows_from_values(mm: _Model, value: Callable[[cp_model.IntVar], float], n: int) -> list[list[int]]:
    """``R`` as rows (Checkmate's Algorithm 1 input) from any solver's values of the R variables."""
    return [sorted([t] + [i for i in range(t) if (t, i) in mm.R and value(mm.R[t, i]) > 0.5]) for t in range(n)]


WARM_START_SHARE = 0.25
"""The baselines that warm-start the MILP get at most this share of its time limit (:func:`best_baseline`)."""


def best_baseline(problem: RematProblem) -> RematSchedule | None:
    """The cheapest baseline plan within budget (None if none fits), from the baselines run
    within :data:`WARM_START_SHARE` of the time limit (:func:`memplan.remat.baselines.run_baselines`)."""
    plans = list(run_baselines(problem, BASELINES, WARM_START_SHARE * problem.time_limit_seconds).values())
    fits = [p for p in plans if p.feasible]
    return min(fits, key=lambda p: (p.compute_cost, p.peak_bytes)) if fits else None


def check_solver(solver: str) -> None:
    """Raise :class:`MemplanError` for an unknown backend, or for HiGHS without highspy."""
    if solver not in SOLVERS:
        raise MemplanError(f"unknown MILP solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    if solver == "highs":
        require_highs()


def solve_checkmate(
    problem: RematProblem,
    warm: RematSchedule | None = None,
    solver: str = "cp-sat",
    gap_limit: float = 0.0,
    on_solution: Callable[[float, float], None] | None = None,
) -> RematSchedule:
    """Checkmate's MILP, warm-started from the best baseline; never worse than that baseline.

    ``solver``: "cp-sat" (OR-Tools, in process) or "highs" (optional, in a child process).
    ``gap_limit``: CP-SAT stops once its plan is proven within this fraction of its bound
    (``relative_gap_limit``; the objective 4.3 is the whole step's compute, so the gap is
    relative to it); 0 searches until optimal or out of time. ``details["found_at"]``: the
    seconds from the call's start until the returned plan was found (the baselines' end for
    a baseline's plan, else the MILP's last improving solution). ``on_solution(cost, bound)``:
    each improving solution of CP-SAT, in the step's cost units (rounded as the model rounds)."""
    check_solver(solver)
    start = time.perf_counter()
    sg = solver_graph(problem)
    warm = warm if warm is not None else best_baseline(problem)
    found = Found(start)
    warm_at = found.now()
    if warm is not None and warm.compute_cost <= problem.plain_cost:
        # no recomputation: no plan can cost less than running every op once
        return found.mark(_finish(problem, warm, None, "optimal", 0.0, start, solver), warm_at)
    mm = build_model(sg, problem.budget_bytes, problem.graph.persistent_bytes)
    hinted = False
    if warm is not None and "rows" in warm.details:
        left = problem.time_limit_seconds - (time.perf_counter() - start)  # the model may take seconds to build
        hinted = complete_hints(mm, sg, warm.details["rows"], max(0.1, left / 4))  # type: ignore[arg-type]
    exact = all(len(members) == 1 for members in sg.groups)
    if mm.infeasible:
        return found.mark(_finish(problem, warm, None, "infeasible", None, start, solver, exact), warm_at)
    left = max(0.1, problem.time_limit_seconds - (time.perf_counter() - start))
    heard = found.solution
    if on_solution is not None:

        def heard(objective: float, bound: float) -> None:
            found.solution(objective, bound)
            on_solution(objective * mm.cost_unit, bound * mm.cost_unit)

    status, rows_ = _solve_model(mm, sg.size, problem.with_time_limit(left), solver, gap_limit, found, heard)
    if rows_ is None:
        return found.mark(_finish(problem, warm, None, status.status, status.gap, start, solver, exact), warm_at)
    plan = schedule_from_decisions(problem, sg, rows_, "checkmate", status.status)
    plan.details["hinted"] = hinted
    chosen = _finish(problem, warm, plan, status.status, status.gap, start, solver)
    new = chosen is plan and (warm is None or plan.compute_cost < warm.compute_cost)
    return found.mark(chosen, found.at() if new else warm_at)


def _solve_model(
    mm: _Model,
    n: int,
    problem: RematProblem,
    solver: str,
    gap_limit: float = 0.0,
    found: Found | None = None,
    heard: Callable[[float, float], None] | None = None,
) -> tuple[SolveStatus, list[list[int]] | None]:
    """Solve the model with ``solver``; the status and ``R`` as rows (None without a solution)."""
    if solver == "highs":
        continuous = [u.index for u in mm.U.values()]
        status, x = solve_highs(mm.model, problem.time_limit_seconds, continuous=continuous, threads=problem.workers)
        if found is not None:
            found.last = found.now()  # HiGHS reports no timeline: its end
        if status.status not in ("optimal", "feasible") or x is None:
            return status, None
        return status, rows_from_values(mm, lambda var: x[var.index], n)
    cp, status = solve_cp_sat(
        mm.model,
        problem.time_limit_seconds,
        workers=problem.workers,
        progress=heard or (found.solution if found is not None else None),
        parameters={"relative_gap_limit": gap_limit} if gap_limit > 0 else None,
    )
    if status.status not in ("optimal", "feasible"):
        return status, None
    return status, rows_from_solution(mm, cp, n)


def _finish(
    problem: RematProblem,
    warm: RematSchedule | None,
    plan: RematSchedule | None,
    status: str,
    gap: float | None,
    start: float,
    solver: str = "cp-sat",
    exact: bool = False,
) -> RematSchedule:
    """Keep the MILP's plan if it fits and is no costlier than the baseline's, else the baseline's.

    Status words say what was proven: "optimal" / "feasible" (with the solver's gap, relative
    to the whole step's compute) when there is a plan. Without one, "infeasible" only when
    the solver proved its model infeasible and the model is ``exact`` (one node per op:
    Checkmate's memory accounting is then that of the real graph); else "unknown" (time ran
    out, or a model over grouped ops, whose memory is over-approximated, is infeasible)."""
    use_plan = plan is not None and plan.feasible and (warm is None or plan.compute_cost <= warm.compute_cost)
    if use_plan:
        chosen = plan
        chosen.details["from"] = "checkmate"
    elif warm is not None:
        chosen = _copy_as(warm, "optimal" if status == "optimal" else "feasible")
    else:
        proven = status == "infeasible" and exact
        if proven:
            why = "proven: the model has one node per op, so no plan that keeps program order fits"
        elif status == "infeasible":
            why = "its model over grouped ops is infeasible, which is no proof for the real graph"
        else:
            why = f"the solver stopped with {status}"
        chosen = RematSchedule(
            "checkmate",
            problem.budget_bytes,
            [],
            0,
            0.0,
            problem.plain_cost,
            "infeasible" if proven else "unknown",
            message=f"checkmate: no plan within {problem.budget_bytes} B ({why})",
        )
    chosen.seconds = time.perf_counter() - start
    chosen.gap = gap if chosen.steps else None
    chosen.details["solver_status"] = status
    chosen.details["solver"] = solver
    return chosen  # type: ignore[return-value]


def _copy_as(plan: RematSchedule, status: str) -> RematSchedule:
    return RematSchedule(
        "checkmate",
        plan.budget_bytes,
        plan.steps,
        plan.peak_bytes,
        plan.compute_cost,
        plan.plain_cost,
        status,
        details={"from": plan.strategy, "rows": plan.details.get("rows")},
    )
