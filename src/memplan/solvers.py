"""The one place that talks to OR-Tools' solvers: time limit, status, bound, gap, progress.

Every exact solver in memplan builds a ``cp_model.CpModel`` and calls :func:`solve_cp_sat`,
so status and gap are reported the same way everywhere. A covering model whose bound is
what matters (the remat stage cuts) may instead be solved as a MILP by :func:`solve_as_mip`:
OR-Tools' bundled SCIP, an LP-based branch and bound with cutting planes, in the process.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ortools.sat.python import cp_model


@dataclass(frozen=True)
class SolveStatus:
    """Outcome of one solve. ``gap`` is ``(objective - bound) / objective`` (0 when optimal)."""

    status: str  # "optimal" | "feasible" | "infeasible" | "unknown"
    objective: float | None
    bound: float | None
    gap: float | None
    seconds: float


INT_MIN, INT_MAX = -(2**63), 2**63 - 1
"""CP-SAT's ``cp_model.INT_MIN``/``INT_MAX``: a domain end at either is unbounded."""


@functools.cache
def _status_names() -> dict[int, str]:
    # OR-Tools (with pandas, about 0.25 s and 57 MiB) is imported on a solver's first call, not
    # with this module: the order and placement heuristics that import this one often settle a
    # plan without it (issue 37: the solver child of a first step)
    from ortools.sat.python import cp_model

    return {
        cp_model.OPTIMAL: "optimal",
        cp_model.FEASIBLE: "feasible",
        cp_model.INFEASIBLE: "infeasible",
        cp_model.MODEL_INVALID: "invalid",
        cp_model.UNKNOWN: "unknown",
    }


@functools.cache
def _progress_class() -> type:
    from ortools.sat.python import cp_model

    class _Progress(cp_model.CpSolverSolutionCallback):
        """Reports each improving solution and remembers when the last one came."""

        def __init__(self, report: Callable[[float, float], None] | None) -> None:
            super().__init__()
            self._report = report
            self.last_improvement = time.perf_counter()
            self.solutions = 0

        def on_solution_callback(self) -> None:
            self.last_improvement = time.perf_counter()
            self.solutions += 1
            if self._report is not None:
                self._report(self.ObjectiveValue(), self.BestObjectiveBound())

    return _Progress


class Found:
    """When a solver's improving solutions came, in seconds from ``start`` (its ``solution``
    is a ``progress`` callback of :func:`solve_cp_sat`): a solve's time to its plan, which
    may come long before the solve ends."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.last: float | None = None

    def now(self) -> float:
        return time.perf_counter() - self.start

    def solution(self, _objective: float, _bound: float) -> None:
        self.last = self.now()

    def at(self) -> float:
        """The last improving solution's time; now when none was reported (the safe side)."""
        return self.last if self.last is not None else self.now()

    def mark(self, plan: Any, seconds: float) -> Any:
        """``plan.details["found_at"]``: ``seconds`` (None for a plan without steps)."""
        plan.details["found_at"] = round(seconds, 3) if plan.steps else None
        return plan


_STOP: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("memplan_solver_stop", default=None)


@contextlib.contextmanager
def stopping(event: threading.Event) -> Iterator[None]:
    """Within this block (in this thread), every solve stops as soon as ``event`` is set, and
    one started after it is set returns "unknown" at once: how a portfolio running another
    solver alongside calls off the CP-SAT stages once that solver has the answer."""
    token = _STOP.set(event)
    try:
        yield
    finally:
        _STOP.reset(token)


def _watchdog(
    solver: cp_model.CpSolver,
    progress: Any,
    stall_seconds: float | None,
    stop: threading.Event | None,
    first_only: bool = False,
) -> threading.Event:
    """Stops the search once no better solution has come for ``stall_seconds`` (a stalled
    search returns its best solution, status feasible with its gap, instead of burning the
    whole time limit) or once ``stop`` is set. ``first_only``: the stall rule applies only while
    no solution has come yet (a search that finds no first solution in time gives up, one that
    found some runs on)."""
    done = threading.Event()
    poll = 0.05 if stall_seconds is None else min(0.05, stall_seconds / 4)

    def watch() -> None:
        while not done.wait(poll):
            limit = None if first_only and progress.solutions else stall_seconds
            stalled = limit is not None and time.perf_counter() - progress.last_improvement > limit
            if stalled or (stop is not None and stop.is_set()):
                solver.StopSearch()
                return

    threading.Thread(target=watch, daemon=True).start()
    return done


def solve_cp_sat(
    model: cp_model.CpModel,
    time_limit_seconds: float,
    *,
    workers: int = 2,
    progress: Callable[[float, float], None] | None = None,
    seed: int = 0,
    stall_seconds: float | None = None,
    parameters: dict[str, Any] | None = None,
    first_solution_seconds: float | None = None,
) -> tuple[cp_model.CpSolver, SolveStatus]:
    """Solve ``model`` within ``time_limit_seconds``; return the solver (to read values) and
    the status. ``progress(objective, bound)`` is called on each improving solution; with
    ``stall_seconds`` the search stops once no better solution came for that long (and at
    once when the :func:`stopping` event of the calling context is set);
    ``parameters`` sets further CP-SAT parameters by name (e.g. ``hint_conflict_limit``);
    with ``first_solution_seconds`` the search stops if it has found no solution by then."""
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, float(time_limit_seconds))
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    for name, value in (parameters or {}).items():
        setattr(solver.parameters, name, value)
    stop = _STOP.get()
    if stop is not None and stop.is_set():
        return solver, SolveStatus("unknown", None, None, None, 0.0)
    callback = _progress_class()(progress)
    first_only = bool(first_solution_seconds) and not stall_seconds
    stall = first_solution_seconds if first_only else (stall_seconds or None)
    watchdog = _watchdog(solver, callback, stall, stop, first_only) if stall or stop is not None else None
    start = time.perf_counter()
    try:
        code = solver.Solve(model, callback)
    finally:
        if watchdog is not None:
            watchdog.set()
    seconds = time.perf_counter() - start
    status = _status_names().get(code, "unknown")
    objective = bound = gap = None
    if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        objective = solver.ObjectiveValue()
        bound = solver.BestObjectiveBound()
        gap = _gap(objective, bound)
        if code == cp_model.OPTIMAL and gap > 1e-9 and model.has_objective():
            status = "feasible"  # stopped at a gap limit: CP-SAT says OPTIMAL, nothing proved that
    return solver, SolveStatus(status, objective, bound, gap, seconds)


def _gap(objective: float, bound: float) -> float:
    if objective == 0:
        return 0.0
    return max(0.0, (objective - bound) / abs(objective))


def min_cut_value(num_nodes: int, tails: Any, heads: Any, capacities: Any, source: int = 0, sink: int = 1) -> int:
    """The capacity of a minimum ``source``-``sink`` cut (= the maximum flow) of the network of
    arcs ``tails[i] -> heads[i]`` with ``capacities[i]`` (integer arrays), by OR-Tools' max flow."""
    from ortools.graph.python import max_flow

    flow = max_flow.SimpleMaxFlow()
    flow.add_arcs_with_capacity(tails, heads, capacities)
    if num_nodes > 0 and flow.solve(source, sink) != flow.OPTIMAL:
        raise RuntimeError("max flow did not solve (capacities overflow?)")
    return int(flow.optimal_flow())


MIP_BACKEND = "SCIP"
"""OR-Tools' bundled MILP solver used by :func:`solve_as_mip` (Apache 2.0, no licence needed)."""
LP_BACKENDS = ("HIGHS", "GLOP")
"""OR-Tools' bundled LP solvers for ``solve_as_mip(relax=True)``, the first one available:
HiGHS's simplex solves the stage cuts' LP of MobileNet-v2 in 0.3 s, GLOP's in 2.2 s."""
BOUND_MARGIN = 1e-7
"""A MILP or LP solver's bound is a floating-point number within its tolerances: it is
lowered by this fraction, so a bound it reports never exceeds what exact arithmetic proves."""


def solve_as_mip(
    model: cp_model.CpModel, time_limit_seconds: float, *, backend: str = MIP_BACKEND, relax: bool = False
) -> tuple[SolveStatus, list[float] | None]:
    """Solve a CP-SAT ``model`` of 0/1 and bounded integer variables, linear constraints (not
    enforced), ``bool_or`` and enforced ``bool_and`` (implications) and a linear objective to
    minimise, as a MILP with ``backend`` (OR-Tools' ``pywraplp``), or with ``relax`` its LP
    relaxation (every variable continuous within its bounds) with :data:`LP_BACKENDS`.

    On covering models CP-SAT's bound moves only as its search proves things, while an LP
    relaxation, and a branch and bound with cutting planes over it, bound them at once (the
    stage cuts of :mod:`memplan.remat.moccasin` on a random 250-node DAG at 0.8 of its peak:
    8.7% of compute from the LP in 0.6 s, where CP-SAT's bound stays at 0 for 5 s). The bound
    is lowered by :data:`BOUND_MARGIN`; the status is never "infeasible" (floating point
    proves nothing exactly): a model the backend finds infeasible, or one it cannot take, is
    "unknown". Returns the status (objective and bound in the model's units, offset included;
    with ``relax``, both the LP's optimum) and the values of the best solution."""
    from ortools.linear_solver import pywraplp

    stop = _STOP.get()
    names = LP_BACKENDS if relax else (backend,)
    solver = next((s for s in map(pywraplp.Solver.CreateSolver, names) if s is not None), None)
    if solver is None or (stop is not None and stop.is_set()):
        return SolveStatus("unknown", None, None, None, 0.0), None
    start = time.perf_counter()
    xs = _mip_variables(solver, model.proto, relax)
    if not all(_add_mip_constraint(solver, constraint, xs) for constraint in model.proto.constraints):
        return SolveStatus("unknown", None, None, None, time.perf_counter() - start), None
    objective = model.proto.objective
    goal = solver.Objective()
    offset = float(objective.offset)
    for ref, a in zip(objective.vars, objective.coeffs, strict=True):
        coefficient, constant = _literal_terms(ref, a)
        goal.SetCoefficient(xs[_var(ref)], goal.GetCoefficient(xs[_var(ref)]) + coefficient)
        offset += constant
    goal.SetMinimization()
    solver.SetTimeLimit(max(1, int(1000 * (time_limit_seconds - (time.perf_counter() - start)))))
    solver.SuppressOutput()
    with _quiet_stdout():  # HiGHS prints its banner whatever the output settings
        code = solver.Solve()
    seconds = time.perf_counter() - start
    if code not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return SolveStatus("unknown", None, None, None, seconds), None
    value = goal.Value() + offset
    bound = value if relax else goal.BestBound() + offset
    bound -= BOUND_MARGIN * max(1.0, abs(bound))
    status = "optimal" if code == pywraplp.Solver.OPTIMAL else "feasible"
    return SolveStatus(status, value, min(value, bound), _gap(value, min(value, bound)), seconds), [
        x.solution_value() for x in xs
    ]


def _var(ref: int) -> int:
    return ref if ref >= 0 else -ref - 1


def _literal_terms(ref: int, coefficient: int) -> tuple[float, float]:
    """``coefficient * literal(ref)`` as (coefficient on the variable, constant): a negative
    ref is ``1 - x``."""
    return (float(coefficient), 0.0) if ref >= 0 else (-float(coefficient), float(coefficient))


def _mip_variables(solver: Any, proto: Any, relax: bool) -> list[Any]:
    domains = [list(v.domain) for v in proto.variables]  # (the proto's fields take no negative index)
    make = solver.NumVar if relax else solver.IntVar
    return [make(float(d[0]), float(d[-1]), f"x{i}") for i, d in enumerate(domains)]


def _add_mip_constraint(solver: Any, constraint: Any, xs: list[Any]) -> bool:
    """Post one CP-SAT constraint as linear rows; False for a kind :func:`solve_as_mip` does not
    take, or a constant row that fails (an empty clause)."""
    enforcement = list(constraint.enforcement_literal)
    if constraint.has_linear() and not enforcement:
        domain = list(constraint.linear.domain)
        if len(domain) != 2:
            return False
        low = domain[0] if domain[0] > INT_MIN else -solver.infinity()
        high = domain[1] if domain[1] < INT_MAX else solver.infinity()
        return _row(solver, xs, list(zip(constraint.linear.vars, constraint.linear.coeffs, strict=True)), low, high)
    # "unmet" enforcement: sum(1 - e), 0 exactly when every enforcement literal holds
    unmet = [(-ref - 1, 1) for ref in enforcement]
    if constraint.has_bool_or():
        return _row(solver, xs, [(ref, 1) for ref in constraint.bool_or.literals] + unmet, 1, solver.infinity())
    if constraint.has_bool_and():
        rows = ([(ref, 1), *unmet] for ref in constraint.bool_and.literals)
        return all(_row(solver, xs, terms, 1, solver.infinity()) for terms in rows)
    return False


def _row(solver: Any, xs: list[Any], terms: list[tuple[int, int]], low: float, high: float) -> bool:
    """``low <= sum a * literal(ref) <= high`` over ``terms`` (ref, a), by coefficients."""
    coefficients: dict[int, float] = {}
    constant = 0.0
    for ref, a in terms:
        on_var, shift = _literal_terms(ref, a)
        coefficients[_var(ref)] = coefficients.get(_var(ref), 0.0) + on_var
        constant += shift
    if not any(coefficients.values()):
        return low <= constant <= high
    row = solver.Constraint(low - constant, high - constant)
    for var, a in coefficients.items():
        if a:
            row.SetCoefficient(xs[var], a)
    return True


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """File descriptor 1 sent to /dev/null (what a C++ library prints bypasses ``sys.stdout``)."""
    import os
    import sys

    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
