"""``memplan analyze``, ``memplan capture`` and ``memplan models``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from memplan.commands.console import Quiet, console, load_source_with_progress, set_quiet
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
from memplan.graph.analysis import peak_lower_bound
from memplan.graph.io import write_graph_json
from memplan.graph.ir import Graph
from memplan.graph.liveness import peak_bytes
from memplan.graph.multistream import is_multi_stream
from memplan.report.format import format_bytes


def analysis_report(graph: Graph) -> dict[str, Any]:
    """The numbers ``memplan analyze`` prints: sizes, program-order peak, lower bound."""
    start = time.perf_counter()
    program_peak = peak_bytes(graph, graph.program_order())
    lower = peak_lower_bound(graph)
    meta = graph.meta
    return {
        "model": meta.get("model", graph.name),
        "batch_size": meta.get("batch_size"),
        "mode": meta.get("mode"),
        "optimizer": meta.get("optimizer"),
        "num_ops": graph.num_ops,
        "num_tensors": graph.num_tensors,
        "persistent_bytes": graph.persistent_bytes,
        "program_order_peak_bytes": program_peak,
        "lower_bound_bytes": lower,
        "capture_seconds": meta.get("capture_seconds"),
        "analysis_seconds": round(time.perf_counter() - start, 3),
    }


def print_analysis(report: dict[str, Any], console: Console) -> None:
    title = f"{report['model']}  batch {report['batch_size']}  {report['mode']}"
    if report.get("optimizer"):
        title += f"  {report['optimizer']}"
    table = Table(title=title, show_header=False)
    table.add_row("ops", str(report["num_ops"]))
    table.add_row("tensors", str(report["num_tensors"]))
    table.add_row("persistent (params, state, buffers, batch)", format_bytes(report["persistent_bytes"]))
    table.add_row("peak in program order (eager)", format_bytes(report["program_order_peak_bytes"]))
    table.add_row("lower bound over all orders", format_bytes(report["lower_bound_bytes"]))
    if report.get("capture_seconds") is not None:
        table.add_row("capture seconds", f"{report['capture_seconds']:.2f}")
    table.add_row("analysis seconds", f"{report['analysis_seconds']:.2f}")
    console.print(table)


def analyze(
    source: Source,
    batch_size: BatchSize = 1,
    mode: ModeOption = Mode.train,
    optimizer: OptimizerOption = OptimizerName.sgd,
    json_path: JsonOut = None,
    time_limit: Annotated[
        float, typer.Option("--time-limit", min=0.01, help="Seconds for a multi-stream graph's placement.")
    ] = 10.0,
    quiet: Quiet = False,
) -> None:
    """Capture a step and print its size, its program-order peak and a lower bound; for a
    multi-stream graph also its safe pairs and safe placements (SOMAS)."""
    set_quiet(quiet)
    graph = load_source_with_progress(source, batch_size=batch_size, mode=mode.value, optimizer=optimizer.value)
    report = analysis_report(graph)
    out = console()
    print_analysis(report, out)
    if is_multi_stream(graph):
        from memplan.commands.console import progress
        from memplan.streams.report import print_stream_report, stream_report

        with progress("placing the streams' tensors (SOMAS)"):
            report["streams"] = stream_report(graph, time_limit_seconds=time_limit)
        print_stream_report(report["streams"], out)
    write_json(json_path, report)


def capture(
    source: Source,
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the graph JSON.")],
    batch_size: BatchSize = 1,
    mode: ModeOption = Mode.train,
    optimizer: OptimizerOption = OptimizerName.sgd,
    quiet: Quiet = False,
) -> None:
    """Capture a zoo model's step and write it as a GRAPH.json that every command reads."""
    set_quiet(quiet)
    if output.exists() and output.suffix != ".json":
        raise MemplanError(f"refusing to overwrite {output}: the output must be a .json file")
    graph = load_source_with_progress(source, batch_size=batch_size, mode=mode.value, optimizer=optimizer.value)
    write_graph_json(graph, output)
    console().print(f"wrote {output}: {graph.num_ops} ops, {graph.num_tensors} tensors")


def models(quiet: Quiet = False) -> None:
    """List the model zoo (nothing is downloaded: HF models are built from configs)."""
    from memplan.torch.zoo import ZOO

    set_quiet(quiet)
    table = Table(title="memplan model zoo")
    table.add_column("name")
    table.add_column("source")
    table.add_column("description")
    for entry in ZOO.values():
        table.add_row(entry.name, entry.source, entry.description)
    console().print(table)


def register(app: typer.Typer) -> None:
    app.command()(analyze)
    app.command()(capture)
    app.command()(models)
