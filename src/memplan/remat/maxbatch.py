"""The largest batch that fits a memory budget (Checkmate section 6.3, Figure 6).

Checkmate asks, per strategy, for the largest batch whose training step fits the budget
"with at most one extra forward pass" of compute: a plan counts at batch ``b`` if it is
within the budget and its overhead is at most the forward pass's share of the step's cost
(:attr:`memplan.remat.problem.RematProblem.forward_fraction`).

The search (:func:`largest_fitting`) doubles the batch until a probe fails, then bisects;
it assumes that what fits at ``b`` fits at every smaller batch (activations grow with the
batch). Probes share one cache per batch (:class:`Probes`): each problem is built (captured)
once and every baseline is solved once, and Checkmate is warm-started from the cheapest
baseline that fits, so its answer is never costlier. That makes Checkmate's largest batch
at least every baseline's, and its search starts from there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from memplan.remat.baselines import BASELINES
from memplan.remat.milp import solve_checkmate
from memplan.remat.portfolio import solve_remat
from memplan.remat.problem import RematProblem, RematSchedule

SOLVERS = ("checkmate", "moccasin", "portfolio")
"""Strategies whose search starts from the best baseline's batch (they are never worse)."""
ProblemAt = Callable[[int], RematProblem]
"""``batch -> RematProblem`` at the fixed budget (a capture of the step at that batch)."""


def within_overhead(problem: RematProblem, plan: RematSchedule) -> bool:
    """``plan`` fits the budget with at most one extra forward pass of overhead."""
    return plan.feasible and plan.overhead <= problem.forward_fraction + 1e-9


def largest_fitting(fits: Callable[[int], bool], start: int = 1, limit: int = 4096, known: int = 0) -> int:
    """The largest ``b`` in ``[1, limit]`` with ``fits(b)`` (0 if none), for a ``fits`` that is
    true up to some batch and false above: double from ``max(start, 2 * known)`` until a
    probe fails, then bisect. ``known``: a batch already known to fit (0: none).

    >>> largest_fitting(lambda b: b <= 37, start=4)
    37
    """
    low, high = known, limit + 1
    probe = max(start, 2 * known, 1)
    while probe < high:
        if not fits(probe):
            high = probe
            break
        low, probe = probe, probe * 2
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low


@dataclass
class Probes:
    """Per-batch cache: the problem, every baseline's plan, and Checkmate's plan."""

    problem_at: ProblemAt
    problems: dict[int, RematProblem] = field(default_factory=dict)
    plans: dict[tuple[str, int], RematSchedule] = field(default_factory=dict)

    def problem(self, batch: int) -> RematProblem:
        if batch not in self.problems:
            self.problems[batch] = self.problem_at(batch)
        return self.problems[batch]

    def plan(self, strategy: str, batch: int) -> RematSchedule:
        if (strategy, batch) not in self.plans:
            self.plans[strategy, batch] = self._solve(strategy, batch)
        return self.plans[strategy, batch]

    def _solve(self, strategy: str, batch: int) -> RematSchedule:
        problem = self.problem(batch)
        if strategy in BASELINES:
            return BASELINES[strategy](problem)
        if strategy in ("moccasin", "portfolio"):
            formulations = ("moccasin",) if strategy == "moccasin" else ("moccasin", "checkmate")
            plan = solve_remat(
                problem.graph,
                problem.budget_bytes,
                problem.time_limit_seconds,
                cost=problem.cost,
                workspace=problem.workspace,
                workers=problem.workers,
                formulations=formulations,
            )
            plan.strategy = strategy
            return plan
        if strategy != "checkmate":
            raise ValueError(f"unknown strategy {strategy!r}")
        fits = [p for p in (self.plan(name, batch) for name in BASELINES) if p.feasible]
        warm = min(fits, key=lambda p: (p.compute_cost, p.peak_bytes)) if fits else None
        return solve_checkmate(problem, warm)

    def fits(self, strategy: str, batch: int) -> bool:
        return within_overhead(self.problem(batch), self.plan(strategy, batch))


@dataclass
class MaxBatch:
    """One strategy's largest batch within the budget and overhead limit, and its plan there."""

    strategy: str
    batch: int
    plan: RematSchedule | None
    seconds: float
    applicable: bool = True

    def summary(self) -> dict[str, object]:
        """The per-strategy JSON of ``memplan remat --max-batch``."""
        return {
            "batch": self.batch,
            "applicable": self.applicable,
            "overhead": round(self.plan.overhead, 6) if self.plan else None,
            "peak_bytes": self.plan.peak_bytes if self.plan else None,
            "status": self.plan.status if self.plan else None,
            "seconds": round(self.seconds, 3),
        }


def max_batches(
    problem_at: ProblemAt, strategies: Sequence[str], *, start: int = 1, limit: int = 4096
) -> dict[str, MaxBatch]:
    """Each strategy's largest batch (Checkmate Figure 6), baselines first; Checkmate's search
    starts from the best baseline's batch. ``seconds``: the time of that strategy's search,
    captures and baseline solves it was the first to need included."""
    probes = Probes(problem_at)
    ordered = sorted(strategies, key=lambda n: n in SOLVERS)
    results: dict[str, MaxBatch] = {}
    for name in ordered:
        started = time.perf_counter()
        known = max((r.batch for r in results.values()), default=0) if name in SOLVERS else 0
        batch = largest_fitting(lambda b, n=name: probes.fits(n, b), start, limit, known)
        plan = probes.plan(name, batch) if batch else None
        applicable = batch > 0 or probes.plan(name, max(start, 1)).status != "not-applicable"
        results[name] = MaxBatch(name, batch, plan, time.perf_counter() - started, applicable)
    return {name: results[name] for name in strategies}


def max_batch(
    problem_at: ProblemAt, strategy: str = "checkmate", *, start: int = 1, limit: int = 4096
) -> tuple[int, RematSchedule | None]:
    """The largest batch whose step fits with at most one extra forward pass of overhead, and
    the plan at that batch (``(0, None)`` if even batch 1 does not)."""
    names = [strategy] if strategy != "checkmate" else [*BASELINES, "checkmate"]
    result = max_batches(problem_at, names, start=start, limit=limit)[strategy]
    return result.batch, result.plan
