"""``memplan run MODEL -b 32 --budget 0.5`` over the zoo's remat models: the main path with a budget.

Per model, in its own process (``memplan run ... --json``, with a timeout): the budget in bytes,
the measured peak of the planned step (resident parameters, optimizer state, batch and arena
plus the CPU allocator's peak during one steady step) against the budget and against eager's,
the planned compute overhead of the recomputation, the step time memplan/eager (both timed in
the same process, alternating) and the largest difference in loss and parameters. The child's
maximum RSS (both runs, Python and torch included) is reported as the process-level figure.
A model that does not finish within the timeout is listed with the exact command to run it.

    python bench/budget.py --out bench/results/budget.md
    python bench/budget.py --models vgg16 --budget 0.75 --append   # rows at another budget, same table
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODELS = ("vgg16", "mobilenet-v2", "unet", "resnet50", "gpt2-2l")
MIB = 2**20


def command(model: str, batch: int, budget: str, steps: int, time_limit: float) -> list[str]:
    return [
        *("memplan", "run", model, "-b", str(batch), "--budget", budget),
        *("--steps", str(steps), "--time-limit", str(time_limit)),
    ]


def run_model(model: str, batch: int, budget: str, steps: int, time_limit: float, timeout: float) -> dict[str, Any]:
    """One ``memplan run`` in a child process; its JSON report, the child's max RSS, or why not."""
    args = command(model, batch, budget, steps, time_limit)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        child = [sys.executable, "-m", "memplan.cli", *args[1:], "--json", str(out), "--quiet"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        start = time.perf_counter()
        try:
            done = subprocess.run(child, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"model": model, "command": " ".join(args), "error": f"not finished within {timeout:.0f} s"}
        seconds = time.perf_counter() - start
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        if not out.exists():
            lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
            return {"model": model, "command": " ".join(args), "error": lines[-1][:600]}
        report = json.loads(out.read_text())
    report.update(command=" ".join(args), wall_seconds=round(seconds, 1))
    report["child_max_rss_bytes"] = rss * 1024 if rss > before else None  # ru_maxrss is KiB on Linux
    return report


def row(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"| {r['model']} | not run: {r['error']} | | | | | | | `{r['command']}` |"
    b = r["budget"]
    rss = f"{r['child_max_rss_bytes'] / MIB:.0f}" if r.get("child_max_rss_bytes") else "n/a"
    how = f"{b['method']}, {b['recomputed_ops']} recomputed" if b["method"] == "remat" else "reorder only"
    replans = len(b.get("placement_rounds") or ()) - 1
    if replans > 0:
        how += f", re-planned {replans}x: placed arena over budget"
    return (
        f"| {r['model']} | {b['budget_bytes'] / MIB:.1f} | {b['measured_peak_bytes'] / MIB:.1f} "
        f"({'within' if b['within_budget'] else 'OVER'}) | {r['eager']['peak_bytes'] / MIB:.1f} | {rss} | "
        f"+{100 * b['overhead']:.2f}% ({how}, {b['status']}) | {b['step_time_ratio']} | {r['max_abs_diff']} | "
        f"`{r['command']}` |"
    )


def write(reports: list[dict[str, Any]], path: Path) -> None:
    """The table of ``reports``, under the bench command(s) that made them (``--append``: several)."""
    commands = dict.fromkeys(f"`python bench/budget.py {' '.join(r['bench_args'])}`" for r in reports)
    lines = [
        "# Remat in the main path: `memplan run MODEL --budget`",
        "",
        f"{'; then '.join(commands)}; 2-core shared CPU machine, noisy timings: rerun on a quiet "
        "machine. Budget: a fraction of the checkpoint-all peak (the step that keeps every activation, kernel "
        "workspace counted). Measured peak: resident parameters, optimizer state, batch and arena plus the CPU "
        "allocator's peak in one steady step; child max RSS: the whole process (eager and memplan runs, Python "
        "and torch). Overhead: planned extra compute (FLOPs) of the recomputation; step time: measured, same "
        "process. When the placed arena of a plan comes out above the budget (fragmentation above the live bytes "
        "the remat solver bounds), the step is re-planned with the budget lowered by the excess (`re-planned`).",
        "",
        "| model | budget MiB | measured peak MiB | eager peak MiB | child max RSS MiB | compute overhead "
        "| step time memplan/eager | max abs diff | command |",
        "|---|---|---|---|---|---|---|---|---|",
        *(row(r) for r in reports),
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    path.with_suffix(".json").write_text(json.dumps(reports, indent=1, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--budget", default="0.5")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="Seconds per model before it is listed as not run."
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/budget.md"))
    parser.add_argument(
        "--append", action="store_true", help="Add the rows to those of --out's .json (a rerun replaces its row)."
    )
    args = parser.parse_args()
    reports = json.loads(args.out.with_suffix(".json").read_text()) if args.append else []
    for model in args.models:
        report = run_model(model, args.batch, args.budget, args.steps, args.time_limit, args.timeout)
        report["bench_args"] = sys.argv[1:]
        same = [i for i, r in enumerate(reports) if r.get("command") == report["command"]]
        if same:
            reports[same[0]] = report  # a rerun of the same command replaces its row
        else:
            reports.append(report)
        print(row(report), flush=True)
        write(reports, args.out)


if __name__ == "__main__":
    main()
