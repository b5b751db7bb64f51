"""``memplan optimize``: reorder the ops of a step to lower its peak (OLLA eq. 14)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from memplan.commands.console import Quiet, console, load_source_with_progress, progress, set_quiet
from memplan.commands.options import (
    BatchSize,
    JsonOut,
    Mode,
    ModeOption,
    OptimizerName,
    OptimizerOption,
    Source,
    write_json,
)
from memplan.errors import MemplanError
from memplan.graph.ir import Graph
from memplan.graph.liveness import peak_bytes
from memplan.graph.multistream import is_multi_stream
from memplan.pipeline import ARENA_ALIGNMENT_BYTES
from memplan.report.format import format_bytes, format_percent
from memplan.schedule import ScheduleResult, optimize_order

TimeLimit = Annotated[float, typer.Option("--time-limit", min=0.01, help="Seconds the exact solver may run.")]
MethodOption = Annotated[str, typer.Option("--method", help="auto | ilp | heuristic")]
GapOption = Annotated[
    float,
    typer.Option(
        "--gap",
        min=0.0,
        max=0.99,
        help="Stop once the order is within this fraction of a proven lower bound (0.005 = 0.5%; 0: prove it).",
    ),
]
AlignmentOption = Annotated[
    int,
    typer.Option(
        "--alignment", min=1, help="Offset alignment of the arena in bytes (512 as PyTorch's CUDA allocator rounds)."
    ),
]
TraceOut = Annotated[
    Path | None, typer.Option("--trace", help="Write the optimised order as a Chrome/Perfetto trace (JSON).")
]
SnapshotOut = Annotated[
    Path | None,
    typer.Option("--snapshot", help="Write the plan as a PyTorch memory snapshot (.pickle, for memory_viz)."),
]


def placement_report(
    graph: Graph, order: list[int], time_limit_seconds: float, alignment_bytes: int = ARENA_ALIGNMENT_BYTES
) -> dict[str, Any]:
    """Static offsets for the optimised order (OLLA 3.3): arena, fragmentation, solver."""
    from memplan.pipeline import place_order
    from memplan.placement import lower_bound_bytes, problem_from_graph

    _, placement = place_order(graph, order, time_limit_seconds, alignment_bytes=alignment_bytes)
    bound = lower_bound_bytes(problem_from_graph(graph, order, alignment=alignment_bytes))
    return {
        "alignment_bytes": alignment_bytes,
        "arena_bytes": placement.arena_bytes,
        "arena_lower_bound_bytes": bound,
        "fragmentation": 0.0 if placement.arena_bytes == 0 else (placement.arena_bytes - bound) / placement.arena_bytes,
        "placement": {
            "method": placement.method,
            "status": placement.status,
            "seconds": round(placement.seconds, 3),
            "gap": round(placement.gap, 6),
        },
    }


def optimize_report(graph: Graph, result: ScheduleResult) -> dict[str, Any]:
    """The JSON of ``memplan optimize``; ``order`` lists op names for later stages."""
    program_bytes = peak_bytes(graph, graph.program_order())
    return {
        "model": graph.meta.get("model", graph.name),
        "num_ops": graph.num_ops,
        "program_order_peak_bytes": program_bytes,
        "optimized_order_peak_bytes": result.peak_bytes,
        "lower_bound_bytes": result.lower_bound_bytes,
        "reduction": 0.0 if program_bytes == 0 else 1 - result.peak_bytes / program_bytes,
        "schedule": {
            "method": result.method,
            "status": result.status,
            "seconds": round(result.seconds, 3),
            "gap": None if result.gap is None else round(result.gap, 6),
        },
        "order": [graph.ops[v].name for v in result.order],
    }


def print_report(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"{report['model']}: operator reordering ({report['num_ops']} ops)")
    table.add_column("")
    table.add_column("peak", justify="right")
    table.add_row("program order (eager)", format_bytes(report["program_order_peak_bytes"]))
    table.add_row("optimised order", format_bytes(report["optimized_order_peak_bytes"]))
    table.add_row("lower bound over all orders", format_bytes(report["lower_bound_bytes"]))
    table.add_row("reduction", format_percent(report["reduction"]))
    s = report["schedule"]
    gap = "-" if s["gap"] is None else format_percent(s["gap"])
    table.add_row("solver", f"{s['method']}, {s['status']}, gap {gap}, {s['seconds']:.2f} s")
    if "arena_bytes" in report:
        p = report["placement"]
        table.add_row("arena (static offsets)", format_bytes(report["arena_bytes"]))
        table.add_row("fragmentation", format_percent(report["fragmentation"]))
        table.add_row("placement", f"{p['method']}, {p['status']}, {p['seconds']:.2f} s")
    console.print(table)


def optimize(
    source: Source,
    batch_size: BatchSize = 1,
    mode: ModeOption = Mode.train,
    optimizer: OptimizerOption = OptimizerName.sgd,
    time_limit: TimeLimit = 30.0,
    method: MethodOption = "auto",
    gap: GapOption = 0.0,
    json_path: JsonOut = None,
    log_solver: Annotated[
        bool, typer.Option("--progress/--no-progress", help="Log every better order the exact solver finds.")
    ] = False,
    trace: TraceOut = None,
    snapshot: SnapshotOut = None,
    alignment: AlignmentOption = ARENA_ALIGNMENT_BYTES,
    quiet: Quiet = False,
) -> None:
    """Find the order of the ops with the smallest peak (OLLA's lifetime optimisation)."""
    set_quiet(quiet)
    graph = load_source_with_progress(source, batch_size=batch_size, mode=mode.value, optimizer=optimizer.value)
    log = log_solver and not quiet
    with progress("reordering") if not log else contextlib.nullcontext():
        result = optimize_order(
            graph, time_limit_seconds=time_limit, method=method, progress=log, relative_gap_limit=gap
        )
    report = optimize_report(graph, result)
    out = console()
    if is_multi_stream(graph):  # one order's lifetimes do not say what may share: place by safe pairs
        from memplan.streams.report import print_stream_report, stream_report

        if snapshot is not None:
            raise MemplanError("--snapshot needs one arena; a multi-stream graph is placed by safe pairs (use --trace)")
        print_report(report, out)
        with progress("placing the streams' tensors (SOMAS)"):
            report["streams"] = stream_report(graph, list(result.order), time_limit_seconds=time_limit)
        print_stream_report(report["streams"], out, "multi-stream placement of the optimised order")
    else:
        with progress("placing"):
            report.update(placement_report(graph, list(result.order), time_limit, alignment))
        print_report(report, out)
        if snapshot is not None:
            report["snapshot"] = write_plan_snapshot(graph, list(result.order), time_limit, snapshot, alignment)
            out.print(f"wrote {snapshot} (open it at https://pytorch.org/memory_viz)")
    if trace is not None:
        from memplan.torch.export.chrome_trace import plan_trace, write_trace

        write_trace(plan_trace(graph, list(result.order)), trace)
        report["trace"] = str(trace)
        out.print(f"wrote {trace} (estimated op times; open it at https://ui.perfetto.dev)")
    write_json(json_path, report)


def write_plan_snapshot(
    graph: Graph, order: list[int], time_limit: float, path: Path, alignment_bytes: int = ARENA_ALIGNMENT_BYTES
) -> dict[str, Any]:
    """The optimised order, placed, as a memory snapshot (PyTorch's memory visualizer)."""
    from memplan.pipeline import place_order
    from memplan.torch.export.snapshot import check_snapshot, plan_snapshot, write_snapshot

    offsets, placement = place_order(graph, order, time_limit, alignment_bytes=alignment_bytes)
    snap = plan_snapshot(graph, order, offsets, placement.arena_bytes)
    numbers = check_snapshot(snap)
    write_snapshot(snap, path)
    return {"path": str(path), **numbers}


def register(app: typer.Typer) -> None:
    app.command()(optimize)
