"""Placement benchmark: static offsets in one arena vs the lower bound.

(1) Every zoo graph (train, SGD), batch 1 and 32, in program order and in memplan's
    optimised order: arena vs lower bound (estimator's peak minus persistent bytes),
    fragmentation (OLLA 5.4), and seconds, for ``place`` and for greedy by size alone.
(2) Adversarial perfect-packing instances of 150-500 buffers: greedy by size vs the
    heuristic portfolio vs CP-SAT asked to fit the lower bound exactly (capacity = bound).

Regenerate: python bench/placement.py --out bench/results/placement.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from memplan.placement import (
    PlacementProblem,
    fragmentation,
    greedy_by_size,
    lower_bound_bytes,
    place,
    portfolio,
    problem_from_graph,
    validate_placement,
)
from memplan.placement.generate import adversarial_instance


@dataclass
class ZooRow:
    model: str
    batch: int
    order: str
    buffers: int
    arena_bytes: int
    bound_bytes: int
    greedy_bytes: int
    status: str
    method: str
    seconds: float


@dataclass
class HardRow:
    buffers: int
    seed: int
    bound_bytes: int
    greedy_bytes: int
    portfolio_bytes: int
    exact_bytes: int
    status: str
    seconds: float


def zoo_rows(batches: list[int], time_limit_seconds: float, order_seconds: float, models: list[str]) -> list[ZooRow]:
    from memplan.schedule import optimize_order
    from memplan.torch.zoo import capture_graph, list_models

    rows = []
    for name in models or list_models():
        for batch in batches:
            graph = capture_graph(name, batch, mode="train", optimizer="sgd")
            orders = {"program": graph.program_order()}
            orders["optimised"] = list(optimize_order(graph, order_seconds, method="heuristic", workers=2).order)
            for label, order in orders.items():
                rows.append(zoo_row(name, batch, label, problem_from_graph(graph, order), time_limit_seconds))
                print(_zoo_line(rows[-1]), flush=True)
    return rows


def zoo_row(name: str, batch: int, label: str, problem: PlacementProblem, time_limit_seconds: float) -> ZooRow:
    placement = place(problem, time_limit_seconds=time_limit_seconds, workers=2)
    validate_placement(problem, placement)
    greedy = greedy_by_size(problem)
    return ZooRow(
        name,
        batch,
        label,
        problem.num_buffers,
        placement.arena_bytes,
        lower_bound_bytes(problem),
        greedy.arena_bytes,
        placement.status,
        placement.method,
        placement.seconds,
    )


def hard_rows(sizes: list[int], seeds: int, time_limit_seconds: float) -> list[HardRow]:
    rows = []
    for n in sizes:
        for seed in range(seeds):
            inst = adversarial_instance(seed, n)
            bound = lower_bound_bytes(inst.problem)
            capped = replace(inst.problem, capacity_bytes=bound)
            t0 = time.perf_counter()
            exact = place(capped, time_limit_seconds=time_limit_seconds, method="exact", workers=2)
            seconds = time.perf_counter() - t0
            if exact.fits:
                validate_placement(capped, exact)
            row = HardRow(
                n,
                seed,
                bound,
                greedy_by_size(inst.problem).arena_bytes,
                portfolio(inst.problem).arena_bytes,
                exact.arena_bytes,
                exact.status,
                seconds,
            )
            rows.append(row)
            print(_hard_line(row), flush=True)
    return rows


def _excess(arena: int, bound: int) -> str:
    return f"{100 * (arena / bound - 1):.1f}%"


def _zoo_line(r: ZooRow) -> str:
    return (
        f"| {r.model} | {r.batch} | {r.order} | {r.buffers} | {r.arena_bytes} | {r.bound_bytes} | "
        f"{r.arena_bytes - r.bound_bytes} | {100 * fragmentation(r.arena_bytes, r.bound_bytes):.4f}% | "
        f"{100 * fragmentation(r.greedy_bytes, r.bound_bytes):.2f}% | {r.status} | {r.method} | {r.seconds:.3f} |"
    )


def _hard_line(r: HardRow) -> str:
    return (
        f"| {r.buffers} | {r.seed} | {r.bound_bytes} | {_excess(r.greedy_bytes, r.bound_bytes)} | "
        f"{_excess(r.portfolio_bytes, r.bound_bytes)} | {_excess(r.exact_bytes, r.bound_bytes)} | {r.status} | "
        f"{r.seconds:.1f} |"
    )


def render(zoo: list[ZooRow], hard: list[HardRow], args: argparse.Namespace, command: str) -> str:
    lines = ["# Placement: static offsets in one arena", "", f"Regenerate: `{command}`", ""]
    if zoo:
        at_bound = sum(r.arena_bytes == r.bound_bytes for r in zoo)
        lines += [
            "## (1) Zoo graphs (train, SGD): arena vs lower bound",
            "",
            "Lower bound = estimator's peak minus persistent bytes (params, optimizer state, batch), which live",
            "outside the arena. Fragmentation = (arena - bound) / arena (OLLA 5.4). `greedy` is greedy by size",
            "alone. Optimised order: memplan.schedule.optimize_order(method='heuristic').",
            f"Placement time limit {args.time_limit} s.",
            "",
            "| model | batch | order | buffers | arena (B) | lower bound (B) | excess (B) | fragmentation "
            "| greedy frag. | status | method | seconds |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
            *[_zoo_line(r) for r in zoo],
            "",
            f"Arena == lower bound on {at_bound}/{len(zoo)} graphs; median placement time "
            f"{statistics.median(r.seconds for r in zoo):.3f} s, max {max(r.seconds for r in zoo):.3f} s.",
            "",
        ]
    if hard:
        closed = sum(r.exact_bytes == r.bound_bytes for r in hard)
        lines += [
            "## (2) Adversarial instances (guillotine-cut perfect packings: optimum = lower bound)",
            "",
            "Excess = arena / lower bound - 1. `exact` = place(method='exact') with capacity = lower bound,",
            f"{args.hard_time_limit} s limit, 2 CP-SAT workers; status 'unknown' means nothing within the",
            "capacity was found in time (its arena column is then the best placement found, over capacity).",
            "",
            "| buffers | seed | lower bound (B) | greedy by size | portfolio | exact | status | seconds |",
            "|---|---|---|---|---|---|---|---|",
            *[_hard_line(r) for r in hard],
            "",
            f"Exact closed the gap on {closed}/{len(hard)} instances.",
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/placement.md"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--models", nargs="*", default=[])
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--order-time-limit", type=float, default=30.0)
    parser.add_argument("--hard-sizes", type=int, nargs="*", default=[150, 300, 500])
    parser.add_argument("--hard-seeds", type=int, default=3)
    parser.add_argument("--hard-time-limit", type=float, default=60.0)
    parser.add_argument("--skip-zoo", action="store_true")
    args = parser.parse_args()
    command = "python bench/placement.py " + " ".join(sys.argv[1:])
    zoo = [] if args.skip_zoo else zoo_rows(args.batches, args.time_limit, args.order_time_limit, args.models)
    hard = hard_rows(args.hard_sizes, args.hard_seeds, args.hard_time_limit)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(zoo, hard, args, command))
    print(f"wrote {args.out}; regenerate with: {command}")


if __name__ == "__main__":
    main()
