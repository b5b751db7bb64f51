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
  new order fits without, remat again given the new order, until a round gains nothing; each
  optimizer update group (the ops the runtime runs as one call) kept contiguous, as it must run;
* main path: what ``memory_budget=`` now picks with ``time_limit_seconds=--time-limit``
  (:func:`memplan.torch.run.budget.plan_budget`'s choice, :func:`memplan.remat.joint.choose_joint`):
  the sequential plan, then the joint search in what is left of the same limit, the joint plan
  taken only when it computes less at a placed peak within the budget (or as much at a lower
  placed peak). The graph-level step of the budget path: no kernel workspace measured here;
* bound: :func:`memplan.remat.joint.order_free_bound`, a lower bound on the compute of every
  plan in every order (how much joint planning could still gain: joint overhead - bound);
* control: the sequential solve given twice the time (joint's time too): does joint planning
  beat simply solving longer?
* placed peak: each plan's expanded DAG placed in its own order
  (:func:`memplan.pipeline.place_order`, 64-byte alignment), plus the persistent bytes.

``--run MODEL:FRACTION`` (repeatable) instead trains the zoo model at batch 32 with
``memory_budget=FRACTION`` for real, as ``memplan run MODEL -b 32 --budget FRACTION --steps 1
--time-limit T`` does (:func:`memplan.torch.compare.compare_with_eager`, ``T``: ``--time-limit``),
and writes the section "Main path, run for real" of the page (which plan the budget path took,
both costs, planned and measured peak, the largest difference from eager); a run of the graphs
keeps that section.

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
from memplan.remat.joint import choose_joint, expand, order_free_bound, solve_joint
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


def captured(name: str, cache: Path) -> tuple[Graph, list[int], list[list[int]]]:
    """The held graph of the zoo model's step, the reordered plan's order and the step's update
    groups (the ops the runtime runs as one optimizer call), cached in ``cache``."""
    path, meta = cache / f"{name}-b{BATCH}-held.json", cache / f"{name}-b{BATCH}-order.json"
    groups_path = cache / f"{name}-b{BATCH}-groups.json"
    if not path.exists() or not meta.exists() or not groups_path.exists():
        from memplan.pipeline import make_groups_contiguous
        from memplan.schedule import optimize_order
        from memplan.torch.run.budget import held_graph
        from memplan.torch.run.interpreter import optimizer_update_groups
        from memplan.torch.zoo import capture_model

        capture = capture_model(name, BATCH, "train", "sgd")
        groups = [[int(v) for v in g] for g in optimizer_update_groups(capture)]
        held = held_graph(capture)
        cache.mkdir(parents=True, exist_ok=True)
        same = path.exists() and meta.exists() and [op.name for op in read_graph_json(path).ops] == [
            op.name for op in held.ops
        ]
        if not same:  # the cached order stays when only the groups were missing
            order = optimize_order(capture.graph, time_limit_seconds=10.0).order
            order = make_groups_contiguous(list(order), groups)
            write_graph_json(held, path)
            meta.write_text(json.dumps([int(v) for v in order]))
        groups_path.write_text(json.dumps(groups))
    return read_graph_json(path), json.loads(meta.read_text()), json.loads(groups_path.read_text())


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


def run_one(
    name: str, graph: Graph, order: list[int], groups: list[list[int]], fraction: float, seconds: float
) -> dict[str, Any]:
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
    search = solve_joint(graph, order, budget, seconds, sequential=sequential, groups=groups)
    joint_seconds = time.perf_counter() - began
    began = time.perf_counter()
    main = choose_joint(graph, sequential, seconds - seq_seconds, limit_bytes=budget, groups=groups)
    main_seconds = seq_seconds + time.perf_counter() - began  # one time limit for both, as memory_budget= has
    began = time.perf_counter()
    longer = solve_remat_in_order(graph, order, budget, 2 * seconds)  # the control: sequential given joint's time too
    longer_seconds = time.perf_counter() - began
    main_side = {**side(graph, main.plan, main_seconds), "plan": main.report["remat_plan"], "why": main.report["joint"]}
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
        "main": main_side,
        "sequential_2x": {"overhead": longer.overhead if longer.feasible else None, "seconds": round(longer_seconds)},
        "rounds": search.rounds,
        "changed": search.best is not sequential,
    }
    print(json.dumps({k: row[k] for k in ("graph", "fraction", "bound", "changed")} | {"main": main.report}),
          flush=True)
    return row


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.4f}%"


def mib(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| graph | ops | budget (MiB) | sequential: overhead | peak | placed | s | joint: overhead | peak | placed "
        "| s | rounds | main path: plan | overhead | placed | s | sequential, 2x time | bound | joint - bound |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s, j, m = r["sequential"], r["joint"], r["main"]
        budget = f"{r['fraction']} ({mib(r['budget_bytes'])})"
        if "overhead" not in s:
            why = "infeasible (order-free floor)" if r["bound_infeasible"] else s["status"]
            out.append(
                f"| {r['graph']} | {r['ops']} | {budget} | {s['status']} | - | - | {s['seconds']} | - | - | - "
                f"| - | - | - | - | - | - | - | {why} | - |"
            )
            continue
        gain = None if r["bound"] is None else j["overhead"] - r["bound"]
        out.append(
            f"| {r['graph']} | {r['ops']} | {budget} | {pct(s['overhead'])} | {mib(s['peak_bytes'])} "
            f"| {mib(s['placed_bytes'])} | {s['seconds']} | {pct(j['overhead'])} | {mib(j['peak_bytes'])} "
            f"| {mib(j['placed_bytes'])} | {j['seconds']} | {len(r['rounds'])} | {m['plan']} | {pct(m['overhead'])} "
            f"| {mib(m['placed_bytes'])} | {m['seconds']} | {pct(r['sequential_2x']['overhead'])} "
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
    took = [r for r in solved if r["main"]["plan"] == "joint"]
    lines.append(
        f"- main path (`memory_budget=` with the same time limit for both): joint plan taken at {len(took)} of "
        f"{len(solved)}"
    )
    for r in took:
        s, m = r["sequential"], r["main"]
        lines.append(
            f"  - {r['graph']} at {r['fraction']}: {pct(s['overhead'])} -> {pct(m['overhead'])}, placed "
            f"{mib(s['placed_bytes'])} -> {mib(m['placed_bytes'])} MiB ({m['why']})"
        )
    kept = [r for r in solved if r["main"]["plan"] != "joint"]
    reasons: dict[str, int] = {}
    for r in kept:
        reasons[r["main"]["why"]] = reasons.get(r["main"]["why"], 0) + 1
    lines += [f"  - sequential kept at {n}: {why}" for why, n in sorted(reasons.items())]
    if solved:
        worst = max(solved, key=lambda r: r["joint"]["overhead"] - (r["bound"] or 0.0))
        lines.append(
            f"- largest gap left to the order-free bound: {worst['graph']} at {worst['fraction']}, "
            f"{pct(worst['joint']['overhead'] - (worst['bound'] or 0.0))} of compute"
        )
    return lines


RUN_HEADING = "## Main path, run for real"


TANH_MLP = "tanh-mlp"
"""Not a zoo model: 6 x (Linear(64, 64), Tanh), batch 512, MSE, SGD with momentum, trained with
``memplan.compile_step(..., memory_budget=FRACTION)`` (:func:`compile_run`)."""


def compile_run(fraction: float, seconds: float, steps: int = 3) -> dict[str, Any]:
    """:data:`TANH_MLP` trained ``steps`` steps with ``compile_step(memory_budget=fraction,
    time_limit_seconds=seconds)`` and eagerly from the same state: the budget report, the
    largest difference (loss, parameters), and each side's measured peak in a steady-state step
    (resident tensors, the arena included, plus the allocator's peak: `memplan run`'s measure)."""
    import copy

    import memplan
    import torch
    from memplan.torch.compare import _max_abs_diff
    from memplan.torch.measure import allocator_peak_bytes, optimizer_state_tensors, resident_bytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(64, 64), torch.nn.Tanh())])
    eager = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(512, 64, generator=g), torch.randn(512, 64, generator=g))
    loss_fn = torch.nn.functional.mse_loss
    step = memplan.compile_step(
        model, opt, loss_fn, batch, memory_budget=fraction, time_limit_seconds=seconds, allocator="views"
    )

    def eager_step() -> torch.Tensor:
        loss = loss_fn(eager(batch[0]), batch[1])
        loss.backward()
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)
        return loss.detach()

    diff = 0.0
    for _ in range(steps):
        diff = max(diff, _max_abs_diff(eager_step(), step(batch)))
        diff = max(diff, _max_abs_diff(list(eager.parameters()), list(model.parameters())))
    eager_loss, eager_peak = allocator_peak_bytes(eager_step)
    loss, peak = allocator_peak_bytes(step, batch)
    diff = max(diff, _max_abs_diff(eager_loss, loss), _max_abs_diff(list(eager.parameters()), list(model.parameters())))
    arena = step.runner_for(batch).arena
    measured = resident_bytes(list(model.parameters()), optimizer_state_tensors(opt), batch, arena) + peak
    budget = step.report["budget"]
    report = {
        "budget": {**budget, "measured_peak_bytes": measured, "within_budget": measured <= budget["budget_bytes"]},
        "eager": {"peak_bytes": resident_bytes(list(eager.parameters()), optimizer_state_tensors(eager_opt), batch)
                  + eager_peak},
        "max_abs_diff": diff,
    }
    return report


def real_run(spec: str, seconds: float) -> dict[str, Any]:
    """``memplan run MODEL -b 32 --budget FRACTION --steps 1 --time-limit seconds``'s report, in
    short (:data:`TANH_MLP`: :func:`compile_run`)."""
    from memplan.torch.compare import compare_with_eager

    model, fraction = spec.split(":")
    if model == TANH_MLP:
        report = compile_run(float(fraction), seconds)
    else:
        report = compare_with_eager(
            model, BATCH, 1, "train", "sgd", time_limit_seconds=seconds, memory_budget=float(fraction)
        )
    budget = report["budget"]
    keys = ("remat_plan", "joint", "sequential_overhead", "joint_overhead", "sequential_placed_bytes",
            "joint_placed_bytes", "joint_seconds", "overhead", "status", "budget_bytes", "checkpoint_all_peak_bytes",
            "planned_peak_bytes", "measured_peak_bytes", "within_budget", "recomputed_ops", "placement_rounds")
    row = {"model": model, "fraction": float(fraction), "time_limit": seconds, **{k: budget.get(k) for k in keys}}
    row.update(eager_peak_bytes=report["eager"]["peak_bytes"], max_abs_diff=report["max_abs_diff"])
    print(json.dumps(row), flush=True)
    return row


def fine(x: int | None) -> str:
    """MiB, to the KiB below 10 MiB (the small model's plans differ by less than 0.1 MiB)."""
    return "-" if x is None else f"{x / 2**20:.3f}" if x < 10 * 2**20 else mib(x)


def run_section(runs: list[dict[str, Any]]) -> list[str]:
    lines = [
        RUN_HEADING,
        "",
        "Command: `python bench/remat_joint.py " + " ".join(f"--run {r['model']}:{r['fraction']:g}" for r in runs)
        + f" --time-limit {runs[0]['time_limit']:g}` (each as `memplan run MODEL -b {BATCH} --budget FRACTION "
        f"--steps 1 --time-limit {runs[0]['time_limit']:g}`: SGD, the budget path with the kernels' workspace "
        "measured; measured peak: resident tensors plus the allocator's peak in a steady-state step, as `memplan "
        "run` reports it; diff: the largest difference from eager in loss, parameters and buffers). "
        f"`{TANH_MLP}`: not a zoo model, 6 x (Linear(64, 64), Tanh) at batch 512 with MSE and SGD (momentum 0.9), "
        "trained 3 steps with `memplan.compile_step(..., memory_budget=FRACTION, time_limit_seconds=T, "
        "allocator='views')`, measured "
        "the same way. Re-plans: the placed arena came out over the budget and the step was planned again with "
        "the budget lowered by the excess (the columns are the last plan's).",
        "",
        "| model | budget (MiB) | re-plans | plan taken | why | sequential: overhead | joint: overhead "
        "| placed, sequential | placed, joint | planned peak | measured peak | measured - planned (KiB) | within "
        "| eager peak | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        name = r["model"] if r["model"] == TANH_MLP else f"{r['model']}-b{BATCH}"
        lines.append(
            f"| {name} | {r['fraction']:g} ({fine(r['budget_bytes'])}) "
            f"| {max(0, len(r['placement_rounds'] or []) - 1)} | {r['remat_plan']} "
            f"| {r['joint']} | {pct(r['sequential_overhead'])} | {pct(r['joint_overhead'])} "
            f"| {fine(r['sequential_placed_bytes'])} | {fine(r['joint_placed_bytes'])} "
            f"| {fine(r['planned_peak_bytes'])} "
            f"| {fine(r['measured_peak_bytes'])} | {(r['measured_peak_bytes'] - r['planned_peak_bytes']) / 1024:.1f} "
            f"| {r['within_budget']} | {fine(r['eager_peak_bytes'])} | {r['max_abs_diff']} |"
        )
    return [*lines, ""]


def write_runs(specs: list[str], seconds: float, out: Path) -> None:
    """The section "Main path, run for real" of ``out``.md (replaced, the rest kept) and ``out``_run.json."""
    runs = [real_run(spec, seconds) for spec in specs]
    page = out.with_suffix(".md")
    text = page.read_text() if page.exists() else ""
    head = text.split(RUN_HEADING)[0].rstrip("\n")
    page.write_text("\n".join([head, "", *run_section(runs)]))
    out.with_name(out.name + "_run.json").write_text(json.dumps(runs, indent=1, default=str))
    print("\n".join(run_section(runs)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="")
    parser.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS))
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT)
    parser.add_argument("--cache", default="/tmp/memplan-remat-joint")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "remat_joint"))
    parser.add_argument("--run", action="append", default=[], help="MODEL:FRACTION, trained for real (repeatable)")
    args = parser.parse_args()
    if args.run:
        write_runs(args.run, args.time_limit, Path(args.out))
        return
    names = [n for n in ZOO if not args.only or n in args.only.split(",")]
    fractions = [float(f) for f in args.fractions.split(",")]
    rows = []
    for name in names:
        graph, order, groups = captured(name, Path(args.cache))
        rows.extend(run_one(name, graph, order, groups, f, args.time_limit) for f in fractions)
    command = "python bench/remat_joint.py " + " ".join(sys.argv[1:])
    lines = [
        "# Joint order and recomputation vs the sequential budget path",
        "",
        f"Command: `{command.strip()}` (2-core CPU machine shared with other jobs: timings are noisy). "
        f"Zoo at batch {BATCH} (SGD), the held graph and reordered order `memory_budget=` plans; budgets are "
        f"fractions of the checkpoint-all peak. Sequential: `solve_remat_in_order` over the reordered order, "
        f"{args.time_limit:g} s. Joint: `solve_joint` from that plan, up to {args.time_limit:g} s more (reorder "
        "the plan's expanded DAG given its recomputations, take out the re-runs the new order fits without, "
        "solve again over the new order; until a round gains nothing; each optimizer update group kept "
        "contiguous, as the runtime runs it as one call). Main path: what `memory_budget=` picks with "
        f"`time_limit_seconds={args.time_limit:g}`: the sequential plan, then the joint search in what is left "
        "of that limit, the joint plan taken only when it computes less at a placed peak within the budget (or "
        "as much at a lower placed peak); graph level, no kernel workspace. Overhead: compute over one plain step "
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
    page = out.with_suffix(".md")
    kept = page.read_text().split(RUN_HEADING, 1) if page.exists() else []
    if len(kept) == 2:  # the real runs' section stays (python bench/remat_joint.py --run ... rewrites it)
        lines += [RUN_HEADING + kept[1].rstrip("\n"), ""]
    page.write_text("\n".join(lines))
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1, default=str))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
