"""Capture fidelity and capture cost over the zoo.

Fidelity: for models cheap enough to run eagerly on a CPU, the program-order peak of the
captured graph against the live-bytes peak measured on a real eager run of the same step.
Cost: capture seconds and graph size for every zoo model at batch 32, and ResNet-50 at 256.

    python bench/capture.py            # writes bench/results/capture.md
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

from memplan.graph import peak_bytes, peak_lower_bound
from memplan.report.format import format_bytes
from memplan.torch.capture import capture_train_step
from memplan.torch.measure import measure_train_step
from memplan.torch.zoo import build_workload, capture_model, list_models, make_optimizer

FIDELITY_CASES = [
    (model, batch, opt)
    for model, batches in [
        ("mlp", (8, 64)),
        ("vgg16", (2, 16)),
        ("gpt2-2l", (1, 4)),
        ("unet", (1, 2)),
        ("lstm", (2, 8)),
        ("resnet50", (1, 2)),
    ]
    for batch in batches
    for opt in ("sgd", "adam")
]


def fidelity_rows() -> list[str]:
    rows = []
    for model, batch, opt in FIDELITY_CASES:
        w = build_workload(model, batch)
        w.model.train()
        optimizer = make_optimizer(opt, w.model.parameters())
        measured = measure_train_step(w.model, optimizer, w.loss_fn, (w.inputs, w.target))
        graph = capture_train_step(w.model, optimizer, w.loss_fn, (w.inputs, w.target)).graph
        estimated = peak_bytes(graph, graph.program_order())
        error = (estimated - measured) / measured
        rows.append(f"| {model} | {batch} | {opt} | {estimated} | {measured} | {100 * error:+.2f}% |")
        print(rows[-1], flush=True)
    return rows


def cost_rows() -> list[str]:
    rows = []
    cases = [(m, 32, "adam") for m in list_models()] + [("resnet50", 256, "sgd")]
    for model, batch, opt in cases:
        start = time.perf_counter()
        cap = capture_model(model, batch, "train", opt)
        total = time.perf_counter() - start
        g = cap.graph
        peak = peak_bytes(g, g.program_order())
        rows.append(
            f"| {model} | {batch} | {opt} | {g.num_ops} | {g.num_tensors} | {format_bytes(g.persistent_bytes)} | "
            f"{format_bytes(peak)} | {format_bytes(peak_lower_bound(g))} | {cap.capture_seconds:.2f} | {total:.2f} |"
        )
        print(rows[-1], flush=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rows.append(f"\nMax RSS of the whole run: {rss:.0f} MiB.")
    return rows


def main() -> None:
    out = Path(__file__).parent / "results" / "capture.md"
    lines = [
        "# Capture fidelity and cost",
        "",
        "Regenerate: `python bench/capture.py` (CPU, PyTorch 2.13).",
        "",
        "## Program-order peak of the captured graph vs the measured eager peak (bytes)",
        "",
        "| model | batch | optimizer | captured graph | measured eager | difference |",
        "|---|---|---|---|---|---|",
        *fidelity_rows(),
        "",
        "## Capture cost (training step, FakeTensors, nothing allocated)",
        "",
        "| model | batch | optimizer | ops | tensors | persistent | program-order peak | lower bound | "
        "trace s | total s |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *cost_rows(),
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
