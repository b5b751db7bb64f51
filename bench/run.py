"""memplan vs eager PyTorch over the zoo: numerics, measured peak memory and step time.

Each row trains K steps with memplan and K steps with eager PyTorch from the same initial
state and seed (CPU), then one more step of each under the profiler to measure memory.
Times are medians over the K steps; the ratio compares the two within one run.

    python bench/run.py --batch 32 --steps 3              # writes bench/results/run-b32.md
    python bench/run.py --batch 1 --models mlp,vgg16
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from memplan.report.format import format_bytes
from memplan.torch.compare import compare_with_eager
from memplan.torch.zoo import list_models

HEADER = (
    "| model | batch | optimizer | allocator | max abs diff | eager peak | memplan peak | planned peak "
    "| graph estimate | memplan / eager | measured / planned | left to allocator | eager s | memplan s | time ratio "
    "| interpreted s | interpreted ratio | eager RSS | memplan RSS | RSS ratio "
    "| RSS beyond the claim, memplan - eager |"
)


NOTES = [
    "Columns: *memplan peak* = resident parameters, buffers, optimizer state, batch and arena + the CPU "
    "allocator's peak during a steady-state step (profiler memory events); *eager peak* = the same for eager "
    "PyTorch. *planned peak* = what the plan claims before the measured step: persistent bytes + the arena "
    "(allocator `replay`: solved from the recorded allocations of the step, kernel scratch included). *graph "
    "estimate* = the captured graph's peak in the planned order (`memplan.graph.liveness`), which sees no kernel "
    "scratch and no in-place reuse (it does see recomputed copies). *left to allocator* = bytes the step requested "
    "that did not come from the "
    "arena (with `replay`: the returned loss and a few scalars). Times: medians of the timed steps, eager and "
    "memplan interleaved in one process; the planned allocator's recording steps are not timed. *memplan s* is the "
    "generated executor (the planned step written once as one Python function, `memplan.torch.run.codegen`); "
    "*interpreted s* the same plan run by the op-by-op interpreter on a third copy of the model, timed in the same "
    "steps.",
    "*eager RSS*, *memplan RSS*: memory as the operating system sees it, the peak resident set (`VmHWM`) of "
    "the whole process during two steady-state steps, each side trained in a fresh process of its own "
    "(`memplan.torch.compare.steady_state_rss`: warm-up, then `VmHWM` reset through `/proc/self/clear_refs`); "
    "the median over `--rss-repeats` such processes per side (default 3; the range in brackets): an eager "
    "process's resident set varies from one process to the next by tens of MiB. "
    "It includes the Python interpreter, torch's libraries and memplan's own objects (captures, plans), which no "
    "plan counts; *memplan peak* above counts allocations only. *RSS beyond the claim*: (memplan RSS - planned "
    "peak) - (eager RSS - eager peak), the resident bytes memplan holds that its plan does not claim, above what "
    "eager holds beyond its own measured peak (the interpreter, captures and plans, heap the C library kept).",
]


def fallback_share(m: dict) -> float:
    """Bytes the step requested that did not land in the arena, over all it requested."""
    if "served_bytes" in m:  # planned allocator
        total = m["served_bytes"] + m["fallback_bytes"]
    else:  # arena views
        total = m["copied_bytes"] + m["out_bytes"] + m["fallback_bytes"]
    return m["fallback_bytes"] / total if total else 0.0


def row(r: dict) -> str:
    m, e = r["memplan"], r["eager"]
    planned = m["planned_peak_bytes"]
    return (
        f"| {r['model']} | {r['batch_size']} | {r['optimizer']} | {r.get('allocator', 'views')} | {r['max_abs_diff']} "
        f"| {format_bytes(e['peak_bytes'])} | {format_bytes(m['peak_bytes'])} | {format_bytes(planned)} "
        f"| {format_bytes(m.get('graph_planned_peak_bytes', planned))} "
        f"| {m['peak_bytes'] / e['peak_bytes']:.3f} | {m['peak_bytes'] / planned:.3f} "
        f"| {100 * fallback_share(m):.2f}% "
        f"| {e['step_seconds']:.3f} | {m['step_seconds']:.3f} | {m['step_seconds'] / e['step_seconds']:.3f} "
        f"| {_interpreted(m, e)} | {rss_cells(r)} |"
    )


def _interpreted(m: dict, e: dict) -> str:
    """The interpreted executor's time on the same plan and its ratio to eager (older runs: none)."""
    seconds = m.get("interpreted_step_seconds")
    return "- | -" if seconds is None else f"{seconds:.3f} | {seconds / e['step_seconds']:.3f}"


def rss_cells(r: dict) -> str:
    if "rss" not in r:
        return "- | - | - | -"
    eager, memplan = r["rss"]["eager"]["peak_rss_bytes"], r["rss"]["memplan"]["peak_rss_bytes"]
    # what the process holds beyond what each side claims (eager: its measured peak; memplan: the plan)
    beyond = (memplan - r["memplan"]["planned_peak_bytes"]) - (eager - r["eager"]["peak_bytes"])
    sign = "-" if beyond < 0 else "+"
    ratio = memplan / eager
    return (
        f"{_rss_runs(r['rss']['eager'])} | {_rss_runs(r['rss']['memplan'])} | {ratio:.3f} "
        f"| {sign}{format_bytes(abs(beyond))}"
    )


def _rss_runs(side: dict) -> str:
    """The median peak RSS, with the range over the processes where there were several."""
    runs = side.get("peak_rss_runs", [])
    median = format_bytes(side["peak_rss_bytes"])
    if len(runs) < 2:
        return median
    return f"{median} ({min(runs) / 2**20:.0f}-{max(runs) / 2**20:.0f} MiB, {len(runs)} runs)"


def write_results(out: Path, command: str, batch: int, rows: list[str], reports: list[dict]) -> None:
    """The table (with its notes) to ``out`` and the reports to ``out``'s .json twin."""
    lines = [
        f"# memplan vs eager PyTorch, training, batch {batch} (CPU)",
        "",
        f"Regenerate: `{command}`",
        "",
        HEADER,
        "|" + "---|" * (HEADER.count("|") - 1),
        *rows,
    ]
    lines += ["", *NOTES]
    recomputed = [r for r in reports if r["plan"].get("recomputed_copies")]
    if recomputed:
        lines += ["", "Copies run again in the backward instead of kept (`memplan.torch.capture.recompute`):", ""]
        lines += [f"- {r['model']}: {', '.join(r['plan']['recomputed_copies'])}" for r in recomputed]
    copied = [r for r in reports if r["memplan"]["copied_ops"]]
    if copied:
        lines += ["", "Bytes computed then copied into the arena (views allocator, no out= kernel), by op:", ""]
        lines += [
            f"- {r['model']}: "
            + ", ".join(f"{op} {format_bytes(b)}" for op, b in list(r["memplan"]["copied_ops"].items())[:4])
            for r in copied
        ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(reports, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--models", default=",".join(list_models()))
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--allocator", default="auto", choices=["auto", "replay", "views"])
    parser.add_argument("--no-recompute", action="store_true", help="keep every forward copy (no recomputed cat/clone)")
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS runs (two extra processes per model)")
    parser.add_argument(
        "--no-interpreter",
        action="store_true",
        help="no third model copy timed with the interpreted executor (XLM-R's three copies need 16 GiB)",
    )
    parser.add_argument("--rss-repeats", type=int, default=3, help="processes per side for RSS (median shown)")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--from-json", nargs="+", default=None, help="rebuild the table from previous runs' JSON (rows in file order)"
    )
    args = parser.parse_args()
    out = Path(args.out or Path(__file__).parent / "results" / f"run-b{args.batch}.md")
    command = " ".join(["python bench/run.py", *sys.argv[1:]])
    rows, reports = [], []
    if args.from_json:
        reports = [r for path in args.from_json for r in json.loads(Path(path).read_text())]
        rows = [row(r) for r in reports]
        command = f"python bench/run.py --batch {args.batch} --steps {reports[0]['steps']}"
    for model in [] if args.from_json else args.models.split(","):
        start = time.perf_counter()
        r = compare_with_eager(
            model,
            args.batch,
            args.steps,
            "train",
            args.optimizer,
            time_limit_seconds=args.time_limit,
            allocator=args.allocator,
            recompute_copies=not args.no_recompute,
            time_interpreter=not args.no_interpreter,
            rss=not args.no_rss,
            rss_repeats=args.rss_repeats,
        )
        reports.append(r)
        rows.append(row(r))
        print(rows[-1], f"({time.perf_counter() - start:.0f} s)", flush=True)
        write_results(out, command, args.batch, rows, reports)  # a later model's crash keeps these rows
    write_results(out, command, args.batch, rows, reports)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
