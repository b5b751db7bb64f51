"""HF architectures at large, planned vs eager: bit for bit, and peak memory.

Every entry of memplan.torch.architectures (encoders, decoders, encoder-decoders, vision,
mixtures of experts, speech) is built from a small config (random weights, nothing downloaded),
its labels in the batch and its loss taken from the model's output, and trained 3 steps through
memplan.compile_step and eagerly from the same weights, seed and batch (AdamW); after every step
parameters, gradients, buffers, optimizer state and the random generator are compared bit for
bit. Then one more steady-state step of each side is measured as `memplan run` measures
(memplan.torch.compare: the CPU allocator's peak during the step plus the resident parameters,
buffers, optimizer state, batch and, for memplan, its arena).

    python bench/architectures.py                  # SMALL: writes bench/results/architectures.md
    python bench/architectures.py --size tiny      # the sizes of the unit test
    python bench/architectures.py llama t5         # some entries only (printed, not written)
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from pathlib import Path

import torch
from memplan.torch.architectures import ARCHITECTURES, SMALL, TINY, ArchitectureResult, Size, run_architecture

STEPS = 3


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def _outcome(arch, r: ArchitectureResult) -> str:
    if r.outcome == "equal":
        return "works, bit-exact"
    if r.outcome == "different" and arch.tolerance and r.max_abs_diff <= arch.tolerance:
        return f"works, differs within {arch.tolerance:g}: {arch.differs_because}"
    if r.outcome == "refused":
        return f"refused: {r.detail}"
    return f"**{r.outcome}**: {r.detail}"


def _row(r: ArchitectureResult) -> str:
    arch = ARCHITECTURES[r.name]
    peaks = ["", "", "", ""]
    if r.eager_peak_bytes:
        ratio = r.memplan_peak_bytes / r.eager_peak_bytes
        peaks = [_mib(r.memplan_peak_bytes), _mib(r.eager_peak_bytes), f"{ratio:.3f}", _mib(r.planned_peak_bytes)]
    diff = f"{r.max_abs_diff:.3g}" if r.outcome in ("equal", "different") else ""
    cells = [r.name, r.family, f"`{arch.model_class}`", _outcome(arch, r), diff, *peaks, f"{r.seconds:.0f}"]
    return "| " + " | ".join(cells) + " |"


def _size_text(size: Size) -> str:
    return (
        f"hidden {size.hidden}, {size.layers} layers, {size.heads} heads, vocabulary {size.vocab}, "
        f"{size.seq} tokens x batch {size.batch}, images {size.image}x{size.image}, audio {size.audio_samples} samples"
    )


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = sys.argv[1:]
    size = SMALL
    if "--size" in args:
        size = {"tiny": TINY, "small": SMALL}[args[args.index("--size") + 1]]
        del args[args.index("--size") : args.index("--size") + 2]
    names = args or list(ARCHITECTURES)
    start = time.perf_counter()
    results, rows = [], []
    for name in names:
        r = run_architecture(name, size, STEPS, measure_memory=True, time_limit_seconds=10.0)
        results.append(r)
        rows.append(_row(r))
        print(rows[-1], flush=True)
    if args:
        return
    works = [
        r for r in results if r.outcome in ("equal", "different") and "works" in _outcome(ARCHITECTURES[r.name], r)
    ]
    exact = [r for r in results if r.outcome == "equal"]
    refused = [r for r in results if r.outcome == "refused"]
    below = [r for r in works if r.eager_peak_bytes and r.memplan_peak_bytes < r.eager_peak_bytes]
    ratios = sorted(r.memplan_peak_bytes / r.eager_peak_bytes for r in works if r.eager_peak_bytes)
    lines = [
        "# HF architectures: planned vs eager",
        "",
        "`python bench/architectures.py`",
        "",
        f"torch {torch.__version__}, transformers {_transformers_version()}. Each architecture is built from a",
        f"small config ({_size_text(size)}), random weights from one seed, nothing downloaded. Its labels",
        "are in the batch and the loss is the model's own (`memplan.compile_step(model, opt, lambda out, t: out.loss,",
        f"(batch, None))`); {STEPS} steps of AdamW through memplan and eagerly from the same weights, seed and batch,",
        "compared bit for bit after every step (parameters, gradients, buffers, optimizer state, random",
        "generator). Max abs diff is over the loss and all of these. Peaks: one more steady-state step of each",
        "side, measured as `memplan run` measures (allocator peak during the step + resident parameters, state,",
        "batch and memplan's arena); planned: the plan's own claim. Default allocator (the planned CPU allocator).",
        "",
        f"{len(results)} entries: {len(exact)} bit-exact, {len(works) - len(exact)} within a named bound,"
        f" {len(refused)} refused with a one-line reason, {len(results) - len(works) - len(refused)} other;"
        f" memplan's peak below eager's on {len(below)} of {len(works)} that run"
        + (f" (ratio {ratios[0]:.3f}-{ratios[-1]:.3f})" if ratios else "")
        + f" ({time.perf_counter() - start:.0f} s, a shared 2-core machine).",
        "",
        "| architecture | family | HF class | outcome | max abs diff | memplan peak MiB | eager peak MiB |"
        " memplan/eager | planned MiB | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "The refusals are the models' own data-dependent steps, named by `file:line`: DeBERTa-v2's sequence",
        "classification loss keeps the labels >= 0 (`nonzero`: a size that depends on the data); wav2vec2's CTC",
        "head checks `labels.max() < vocab_size` before the forward; LayerDrop (wav2vec2's default 0.1) skips a",
        "layer on a random draw, a different program at each step. With LayerDrop off and a classification",
        "head, wav2vec2 and HuBERT train bit-exactly.",
        "",
    ]
    out = Path("bench/results/architectures.md")
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    main()
