"""Budget sweeps (Checkmate Figure 4); the largest batch within a budget (Figure 6) is in
:mod:`memplan.remat.maxbatch`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from memplan.graph.ir import Graph
from memplan.remat.baselines import BASELINES, checkpoint_all
from memplan.remat.milp import solve_checkmate
from memplan.remat.portfolio import GAP_LIMIT, solve_remat
from memplan.remat.problem import RematProblem, RematSchedule


def solve_all(
    problem: RematProblem,
    strategies: Sequence[str],
    progress: Callable[[str], None] | None = None,
    reorder: bool = False,
    gap_limit: float | None = None,
) -> dict[str, RematSchedule]:
    """Run ``strategies`` on one problem: every baseline once, then the solvers. Checkmate's
    MILP is warm-started from the best baseline; the portfolio and Moccasin run their own
    (:func:`memplan.remat.portfolio.solve_remat`, ``reorder`` passed on), with ``progress``
    told what runs. ``gap_limit``: every solver's stopping gap (None: the MILP exact, the
    others :data:`memplan.remat.portfolio.GAP_LIMIT`)."""
    plans = {name: solve(problem) for name, solve in BASELINES.items()}
    if "checkmate" in strategies:
        if progress:
            progress(f"checkmate MILP ({problem.time_limit_seconds:g} s)")
        fits = [p for p in plans.values() if p.feasible]
        warm = min(fits, key=lambda p: (p.compute_cost, p.peak_bytes)) if fits else None
        plans["checkmate"] = solve_checkmate(problem, warm, gap_limit=gap_limit or 0.0)
    for name, formulations in (("moccasin", ("moccasin",)), ("portfolio", ("moccasin", "checkmate"))):
        if name in strategies:
            plan = solve_remat(
                problem.graph,
                problem.budget_bytes,
                problem.time_limit_seconds,
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
