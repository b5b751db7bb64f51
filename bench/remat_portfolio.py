"""Rematerialisation on whole graphs: Checkmate's MILP, Moccasin's CP model and the portfolio.

Graphs: the zoo's training steps (batch 32, SGD) as memplan captures them, the same steps as
GRAPH.json files without memplan's marks, and random layered DAGs as GRAPH.json files (both
written by ``bench/remat_graphs.py``). Budgets: fractions of the checkpoint-all peak. Per
budget and solver: the compute overhead, the status, the gap and the seconds.

* MILP: ``memplan remat --strategy checkmate`` as it was before the portfolio: Checkmate's
  MILP on a graph coarsened to 200 nodes, warm-started from the best baseline there;
* CP: ``--strategy moccasin``: the baselines, the stage cuts' relaxation (a MILP) and the CP
  model over the nodes it re-runs, a large neighbourhood search on large models, then
  Moccasin's CP model on the whole graph;
* portfolio: ``--strategy portfolio`` (the default): the baselines, the CP model, the MILP;
* CP+reorder: the CP model that may also run an op first later than program order.

Regenerate: ``python bench/remat_portfolio.py`` (writes bench/results/remat_portfolio.md and
.json; about two hours on 2 cores). Options: ``--only vgg16,layered-n100 --budgets 0.9,0.8
--time-limit 60 --no-reorder --graphs DIR``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from memplan.graph.io import read_graph_json
from memplan.graph.ir import Graph
from memplan.remat import solve_remat
from memplan.remat.baselines import BASELINES, checkpoint_all
from memplan.remat.milp import solve_checkmate
from memplan.remat.portfolio import GAP_LIMIT
from memplan.remat.problem import RematProblem, RematSchedule, memory_floor
from remat_graphs import LAYERED, ZOO, write_all

ROOT = Path(__file__).resolve().parent.parent
BUDGETS = (0.9, 0.8, 0.7, 0.6)
SOLVERS = ("milp", "cp", "portfolio", "cp+reorder")


def graphs(directory: Path, only: set[str]) -> list[tuple[str, str, Graph]]:
    """(name, kind, graph): the zoo as captured, then the GRAPH.json files."""
    from memplan.torch.zoo import capture_graph

    out = []
    paths = {p.stem: p for p in write_all(directory)}
    for name in ZOO:
        if not only or name in only:
            out.append((name, "zoo (marked)", capture_graph(name, batch_size=32, mode="train", optimizer="sgd")))
    for name in ZOO:
        stem = f"{name}-b32-nomarks"
        if not only or stem in only or f"{name}-nomarks" in only:
            out.append((f"{name} (no marks)", "GRAPH.json, no marks", read_graph_json(paths[stem])))
    for nodes, seed in LAYERED:
        stem = f"layered-n{nodes}-s{seed}"
        if not only or stem in only or f"layered-n{nodes}" in only:
            out.append((stem, "GRAPH.json, random layered DAG", read_graph_json(paths[stem])))
    return out


def solve(kind: str, graph: Graph, budget: int, seconds: float, gap: float | None = None) -> RematSchedule:
    """One solve; ``gap``: the gap limit of every solver (None: the MILP's as before the
    portfolio, exact, and the portfolio's default :data:`GAP_LIMIT`)."""
    if kind == "milp":
        problem = RematProblem(graph, budget, time_limit_seconds=seconds, max_solver_nodes=200)
        return solve_checkmate(problem, gap_limit=gap or 0.0)
    formulations = ("moccasin", "checkmate") if kind == "portfolio" else ("moccasin",)
    limit = GAP_LIMIT if gap is None else gap
    return solve_remat(graph, budget, seconds, formulations=formulations, reorder=kind == "cp+reorder", gap_limit=limit)


def summary(plan: RematSchedule) -> dict[str, Any]:
    out: dict[str, Any] = {
        "feasible": plan.feasible,
        "overhead": plan.overhead if plan.feasible else None,
        "cost": plan.compute_cost if plan.feasible else None,
        "status": plan.status,
        "gap": plan.gap,
        "seconds": round(plan.seconds, 2),
        "from": plan.details.get("from"),
        "message": plan.message,
        "found_at": plan.details.get("found_at"),
        "timeline": plan.details.get("timeline"),
    }
    for key in ("nodes_before", "nodes_after", "coarsened"):
        if key in plan.details:
            out[key] = plan.details[key]
    return out


def run_graph(
    name: str, kind: str, graph: Graph, budgets: list[float], seconds: float, solvers: list[str], gap: float | None
) -> dict:
    base = RematProblem(graph, 10**18, max_solver_nodes=10**9)
    top = checkpoint_all(base).peak_bytes
    floor = memory_floor(base).bytes
    rows = []
    for fraction in budgets:
        budget = int(top * fraction)
        problem = base.with_budget(budget)
        began = time.perf_counter()
        plans = {n: s(problem) for n, s in BASELINES.items()}
        fits = {n: p for n, p in plans.items() if p.feasible}
        best = min(fits, key=lambda n: fits[n].compute_cost) if fits else None
        row: dict[str, Any] = {
            "fraction": fraction,
            "budget_bytes": budget,
            "baselines_seconds": round(time.perf_counter() - began, 2),
            "best_baseline": best,
            "best_baseline_overhead": fits[best].overhead if best else None,
            "best_baseline_cost": fits[best].compute_cost if best else None,
        }
        for solver in solvers:
            row[solver] = summary(solve(solver, graph, budget, seconds, gap))
            print(f"  {name} {fraction}: {solver} {cell(row[solver])}", flush=True)
        rows.append(row)
    units = RematProblem(graph, 0, max_solver_nodes=10**9)
    from memplan.remat.coarsen import coarsen

    return {
        "name": name,
        "kind": kind,
        "ops": graph.num_ops,
        "nodes": coarsen(units, 10**9).size,
        "top_bytes": top,
        "floor_bytes": floor,
        "rows": rows,
    }


def cell(s: dict[str, Any] | None) -> str:
    if s is None:
        return "-"
    if not s["feasible"]:
        why = "floor" if "memory floor" in (s.get("message") or "") else ""
        return f"— {s['status']}{' (' + why + ')' if why else ''} · {s['seconds']:.0f} s"
    gap = "" if s["status"] == "optimal" or s["gap"] is None else f" gap {100 * s['gap']:.2f}%"
    return f"{100 * s['overhead']:.2f}% · {s['status']}{gap} · {s['seconds']:.1f} s"


def table(result: dict[str, Any], solvers: list[str]) -> list[str]:
    nodes = result["nodes"]
    lines = [
        f"### {result['name']}: {result['kind']}, {result['ops']} ops, {nodes} nodes (whole graph), "
        f"checkpoint-all peak {result['top_bytes'] / 2**20:.1f} MiB, memory floor "
        f"{result['floor_bytes'] / result['top_bytes']:.2f} of it",
        "",
        "| budget | best baseline | " + " | ".join(solvers) + " | portfolio's plan from (nodes) | "
        "to the MILP's cost: MILP / portfolio |",
        "|---" * (len(solvers) + 4) + "|",
    ]
    for row in result["rows"]:
        best = row["best_baseline"]
        baseline = f"{100 * row['best_baseline_overhead']:.2f}% ({best})" if best else "—"
        port = row.get("portfolio") or {}
        source = f"{port.get('from') or '-'} ({port.get('nodes_after', '-')}/{port.get('nodes_before', '-')})"
        cells = " | ".join(cell(row.get(s)) for s in solvers)
        lines.append(
            f"| {row['fraction']:.2f} ({row['budget_bytes'] / 2**20:.1f} MiB) | {baseline} | {cells} | {source} "
            f"| {_reach_cell(row)} |"
        )
    return [*lines, ""]


def targets(results: list[dict[str, Any]], seconds: float, solvers: list[str]) -> list[str]:
    rows = [row for r in results for row in r["rows"]]
    solves = [(s, row[s]) for row in rows for s in solvers if s != "milp" and s in row]
    slow = [f"{s} {x['seconds']:.0f} s" for s, x in solves if x["seconds"] > seconds + 1]
    if "portfolio" not in solvers:
        return _reorder_line(rows, solvers)
    port = [row["portfolio"] for row in rows if "portfolio" in row]
    fits = [p for p in port if p["feasible"]]
    close = [p for p in fits if p["status"] == "optimal" or (p["gap"] is not None and p["gap"] <= 0.01)]
    bounded = [p for p in fits if p["gap"] is not None]
    worse = [row for row in rows if row.get("best_baseline_cost") and not _not_worse(row)]
    speed = [
        row["milp"]["seconds"] / max(row["portfolio"]["seconds"], 1e-3)
        for row in rows
        if "milp" in row and "portfolio" in row and row["milp"]["feasible"] and row["portfolio"]["feasible"]
    ]
    reach = [_reach(row) for row in rows if "milp" in row and row["milp"]["feasible"] and row["portfolio"]["feasible"]]
    ratios = [m / max(p, 1e-3) for m, p in reach if p is not None]
    exists = [row for row in rows if _someone_fits(row, solvers)]
    missing = [row for row in exists if not row["portfolio"]["feasible"]]
    unknown = [row for row in rows if not _someone_fits(row, solvers) and row["portfolio"]["status"] == "unknown"]
    proven = [row for row in rows if row["portfolio"]["status"] == "infeasible"]
    lines = [
        f"- solves (CP, portfolio, CP+reorder) within the {seconds:g} s limit (+1 s): "
        f"{len(solves) - len(slow)}/{len(solves)}" + (f"; over: {', '.join(slow)}" if slow else ""),
        f"- portfolio optimal or proven within 1% of compute: {len(close)}/{len(fits)} plans "
        f"({len(bounded)} with a bound)",
        f"- portfolio never worse than the best baseline: {len(rows) - len(worse)}/{len(rows)} budgets",
        f"- time to quality (the MILP's time to find its final plan / the portfolio's time to a plan at least "
        f"as cheap, both from the solve's start, baselines included) where both have a plan: median "
        f"{statistics.median(ratios):.1f}x, min {min(ratios):.1f}x, >= 5x at {sum(r >= 5 for r in ratios)}/"
        f"{len(reach)}; the portfolio never reached the MILP's cost at {len(reach) - len(ratios)}"
        if ratios
        else "- time to quality: no budget where both have a plan and the portfolio reached the MILP's cost",
        f"- whole solve (the MILP's seconds / the portfolio's seconds, each until it stops) where both have a "
        f"plan: median {statistics.median(speed):.1f}x, min {min(speed):.1f}x, >= 5x at "
        f"{sum(s >= 5 for s in speed)}/{len(speed)}"
        if speed
        else "- no budget where both the MILP and the portfolio have a plan",
        f"- a plan at every budget where some method found one: {len(exists) - len(missing)}/{len(exists)}; "
        f"proven infeasible (memory floor or exact MILP): {len(proven)}; no plan and no proof (unknown): "
        f"{len(unknown)}",
    ]
    if "milp" in solvers:
        both = [row for row in rows if row["milp"]["feasible"] and row["portfolio"]["feasible"]]
        better = sum(row["portfolio"]["cost"] < row["milp"]["cost"] * (1 - 1e-9) for row in both)
        worse_milp = sum(row["portfolio"]["cost"] > row["milp"]["cost"] * (1 + 1e-9) for row in both)
        lines.append(
            f"- portfolio vs MILP where both have a plan: cheaper at {better}, equal at "
            f"{len(both) - better - worse_milp}, costlier at {worse_milp} of {len(both)}"
        )
    return lines + _reorder_line(rows, solvers)


def _reorder_line(rows: list[dict[str, Any]], solvers: list[str]) -> list[str]:
    lines = []
    if "cp+reorder" in solvers and "cp" in solvers:
        pairs = [
            (row["cp"], row["cp+reorder"]) for row in rows if row["cp"]["feasible"] or row["cp+reorder"]["feasible"]
        ]
        gained = [b for a, b in pairs if b["feasible"] and (not a["feasible"] or b["cost"] < a["cost"] * (1 - 1e-9))]
        lost = [b for a, b in pairs if a["feasible"] and (not b["feasible"] or b["cost"] > a["cost"] * (1 + 1e-9))]
        drops = [100 * (a["overhead"] - b["overhead"]) for a, b in pairs if a["feasible"] and b["feasible"]]
        mean = f"{statistics.mean(drops):+.3f}" if drops else "n/a"
        lines.append(
            f"- joint reordering (CP+reorder vs CP, same budget and time): better at {len(gained)}, worse at "
            f"{len(lost)} of {len(pairs)}; mean overhead change {mean} points (positive: reordering saves compute)"
        )
    return lines


def _reach(row: dict[str, Any]) -> tuple[float, float | None]:
    """The MILP's time to find its final plan, and the portfolio's first time (from its
    timeline) with a plan at most as costly (None: never)."""
    milp = row["milp"]
    target = milp["cost"] * (1 + 1e-9)
    found = milp["found_at"] if milp.get("found_at") is not None else milp["seconds"]
    times = [t["seconds"] for t in row["portfolio"].get("timeline") or [] if t["cost"] <= target]
    return float(found), (min(times) if times else None)


def _reach_cell(row: dict[str, Any]) -> str:
    if "milp" not in row or "portfolio" not in row or not (row["milp"]["feasible"] and row["portfolio"]["feasible"]):
        return "-"
    milp, port = _reach(row)
    return f"{milp:.1f} s / " + (f"{port:.2f} s ({milp / max(port, 1e-3):.0f}x)" if port is not None else "never")


def _gap_rule(gap: float | None) -> str:
    if gap is None:
        return (
            f"The portfolio and CP stop once their plan is proven within the gap limit ({100 * GAP_LIMIT:g}% of "
            "the step's compute; status 'feasible' with the gap, 'optimal' only when proven); the MILP runs "
            "until optimal or out of time, as before the portfolio."
        )
    return (
        f"Every solver, the MILP included, stops once its plan is proven within a gap limit of {100 * gap:g}% "
        "of the step's compute (`--gap-limit`; status 'feasible' with the gap, 'optimal' only when proven)."
    )


def _not_worse(row: dict[str, Any]) -> bool:
    port = row["portfolio"]
    return port["feasible"] and port["cost"] <= row["best_baseline_cost"] * (1 + 1e-12)


def _someone_fits(row: dict[str, Any], solvers: list[str]) -> bool:
    return bool(row.get("best_baseline")) or any(row[s]["feasible"] for s in solvers if s in row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated graph names (default: all)")
    parser.add_argument("--budgets", default=",".join(str(b) for b in BUDGETS))
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--no-reorder", action="store_true", help="leave out the CP+reorder column")
    parser.add_argument("--solvers", default=",".join(SOLVERS), help="which columns to solve")
    parser.add_argument("--graphs", default="/tmp/memplan-remat-graphs", help="where the GRAPH.json files go")
    parser.add_argument(
        "--gap-limit",
        type=float,
        default=None,
        help="one gap limit for every solver, MILP included (default: MILP exact, portfolio and CP 0.001)",
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "remat_portfolio.md"))
    args = parser.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]
    chosen = set(args.solvers.split(","))
    solvers = [s for s in SOLVERS if s in chosen and not (args.no_reorder and s == "cp+reorder")]
    out = Path(args.out)
    results = []
    for name, kind, graph in graphs(Path(args.graphs), {s for s in args.only.split(",") if s}):
        print(f"{name} ({graph.num_ops} ops) ...", flush=True)
        results.append(run_graph(name, kind, graph, budgets, args.time_limit, solvers, args.gap_limit))
        out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    command = "python bench/remat_portfolio.py " + " ".join(sys.argv[1:])
    subset = f" (subset: {args.only} only)" if args.only else ""
    lines = [
        f"# Rematerialisation on whole graphs: MILP, CP model, portfolio{subset}",
        "",
        f"Regenerate: `{command.strip()}` (2-core CPU machine; the graphs are written by "
        "`python bench/remat_graphs.py`). Cells: compute overhead over one plain step (cost = FLOPs, "
        "layered DAGs: their durations) · status · gap to the solver's bound (relative to the whole "
        "step's compute) · seconds. Budgets are fractions of the checkpoint-all peak; '—' = no plan. "
        "MILP = Checkmate's MILP on a graph coarsened to 200 nodes (memplan before the portfolio); CP = "
        "the baselines, the stage cuts' relaxation (its LP, then SCIP; in solves of about 35 s or more, "
        "where it has 10 s, also HiGHS on the cuts with reader windows in a background process, niced, "
        "its bound taken when it ends) and the CP model over the nodes "
        "it re-runs (at most 3 runs each), where the whole CP model has 20k events or more a large "
        "neighbourhood search from the best plan (the CP model over a few freed nodes at a time, the "
        "other nodes' runs kept), then Moccasin's CP model on the whole graph; portfolio = "
        "the same, then Checkmate's MILP; CP+reorder = the CP model that may also run ops first later "
        "than program order. Gaps and 'optimal' are relative to each solver's own scope (CP and "
        "portfolio: plans in program order, for the drop cover and the stage cuts, or with at most 2 "
        f"runs per node, for the CP search; MILP: its coarsened graph). {_gap_rule(args.gap_limit)} "
        "Speed is time to "
        "quality: the last column gives the MILP's time to find its final plan (its last improving "
        "solution, or the end of its baselines when it kept a baseline's plan) and the portfolio's time to "
        "a plan at least as cheap (a baseline's: when it returned; the CP model's or the MILP's: its last "
        "improving solution), both from the start of the solve, in the same run. Timings were taken on a "
        "shared machine: rerun on a quiet one.",
        "",
        "## Targets",
        "",
        *targets(results, args.time_limit, solvers),
        "",
    ]
    for result in results:
        lines += table(result, solvers)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(targets(results, args.time_limit, solvers)))
    print(f"wrote {out}\nregenerate: {command}")


if __name__ == "__main__":
    main()
