"""Budget sweeps (Checkmate Figure 4); the largest batch within a budget (Figure 6) is in
:mod:`memplan.remat.maxbatch`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from memplan.graph.ir import Graph
from memplan.remat.baselines import BASELINES, checkpoint_all, run_baselines
from memplan.remat.deadline import deadline_for, ticking
from memplan.remat.milp import solve_checkmate
from memplan.remat.portfolio import GAP_LIMIT, solve_remat
from memplan.remat.problem import RematProblem, RematSchedule

SAFETY_SHARE = 0.05
"""Each strategy of :func:`solve_all` is given this share less than the time limit: lowering,
validating and reporting its plan (and, in ``memplan remat``, starting) fit in the rest."""
BASELINE_SHARE = 0.25
"""The baselines get this share of the time when Checkmate's MILP follows them (its warm start)."""
MILP_MARGIN_SHARE = 0.05
"""Checkmate's MILP ends this share of the time limit earlier still: CP-SAT's presolve of a large
model runs past its limit (the 200-node MILP of a 1000-node DAG, 225k variables: 9.6 s for 6 s,
on a loaded 2-core machine)."""


def solve_all(
    problem: RematProblem,
    strategies: Sequence[str],
    progress: Callable[[str], None] | None = None,
    reorder: bool = False,
    gap_limit: float | None = None,
    solver: str = "cp-sat",
) -> dict[str, RematSchedule]:
    """Run ``strategies`` on one problem, each within the problem's time limit (less
    :data:`SAFETY_SHARE`), and within the caller's :func:`memplan.remat.deadline.within`.

    The baselines asked for (all of them when Checkmate's MILP is, its warm start) run first,
    in :data:`BASELINE_SHARE` of the time when the MILP follows, else in all of it (one that
    does not finish in its share is cut and says so, see
    :func:`memplan.remat.baselines.run_baselines`); then the MILP with ``solver``, warm-started
    from the best baseline, in the rest; the portfolio and Moccasin run their own
    (:func:`memplan.remat.portfolio.solve_remat`, ``reorder`` passed on), each in its own time.
    ``progress`` is told what runs, and every few seconds how it stands. ``gap_limit``: every
    solver's stopping gap (None: the MILP exact, the others
    :data:`memplan.remat.portfolio.GAP_LIMIT`)."""
    limit = problem.time_limit_seconds * (1 - SAFETY_SHARE)
    say = progress or (lambda text: None)
    plans: dict[str, RematSchedule] = {}
    clock = deadline_for(limit)  # the baselines', then the MILP's
    names = [n for n in BASELINES if n in strategies or "checkmate" in strategies]
    if names:
        phase = limit * (BASELINE_SHARE if "checkmate" in strategies else 1.0)
        say(f"baselines ({phase:.0f} s)")
        with ticking(progress, "baselines", lambda: (_cheapest(plans), None, problem.plain_cost)):
            run_baselines(problem, names, phase, plans)
    if "checkmate" in strategies:
        warm = min(
            (p for p in plans.values() if p.feasible), key=lambda p: (p.compute_cost, p.peak_bytes), default=None
        )
        seconds = max(0.1, clock.left() - MILP_MARGIN_SHARE * problem.time_limit_seconds)
        say(f"checkmate MILP ({seconds:.0f} s)")
        heard: dict[str, float | None] = {"cost": warm.compute_cost if warm else None, "bound": None}

        def on_solution(cost: float, bound: float) -> None:
            heard.update(cost=cost, bound=bound)

        with ticking(progress, "checkmate MILP", lambda: (heard["cost"], heard["bound"], problem.plain_cost)):
            plans["checkmate"] = solve_checkmate(
                problem.with_time_limit(seconds), warm, solver, gap_limit or 0.0, on_solution
            )
    for name, formulations in (("moccasin", ("moccasin",)), ("portfolio", ("moccasin", "checkmate"))):
        if name in strategies:
            plan = solve_remat(
                problem.graph,
                problem.budget_bytes,
                limit,
                cost=problem.cost,
                workspace=problem.workspace,
                workers=problem.workers,
                formulations=formulations,
                reorder=reorder,
                gap_limit=GAP_LIMIT if gap_limit is None else gap_limit,
                progress=(lambda text, name=name: progress(f"{name}: {text}")) if progress else None,
            )
            plan.strategy = name
            plans[name] = plan
    return {name: plans[name] for name in strategies}


def _cheapest(plans: dict[str, RematSchedule]) -> float | None:
    return min((p.compute_cost for p in list(plans.values()) if p.feasible), default=None)


def smallest_budget(problem: RematProblem) -> int:
    """The lowest peak any baseline reaches (each returns its lowest-peak plan when over budget)."""
    low = problem.with_budget(0)
    peaks = [solve(low).peak_bytes for solve in BASELINES.values()]
    return min(p for p in peaks if p > 0)


def sweep(
    graph: Graph,
    strategies: Sequence[str],
    num_budgets: int = 6,
    *,
    time_limit_seconds: float = 60.0,
    workers: int = 2,
    progress: Callable[[int, dict[str, RematSchedule]], None] | None = None,
    cost: tuple[float, ...] = (),
    workspace: tuple[int, ...] = (),
) -> list[dict[str, Any]]:
    """Budgets from the smallest feasible to the checkpoint-all peak; per budget, each
    strategy's summary (feasible, peak, overhead, seconds, status, gap). ``cost`` and
    ``workspace``: as in :class:`RematProblem` (default: FLOPs, no workspace)."""
    base = RematProblem(graph, 0, cost, time_limit_seconds=time_limit_seconds, workers=workers, workspace=workspace)
    top = checkpoint_all(base.with_budget(10**18)).peak_bytes
    low = smallest_budget(base)
    steps = max(1, num_budgets - 1)
    budgets = sorted({int(low + (top - low) * i / steps) for i in range(steps + 1)})
    results = []
    for budget in budgets:
        plans = solve_all(base.with_budget(budget), strategies)
        if progress:
            progress(budget, plans)
        results.append({"budget_bytes": budget, "strategies": {n: p.summary() for n, p in plans.items()}})
    return results


def plot_sweep(results: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> None:
    """Overhead vs budget per strategy (Checkmate Figure 4 style), matplotlib Agg."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    names = sorted({n for r in results for n in r["strategies"]})
    for name in names:
        points = [
            (r["budget_bytes"] / 2**20, r["strategies"][name]["overhead"])
            for r in results
            if r["strategies"].get(name, {}).get("feasible")
        ]
        if points:
            xs, ys = zip(*points, strict=True)
            solver = name in ("checkmate", "moccasin", "portfolio")
            ax.plot(xs, [1 + y for y in ys], "-o" if solver else "--.", label=name, linewidth=2 if solver else 1)
    ax.set_xlabel("budget (MiB)")
    ax.set_ylabel("compute cost / plain step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
