"""memplan's data-parallel step vs PyTorch's DistributedDataParallel: ranks under torchrun, gloo, CPU.

For each model, one torchrun job trains every rank with memplan and with DDP (gradient_as_bucket_view
False and True) from the same state and seed, compares loss and parameters after every step, times
the steps (interleaved in one process), measures memory with the profiler's allocator events, and
profiles one more step of each for the timeline. Then one torchrun job per model and variant
measures the process's peak RSS (VmHWM, reset through /proc/self/clear_refs) during a steady step
of that variant alone. Optionally: memplan's wait policies, and a run with more ranks.

    python bench/ddp.py                                   # writes bench/results/ddp.md (+ .json, timelines)
    python bench/ddp.py --models mlp --policy-models "" --nproc-exactness 0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from memplan.report.format import format_bytes
from memplan.torch.distributed.timeline import plot_timeline, write_chrome_trace
from memplan.torch.distributed.worker import launch_command

RESULTS = Path(__file__).parent / "results"
VARIANTS = ("memplan", "ddp", "ddp-view")
TITLES = {"memplan": "memplan", "ddp": "DDP", "ddp-view": "DDP, grad. as bucket view"}


def worker(nproc: int, args: list[str]) -> list[dict[str, Any]]:
    """Run the worker on ``nproc`` ranks and return every rank's report."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
        done = subprocess.run(
            launch_command(nproc, [*args, "--out", str(out)]), capture_output=True, text=True, env=env
        )
        if done.returncode != 0 or not out.exists():
            sys.exit(f"worker {' '.join(args)} failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def peak(v: dict[str, Any]) -> int:
    """Tracker peak of one variant: resident tensors + the allocator's peak over the step + DDP's buckets."""
    return v["resident_bytes"] + v["step_peak_bytes"] + v["bucket_bytes"]


def correctness_rows(model: str, ranks: list[dict[str, Any]]) -> list[str]:
    rows = []
    for r in ranks:
        v = r["variants"]
        rows.append(
            f"| {model} | {r['world_size']} | {r['rank']} | {r['compared_steps']} | {v['ddp']['max_abs_diff']} "
            f"| {v['ddp-view']['max_abs_diff']} | {r['loss_max_abs_diff']} | {r['param_spread_over_ranks']} "
            f"| {r['plan']['buckets']} | {'yes' if all(r['buckets_as_ddp'].values()) else 'NO'} |"
        )
    return rows


def memory_rows(model: str, ranks: list[dict[str, Any]]) -> list[str]:
    rows = []
    for r in ranks:
        v = r["variants"]
        m, d, dv = peak(v["memplan"]), peak(v["ddp"]), peak(v["ddp-view"])
        claimed = r["claimed_peak_bytes"]
        rows.append(
            f"| {model} | {r['rank']} | {format_bytes(m)} | {format_bytes(claimed)} | {m - claimed} "
            f"| {format_bytes(d)} | {format_bytes(dv)} | {m / d:.3f} | {m / dv:.3f} "
            f"| {format_bytes(r['plan']['arena_bytes'])} | {format_bytes(r['plan']['allocator_peak_bytes'])} |"
        )
    return rows


def rss_rows(model: str, rss: dict[str, list[dict[str, Any]]]) -> list[str]:
    rows = []
    for rank in range(len(rss["memplan"])):
        runs = {name: rss[name][rank] for name in VARIANTS}
        m = runs["memplan"]
        cells = " | ".join(
            f"{format_bytes(runs[n]['peak_bytes'])} ({format_bytes(runs[n]['peak_above_base_bytes'])})"
            for n in VARIANTS
        )
        ratios = " | ".join(
            f"{m['peak_above_base_bytes'] / runs[n]['peak_above_base_bytes']:.3f}" for n in ("ddp", "ddp-view")
        )
        rows.append(f"| {model} | {rank} | {cells} | {ratios} | {format_bytes(m['claimed_peak_bytes'])} |")
    return rows


def time_rows(model: str, ranks: list[dict[str, Any]]) -> list[str]:
    rows = []
    for r in ranks:
        v = r["variants"]
        s = {n: v[n]["step_seconds"] for n in VARIANTS}
        o = {n: v[n]["overlap"] for n in VARIANTS}
        overlap = " | ".join(f"{100 * o[n]['fraction']:.0f}% of {o[n]['comm_us'] / 1e6:.3f} s" for n in VARIANTS)
        rows.append(
            f"| {model} | {r['rank']} | {s['memplan']:.3f} | {s['ddp']:.3f} | {s['ddp-view']:.3f} "
            f"| {s['memplan'] / s['ddp']:.3f} | {s['memplan'] / s['ddp-view']:.3f} | {overlap} |"
        )
    return rows


def policy_row(model: str, waits: str, ranks: list[dict[str, Any]]) -> str:
    r = ranks[0]
    v = r["variants"]
    m = peak(v["memplan"])
    s = v["memplan"]["step_seconds"]
    overlap = v["memplan"]["overlap"]
    share = "" if overlap is None else f"{100 * overlap['fraction']:.0f}%"
    return (
        f"| {model} | {waits} | {format_bytes(r['plan']['arena_bytes'])} | {format_bytes(m)} "
        f"| {m / peak(v['ddp-view']):.3f} | {s:.3f} | {s / v['ddp-view']['step_seconds']:.3f} | {share} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,resnet50,gpt2-2l")
    parser.add_argument("--batch", type=int, default=8, help="per rank")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--waits", default="next-bucket")
    parser.add_argument("--policy-models", default="mlp,resnet50,gpt2-2l", help="models to try every wait policy on")
    parser.add_argument("--nproc-exactness", type=int, default=3, help="also train mlp on this many ranks (0: skip)")
    parser.add_argument("--skip-rss", action="store_true")
    parser.add_argument("--out", default=str(RESULTS / "ddp.md"))
    args = parser.parse_args()
    command = " ".join(["python bench/ddp.py", *sys.argv[1:]])
    models = [m for m in args.models.split(",") if m]
    common = ["--batch", str(args.batch), "--optimizer", args.optimizer, "--time-limit", str(args.time_limit)]
    start = time.perf_counter()

    compared: dict[str, list[dict[str, Any]]] = {}
    rss: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for model in models:
        print(f"[{time.perf_counter() - start:.0f} s] {model}: memplan vs DDP, {args.nproc} ranks", flush=True)
        ranks = worker(args.nproc, [model, *common, "--steps", str(args.steps), "--waits", args.waits, "--trace", "1"])
        traces = {f"{TITLES[n]} (rank 0)": ranks[0]["trace_events"][n] for n in VARIANTS}
        write_chrome_trace(RESULTS / f"ddp-{model}.trace.json", traces)
        plot_timeline(RESULTS / f"ddp-{model}.png", traces, f"{model}, batch {args.batch} per rank, one profiled step")
        for r in ranks:
            r.pop("trace_events")
        compared[model] = ranks
        if not args.skip_rss:
            rss[model] = {}
            for variant in VARIANTS:
                print(f"[{time.perf_counter() - start:.0f} s] {model}: peak RSS of {variant}", flush=True)
                rss[model][variant] = worker(args.nproc, [model, *common, "--waits", args.waits, "--rss", variant])
    policies: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for model in [m for m in args.policy_models.split(",") if m]:
        policies[model] = {}
        for waits in ("earliest", "next-bucket", "end-of-backward"):
            if waits == args.waits and model in compared:
                policies[model][waits] = compared[model]
                continue
            print(f"[{time.perf_counter() - start:.0f} s] {model}: waits {waits}", flush=True)
            ranks = worker(args.nproc, [model, *common, "--steps", str(args.steps), "--waits", waits, "--trace", "1"])
            for r in ranks:
                r.pop("trace_events")
            policies[model][waits] = ranks
    exactness = None
    if args.nproc_exactness:
        print(f"[{time.perf_counter() - start:.0f} s] mlp on {args.nproc_exactness} ranks", flush=True)
        exactness = worker(args.nproc_exactness, ["mlp", *common, "--steps", str(args.steps), "--waits", args.waits])
    total = time.perf_counter() - start

    raw = {"command": command, "compared": compared, "rss": rss, "policies": policies, "exactness": exactness}
    Path(args.out).with_suffix(".json").write_text(json.dumps(raw, indent=1, default=str) + "\n")
    Path(args.out).write_text(render(args, command, compared, rss, policies, exactness, total))
    print(f"wrote {args.out}")


def render(args, command, compared, rss, policies, exactness, total) -> str:
    lines = [
        f"# memplan vs DistributedDataParallel: {args.nproc} ranks, gloo, CPU, batch {args.batch} per rank",
        "",
        f"Regenerate: `{command}` ({total / 60:.0f} min here). Optimizer: {args.optimizer} (momentum 0.9); "
        f"DDP's default buckets (25 MiB, first 1 MiB); memplan's waits: {args.waits}; solver limit "
        f"{args.time_limit} s. Every rank builds its model and data from its own seed; memplan and DDP both "
        "broadcast rank 0's parameters and buffers at construction and the buffers before every step.",
        "",
        "## Numerics: loss and parameters identical on every rank",
        "",
        "Max abs diff of loss, parameters and buffers between memplan and each DDP after every step (the timed "
        "steps, the memory step and the profiled step); spread = largest difference of any parameter between "
        "this rank and rank 0; buckets = memplan's buckets are DDP's rebuilt buckets, member for member.",
        "",
        "| model | ranks | rank | steps | vs DDP | vs DDP (view) | loss vs DDP | param spread | buckets | as DDP's |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, ranks in compared.items():
        lines += correctness_rows(model, ranks)
    if exactness:
        lines += correctness_rows("mlp", exactness)
        worst = max(max(v["max_abs_diff"] for v in r["variants"].values()) for r in exactness)
        lines += [
            "",
            f"With {exactness[0]['world_size']} ranks the difference is {worst:.3g}, not 0: gloo's ring all-reduce "
            "sums each chunk of the buffer starting from another rank, so an element's summation order depends on "
            "its position in the buffer; memplan pads each gradient of a bucket to the arena's 64-byte alignment, "
            "which shifts positions against DDP's unpadded bucket (same members, same order). With 2 ranks every "
            "element is a + b = b + a, so the layout cannot matter and the result is bit-identical.",
        ]
    lines += [
        "",
        "## Memory per rank (allocator tracker)",
        "",
        "measured = parameters, buffers, optimizer state, batch and arena (memplan) resident + the CPU allocator's "
        "peak during a steady step (profiler memory events) + for DDP its buckets (every gradient once, held by "
        "its reducer for the model's life). claimed = what the plan says before the step: persistent + arena + "
        "at each op, tensors left to the allocator + the op's scratch (`claimed_peak_bytes`). The difference is "
        "what kernels allocate inside themselves, which no plan of arena views sees.",
        "",
        "| model | rank | memplan measured | claimed | measured - claimed (bytes) | DDP | DDP (view) "
        "| memplan / DDP | memplan / DDP (view) | arena | left to allocator (peak) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, ranks in compared.items():
        lines += memory_rows(model, ranks)
    if rss:
        lines += [
            "",
            "## Memory per rank (process peak RSS)",
            "",
            "Each variant alone in its own torchrun job: VmHWM of the process during one steady step (reset "
            "through /proc/self/clear_refs just before it); in brackets, above the process's RSS after imports "
            "and the process group, before the model (the libraries of both, OR-Tools included, are loaded "
            "first). Ratios compare the bracketed figures.",
            "",
            "| model | rank | memplan | DDP | DDP (view) | memplan / DDP | memplan / DDP (view) | claimed |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for model, by_variant in rss.items():
            lines += rss_rows(model, by_variant)
    lines += [
        "",
        "## Time and overlap",
        "",
        "Median seconds of the timed steps, the three interleaved in one process per rank. Overlap: in one "
        "profiled step, the share of the time some all-reduce ran (gloo's threads) during which the compute "
        "thread was running an op (not waiting). Timelines, one lane per stream: `ddp-MODEL.png`, Chrome traces "
        "`ddp-MODEL.trace.json` (chrome://tracing or ui.perfetto.dev).",
        "",
        "| model | rank | memplan s | DDP s | DDP (view) s | memplan / DDP | memplan / DDP (view) "
        "| overlap memplan | overlap DDP | overlap DDP (view) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, ranks in compared.items():
        lines += time_rows(model, ranks)
    if policies:
        lines += [
            "",
            "## memplan's wait policies (rank 0)",
            "",
            "earliest: each wait where the reordering puts it (the smallest peak; a bucket's updates may follow its "
            "all-reduce at once, whose time the compute thread then waits out); next-bucket: each wait after the "
            "next bucket's all-reduce is launched; end-of-backward: every wait after the last launch, as DDP.",
            "",
            "| model | waits | arena | measured peak | / DDP (view) | step s | / DDP (view) | overlap |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for model, by_policy in policies.items():
            for waits, ranks in by_policy.items():
                lines.append(policy_row(model, waits, ranks))
    lines += ["", "Plans (rank 0):", ""]
    for model, ranks in compared.items():
        p = ranks[0]["plan"]
        sizes = ", ".join(format_bytes(b) for b in p["bucket_bytes"])
        lines.append(
            f"- {model}: {p['num_ops']} ops, {p['buckets']} buckets ({sizes}); "
            f"order {p['schedule']['method']} {p['schedule']['status']} in {p['schedule']['seconds']} s; arena "
            f"{format_bytes(p['arena_bytes'])} vs lower bound {format_bytes(p['arena_lower_bound_bytes'])} "
            f"({p['placement']['method']}, {p['placement']['status']}); {p['unsafe_pairs']} unsafe pairs; execution "
            f"check {'exhaustive' if p['stream_check']['exhaustive'] else 'sampled'} ({p['stream_check']['states']}), "
            f"safe; planned in {ranks[0]['plan_seconds']} s."
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
