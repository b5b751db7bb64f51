"""Rematerialisation benchmark: budget sweeps on four CNNs (Checkmate Figure 4), the portfolio,
Checkmate's MILP and every baseline.

Regenerate: ``python bench/remat.py`` (writes bench/results/remat.md and docs/img/remat-*.png).
Options: ``--models vgg16,unet --batch-size 32 --budgets 6 --time-limit 60``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from memplan.remat.baselines import BASELINES, is_linear, solver_graph
from memplan.remat.problem import RematProblem
from memplan.remat.sweep import plot_sweep, sweep
from memplan.torch.zoo import capture_graph

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("vgg16", "mobilenet-v2", "unet", "resnet50")
STRATEGIES = ("portfolio", "checkmate", *BASELINES)


def run_model(name: str, batch_size: int, budgets: int, time_limit: float, workers: int) -> tuple[list[str], dict]:
    graph = capture_graph(name, batch_size=batch_size, mode="train", optimizer="sgd")
    sg = solver_graph(RematProblem(graph, 0))
    started = time.perf_counter()

    def progress(budget: int, plans: dict) -> None:
        cm, pf = plans["checkmate"], plans["portfolio"]
        print(
            f"  {name} budget {budget / 2**20:.1f} MiB: checkmate {cm.status} {cm.seconds:.1f}s, "
            f"portfolio {pf.status} {pf.seconds:.1f}s",
            flush=True,
        )

    results = sweep(graph, list(STRATEGIES), budgets, time_limit_seconds=time_limit, workers=workers, progress=progress)
    plot_sweep(results, ROOT / "docs" / "img" / f"remat-{name}.png", title=f"{name} batch {batch_size}")
    lines = [
        f"### {name} (batch {batch_size}, SGD): {graph.num_ops} ops -> {sg.size} solver nodes, "
        f"forward {'linear' if is_linear(sg) else 'not linear'}, sweep {time.perf_counter() - started:.0f} s",
        "",
        "| budget MiB | " + " | ".join(STRATEGIES) + " | portfolio status, gap, s | checkmate status, gap, s |",
        "|---" * (len(STRATEGIES) + 3) + "|",
    ]
    stats = {"budgets": 0, "not_worse": 0, "own": 0, "portfolio": 0}
    for r in results:
        s = r["strategies"]
        cells = [_cell(s[n]) for n in STRATEGIES]
        cm, pf = s["checkmate"], s["portfolio"]
        solvers = f"{_solver(pf)} | {_solver(cm)}"
        lines.append(f"| {r['budget_bytes'] / 2**20:.1f} | " + " | ".join(cells) + f" | {solvers} |")
        feasible = [v["overhead"] for n, v in s.items() if n in BASELINES and v["feasible"]]
        stats["budgets"] += 1
        stats["not_worse"] += int(not feasible or (cm["feasible"] and cm["overhead"] <= min(feasible) + 1e-12))
        stats["portfolio"] += int(not feasible or (pf["feasible"] and pf["overhead"] <= min(feasible) + 1e-12))
        stats["own"] += int(cm.get("from") == "checkmate")
    lines += ["", f"![{name}](../../docs/img/remat-{name}.png)", ""]
    return lines, stats


def _solver(summary: dict) -> str:
    gap = "-" if summary["gap"] is None else f"{100 * summary['gap']:.2f}%"
    return f"{summary['status']}, {gap}, {summary['seconds']:.1f}"


def _cell(summary: dict) -> str:
    if summary["status"] == "not-applicable":
        return "n/a"
    return f"{100 * summary['overhead']:.2f}%" if summary["feasible"] else "—"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--budgets", type=int, default=6)
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "remat.md"))
    args = parser.parse_args()
    command = "python bench/remat.py " + " ".join(sys.argv[1:])
    lines = [
        "# Rematerialisation under a budget (Checkmate vs baselines)",
        "",
        f"Regenerate: `{command.strip()}`. Cells: compute overhead over one plain step (cost = FLOPs), "
        "'—' = no plan within the budget, n/a = not applicable (the forward graph is not linear, or no split). "
        "Budgets run from the lowest peak any baseline reaches to the checkpoint-all peak. Status and gap say "
        "what each solver proved (gap relative to the whole step's compute); Checkmate's own plan = the MILP "
        "found one at least as cheap as the best baseline (else that baseline's plan is returned).",
        "",
    ]
    summary = []
    for name in args.models.split(","):
        print(f"{name} ...", flush=True)
        model_lines, stats = run_model(name, args.batch_size, args.budgets, args.time_limit, args.workers)
        lines += model_lines
        summary.append(
            f"- {name}: portfolio <= every baseline at {stats['portfolio']}/{stats['budgets']} budgets, checkmate "
            f"at {stats['not_worse']}/{stats['budgets']}; the MILP's own plan at {stats['own']}/{stats['budgets']}"
        )
    lines[4:4] = ["## Summary", "", *summary, ""]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(summary))
    print(f"wrote {args.out}\nregenerate: {command}")


if __name__ == "__main__":
    main()
