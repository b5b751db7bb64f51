"""memplan's planned FSDP2 step vs eager FSDP2 (``fully_shard``) and eager FSDP2 with every block under
``torch.utils.checkpoint``: spawned gloo ranks, CPU.

For each model, the blocks and the root are ``fully_shard``-ed (FSDP2's defaults: blocks reshard
after forward, the root does not), with AdamW. One spawned job trains every rank with memplan, with
eager FSDP2 and with eager FSDP2 + checkpoint-per-block from the same seed, compares the loss, every
gathered parameter and every optimizer state tensor after every step, and measures the last step
with the profiler's allocator events; then one job per variant measures the process's peak RSS
(VmHWM, reset just before a steady step) of that variant alone.

    python bench/fsdp.py                     # every model: writes bench/results/fsdp.md (+ .json, traces)
    python bench/fsdp.py --models llama      # one row (re)measured; the others kept from the .json
    python bench/fsdp.py --nproc 4 --steps 3 --models mlp,gpt2-2l,llama
                                             # 4 ranks: bench/results/fsdp_4ranks.md (+ .json, traces)

memplan's collectives run asynchronously on a communication stream, their waits and the prefetch
depth chosen by the plan (:mod:`memplan.torch.distributed.fsdp_plan`); a fourth variant,
``memplan_prefetch1``, fixes the depth at FSDP2's default (one unit ahead, each reduce-scatter
waited for at the next launch) to show what overlap costs. One more step of memplan, memplan
prefetch 1 and FSDP2 is profiled on every rank: rank 0's timeline is written as a Chrome trace,
``bench/results/fsdp-MODEL[-4ranks].trace.json``, and each variant's overlap (the share of the
time gloo ran a collective during which the compute thread ran an op) goes in the table.
    python bench/fsdp.py --budget 0.7        # memplan under memory_budget=0.7 vs FSDP2 + checkpoint:
                                             # bench/results/fsdp_budget.md (+ .json), model mlp-wide
    python bench/fsdp.py --mp bf16 --models mlp,gpt2-2l
                                             # every variant under MixedPrecisionPolicy(bf16 params, fp32
                                             # reduce): bench/results/fsdp_mp.md (+ .json)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from memplan.report.format import format_bytes
from memplan.torch.distributed import fsdp_compare as fc

RESULTS = Path(__file__).parent / "results"
PREFETCH = 1  # memplan_prefetch1: FSDP2's default depth, fixed
FIXED = f"memplan_prefetch{PREFETCH}"
VARIANTS = ("memplan", FIXED, *fc.EAGER_VARIANTS)
RSS_VARIANTS = ("memplan", *fc.EAGER_VARIANTS)  # the process's peak: one job per variant
LLAMA_TOKENS = 128
MODELS: dict[str, dict[str, Any]] = {
    "mlp": {"batch": 64, "about": "4 blocks of Linear(1003) + GELU (uneven shards), batch 64"},
    "gpt2-2l": {"batch": 2, "about": "HF GPT-2 with 2 layers (zoo `gpt2-2l`), 2 x 128 tokens, tied embedding"},
    "gpt2": {
        "batch": 1,
        "about": "HF GPT-2 small from its config (zoo `gpt2`: 12 layers, hidden 768, vocab 50257, tied embedding), "
        "1 x 128 tokens",
    },
    "llama": {
        "batch": 2,
        "about": "HF LlamaForCausalLM from a small config (RMSNorm, RoPE, SwiGLU, grouped-query attention): 4 "
        "layers, hidden 512, intermediate 1376, 8 heads, 4 KV heads, vocab 32000 (untied), 2 x 128 tokens",
    },
}
BUDGET_MODELS: dict[str, dict[str, Any]] = {
    "mlp-wide": {
        "batch": 2048,
        "about": "4 blocks of Linear(259) + GELU, batch 2048: the activations outweigh the weights",
    },
    "llama-b8": {
        "batch": 8,
        "about": "the `llama` row's decoder on 8 x 128 tokens: the activations (logits 125 MiB) outweigh a rank's "
        "shards and AdamW state",
        "time_limit": 20.0,  # 2738 ops: the portfolio's 5 s find no plan at 0.8 (10 s do)
    },
}
STEPS = 5  # --steps
BUDGET_TIME_LIMIT = 5.0  # solver seconds per stage of the budgeted plan (the remat portfolio), unless the model says


def budget_time_limit(model: str) -> float:
    """The solver's seconds per stage for ``model``'s budgeted rows."""
    return float(BUDGET_MODELS.get(model, {}).get("time_limit", BUDGET_TIME_LIMIT))


def workload(model: str) -> tuple[Any, Any, Any]:
    """``(build(seed), batch, loss_fn)`` of a bench model on this rank."""
    rank, batch = dist.get_rank(), {**MODELS, **BUDGET_MODELS}[model]["batch"]
    if model == "mlp-wide":
        return (lambda seed: fc.mlp(seed, width=256, depth=4)), fc.mlp_batch(rank, size=batch), fc.cross_entropy
    if model == "mlp":
        return (lambda seed: fc.mlp(seed, width=1000, depth=4)), fc.mlp_batch(rank, size=batch), fc.cross_entropy
    if model in ("llama", "llama-b8"):
        tokens = fc.token_batch(rank, fc.LLAMA["vocab_size"], batch, LLAMA_TOKENS)
        return fc.llama, tokens, fc.token_loss
    from memplan.torch.zoo import build_workload

    w = build_workload(model, batch, seed=rank)
    return (lambda seed: build_workload(model, batch, seed=seed).model), (w.inputs, w.target), w.loss_fn


MP_POLICIES = {"bf16": fc.bf16_policy}  # --mp: every variant's units under this MixedPrecisionPolicy


def compare(model: str, budget: float | None = None, mp: str | None = None, steps: int = STEPS) -> dict[str, Any]:
    build, batch, loss_fn = workload(model)
    if mp is not None:
        return fc.compare_with_fsdp2(build, batch, steps=steps, loss_fn=loss_fn, mp_policy=MP_POLICIES[mp]())
    if budget is None:
        return fc.compare_with_fsdp2(build, batch, steps=steps, loss_fn=loss_fn, prefetch=PREFETCH, trace=True)
    return fc.compare_with_fsdp2(
        build, batch, steps=steps, loss_fn=loss_fn, memory_budget=budget, time_limit_seconds=budget_time_limit(model)
    )


def rss(model: str, variant: str, budget: float | None = None, mp: str | None = None) -> dict[str, Any]:
    build, batch, loss_fn = workload(model)
    if budget is None:
        return fc.measure_rss(build, batch, variant, loss_fn=loss_fn, mp_policy=MP_POLICIES[mp]() if mp else None)
    limit = budget_time_limit(model)
    return fc.measure_rss(build, batch, variant, loss_fn=loss_fn, memory_budget=budget, time_limit_seconds=limit)


def tracker(r: dict[str, Any], variant: str) -> int:
    return r["held_bytes"][variant] + r["step_peak_bytes"][variant]


def measure(
    model: str, nproc: int, budget: float | None = None, mp: str | None = None, steps: int = STEPS
) -> dict[str, Any]:
    """One model's row: the compared job, then one RSS job per variant."""
    start = time.perf_counter()
    row: dict[str, Any] = {"compare": fc.run_ranks(nproc, compare, model, budget, mp, steps), "rss": {}}
    for variant in RSS_VARIANTS if budget is None else BUDGET_VARIANTS:
        row["rss"][variant] = fc.run_ranks(nproc, rss, model, variant, budget, mp)
    for r in [*row["compare"], *(r for v in row["rss"].values() for r in v)]:
        if "error" in r:
            raise SystemExit(f"{model}: a rank failed:\n{r['error']}")
    row["seconds"] = time.perf_counter() - start
    row["command"] = f"python bench/fsdp.py --models {model}" + (f" --nproc {nproc}" if nproc != 2 else "")
    row["command"] += "" if budget is None else f" --budget {budget}"
    row["command"] += "" if mp is None else f" --mp {mp}"
    row["command"] += "" if steps == STEPS else f" --steps {steps}"
    row["steps"] = steps
    row["budget"] = budget
    row["time_limit"] = None if budget is None else budget_time_limit(model)
    if budget is None and mp is None:
        _write_trace(model, nproc, row)
    return row


def trace_path(model: str, nproc: int) -> Path:
    return RESULTS / (f"fsdp-{model}" + ("" if nproc == 2 else f"-{nproc}ranks") + ".trace.json")


TRACE_TITLES = {"memplan": "memplan (the plan's choice)", FIXED: f"memplan, prefetch {PREFETCH}", "fsdp2": "FSDP2"}


def _write_trace(model: str, nproc: int, row: dict[str, Any]) -> None:
    """Rank 0's profiled step of each traced variant as one Chrome trace; the events leave the row."""
    from memplan.torch.distributed.timeline import write_chrome_trace

    events = row["compare"][0]["trace_events"]
    write_chrome_trace(trace_path(model, nproc), {f"{TRACE_TITLES[n]} (rank 0)": e for n, e in events.items()})
    for r in row["compare"]:
        r.pop("trace_events", None)


BUDGET_VARIANTS = ("memplan_budget", "fsdp2_ckpt", "fsdp2", "memplan")


def _row_budget(row: dict[str, Any]) -> float:
    """The ``--budget`` a row was measured with (rows from before it was stored: read from its command)."""
    if row.get("budget") is not None:
        return float(row["budget"])
    return float(row["command"].split("--budget ")[1].split()[0])


def render_budget(rows: dict[str, dict[str, Any]], world: int) -> str:
    """memplan under ``memory_budget`` (remat on top of sharding) vs FSDP2 + checkpoint-per-block."""
    lines = [
        "# FSDP2 with memory_budget (remat on top of sharding) vs FSDP2 + checkpoint-per-block: "
        f"{world} ranks, gloo, CPU",
        "",
        "Same protocol as the FSDP2 table (tracker, RSS, step time, numerics over "
        f"{STEPS} steps), a fourth variant: memplan's step with `memory_budget` (the row's fraction of the "
        "checkpoint-all peak of rank 0's step; rank 0 solves the remat plan, every rank runs it; solver "
        "the row's seconds per stage). Planned overhead: the remat plan's added compute (its cost model); "
        "step times are measured on a shared, busy 2-core machine: compare them as ratios within a row.",
        "",
        "| model | what | memory_budget | solver s per stage | command | minutes |",
        "|---|---|---|---|---|---|",
    ]
    for model, row in rows.items():
        about = BUDGET_MODELS[model]["about"]
        limit = row.get("time_limit") or BUDGET_TIME_LIMIT  # rows from before it was stored: the default's
        lines.append(
            f"| {model} | {about} | {_row_budget(row):g} | {limit:g} | `{row['command']}` "
            f"| {row['seconds'] / 60:.1f} |"
        )
    lines += [
        "",
        "| model | rank | plan | recomputed ops | planned overhead | budget | planned peak | max abs diff vs FSDP2 "
        "(budget / memplan / ckpt) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, row in rows.items():
        for r in row["compare"]:
            b = r["budget_report"]
            diffs = f"{max(r['budget_diffs'])} / {max(r['diffs'])} / {max(r['ckpt_diffs'])}"
            lines.append(
                f"| {model} | {r['rank']} | {b['method']} ({b.get('from') or '-'}) | {b['recomputed_ops']} "
                f"| +{100 * b['overhead']:.2f}% | {format_bytes(b['budget_bytes'])} "
                f"| {format_bytes(b.get('remat_peak_bytes', b['reordered_peak_bytes']))} | {diffs} |"
            )
    names = {"memplan_budget": "memplan + budget", "fsdp2_ckpt": "FSDP2 + ckpt", "fsdp2": "FSDP2", "memplan": "memplan"}
    lines += [
        "",
        "| model | rank | peak | " + " | ".join(names[v] for v in BUDGET_VARIANTS) + " | budget / ckpt |",
        "|---|---|---|---|---|---|---|---|",
    ]
    above: list[str] = []
    for model, row in rows.items():
        for r in row["compare"]:
            rank = r["rank"]
            of = {
                "tracker": {v: tracker(r, v) for v in BUDGET_VARIANTS},
                "RSS": {v: row["rss"][v][rank]["peak_above_base"] for v in BUDGET_VARIANTS},
            }
            for kind, peak in of.items():
                cells = [format_bytes(peak[v]) for v in BUDGET_VARIANTS]
                ratio = peak["memplan_budget"] / peak["fsdp2_ckpt"]
                lines.append(f"| {model} | {rank} | {kind} | " + " | ".join(cells) + f" | {ratio:.3f} |")
            t = r["median_seconds"]
            cells = [f"{t[v]:.3f} s" for v in BUDGET_VARIANTS]
            ratio = t["memplan_budget"] / t["fsdp2_ckpt"]
            lines.append(f"| {model} | {rank} | step time | " + " | ".join(cells) + f" | {ratio:.3f} |")
            of["step time"] = t
            above += [
                f"{model} rank {rank}: {k}" for k, peak in of.items() if peak["memplan_budget"] >= peak["fsdp2_ckpt"]
            ]
    where = "; ".join(above) if above else "nowhere (every row, rank, peak and step time)."
    lines += ["", f"memplan + budget at or above FSDP2 + checkpoint: {where}"]
    return "\n".join(lines) + "\n"


def _above_eager(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Where memplan's peak (tracker or RSS) is not below eager FSDP2's or FSDP2 + checkpoint's."""
    found = []
    for model, row in rows.items():
        for r in row["compare"]:
            rank = r["rank"]
            for eager in fc.EAGER_VARIANTS:
                if tracker(r, "memplan") >= tracker(r, eager):
                    found.append(f"{model} rank {rank}: tracker above {eager}")
                rss_of = {v: row["rss"][v][rank]["peak_above_base"] for v in RSS_VARIANTS}
                if rss_of["memplan"] >= rss_of[eager]:
                    found.append(f"{model} rank {rank}: RSS above {eager}")
    return found


MP_ABOUT = {
    "bf16": "Every variant's units (blocks and root) under `MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
    "reduce_dtype=torch.float32)`: fp32 shards and AdamW state, parameters gathered and computed on in bf16, "
    "gradients reduce-scattered in fp32 (memplan's plan: bf16 all-gathers, fp32 reduce-scatters, as its "
    "collectives' dtypes below show). ",
}


def _steps(rows: dict[str, dict[str, Any]]) -> str:
    return "/".join(sorted({str(row.get("steps", STEPS)) for row in rows.values()}))


def _header(rows: dict[str, dict[str, Any]], world: int, mp: str | None = None) -> list[str]:
    title = "" if mp is None else f", {mp} mixed precision"
    lines = [
        f"# memplan vs eager FSDP2 (fully_shard) and FSDP2 + checkpoint-per-block{title}: {world} ranks, gloo, CPU",
        "",
        ("" if mp is None else MP_ABOUT[mp])
        + (
            ""
            if world <= 2
            else f"{world} ranks on 2 cores: the ranks and gloo's threads compete for the CPU, so the step times "
            "are noisier still and each row runs few steps. "
        )
        + "Each row regenerated by its command (a shared 2-core machine, up to 6 other jobs on it: the step times are "
        "noisy, compare them as ratios within a row). Blocks and root `fully_shard`-ed with FSDP2's defaults "
        "(blocks reshard after forward, the root does not), AdamW (lr 1e-2, weight decay 0.1), "
        f"{_steps(rows)} steps. fsdp2_ckpt: the same eager FSDP2 step with every block's forward under "
        "`torch.utils.checkpoint` (non-reentrant, RNG state preserved), applied before `fully_shard`. "
        + "memplan's all-gathers and reduce-scatters run asynchronously on a communication stream (gloo "
        "`async_op=True`), each waited for where the plan puts the wait; the plan tries every prefetch depth "
        "(0, 1, 2 units ahead) and wait policy (serial: each wait right after its launch; earliest: just "
        "before the first reader; next: each reduce-scatter waited for after the next launch) and keeps the "
        "smallest planned peak, ties to the most overlap (gloo's staging buffer of each collective in flight "
        "counted)."
        + (
            ""
            if mp is not None
            else f" memplan p{PREFETCH}: the same with the depth fixed at FSDP2's default ({PREFETCH} unit "
            "ahead, reduce-scatters waited for at the next launch)."
        ),
        "",
        "| model | what | command | minutes |",
        "|---|---|---|---|",
    ]
    for model, row in rows.items():
        about = MODELS.get(model, {}).get("about", "")
        lines.append(f"| {model} | {about} | `{row['command']}` | {row['seconds'] / 60:.1f} |")
    return lines


def _variants(row: dict[str, Any]) -> list[str]:
    """The variants a row compared (rows measured before the communication stream lack memplan p1)."""
    return [v for v in VARIANTS if v in row["compare"][0]["median_seconds"]]


NAMES = {"memplan": "memplan", FIXED: f"memplan p{PREFETCH}", "fsdp2": "FSDP2", "fsdp2_ckpt": "FSDP2 + ckpt"}


def _choice(r: dict[str, Any]) -> str:
    s = r.get("streams")
    return "synchronous (predates the stream)" if not s else f"prefetch {s['prefetch']}, {s['waits']} waits"


def render(rows: dict[str, dict[str, Any]], world: int, mp: str | None = None) -> str:
    lines = [
        *_header(rows, world, mp),
        "",
        "## Numerics: loss, gathered parameters, optimizer state",
        "",
        "Max abs difference of memplan's to each eager variant's after every step, each rank (memplan p"
        f"{PREFETCH}: its own to FSDP2's).",
        "",
        "| model | rank | steps | vs FSDP2, per step | vs FSDP2 + checkpoint, per step | memplan p1 vs FSDP2 "
        "| collectives in the plan | the plan's choice |" + ("" if mp is None else " their dtypes |"),
        "|---|---|---|---|---|---|---|---|" + ("" if mp is None else "---|"),
    ]
    for model, row in rows.items():
        for r in row["compare"]:
            dtypes = r.get("collective_dtypes", {})
            shown = "" if mp is None else " " + ", ".join(f"{k}: {'/'.join(v)}" for k, v in dtypes.items()) + " |"
            fixed = r.get("prefetch_diffs", "-")
            lines.append(
                f"| {model} | {r['rank']} | {len(r['diffs'])} | {r['diffs']} | {r['ckpt_diffs']} | {fixed} "
                f"| {r['collectives']} | {_choice(r)} |" + shown
            )
    lines += [
        "",
        "## Memory per rank",
        "",
        "tracker = what each variant holds between steps (shards, optimizer state, and memplan's arena) + the "
        "CPU allocator's peak above that during a steady step (profiler memory events). RSS = the process's "
        "peak resident set during one steady step of that variant alone, above its resident set before the "
        "model existed (no RSS job for memplan p1). Ratios: memplan's over FSDP2's, then over FSDP2 + "
        "checkpoint's. Step time = median of the compared steps (interleaved in one process).",
        "",
        "| model | rank | tracker memplan | memplan p1 | FSDP2 | FSDP2 + ckpt | ratios | RSS memplan | FSDP2 "
        "| FSDP2 + ckpt | ratios | arena | step memplan | memplan p1 | FSDP2 | FSDP2 + ckpt |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, row in rows.items():
        have = _variants(row)
        for r in row["compare"]:
            rank = r["rank"]
            tr = {v: tracker(r, v) for v in have}
            rs = {v: row["rss"][v][rank]["peak_above_base"] for v in RSS_VARIANTS}
            t = r["median_seconds"]
            cells = [
                *(format_bytes(tr[v]) if v in tr else "-" for v in VARIANTS),
                " / ".join(f"{tr['memplan'] / tr[v]:.3f}" for v in fc.EAGER_VARIANTS),
                *(format_bytes(rs[v]) for v in RSS_VARIANTS),
                " / ".join(f"{rs['memplan'] / rs[v]:.3f}" for v in fc.EAGER_VARIANTS),
                format_bytes(r["arena_bytes"]),
                *(f"{t[v]:.3f} s" if v in t else "-" for v in VARIANTS),
            ]
            lines.append(f"| {model} | {rank} | " + " | ".join(cells) + " |")
    above = _above_eager(rows)
    where = "; ".join(above) if above else "nowhere (every row, rank and peak)."
    lines += ["", f"memplan at or above an eager variant: {where}"]
    if mp is None:
        lines += _choices_and_overlap(rows, world)
    return "\n".join(lines) + "\n"


def _choices_and_overlap(rows: dict[str, dict[str, Any]], world: int) -> list[str]:
    """The plan's candidates (rank 0) and the measured overlap of one profiled step per variant."""
    lines = [
        "",
        "## The plan's choice and the overlap",
        "",
        "Rank 0's candidates, each ordered and placed: planned peak (persistent + arena + the allocator's "
        "tensors, gloo's staging buffers among them) and overlap ops (compute ops run while a collective is in "
        "flight, summed over collectives); the chosen one is marked *. Overlap measured on one profiled step "
        "per variant (rank 0): the share of the time gloo ran a collective during which the compute thread ran "
        "an op (`memplan.torch.distributed.timeline.overlap`), and the collectives' total time. Chrome traces: "
        "`" + trace_path("MODEL", world).name + "` (chrome://tracing or ui.perfetto.dev).",
        "",
        "| model | candidates: planned peak (overlap ops) | why | overlap memplan | memplan p1 | FSDP2 |",
        "|---|---|---|---|---|---|",
    ]
    for model, row in rows.items():
        r = row["compare"][0]
        s, o = r.get("streams"), r.get("overlap")
        if not s or not o:
            lines.append(f"| {model} | not rerun since the communication stream | | | | |")
            continue
        shown = []
        for c in s["candidates"]:
            mark = "*" if (c["prefetch"], c["waits"]) == (s["prefetch"], s["waits"]) else ""
            shown.append(
                f"{mark}p{c['prefetch']} {c['waits']}: {format_bytes(c['planned_peak_bytes'])} ({c['overlap_ops']})"
            )
        cells = [f"{100 * o[v]['fraction']:.0f}% of {o[v]['comm_us'] / 1e6:.3f} s" for v in ("memplan", FIXED, "fsdp2")]
        lines.append(f"| {model} | " + "; ".join(shown) + f" | {s['why']} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="the rows to measure (none: render); the others are kept")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--budget", type=float, default=None, help="memplan under this memory_budget too")
    parser.add_argument("--mp", default=None, choices=list(MP_POLICIES), help="every variant in mixed precision")
    parser.add_argument("--steps", type=int, default=STEPS, help="compared steps per row")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.mp and args.budget is not None:
        raise SystemExit("--mp and --budget: one at a time")
    models = MODELS if args.budget is None else BUDGET_MODELS
    name = "fsdp.md" if args.budget is None else "fsdp_budget.md"
    name = name if args.mp is None else "fsdp_mp.md"  # bf16, the one policy so far
    if args.nproc != 2:
        name = name.replace(".md", f"_{args.nproc}ranks.md")
    out = Path(args.out or RESULTS / name)
    kept = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else {}
    kept = {m: row for m, row in kept.items() if "ckpt_diffs" in row["compare"][0]}  # rows of this bench's form
    chosen = ",".join(models) if args.models is None else args.models
    for model in filter(None, chosen.split(",")):
        if model not in models:
            raise SystemExit(f"unknown model {model!r}; choose from {', '.join(models)}")
        kept[model] = measure(model, args.nproc, args.budget, args.mp, args.steps)
        out.with_suffix(".json").write_text(json.dumps(kept, indent=1) + "\n")
        print(model, "done", flush=True)
    rows = {m: kept[m] for m in models if m in kept}
    text = render(rows, args.nproc, args.mp) if args.budget is None else render_budget(rows, args.nproc)
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
