"""memplan's recompute decision in the user's own loop: the SAC policy in plain eager PyTorch,
and the ``torch.compile`` backend, on zoo models (CPU).

SAC rows: the model's step planned within the budget (a fraction of the checkpoint-all peak,
strategy "best": the cheapest feasible plan of every strategy), the plan turned into a SAC
policy (memplan.torch.export.sac) applied to the model's repeated layers, and the model
trained eagerly with and without it from the same state and seed
(memplan.torch.export.sac_compare.compare_sac_with_eager). Peaks are what the user's tools
show: resident parameters, buffers, optimizer state and batch plus the CPU allocator's peak
during one steady-state step (the profiler's memory events). "SAC / plan" is the measured
peak with the policy over the plan's peak (``sequence_peak_bytes``); the issue's target is
within 5%.

Compile rows: the model trained with ``torch.compile(backend=memplan_backend(budget))``,
with ``torch.compile(backend="aot_eager")`` and eagerly, from the same state and seed; the
allocator's peak of one steady-state step of each (resident state is the same for all three
and left out), the largest difference in loss and parameters against eager, and what the
partitioner decided.

    python bench/export.py --out bench/results/export.md
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from typing import Any

SAC_CONFIGS: list[tuple[str, int, float, str]] = [("gpt2-2l", 8, 0.90, "best")]
COMPILE_CONFIGS: list[tuple[str, int, float, str]] = [("gpt2-2l", 8, 0.95, "best")]
MIB = 2**20


def sac_row(model: str, batch: int, budget: float, strategy: str, steps: int) -> dict[str, Any]:
    from memplan.torch.export.sac_compare import compare_sac_with_eager

    return compare_sac_with_eager(model, batch, budget, strategy, steps)


def compile_row(model_name: str, batch: int, budget: float, strategy: str, steps: int) -> dict[str, Any]:
    import torch
    from memplan.torch.compare import _max_abs_diff
    from memplan.torch.export.backend import memplan_backend
    from memplan.torch.export.sac_compare import without_kv_cache
    from memplan.torch.measure import allocator_peak_bytes
    from memplan.torch.zoo import build_workload, make_optimizer

    torch._dynamo.reset()
    w = build_workload(model_name, batch, seed=0)
    eager = without_kv_cache(w.model).train()
    models = {"eager": eager, "memplan": copy.deepcopy(eager), "aot_eager": copy.deepcopy(eager)}
    backend = memplan_backend(budget=budget, strategy=strategy)
    run = {
        "eager": models["eager"],
        "memplan": torch.compile(models["memplan"], backend=backend),
        "aot_eager": torch.compile(models["aot_eager"], backend="aot_eager"),
    }
    optimizers = {k: make_optimizer("sgd", m.parameters()) for k, m in models.items()}

    def step(f: Any, optimizer: Any) -> Any:
        loss = w.loss_fn(f(w.inputs), w.target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    peaks: dict[str, int] = {}
    diffs = {"memplan": 0.0, "aot_eager": 0.0}
    for k in range(steps + 1):
        losses = {}
        for name, f in run.items():
            torch.manual_seed(1000 + k)
            if k == steps:
                losses[name], peaks[name] = allocator_peak_bytes(step, f, optimizers[name])
            else:
                losses[name] = step(f, optimizers[name])
        for name in diffs:
            state = [*models[name].parameters()], [*models["eager"].parameters()]
            diffs[name] = max(diffs[name], _max_abs_diff(losses[name], losses["eager"]), _max_abs_diff(*state))
    report = backend.last_report
    return {
        "model": model_name,
        "batch_size": batch,
        "budget": budget,
        "partition": report.summary() if report else None,
        "allocator_peak_bytes": peaks,
        "max_abs_diff_vs_eager": diffs,
    }


def sac_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | batch | budget MiB | strategy | planned peak MiB | eager peak MiB | eager + SAC peak MiB "
        "| SAC / plan | SAC / eager | max abs diff | ops saved / forward ops | step s SAC / eager |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body = ""
    for r in rows:
        p = r["policy"]
        body += (
            f"| {r['model']} | {r['batch_size']} | {r['budget_bytes'] / MIB:.1f} | {r['strategy']} "
            f"| {r['planned_peak_bytes'] / MIB:.1f} | {r['eager_peak_bytes'] / MIB:.1f} "
            f"| {r['sac_peak_bytes'] / MIB:.1f} "
            f"| {r['sac_vs_plan']:.3f} | {r['sac_vs_eager']:.3f} | {r['max_abs_diff']:g} "
            f"| {p['must_save']} / {p['forward_ops']} | {r['sac_step_seconds']:.2f} / {r['eager_step_seconds']:.2f} |\n"
        )
    return head + body


def compile_table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | batch | budget | plan | recomputed nodes | planned joint-graph peak MiB "
        "| step peak MiB: memplan / aot_eager / eager | max abs diff vs eager: memplan / aot_eager |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    body = ""
    for r in rows:
        p, peaks, diffs = r["partition"] or {}, r["allocator_peak_bytes"], r["max_abs_diff_vs_eager"]
        plan = f"{p.get('strategy')}, overhead {100 * p.get('overhead', 0):.1f}%" if p.get("feasible") else "infeasible"
        body += (
            f"| {r['model']} | {r['batch_size']} | {r['budget']} | {plan} | {p.get('recomputed_nodes')} "
            f"| {p.get('planned_peak_bytes', 0) / MIB:.1f} "
            f"| {peaks['memplan'] / MIB:.1f} / {peaks['aot_eager'] / MIB:.1f} / {peaks['eager'] / MIB:.1f} "
            f"| {diffs['memplan']:g} / {diffs['aot_eager']:g} |\n"
        )
    return head + body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--only", choices=("sac", "compile"), default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sections = []
    if args.only in (None, "sac"):
        rows = []
        for config in SAC_CONFIGS:
            start = time.perf_counter()
            row = sac_row(*config, args.steps)
            row["seconds"] = round(time.perf_counter() - start, 1)
            print(json.dumps(row, default=str), flush=True)
            rows.append(row)
        sections.append("## SAC policy in plain eager PyTorch\n\n" + sac_table(rows))
    if args.only in (None, "compile"):
        rows = []
        for config in COMPILE_CONFIGS:
            row = compile_row(*config, args.steps)
            print(json.dumps(row, default=str), flush=True)
            rows.append(row)
        sections.append("## torch.compile with the memplan backend\n\n" + compile_table(rows))
    text = "\n".join(sections)
    print(text)
    if args.out:
        command = "python bench/export.py " + " ".join(
            [f"--steps {args.steps}"] + ([f"--only {args.only}"] if args.only else []) + [f"--out {args.out}"]
        )
        title = "# memplan's recompute decision in the user's own loop (CPU)"
        args.out.write_text(f"{title}\n\nRegenerate: `{command}`\n\n{text}")


if __name__ == "__main__":
    main()
