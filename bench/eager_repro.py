"""Is eager PyTorch's training step reproducible across processes on this machine?

Each run is a fresh process running ``bench/first_step.py``'s eager child: the zoo model at
batch 8, AdamW, the same weights, batch and seeds, ``--steps`` steps. It records the loss bits of
every step and a digest of the final parameters. Counted: how many distinct results the runs
gave, under each setting:

* default: the machine's threads, as every bench here runs;
* ``OMP_NUM_THREADS=1``: one thread;
* ``MKL_CBWR=COMPATIBLE``: MKL's conditional numerical reproducibility, in its most portable
  code path (slower GEMMs).

When eager gives several results, a comparison of memplan's bits with eager's across processes
(``bench/first_step.py``'s "bits" column) can differ for eager's own reasons.

    python bench/eager_repro.py                     # lstm, 15 runs per setting
    python bench/eager_repro.py --model gpt2-2l --runs 8
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {
    "default": {},
    "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"},
    "MKL_CBWR=COMPATIBLE": {"MKL_CBWR": "COMPATIBLE"},
}


def results(model: str, runs: int, steps: int, extra: dict[str, str]) -> collections.Counter:
    """How often each (losses, digest) came out of ``runs`` eager processes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **extra}
    seen: collections.Counter = collections.Counter()
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "eager.json"
        for _ in range(runs):
            command = [sys.executable, str(ROOT / "bench" / "first_step.py"), "--child", "eager", model, "8"]
            command += [str(steps), folder, str(out)]
            subprocess.run(command, env=env, check=True, capture_output=True, timeout=600)
            result = json.loads(out.read_text())
            seen[(tuple(result["losses"]), result["digest"][:12])] += 1
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="lstm")
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "eager_repro.md")
    args = parser.parse_args()
    command = "python bench/eager_repro.py " + " ".join(sys.argv[1:])
    lines = [
        "# Eager PyTorch's step across processes (CPU)",
        "",
        f"`{command.strip()}`: {args.model} at batch 8, AdamW, {args.steps} steps, the same weights, batch and",
        f"seeds in each of {args.runs} fresh processes per setting; {os.cpu_count()} cores. Results: the distinct",
        "(loss bits of every step, digest of the final parameters), with how many processes gave each.",
        "",
        "| setting | distinct results | processes per result |",
        "|---|---|---|",
    ]
    for name, extra in SETTINGS.items():
        seen = results(args.model, args.runs, args.steps, extra)
        counts = ", ".join(f"{digest}: {n}" for (_, digest), n in seen.most_common())
        lines.append(f"| {name} | {len(seen)} | {counts} |")
        print(lines[-1], flush=True)
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
