"""Rematerialisation under a memory budget: Checkmate's MILP, Moccasin's CP model, the baselines.

:func:`solve_remat` is the one call for a plan: a portfolio of the baselines, Moccasin's CP
model (Bartan et al. 2023) on the whole graph and Checkmate's MILP, with one status and gap
(see :mod:`memplan.remat.portfolio`).

The MILP is solved with OR-Tools CP-SAT, or with HiGHS (``solver="highs"``, optional:
``pip install highspy``; it runs in a child process, see :mod:`memplan.remat.highs`).

``rematerialize(graph, budget_bytes, strategy)`` returns a :class:`RematSchedule` whose
``steps`` the runtime executes: ``("run", op_id)`` runs an op (first run or recompute) and
``("free", tensor_id)`` releases the current instance of a tensor; reads use the latest
instance. Its ``peak_bytes`` is measured by :func:`sequence_peak_bytes`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memplan.errors import MemplanError
from memplan.graph.ir import Graph
from memplan.remat.baselines import BASELINES, require_feasible
from memplan.remat.lower import InvalidPlan, lower, sequence_peak_bytes, steps_for_order, validate_sequence
from memplan.remat.problem import RematProblem, RematSchedule, Step, memory_floor

if TYPE_CHECKING:
    from memplan.remat.milp import SOLVERS
    from memplan.remat.portfolio import solve_remat, solve_remat_within_overhead

# The solvers' modules import OR-Tools (and pandas through CP-SAT's helpers: about 57 MiB and a
# second); the runtime imports this package for its plans' types only, so they load on first use
_LAZY = {
    "SOLVERS": "memplan.remat.milp",
    "check_solver": "memplan.remat.milp",
    "solve_checkmate": "memplan.remat.milp",
    "moccasin_strategy": "memplan.remat.portfolio",
    "portfolio_strategy": "memplan.remat.portfolio",
    "solve_remat": "memplan.remat.portfolio",
    "solve_remat_within_overhead": "memplan.remat.portfolio",
}
SOLVER_STRATEGIES = ("portfolio", "checkmate", "moccasin")
"""The strategies that solve (and take the time limit); the rest are the baselines."""


def _strategies() -> dict[str, Callable[[RematProblem], RematSchedule]]:
    from memplan.remat.milp import solve_checkmate
    from memplan.remat.portfolio import moccasin_strategy, portfolio_strategy

    return {"portfolio": portfolio_strategy, "checkmate": solve_checkmate, "moccasin": moccasin_strategy, **BASELINES}


def __getattr__(name: str) -> Any:
    if name == "STRATEGIES":
        value: Any = _strategies()
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def rematerialize(
    graph: Graph,
    budget_bytes: int,
    strategy: str = "checkmate",
    time_limit_seconds: float = 60.0,
    *,
    workers: int = 2,
    max_solver_nodes: int = 200,
    strict: bool = True,
    cost: tuple[float, ...] = (),
    workspace: tuple[int, ...] = (),
    solver: str = "cp-sat",
) -> RematSchedule:
    """Plan ``graph`` within ``budget_bytes`` with ``strategy`` (a key of :data:`STRATEGIES`).

    With ``strict`` a plan that does not fit raises :class:`memplan.errors.InfeasibleBudget`.
    ``cost`` (per op, default FLOPs) and ``workspace`` (per-op scratch bytes, default none):
    see :class:`RematProblem`. ``solver``: the MILP's backend for "checkmate", one of
    :data:`SOLVERS` ("cp-sat", or "highs" if highspy is installed).
    """
    from memplan.remat.milp import check_solver, solve_checkmate

    strategies = _strategies()
    check_solver(solver)
    if strategy not in strategies:
        raise MemplanError(f"unknown remat strategy {strategy!r}; choose one of {', '.join(strategies)}")
    problem = RematProblem(
        graph,
        int(budget_bytes),
        cost,
        time_limit_seconds=time_limit_seconds,
        workers=workers,
        max_solver_nodes=max_solver_nodes,
        workspace=workspace,
    )
    schedule = solve_checkmate(problem, solver=solver) if strategy == "checkmate" else strategies[strategy](problem)
    return require_feasible(schedule) if strict else schedule


__all__ = [
    "SOLVERS",
    "SOLVER_STRATEGIES",
    "STRATEGIES",
    "InvalidPlan",
    "RematProblem",
    "RematSchedule",
    "Step",
    "lower",
    "memory_floor",
    "rematerialize",
    "sequence_peak_bytes",
    "solve_remat",
    "solve_remat_within_overhead",
    "steps_for_order",
    "validate_sequence",
]
