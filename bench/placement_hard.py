"""Placement on hard instances: MiniMalloc's eleven challenging ones, and generated tight packings.

(1) google/minimalloc's "challenging" instances A..K (150-450 buffers, capacity 1048576 B,
    from production accelerator workloads), read at run time from
    ../shared/benchmarks/minimalloc-challenging/ (``--instances`` to point elsewhere; they are
    never copied into this repository). Per instance: the arena ``place`` finds with no
    capacity, whether it fits 1048576, time and status; then the same with capacity 1048576
    (MiniMalloc's own setting); and the solver as it was before the canonical search
    (``solve_exact(search=False)``) for comparison.
(2) Tight packings from ``memplan.placement.generate.tight_instance`` (capacity = lower bound
    = optimum, known by construction): greedy by size, the heuristic portfolio, the solver
    before the canonical search, and ``place`` now.
(3) Perfect packings from ``memplan.placement.generate.perfect_instance`` (issue 13: the load
    equals the capacity at every time, similar fine-grained sizes, long-lived buffers on short
    ones): ``place`` with no capacity and with capacity = optimum, per family of generator
    settings (``--perfect-families``, names from ``PERFECT``).

Regenerate: python bench/placement_hard.py --out bench/results/placement_hard.md
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from memplan.placement import (
    PlacementProblem,
    greedy_by_size,
    place,
    portfolio,
    read_placement_csv,
    solve_exact,
    validate_placement,
)
from memplan.placement.generate import perfect_instance, tight_instance

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_INSTANCES = ROOT.parent / "shared" / "benchmarks" / "minimalloc-challenging"
CAPACITY_BYTES = 1_048_576
NAMES = "ABCDEFGHIJK"


@dataclass
class Run:
    arena_bytes: int
    status: str
    method: str
    seconds: float


@dataclass
class ChallengeRow:
    name: str
    buffers: int
    bound_bytes: int
    greedy_bytes: int
    portfolio_bytes: int
    free: Run  # no capacity
    capped: Run  # capacity 1048576
    before: Run  # no capacity, solver without the canonical search


@dataclass
class TightRow:
    buffers: int
    seed: int
    optimum_bytes: int
    greedy_bytes: int
    portfolio_bytes: int
    before: Run
    now: Run


@dataclass
class PerfectRow:
    family: str
    buffers: int
    seed: int
    optimum_bytes: int
    greedy_bytes: int
    free: Run  # no capacity
    capped: Run  # capacity = optimum


def timed(problem: PlacementProblem, time_limit_seconds: float, *, search: bool = True) -> Run:
    t0 = time.perf_counter()
    if search:
        result = place(problem, time_limit_seconds=time_limit_seconds, workers=2)
    else:
        result = solve_exact(problem, time_limit_seconds, workers=2, search=False)
    seconds = time.perf_counter() - t0
    if result.fits:
        validate_placement(problem, result)
    return Run(result.arena_bytes, result.status, result.method, seconds)


def challenge_rows(folder: Path, names: str, time_limit_seconds: float, before: bool) -> list[ChallengeRow]:
    rows = []
    for name in names:
        problem = read_placement_csv(folder / f"{name}.{CAPACITY_BYTES}.csv").problem
        free = timed(problem, time_limit_seconds)
        capped = timed(replace(problem, capacity_bytes=CAPACITY_BYTES), time_limit_seconds)
        old = timed(problem, time_limit_seconds, search=False) if before else Run(0, "-", "-", 0.0)
        row = ChallengeRow(
            name,
            problem.num_buffers,
            problem.lower_bound_bytes,
            greedy_by_size(problem).arena_bytes,
            portfolio(problem).arena_bytes,
            free,
            capped,
            old,
        )
        rows.append(row)
        print(_challenge_line(row), flush=True)
    return rows


def tight_rows(sizes: list[int], seeds: int, time_limit_seconds: float) -> list[TightRow]:
    rows = []
    for n in sizes:
        for seed in range(seeds):
            inst = tight_instance(seed, n, **TIGHT)
            capped = replace(inst.problem, capacity_bytes=inst.optimal_arena_bytes)
            row = TightRow(
                n,
                seed,
                inst.optimal_arena_bytes,
                greedy_by_size(inst.problem).arena_bytes,
                portfolio(inst.problem).arena_bytes,
                timed(capped, time_limit_seconds, search=False),
                timed(capped, time_limit_seconds),
            )
            rows.append(row)
            print(_tight_line(row), flush=True)
    return rows


def perfect_rows(families: list[str], sizes: list[int], seeds: int, time_limit_seconds: float) -> list[PerfectRow]:
    rows = []
    for family in families:
        for n in sizes:
            for seed in range(seeds):
                inst = perfect_instance(seed, n, **PERFECT[family])
                row = PerfectRow(
                    family,
                    inst.problem.num_buffers,
                    seed,
                    inst.optimal_arena_bytes,
                    greedy_by_size(inst.problem).arena_bytes,
                    timed(inst.problem, time_limit_seconds),
                    timed(replace(inst.problem, capacity_bytes=inst.optimal_arena_bytes), time_limit_seconds),
                )
                rows.append(row)
                print(_perfect_line(row), flush=True)
    return rows


# Generator settings of section (3), by family: the default (1024 units of 1 KiB, sizes 31-52
# units), six similar sizes only, the same shapes on a coarser grid (256 units), and the
# default with the lifetimes stacked the other way up or in random order in each refill.
PERFECT: dict[str, dict] = {
    "fine": {},
    "fine-6-sizes": {"num_sizes": 6},
    "coarse": {"height_units": 256, "mean_size_units": 10},
    "coarse-wide": {"height_units": 256, "mean_size_units": 32, "size_spread": 2.0},
    "long-low": {"stacking": "long-low"},
    "mixed": {"stacking": "mixed"},
}

# Generator settings of section (2): wide sizes (mean 32 units of 512 B, 4x either way), holes
# in a third of the refills, long-lived buffers of 20-200 steps on top of short ones.
TIGHT = {"height_units": 256, "mean_size_units": 32, "size_spread": 4.0, "hole_share": 0.3, "long_steps": (20, 200)}


def _excess(arena: int, bound: int) -> str:
    return f"{100 * (arena / bound - 1):.1f}%"


def _run(r: Run) -> str:
    return f"{r.status} | {r.seconds:.1f}"


def _challenge_line(r: ChallengeRow) -> str:
    fits = "yes" if r.free.arena_bytes <= CAPACITY_BYTES else "**no**"
    before = f"{r.before.arena_bytes} ({_excess(r.before.arena_bytes, r.bound_bytes)})" if r.before.seconds else "-"
    return (
        f"| {r.name} | {r.buffers} | {r.bound_bytes} | {_excess(r.greedy_bytes, r.bound_bytes)} | "
        f"{_excess(r.portfolio_bytes, r.bound_bytes)} | {r.free.arena_bytes} | "
        f"{_excess(r.free.arena_bytes, r.bound_bytes)} | "
        f"{fits} | {_run(r.free)} | {_run(r.capped)} | {before} |"
    )


def _tight_line(r: TightRow) -> str:
    return (
        f"| {r.buffers} | {r.seed} | {r.optimum_bytes} | {_excess(r.greedy_bytes, r.optimum_bytes)} | "
        f"{_excess(r.portfolio_bytes, r.optimum_bytes)} | {_run(r.before)} | {_run(r.now)} | {r.now.method} |"
    )


def _perfect_line(r: PerfectRow) -> str:
    opt = r.optimum_bytes
    return (
        f"| {r.family} | {r.buffers} | {r.seed} | {opt} | {_excess(r.greedy_bytes, opt)} | "
        f"{_excess(r.free.arena_bytes, opt)} | {_run(r.free)} | "
        f"{_excess(r.capped.arena_bytes, opt)} | {_run(r.capped)} | {r.capped.method} |"
    )


def render_perfect(rows: list[PerfectRow], args: argparse.Namespace) -> list[str]:
    reached_free = sum(r.free.arena_bytes == r.optimum_bytes for r in rows)
    reached_capped = sum(r.capped.arena_bytes == r.optimum_bytes for r in rows)
    settings = ", ".join(f"`{name}`: `{PERFECT[name]}`" for name in args.perfect_families)
    return [
        "## (3) Generated perfect packings (load = capacity at every time; optimum = lower bound)",
        "",
        "`memplan.placement.generate.perfect_instance(seed, buffers, **PERFECT[family])`, settings beyond the",
        f"defaults: {settings}. Defaults: 1024 units of 1024 B (MiniMalloc's 1 MiB), sizes",
        "31-52 units, long-lived buffers (30%, 20-200 steps) on short-lived ones (1-6 steps); every refill is",
        "complete (section (2) leaves 30% of refills short), so every section must tile the capacity exactly.",
        "`no capacity`: `place(problem,",
        f"time_limit_seconds={args.perfect_time_limit})`, 2 workers; `capacity = optimum`: the same with the capacity",
        "given ('unknown' = nothing within it found; the arena shown is then the best found above it);",
        "`method`: what found the arena with the capacity given (`hole-filling`: `memplan.placement.holefill`).",
        "Excess over the optimum; seconds are wall time on a shared, noisy 2-core machine.",
        "",
        "| family | buffers | seed | optimum (B) | greedy | no capacity: excess | status | seconds "
        "| capacity = optimum: excess | status | seconds | method |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *[_perfect_line(r) for r in rows],
        "",
        f"Reached the optimum: no capacity {reached_free}/{len(rows)}, capacity given {reached_capped}/{len(rows)}.",
        "",
    ]


def render(
    challenge: list[ChallengeRow],
    tight: list[TightRow],
    perfect: list[PerfectRow],
    args: argparse.Namespace,
    command: str,
) -> str:
    lines = ["# Placement on hard instances", "", f"Regenerate: `{command}`", ""]
    if challenge:
        fitting = sum(r.free.arena_bytes <= CAPACITY_BYTES for r in challenge)
        at_bound = sum(r.free.arena_bytes == r.bound_bytes for r in challenge)
        capped_ok = sum(r.capped.status in ("optimal", "feasible") for r in challenge)
        lines += [
            "## (1) MiniMalloc's challenging instances (google/minimalloc benchmarks/challenging)",
            "",
            f"Read from `{args.instances}` at run time. Lower bound = most bytes live at once. `greedy` = greedy",
            "by size, `heuristics` = memplan's heuristic portfolio (excess over the bound). `no capacity`:",
            f"`place(problem, time_limit_seconds={args.time_limit})`, 2 workers: the arena found, whether it fits",
            f"{CAPACITY_BYTES} B, status and wall seconds (portfolio included). `capacity {CAPACITY_BYTES}`: the same",
            "with that capacity (MiniMalloc's setting; MiniMalloc needs 0.9-10.5 s per instance on a 2-core",
            "machine). `before` = the solver without the canonical search (`solve_exact(search=False)`), no capacity.",
            "",
            "| instance | buffers | lower bound (B) | greedy | heuristics | arena (B), no capacity | excess | fits "
            f"| status | seconds | status, capacity {CAPACITY_BYTES} | seconds | before: arena (excess) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            *[_challenge_line(r) for r in challenge],
            "",
            f"Fits {CAPACITY_BYTES} B with no capacity given: {fitting}/{len(challenge)}; at the lower bound: "
            f"{at_bound}/{len(challenge)}; placed within the capacity when it is given: {capped_ok}/{len(challenge)}. "
            f"Seconds, no capacity: max {max(r.free.seconds for r in challenge):.1f}; with the capacity: max "
            f"{max(r.capped.seconds for r in challenge):.1f}.",
            "",
        ]
    if tight:
        solved_now = sum(r.now.status == "optimal" for r in tight)
        solved_before = sum(r.before.status == "optimal" for r in tight)
        lines += [
            "## (2) Generated tight packings (capacity = lower bound = optimum)",
            "",
            "`memplan.placement.generate.tight_instance(seed, buffers, **TIGHT)` with "
            f"`TIGHT = {TIGHT}`: a sweep over time refills what ends with buffers of similar sizes, merged",
            "across old boundaries, long-lived ones on top of short-lived ones; the load meets the bound on most",
            f"sections. Time limit {args.tight_time_limit} s, 2 workers; 'unknown' = nothing within the capacity",
            "found.",
            "",
            "| buffers | seed | optimum (B) | greedy | heuristics | before: status | seconds | now: status "
            "| seconds | method |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *[_tight_line(r) for r in tight],
            "",
            f"Reached the optimum: now {solved_now}/{len(tight)}, before the canonical search "
            f"{solved_before}/{len(tight)}.",
            "",
        ]
    if perfect:
        lines += render_perfect(perfect, args)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/placement_hard.md"))
    parser.add_argument("--instances", type=Path, default=DEFAULT_INSTANCES)
    parser.add_argument("--names", default=NAMES, help="which of A..K to run")
    parser.add_argument("--time-limit", type=float, default=9.0)
    parser.add_argument("--no-before", action="store_true", help="skip the solver without the canonical search")
    parser.add_argument("--tight-sizes", type=int, nargs="*", default=[150, 300, 450])
    parser.add_argument("--tight-seeds", type=int, default=3)
    parser.add_argument("--tight-time-limit", type=float, default=10.0)
    parser.add_argument("--skip-challenging", action="store_true")
    parser.add_argument("--perfect-families", nargs="*", default=list(PERFECT), choices=list(PERFECT))
    parser.add_argument("--perfect-sizes", type=int, nargs="*", default=[150, 300, 500])
    parser.add_argument("--perfect-seeds", type=int, default=2)
    parser.add_argument("--perfect-time-limit", type=float, default=9.0)
    args = parser.parse_args()
    command = "python bench/placement_hard.py " + " ".join(sys.argv[1:])
    if not args.skip_challenging and not all(
        (args.instances / f"{n}.{CAPACITY_BYTES}.csv").is_file() for n in args.names
    ):
        sys.exit(
            f"MiniMalloc's challenging instances are missing from {args.instances} (expected "
            f"{args.names[0]}.{CAPACITY_BYTES}.csv ...): give --instances DIR (google/minimalloc, "
            "benchmarks/challenging) or --skip-challenging"
        )
    challenge = (
        [] if args.skip_challenging else challenge_rows(args.instances, args.names, args.time_limit, not args.no_before)
    )
    tight = tight_rows(args.tight_sizes, args.tight_seeds, args.tight_time_limit)
    perfect = perfect_rows(args.perfect_families, args.perfect_sizes, args.perfect_seeds, args.perfect_time_limit)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(challenge, tight, perfect, args, command.strip()))
    print(f"wrote {args.out}; regenerate with: {command.strip()}")


if __name__ == "__main__":
    main()
