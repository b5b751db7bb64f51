"""The largest batch within a fixed budget per strategy (Checkmate Figure 6).

Budget per model: the checkpoint-all (no remat) peak of its batch-32 training step (SGD),
so checkpoint-all's largest batch is about 32 by construction. A strategy's plan counts at a
batch if it fits the budget with at most one extra forward pass of overhead (cost = FLOPs).
Search: doubling from ``--start`` then bisection, one capture per probed batch
(:mod:`memplan.remat.maxbatch`).

    python bench/remat_maxbatch.py --time-limit 10 --out bench/results/remat_maxbatch.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from memplan.remat.baselines import BASELINES, checkpoint_all
from memplan.remat.maxbatch import MaxBatch, max_batches
from memplan.remat.problem import RematProblem
from memplan.torch.zoo import capture_graph

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("vgg16", "mobilenet-v2", "unet", "resnet50")
MIB = 2**20
STRATEGIES = ("checkmate", *BASELINES)
"""Checkmate's MILP and the baselines (the portfolio's largest batch: ``memplan remat --max-batch``)."""


def budget_of(name: str, batch: int) -> tuple[int, RematProblem]:
    """The checkpoint-all peak of ``name``'s step at ``batch`` (and that problem)."""
    problem = RematProblem(capture_graph(name, batch_size=batch, mode="train", optimizer="sgd"), 10**18)
    return checkpoint_all(problem).peak_bytes, problem


def run_model(name: str, budget_batch: int, start: int, time_limit: float) -> tuple[list[str], dict[str, MaxBatch]]:
    budget, reference = budget_of(name, budget_batch)

    def problem_at(batch: int) -> RematProblem:
        graph = capture_graph(name, batch_size=batch, mode="train", optimizer="sgd")
        return RematProblem(graph, budget, time_limit_seconds=time_limit)

    started = time.perf_counter()
    results = max_batches(problem_at, list(STRATEGIES), start=start)
    seconds = time.perf_counter() - started
    base = results["checkpoint-all"].batch
    lines = [
        f"### {name}: budget {budget / MIB:.1f} MiB (checkpoint-all peak at batch {budget_batch}), "
        f"one extra forward = {100 * reference.forward_fraction:.1f}% of a step, search {seconds:.0f} s",
        "",
        "| strategy | largest batch | x checkpoint-all | overhead at that batch | peak MiB | status | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in ["checkpoint-all", *[s for s in STRATEGIES if s != "checkpoint-all"]]:
        lines.append(_row(results[n], base))
    return [*lines, ""], results


def _row(r: MaxBatch, base: int) -> str:
    ratio = f"{r.batch / base:.2f}" if base else "-"
    if not r.applicable:
        return f"| {r.strategy} | n/a | - | - | - | not-applicable | {r.seconds:.1f} |"
    if r.plan is None:
        return f"| {r.strategy} | {r.batch} | {ratio} | - | - | - | {r.seconds:.1f} |"
    return (
        f"| {r.strategy} | {r.batch} | {ratio} | {100 * r.plan.overhead:.1f}% | {r.plan.peak_bytes / MIB:.1f} "
        f"| {r.plan.status} | {r.seconds:.1f} |"
    )


def summarise(name: str, results: dict[str, MaxBatch]) -> str:
    """One line: Checkmate's batch against checkpoint-all's and the best baseline's."""
    base = results["checkpoint-all"].batch
    baselines = {n: r.batch for n, r in results.items() if n not in ("checkmate", "checkpoint-all")}
    best = max(baselines.values(), default=0)
    leaders = ", ".join(n for n, b in baselines.items() if b == best)
    cm = results["checkmate"]
    own = cm.plan is not None and cm.plan.details.get("from") == "checkmate"
    return (
        f"- {name}: checkpoint-all {base}, best baseline {best} ({leaders}), checkmate {cm.batch} "
        f"({cm.batch / max(base, 1):.2f}x checkpoint-all; {'its own plan' if own else 'a baseline plan'} there)"
    )


def plot(all_results: dict[str, dict[str, MaxBatch]], path: Path) -> None:
    """Figure 6 style: largest batch per model and strategy, normalised to checkpoint-all."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(STRATEGIES)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    colours = plt.get_cmap("tab20").colors  # one colour per strategy (the default cycle has 10)
    for k, strategy in enumerate(names):
        xs = [i + k * width for i in range(len(all_results))]
        ys = [r[strategy].batch / max(1, r["checkpoint-all"].batch) for r in all_results.values()]
        hatch = "//" if strategy == "checkmate" else None
        ax.bar(xs, ys, width, label=strategy, hatch=hatch, color=colours[k % len(colours)])
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(all_results))], list(all_results))
    ax.set_ylabel("largest batch / checkpoint-all's")
    ax.axhline(1, color="black", linewidth=0.5)
    ax.set_ylim(0, 1.3 * max(ax.get_ylim()[1], 1))
    ax.legend(fontsize=6, ncol=5, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--budget-batch", type=int, default=32, help="budget = checkpoint-all peak at this batch")
    parser.add_argument("--start", type=int, default=32, help="first batch probed")
    parser.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT seconds per Checkmate probe")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "remat_maxbatch.md")
    args = parser.parse_args()
    command = "python bench/remat_maxbatch.py " + " ".join(sys.argv[1:])
    lines = [
        "# Largest batch within a budget (Checkmate Figure 6)",
        "",
        f"Regenerate: `{command.strip()}`. Budget per model: the checkpoint-all (no remat) peak of its batch-"
        f"{args.budget_batch} SGD training step. A plan counts if it fits the budget with at most one extra forward "
        "pass of compute (overhead <= the forward's share of the step's FLOPs). Search: doubling from batch "
        f"{args.start}, then bisection, one capture per probed batch; Checkmate (CP-SAT, {args.time_limit:g} s per "
        "probe) is warm-started from the cheapest fitting baseline and its search starts at the best baseline's "
        "batch. 0 = not even batch 1 fits; n/a = the forward graph is not linear (Chen's and Griewank's own "
        "schemes); s = seconds of that strategy's search (captures it was the first to "
        "need included).",
        "",
    ]
    all_results = {}
    summary = []
    for name in args.models.split(","):
        print(f"{name} ...", flush=True)
        model_lines, all_results[name] = run_model(name, args.budget_batch, args.start, args.time_limit)
        print("\n".join(model_lines), flush=True)
        lines += model_lines
        summary.append(summarise(name, all_results[name]))
    lines[4:4] = ["## Summary", "", *summary, ""]
    img = ROOT / "docs" / "img" / "remat-maxbatch.png"
    plot(all_results, img)
    lines += [f"![largest batch per strategy](../../docs/img/{img.name})", ""]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}\nregenerate: {command}")


if __name__ == "__main__":
    main()
