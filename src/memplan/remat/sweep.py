"""Budget sweeps (Checkmate Figure 4) and the largest batch within a budget (Figure 6)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from memplan.graph.ir import Graph
from memplan.remat.baselines import BASELINES, checkpoint_all
from memplan.remat.coarsen import _loss_op
from memplan.remat.milp import solve_checkmate
from memplan.remat.problem import RematProblem, RematSchedule


def solve_all(problem: RematProblem, strategies: Sequence[str]) -> dict[str, RematSchedule]:
    """Run ``strategies`` on one problem; Checkmate is warm-started from the best baseline."""
    plans = {name: solve(problem) for name, solve in BASELINES.items()}
    if "checkmate" in strategies:
        fits = [p for p in plans.values() if p.feasible]
        warm = min(fits, key=lambda p: (p.compute_cost, p.peak_bytes)) if fits else None
        plans["checkmate"] = solve_checkmate(problem, warm)
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
) -> list[dict[str, Any]]:
    """Budgets from the smallest feasible to the checkpoint-all peak; per budget, each
    strategy's summary (feasible, peak, overhead, seconds, status, gap)."""
    base = RematProblem(graph, 0, time_limit_seconds=time_limit_seconds, workers=workers)
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
            style = "-o" if name == "checkmate" else "--."
            ax.plot(xs, [1 + y for y in ys], style, label=name, linewidth=2 if name == "checkmate" else 1)
    ax.set_xlabel("budget (MiB)")
    ax.set_ylabel("compute cost / plain step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def forward_fraction(graph: Graph) -> float:
    """Cost of the forward pass (up to the loss) over the cost of the whole step."""
    loss = _loss_op(graph)
    total = sum(op.flops for op in graph.ops)
    if loss is None or total == 0:
        return 1.0
    return sum(op.flops for op in graph.ops[: loss + 1]) / total


def max_batch(
    make_graph: Callable[[int], Graph],
    budget_bytes: int,
    strategy: Callable[[RematProblem], RematSchedule] = solve_checkmate,
    *,
    start: int = 1,
    limit: int = 4096,
    time_limit_seconds: float = 60.0,
) -> tuple[int, RematSchedule | None]:
    """The largest batch whose step fits ``budget_bytes`` with at most one extra forward
    pass of overhead (Checkmate Figure 6): doubling, then bisection on the batch size."""

    def fits(batch: int) -> RematSchedule | None:
        graph = make_graph(batch)
        plan = strategy(RematProblem(graph, budget_bytes, time_limit_seconds=time_limit_seconds))
        return plan if plan.feasible and plan.overhead <= forward_fraction(graph) + 1e-9 else None

    best: tuple[int, RematSchedule | None] = (0, None)
    batch = start
    while batch <= limit and (plan := fits(batch)) is not None:
        best = (batch, plan)
        batch *= 2
    low, high = best[0], min(batch, limit + 1)
    while high - low > 1:
        mid = (low + high) // 2
        plan = fits(mid)
        if plan is not None:
            low, best = mid, (mid, plan)
        else:
            high = mid
    return best
