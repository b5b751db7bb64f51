"""Peak RSS of a steady-state training step, eager vs memplan, over the zoo (issue 15).

Only the resident-set measurement of ``bench/run.py`` (no timing, no profiler, no interpreter
copy), so it fits where the full run does not (batch 32 on a 2-core machine). Each side trains
in fresh processes of its own (``memplan.torch.compare.median_steady_state_rss``): warm-up
(memplan: until the plan replays, then one step more), ``VmHWM`` reset, two steps; the median
over ``--repeats`` processes per side.

    python bench/rss.py --batch 32 --repeats 1 --out bench/results/rss-b32.md
    python bench/rss.py --batch 32 --models vgg16 --out /tmp/vgg16.md   # one model; merge with --from-json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from memplan.report.format import format_bytes
from memplan.torch.compare import median_steady_state_rss
from memplan.torch.zoo import list_models

HEADER = "| model | batch | optimizer | eager peak RSS | memplan peak RSS | memplan / eager | memplan - eager |"


def measure(model: str, batch: int, optimizer: str, repeats: int, time_limit: float) -> dict:
    options = {"optimizer_name": optimizer, "time_limit_seconds": time_limit}
    return {
        "model": model,
        "batch_size": batch,
        "optimizer": optimizer,
        "repeats": repeats,
        "eager": median_steady_state_rss(model, batch, "eager", repeats, **options),
        "memplan": median_steady_state_rss(model, batch, "auto", repeats, **options),
    }


def _cell(side: dict) -> str:
    runs = side["peak_rss_runs"]
    text = format_bytes(side["peak_rss_bytes"])
    return text if len(runs) < 2 else f"{text} ({min(runs) / 2**20:.0f}-{max(runs) / 2**20:.0f} MiB)"


def row(r: dict) -> str:
    eager, memplan = r["eager"]["peak_rss_bytes"], r["memplan"]["peak_rss_bytes"]
    sign = "-" if memplan < eager else "+"
    return (
        f"| {r['model']} | {r['batch_size']} | {r['optimizer']} | {_cell(r['eager'])} | {_cell(r['memplan'])} "
        f"| {memplan / eager:.3f} | {sign}{format_bytes(abs(memplan - eager))} |"
    )


def table(reports: list[dict], command: str) -> str:
    below = [r["model"] for r in reports if r["memplan"]["peak_rss_bytes"] < r["eager"]["peak_rss_bytes"]]
    above = [r["model"] for r in reports if r["model"] not in below]
    repeats = sorted({r["repeats"] for r in reports})
    lines = [
        f"# Peak RSS of a steady-state training step, eager vs memplan, batch {reports[0]['batch_size']} (CPU)",
        "",
        f"Regenerate: `{command}`",
        "",
        "Memory as the operating system sees it: the peak resident set (`VmHWM`) of the whole process during "
        "two steady-state steps, each side trained in fresh processes of its own "
        "(`memplan.torch.compare.steady_state_rss`: warm-up, memplan until its plan replays, then `VmHWM` reset "
        f"through `/proc/self/clear_refs`); the median over {'/'.join(map(str, repeats))} process(es) per side, "
        "the range in brackets where there were several. memplan runs with its default allocator (the planned "
        "CPU allocator, `replay`); its solvers run in a forked child (`memplan.isolate`). RSS does not depend on "
        "the machine's load.",
        "",
        f"memplan's peak RSS is below eager's on {len(below)} of {len(reports)} models"
        + (f"; at or above it on: {', '.join(above)}." if above else "."),
        "",
        HEADER,
        "|" + "---|" * (HEADER.count("|") - 1),
        *[row(r) for r in reports],
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--models", default=",".join(list_models()))
    parser.add_argument("--repeats", type=int, default=3, help="processes per side (median shown)")
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--from-json", nargs="*", default=None, help="rebuild the table from previous runs' JSON")
    args = parser.parse_args()
    out = Path(args.out or Path(__file__).parent / "results" / f"rss-b{args.batch}.md")
    command = " ".join(["python bench/rss.py", *sys.argv[1:]])
    reports: list[dict] = []
    if args.from_json is not None:
        for path in args.from_json:
            reports += json.loads(Path(path).read_text())
        command = f"python bench/rss.py --batch {args.batch} --repeats {reports[0]['repeats']}"
    for model in [] if args.from_json is not None else args.models.split(","):
        start = time.perf_counter()
        reports.append(measure(model, args.batch, args.optimizer, args.repeats, args.time_limit))
        print(row(reports[-1]), f"({time.perf_counter() - start:.0f} s)", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table(reports, command))
    out.with_suffix(".json").write_text(json.dumps(reports, indent=1))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
