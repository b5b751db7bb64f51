"""The training loops people write, planned by memplan.compile and run eagerly: one row per loop
feature on an MLP and on HF BERT and GPT-2 (2 layers each, from configs, random weights).

Each row runs the same step function eagerly and planned for 3 steps from the same weights and
seed, compares parameters, gradients, buffers, optimizer/scheduler/scaler state and the random
generator bit for bit after every step (memplan.torch.loops), then measures one more
steady-state step of each: the bytes it holds at its peak beyond parameters, optimizer state and
the batch (the CPU allocator's count during the step; for memplan plus its arena).

    python bench/loops.py            # writes bench/results/loops.md
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

from memplan.report.format import format_bytes
from memplan.torch.loops import FEATURES, bert, gpt2, mlp, run_feature

MODELS = [mlp(width=1024, batch=32), bert(batch=8, seq=128), gpt2(batch=8, seq=128)]


def main() -> None:
    warnings.filterwarnings("ignore")
    out = Path(sys.argv[sys.argv.index("--out") + 1]) if "--out" in sys.argv else Path("bench/results/loops.md")
    rows, start, works, below = [], time.perf_counter(), 0, 0
    for spec in MODELS:
        for feature in FEATURES.values():
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
    lines = [
        "# Training loops: the step-function form against the same function run eagerly",
        "",
        "`python bench/loops.py`",
        "",
        "Each step function (memplan.torch.loops) runs eagerly and through `memplan.compile` for 3 steps",
        "from the same weights and seed; after every step parameters, gradients, buffers, optimizer, LR",
        'scheduler and GradScaler state and the random generator are compared bit for bit ("max abs diff" is',
        "over the parameters). Peak: the bytes one more steady-state step holds beyond parameters, optimizer",
        "state and batch, by the CPU allocator's own count (for memplan plus its arena, mapped before the step).",
        "MLP: 1024 wide, batch 32; BERT and GPT-2: 2 layers, hidden 768, batch 8 x 128 tokens, AdamW.",
        "The GradScaler rows start at a scale of 2^20, which overflows float16: the first steps are skipped",
        "(and must be skipped by memplan too), the later ones update.",
        "",
        f"{works}/{len(rows)} rows train bit for bit like eager; memplan's peak is below eager's on {below}"
        f" ({time.perf_counter() - start:.0f} s).",
        "",
        "| model | loop feature | works | max abs diff | memplan peak | eager peak | memplan / eager |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
