"""Joint order and recomputation against the sequential budget path (issue 36).

Graphs: the captured zoo at batch 32 (SGD) as ``memory_budget=`` plans it: the held graph of
:func:`memplan.torch.run.budget.held_graph` and the reordered plan's order (OLLA's lifetime
optimisation, update groups made contiguous, as :func:`memplan.api.plan_capture` makes it).
Budgets: 0.8, 0.7, 0.6 and 0.5 of the checkpoint-all peak (``memory_budget=0.8`` ...).

Per graph and budget:

* sequential: :func:`memplan.remat.portfolio.solve_remat_in_order` over the reordered order
  (what the budget path runs), ``--time-limit`` seconds;
* joint: :func:`memplan.remat.joint.solve_joint` from that plan, up to ``--time-limit`` more
  seconds: reorder given the recomputations (the plan's expanded DAG), take out the re-runs the
  new order fits without, remat again given the new order, until a round gains nothing;
* bound: :func:`memplan.remat.joint.order_free_bound`, a lower bound on the compute of every
  plan in every order (how much joint planning could still gain: joint overhead - bound);
* control: the sequential solve given twice the time (joint's time too): does joint planning
  beat simply solving longer?
* placed peak: each plan's expanded DAG placed in its own order
  (:func:`memplan.pipeline.place_order`, 64-byte alignment), plus the persistent bytes.

Overheads are compute over one plain step (FLOPs). Regenerate (about 30 minutes on 2 cores):
``python bench/remat_joint.py`` (writes bench/results/remat_joint.md and .json); options
``--only vgg16,unet --fractions 0.8,0.5 --time-limit 20 --cache DIR`` (captured graphs are kept
in DIR between runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from memplan.graph.io import read_graph_json, write_graph_json
from memplan.graph.ir import Graph
from memplan.remat.baselines import checkpoint_all
from memplan.remat.joint import expand, order_free_bound, solve_joint
from memplan.remat.lower import validate_sequence
from memplan.remat.portfolio import solve_remat_in_order
from memplan.remat.problem import RematProblem, RematSchedule

ROOT = Path(__file__).resolve().parent.parent
ZOO = ("vgg16", "unet", "mobilenet-v2", "resnet50", "gpt2-2l")
BATCH = 32
FRACTIONS = (0.8, 0.7, 0.6, 0.5)
TIME_LIMIT = 20.0
PLACE_SECONDS = 5.0
CUT_SECONDS = 5.0


def captured(name: str, cache: Path) -> tuple[Graph, list[int]]:
    """The held graph of the zoo model's step and the reordered plan's order (cached in ``cache``)."""
    path, meta = cache / f"{name}-b{BATCH}-held.json", cache / f"{name}-b{BATCH}-order.json"
    if not path.exists() or not meta.exists():
        from memplan.pipeline import make_groups_contiguous
        from memplan.schedule import optimize_order
        from memplan.torch.run.budget import held_graph
        from memplan.torch.run.interpreter import optimizer_update_groups
        from memplan.torch.zoo import capture_model

        capture = capture_model(name, BATCH, "train", "sgd")
        order = optimize_order(capture.graph, time_limit_seconds=10.0).order
        order = make_groups_contiguous(list(order), optimizer_update_groups(capture))
        cache.mkdir(parents=True, exist_ok=True)
        write_graph_json(held_graph(capture), path)
        meta.write_text(json.dumps([int(v) for v in order]))
    return read_graph_json(path), json.loads(meta.read_text())


def placed_peak(graph: Graph, plan: RematSchedule) -> int:
    """Persistent bytes plus the arena of the plan's expanded DAG placed in its own order."""
    from memplan.pipeline import place_order

    expanded = expand(graph, plan.steps)
    order = list(range(len(expanded.op_of)))
    _, placement = place_order(expanded.graph, order, PLACE_SECONDS)  # type: ignore[arg-type]
    return graph.persistent_bytes + int(placement.arena_bytes)


def side(graph: Graph, plan: RematSchedule, seconds: float) -> dict[str, Any]:
    if not plan.feasible:
        return {"status": plan.status, "seconds": round(seconds, 2), "message": plan.message}
    validate_sequence(graph, plan.steps)
    return {
        "status": plan.status,
        "overhead": plan.overhead,
        "peak_bytes": plan.peak_bytes,
        "placed_bytes": placed_peak(graph, plan),
        "reruns": sum(1 for k, _ in plan.steps if k == "run") - len(graph.ops),
        "seconds": round(seconds, 2),
    }


def run_one(name: str, graph: Graph, order: list[int], fraction: float, seconds: float) -> dict[str, Any]:
    reference = checkpoint_all(RematProblem(graph, 10**18)).peak_bytes
    budget = int(fraction * reference)
    problem = RematProblem(graph, budget)
    began = time.perf_counter()
    bound = order_free_bound(problem, CUT_SECONDS)
    bound_seconds = time.perf_counter() - began
    began = time.perf_counter()
    sequential = solve_remat_in_order(graph, order, budget, seconds)
    seq_seconds = time.perf_counter() - began
    began = time.perf_counter()
    search = solve_joint(graph, order, budget, seconds, sequential=sequential)
    joint_seconds = time.perf_counter() - began
    began = time.perf_counter()
    longer = solve_remat_in_order(graph, order, budget, 2 * seconds)  # the control: sequential given joint's time too
    longer_seconds = time.perf_counter() - began
    row = {
        "graph": f"{name}-b{BATCH}",
        "ops": len(graph.ops),
        "fraction": fraction,
        "budget_bytes": budget,
        "checkpoint_all_bytes": reference,
        "bound": None if bound.extra == float("inf") else bound.extra / problem.plain_cost,
        "bound_infeasible": bound.extra == float("inf"),
        "bound_seconds": round(bound_seconds, 2),
        "sequential": side(graph, sequential, seq_seconds),
        "joint": side(graph, search.best, joint_seconds),
        "sequential_2x": {"overhead": longer.overhead if longer.feasible else None, "seconds": round(longer_seconds)},
        "rounds": search.rounds,
        "changed": search.best is not sequential,
    }
    print(json.dumps({k: row[k] for k in ("graph", "fraction", "bound", "changed")}), flush=True)
    return row


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.4f}%"


def mib(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| graph | ops | budget (MiB) | sequential: overhead | peak | placed | s | joint: overhead | peak | placed "
        "| s | rounds | sequential, 2x time | bound | joint - bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s, j = r["sequential"], r["joint"]
        budget = f"{r['fraction']} ({mib(r['budget_bytes'])})"
        if "overhead" not in s:
            why = "infeasible (order-free floor)" if r["bound_infeasible"] else s["status"]
            out.append(f"| {r['graph']} | {r['ops']} | {budget} | {s['status']} | - | - | {s['seconds']} | - | - | - "
                       f"| - | - | - | {why} | - |")
            continue
        gain = None if r["bound"] is None else j["overhead"] - r["bound"]
        out.append(
            f"| {r['graph']} | {r['ops']} | {budget} | {pct(s['overhead'])} | {mib(s['peak_bytes'])} "
            f"| {mib(s['placed_bytes'])} | {s['seconds']} | {pct(j['overhead'])} | {mib(j['peak_bytes'])} "
            f"| {mib(j['placed_bytes'])} | {j['seconds']} | {len(r['rounds'])} | {pct(r['sequential_2x']['overhead'])} "
            f"| {pct(r['bound'])} | {pct(gain)} |"
        )
    return out


def summary(rows: list[dict[str, Any]]) -> list[str]:
    solved = [r for r in rows if "overhead" in r["sequential"]]
    better = [r for r in solved if r["joint"]["overhead"] < r["sequential"]["overhead"] - 1e-12]
    lines = [f"- budgets with a plan: {len(solved)} of {len(rows)}; joint cheaper than sequential at {len(better)}"]
    for r in better:
        lines.append(
            f"  - {r['graph']} at {r['fraction']}: {pct(r['sequential']['overhead'])} -> {pct(r['joint']['overhead'])}"
        )
    control = [r for r in better if (r["sequential_2x"]["overhead"] or 1.0) <= r["joint"]["overhead"] + 1e-12]
    lines.append(f"  - of which sequential given joint's time too (2x) is as cheap at {len(control)}")
    lower = [r for r in solved if r not in better and r["joint"]["peak_bytes"] < r["sequential"]["peak_bytes"]]
    lines.append(f"- same compute, lower peak at {len(lower)}")
    for r in lower:
        s, j = r["sequential"], r["joint"]
        lines.append(
            f"  - {r['graph']} at {r['fraction']}: peak {mib(s['peak_bytes'])} -> {mib(j['peak_bytes'])} MiB, "
            f"placed {mib(s['placed_bytes'])} -> {mib(j['placed_bytes'])} MiB"
        )
    if solved:
        worst = max(solved, key=lambda r: r["joint"]["overhead"] - (r["bound"] or 0.0))
        lines.append(
            f"- largest gap left to the order-free bound: {worst['graph']} at {worst['fraction']}, "
            f"{pct(worst['joint']['overhead'] - (worst['bound'] or 0.0))} of compute"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="")
    parser.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS))
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT)
    parser.add_argument("--cache", default="/tmp/memplan-remat-joint")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "remat_joint"))
    args = parser.parse_args()
    names = [n for n in ZOO if not args.only or n in args.only.split(",")]
    fractions = [float(f) for f in args.fractions.split(",")]
    rows = []
    for name in names:
        graph, order = captured(name, Path(args.cache))
        rows.extend(run_one(name, graph, order, f, args.time_limit) for f in fractions)
    command = "python bench/remat_joint.py " + " ".join(sys.argv[1:])
    lines = [
        "# Joint order and recomputation vs the sequential budget path",
        "",
        f"Command: `{command.strip()}` (2-core CPU machine shared with other jobs: timings are noisy). "
        f"Zoo at batch {BATCH} (SGD), the held graph and reordered order `memory_budget=` plans; budgets are "
        f"fractions of the checkpoint-all peak. Sequential: `solve_remat_in_order` over the reordered order, "
        f"{args.time_limit:g} s. Joint: `solve_joint` from that plan, up to {args.time_limit:g} s more (reorder "
        "the plan's expanded DAG given its recomputations, take out the re-runs the new order fits without, "
        "solve again over the new order; until a round gains nothing). Overhead: compute over one plain step "
        "(FLOPs). Peak: the estimator's; placed: persistent bytes + the arena of the plan's expanded DAG placed "
        "in its order. Bound: `order_free_bound`, no plan in any order with any re-runs computes less; "
        "'joint - bound' is what joint planning could at most still gain. 'sequential, 2x time': the control, "
        "the sequential solve given the joint search's time too.",
        "",
        *summary(rows),
        "",
        *table(rows),
        "",
    ]
    out = Path(args.out)
    out.with_suffix(".md").write_text("\n".join(lines))
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1, default=str))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
