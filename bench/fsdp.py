"""memplan's planned FSDP2 step vs eager FSDP2 (``fully_shard``): spawned gloo ranks, CPU.

For each model, the blocks and the root are ``fully_shard``-ed (FSDP2's defaults: blocks reshard
after forward, the root does not), with AdamW. One spawned job trains every rank with memplan and
with eager FSDP2 from the same seed, compares the loss, every gathered parameter and every
optimizer state tensor after every step, and measures the last step with the profiler's
allocator events; then one job per variant measures the process's peak RSS (VmHWM, reset just
before a steady step) of that variant alone.

    python bench/fsdp.py                     # writes bench/results/fsdp.md (+ .json)
    python bench/fsdp.py --models mlp        # a quick run
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
STEPS = {"mlp": 5, "gpt2-2l": 3}


def workload(model: str) -> tuple[Any, Any, Any]:
    """``(build(seed), batch, loss_fn)`` of a bench model on this rank."""
    rank = dist.get_rank()
    if model == "mlp":
        return (lambda seed: fc.mlp(seed, width=1000, depth=4)), fc.mlp_batch(rank, size=64), fc.cross_entropy
    from memplan.torch.zoo import build_workload

    w = build_workload(model, 2, seed=rank)
    return (lambda seed: build_workload(model, 2, seed=seed).model), (w.inputs, w.target), w.loss_fn


def compare(model: str) -> dict[str, Any]:
    build, batch, loss_fn = workload(model)
    return fc.compare_with_fsdp2(build, batch, steps=STEPS.get(model, 3), loss_fn=loss_fn)


def rss(model: str, variant: str) -> dict[str, Any]:
    build, batch, loss_fn = workload(model)
    return fc.measure_rss(build, batch, variant, loss_fn=loss_fn)


def tracker(r: dict[str, Any], variant: str) -> int:
    return r["held_bytes"][variant] + r["step_peak_bytes"][variant]


def render(rows: dict[str, dict[str, Any]], world: int, command: str, seconds: float) -> str:
    lines = [
        f"# memplan vs eager FSDP2 (fully_shard): {world} ranks, gloo, CPU",
        "",
        f"Regenerate: `{command}` ({seconds / 60:.0f} min here, on a shared 2-core machine: the step times are "
        "noisy, compare them as ratios within a row). Blocks and root `fully_shard`-ed with FSDP2's defaults "
        "(blocks reshard after forward, the root does not), AdamW (lr 1e-2, weight decay 0.1); mlp: 4 blocks "
        "of Linear(1003) + GELU (uneven shards), batch 64; gpt2-2l: HF GPT-2 with 2 layers, 2 x 128 tokens "
        "(tied embedding). memplan's collectives run synchronously at their planned place (no communication "
        "stream yet).",
        "",
        "## Numerics: loss, gathered parameters, optimizer state",
        "",
        "Max abs difference to eager FSDP2 after every step, each rank.",
        "",
        "| model | rank | steps | max abs diff per step | collectives in the plan |",
        "|---|---|---|---|---|",
    ]
    for model, row in rows.items():
        for r in row["compare"]:
            lines.append(f"| {model} | {r['rank']} | {len(r['diffs'])} | {r['diffs']} | {r['collectives']} |")
    lines += [
        "",
        "## Memory per rank",
        "",
        "tracker = what each variant holds between steps (shards, optimizer state, and memplan's arena) + the "
        "CPU allocator's peak above that during a steady step (profiler memory events). RSS = the process's "
        "peak resident set during one steady step of that variant alone, above its resident set before the "
        "model existed. Step time = median of the compared steps (interleaved in one process).",
        "",
        "| model | rank | memplan tracker | FSDP2 tracker | ratio | memplan RSS | FSDP2 RSS | ratio "
        "| arena | memplan step | FSDP2 step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, row in rows.items():
        for r in row["compare"]:
            rank = r["rank"]
            ours, eager = tracker(r, "memplan"), tracker(r, "fsdp2")
            rss_ours = row["rss"]["memplan"][rank]["peak_above_base"]
            rss_eager = row["rss"]["fsdp2"][rank]["peak_above_base"]
            t = r["median_seconds"]
            lines.append(
                f"| {model} | {rank} | {format_bytes(ours)} | {format_bytes(eager)} | {ours / eager:.3f} "
                f"| {format_bytes(rss_ours)} | {format_bytes(rss_eager)} | {rss_ours / rss_eager:.3f} "
                f"| {format_bytes(r['arena_bytes'])} | {t['memplan']:.3f} s | {t['fsdp2']:.3f} s |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,gpt2-2l")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "fsdp.md"))
    args = parser.parse_args()
    start = time.perf_counter()
    rows: dict[str, dict[str, Any]] = {}
    for model in args.models.split(","):
        row: dict[str, Any] = {"compare": fc.run_ranks(args.nproc, compare, model), "rss": {}}
        for variant in ("memplan", "fsdp2"):
            row["rss"][variant] = fc.run_ranks(args.nproc, rss, model, variant)
        for r in [*row["compare"], *row["rss"]["memplan"], *row["rss"]["fsdp2"]]:
            if "error" in r:
                raise SystemExit(f"{model}: a rank failed:\n{r['error']}")
        rows[model] = row
        print(model, "done", flush=True)
    command = "python bench/fsdp.py" + ("" if args.models == "mlp,gpt2-2l" else f" --models {args.models}")
    out = Path(args.out)
    out.write_text(render(rows, args.nproc, command, time.perf_counter() - start))
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
