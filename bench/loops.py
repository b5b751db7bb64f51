"""The training loops people write, planned by memplan.compile and run eagerly: one row per loop
feature on an MLP and on HF BERT and GPT-2 (2 layers each, from configs, random weights).

Each row runs the same step function eagerly and planned for 3 steps from the same weights and
seed, compares parameters, gradients, buffers, optimizer/scheduler/scaler state and the random
generator bit for bit after every step (memplan.torch.loops), then measures more steady-state
steps of each: the bytes it holds at its peak beyond parameters, optimizer state and the batch
(the CPU allocator's count during the step; for memplan plus its arena).

    python bench/loops.py                        # writes bench/results/loops.md
    python bench/loops.py --models mlp,bert      # some models only (mlp, bert, gpt2)
    python bench/loops.py --features foreach     # features whose name contains a word

The table is written again after every row, labelled partial until every selected row is in.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

from memplan.report.format import format_bytes
from memplan.torch.loops import FEATURES, bert, gpt2, mlp, run_feature

MODELS = {
    "mlp": lambda: mlp(width=1024, batch=32),
    "bert": lambda: bert(batch=8, seq=128),
    "gpt2": lambda: gpt2(batch=8, seq=128),
    # fp16 matmuls are slow on CPU: the GPT-2 float16 row at 1/8 of the tokens (not in the default run)
    "gpt2-small-batch": lambda: gpt2(batch=2, seq=64),
}
DEFAULT_MODELS = "mlp,bert,gpt2"


def _option(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main() -> None:
    warnings.filterwarnings("ignore")
    out = Path(_option("--out", "bench/results/loops.md"))
    models = [MODELS[m]() for m in _option("--models", DEFAULT_MODELS).split(",")]
    words = [w for w in _option("--features", "").split(",") if w]
    features = [f for f in FEATURES.values() if not words or any(w in f.name for w in words)]
    command = " ".join(["python", "bench/loops.py", *sys.argv[1:]])
    rows, start, works, below = [], time.perf_counter(), 0, 0
    total = len(models) * len(features)
    for spec in models:
        for feature in features:
            r = run_feature(spec, feature, steps=3, measure=True)
            if r.works:
                works += 1
                below += r.planned_peak_bytes < r.eager_peak_bytes
                ratio = r.planned_peak_bytes / r.eager_peak_bytes if r.eager_peak_bytes else float("nan")
                peaks = f"{format_bytes(r.planned_peak_bytes)} | {format_bytes(r.eager_peak_bytes)}"
                cells = f"yes | {r.max_abs_diff} | {peaks} | {ratio:.3f}"
            else:
                cells = f"**no**: {r.detail} | | | |"
            rows.append(f"| {spec.name} | {feature.name} | {cells} |")
            print(rows[-1], flush=True)
            seconds = time.perf_counter() - start
            out.write_text(_table(command, rows, total, works, below, seconds))
    print(f"wrote {out}")


def _table(command: str, rows: list[str], total: int, works: int, below: int, seconds: float) -> str:
    partial = (
        [f"**Partial run**: {len(rows)} of {total} rows so far (the table is written after every row).", ""]
        if len(rows) < total
        else []
    )
    lines = [
        "# Training loops: the step-function form against the same function run eagerly",
        "",
        f"`{command}`",
        "",
        "Each step function (memplan.torch.loops) runs eagerly and through `memplan.compile` from the same",
        "weights and seed; after every step parameters, gradients, buffers, optimizer, LR scheduler and",
        'GradScaler state and the random generator are compared bit for bit ("max abs diff" is over the',
        "parameters). Peak: the most bytes a step holds beyond parameters, optimizer state and batch, by the",
        "CPU allocator's own count (counted from its level at the step's start; for memplan plus its arena,",
        "mapped before the step), over 3 steps after the compared ones, each side drawing the same random",
        "numbers. memplan's planned allocator records its first steps on the ordinary allocator and then",
        "replays a placed trace; a step of a kind the trace does not cover (a GradScaler step that updates",
        "after a plan recorded on skipped ones) runs on the ordinary allocator and, seen twice, is placed",
        "with it as a branch of the plan. The compared steps go on (at most 8 more) until the latest one",
        "was served by the plan and none waits to become a branch, so the measured steps are its steady",
        "state. MLP: 1024 wide, batch 32; BERT and GPT-2: 2 layers, hidden 768,",
        "batch 8 x 128 tokens, AdamW. The GradScaler rows start at a scale of 2^20, which overflows",
        "float16: the first steps are skipped (and must be skipped by memplan too), later ones update, and",
        "with growth every 2 steps some measured steps skip again.",
        "",
        *partial,
        f"{works}/{len(rows)} rows train bit for bit like eager; memplan's peak is below eager's on {below}"
        f" ({seconds:.0f} s on a shared 2-core machine; the time depends on its load, memory does not).",
        "",
        "| model | loop feature | works | max abs diff | memplan peak | eager peak | memplan / eager |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
