"""The one place that talks to OR-Tools CP-SAT: time limit, status, bound, gap, progress.

Every exact solver in memplan builds a ``cp_model.CpModel`` and calls :func:`solve_cp_sat`,
so status and gap are reported the same way everywhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ortools.sat.python import cp_model


@dataclass(frozen=True)
class SolveStatus:
    """Outcome of one solve. ``gap`` is ``(objective - bound) / objective`` (0 when optimal)."""

    status: str  # "optimal" | "feasible" | "infeasible" | "unknown"
    objective: float | None
    bound: float | None
    gap: float | None
    seconds: float


_STATUS = {
    cp_model.OPTIMAL: "optimal",
    cp_model.FEASIBLE: "feasible",
    cp_model.INFEASIBLE: "infeasible",
    cp_model.MODEL_INVALID: "invalid",
    cp_model.UNKNOWN: "unknown",
}


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
    progress: _Progress,
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
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, float(time_limit_seconds))
    solver.parameters.num_workers = workers
    solver.parameters.random_seed = seed
    for name, value in (parameters or {}).items():
        setattr(solver.parameters, name, value)
    stop = _STOP.get()
    if stop is not None and stop.is_set():
        return solver, SolveStatus("unknown", None, None, None, 0.0)
    callback = _Progress(progress)
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
    status = _STATUS.get(code, "unknown")
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
