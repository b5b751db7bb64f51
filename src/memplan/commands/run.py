"""``memplan run``: train with the plan and with eager PyTorch, compare numbers, memory, time."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from memplan.commands.console import Quiet, console, progress, set_quiet
from memplan.commands.options import BatchSize, JsonOut, Mode, ModeOption, OptimizerName, OptimizerOption, write_json
from memplan.errors import MemplanError
from memplan.report.format import format_bytes


class Allocator(str, Enum):
    auto = "auto"
    replay = "replay"
    views = "views"


def print_plan(plan: dict[str, Any], console: Console) -> None:
    table = Table(title="the plan")
    table.add_column("")
    table.add_column("bytes", justify="right")
    table.add_column("how", justify="left")
    s, p = plan["schedule"], plan["placement"]
    table.add_row("peak in program order (eager)", format_bytes(plan["program_order_peak_bytes"]), "")
    table.add_row(
        "peak in the optimised order",
        format_bytes(plan["optimized_order_peak_bytes"]),
        f"{s['method']}, {s['status']}, {s['seconds']:.2f} s",
    )
    table.add_row("lower bound over all orders", format_bytes(plan["lower_bound_bytes"]), "")
    table.add_row(
        "arena (one block, static offsets)",
        format_bytes(plan["arena_bytes"]),
        f"{p['method']}, {p['status']}, fragmentation {100 * plan['fragmentation']:.2f}%",
    )
    console.print(table)


def print_run(report: dict[str, Any], console: Console) -> None:
    m, e = report["memplan"], report["eager"]
    table = Table(title=f"{report['model']}  batch {report['batch_size']}  {report['mode']}  {report['steps']} steps")
    table.add_column("")
    table.add_column("memplan", justify="right")
    table.add_column("eager PyTorch", justify="right")
    table.add_row("measured peak", format_bytes(m["peak_bytes"]), format_bytes(e["peak_bytes"]))
    table.add_row("step seconds (median)", f"{m['step_seconds']:.3f}", f"{e['step_seconds']:.3f}")
    table.add_row("planned peak (persistent + arena)", format_bytes(m["planned_peak_bytes"]), "")
    table.add_row("arena", format_bytes(m["arena_bytes"]), "")
    table.add_row("persistent (params, state, batch)", format_bytes(m["persistent_bytes"]), "")
    table.add_row("left to the allocator", format_bytes(m["fallback_bytes"]), "")
    if report.get("allocator") == "views":
        table.add_row("computed then copied into the arena", format_bytes(m["copied_bytes"]), "")
    console.print(table)
    if report.get("allocator") == "replay":
        console.print(
            f"planned allocator: {m['allocations']} allocations per step, {m['fallback_allocations']} not from the "
            f"arena; arena {m['arena_method']} (lower bound {format_bytes(m['arena_lower_bound_bytes'])})"
        )
    verdict = "identical" if report["max_abs_diff"] == 0.0 else f"DIFFER by up to {report['max_abs_diff']:.3g}"
    console.print(f"loss and parameters after every step: {verdict} (max abs diff {report['max_abs_diff']})")


def run(
    model: Annotated[str, typer.Argument(help="A zoo model name (see `memplan models`).")],
    batch_size: BatchSize = 8,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Steps to train with each.")] = 3,
    mode: ModeOption = Mode.train,
    optimizer: OptimizerOption = OptimizerName.sgd,
    time_limit: Annotated[float, typer.Option("--time-limit", min=0.1, help="Solver seconds per stage.")] = 10.0,
    allocator: Annotated[
        Allocator,
        typer.Option(
            "--allocator",
            help="replay: every allocation at a planned offset (profile-guided, needs a C++ compiler); "
            "views: out= kernels into arena views, the rest to PyTorch's allocator; auto: replay where it builds.",
        ),
    ] = Allocator.auto,
    json_path: JsonOut = None,
    snapshot: Annotated[
        Path | None,
        typer.Option(
            "--snapshot",
            help="Write memory snapshots for PyTorch's memory visualizer: the memplan step to this .pickle, "
            "the plan to NAME.plan.pickle, the eager step to NAME.eager.pickle.",
        ),
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option("--trace", help="Write the plan as a Chrome/Perfetto trace (JSON) with measured op times."),
    ] = None,
    quiet: Quiet = False,
) -> None:
    """Train K steps with memplan and with eager PyTorch from the same state and seed."""
    from memplan.torch.compare import compare_with_eager

    set_quiet(quiet)
    for path, suffix in ((snapshot, ".pickle"), (trace, ".json")):
        if path is not None and path.suffix != suffix:
            raise MemplanError(f"{path}: the file must end in {suffix}")
    with progress(f"planning {model}, then training {steps} steps with memplan and eagerly"):
        report = compare_with_eager(
            model,
            batch_size,
            steps,
            mode.value,
            optimizer.value,
            time_limit_seconds=time_limit,
            allocator=allocator.value,
        )
    out = console()
    print_run(report, out)
    if snapshot is not None or trace is not None:
        from memplan.torch.export.zoo_exports import export_zoo_step

        report["exports"] = export_zoo_step(
            model,
            batch_size,
            optimizer.value,
            mode.value,
            snapshot=snapshot,
            trace=trace,
            allocator=allocator.value,
            time_limit_seconds=time_limit,
            stage=progress,
        )
        print_exports(report["exports"], out)
    write_json(json_path, report)
    if report["max_abs_diff"] != 0.0:
        raise typer.Exit(1)


def print_exports(exports: dict[str, Any], out: Console) -> None:
    """Where the exports went and the peaks their own replay finds (persistent bytes included)."""
    labels = {"memplan": "memplan step", "plan": "the plan", "eager": "eager step"}
    for key, label in labels.items():
        if key in exports:
            e = exports[key]
            out.print(
                f"wrote {e['path']}: {label}, {e['events']} events, peak allocated "
                f"{format_bytes(e['peak_allocated_bytes'])}, reserved {format_bytes(e['peak_reserved_bytes'])}",
                markup=False,
                highlight=False,
            )
    if "trace" in exports:
        t = exports["trace"]
        out.print(f"wrote {t['path']}: Chrome/Perfetto trace of the plan, {t['op_times']} op times", markup=False)
    if any(k in exports for k in labels):
        out.print("open the snapshots at https://pytorch.org/memory_viz (drag several files in to compare them)")


def register(app: typer.Typer) -> None:
    app.command()(run)
