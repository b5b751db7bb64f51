"""``memplan place``: static offsets for every buffer of a CSV problem or a graph's step."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from memplan.commands.console import Quiet, console, progress, set_quiet
from memplan.commands.options import write_json
from memplan.errors import MemplanError
from memplan.placement import (
    METHODS,
    Placement,
    PlacementProblem,
    fragmentation,
    lower_bound_bytes,
    place,
    problem_from_graph,
    read_placement_csv,
    validate_placement,
    write_placement_csv,
)
from memplan.report.format import format_bytes


class OutputClash(MemplanError):
    """An output path would overwrite the input."""


class CapacityExceeded(MemplanError):
    """No placement within the requested capacity was found (or one provably does not exist)."""


def load_problem(path: Path, capacity_bytes: int | None, alignment_bytes: int) -> PlacementProblem:
    """A CSV ``id,lower,upper,size[,offset]`` (offsets ignored) or a GRAPH.json in program order."""
    if path.suffix.lower() == ".json":
        from memplan.graph.io import read_graph_json

        graph = read_graph_json(path)
        problem = problem_from_graph(graph, graph.program_order(), alignment=alignment_bytes)
    else:
        problem = read_placement_csv(path).problem
    return PlacementProblem(
        problem.sizes_bytes,
        problem.conflicts,
        alignment_bytes,
        problem.names,
        problem.lifetimes,
        capacity_bytes=capacity_bytes,
    )


def placement_report(problem: PlacementProblem, placement: Placement) -> dict[str, Any]:
    bound = lower_bound_bytes(problem)
    return {
        "num_buffers": problem.num_buffers,
        "arena_bytes": placement.arena_bytes,
        "lower_bound_bytes": bound,
        "fragmentation": fragmentation(placement.arena_bytes, bound),
        "capacity_bytes": problem.capacity_bytes,
        "status": placement.status,
        "method": placement.method,
        "seconds": round(placement.seconds, 3),
        "gap": placement.gap,
    }


def _refuse_clash(source: Path, *outputs: Path | None) -> None:
    for out in outputs:
        if out is not None and out.resolve() == source.resolve():
            raise OutputClash(f"refusing to overwrite the input {source}: choose another output path")


def place_command(
    source: Annotated[Path, typer.Argument(help="A PROBLEM.csv (id,lower,upper,size) or a GRAPH.json.")],
    capacity: Annotated[int | None, typer.Option("--capacity", min=0, help="Arena capacity in bytes.")] = None,
    time_limit: Annotated[float, typer.Option("--time-limit", min=0.0, help="Seconds for the exact solver.")] = 10.0,
    method: Annotated[str, typer.Option("--method", help=f"One of {', '.join(METHODS)}.")] = "auto",
    alignment: Annotated[int, typer.Option("--alignment", min=1, help="Offset alignment in bytes.")] = 1,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write id,lower,upper,size,offset.")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write the numbers as JSON.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Draw time x address to this PNG.")] = None,
    quiet: Quiet = False,
) -> None:
    """Give every buffer a static offset in one arena, as small as possible (OLLA, Sekiyama)."""
    set_quiet(quiet)
    _refuse_clash(source, output, json_path, plot)
    problem = load_problem(source, capacity, alignment)
    with progress(f"placing {problem.num_buffers} buffers"):
        placement = place(problem, time_limit_seconds=time_limit, method=method)
    report = placement_report(problem, placement)
    write_json(json_path, report)
    if plot is not None:
        from memplan.report.placement_plot import plot_placement

        plot_placement(problem, placement, plot)
    console().print(
        f"{problem.num_buffers} buffers: arena {format_bytes(placement.arena_bytes)} ({placement.arena_bytes} B), "
        f"lower bound {report['lower_bound_bytes']} B, fragmentation {100 * report['fragmentation']:.2f}%, "
        f"{placement.status} by {placement.method} in {placement.seconds:.2f} s",
        markup=False,
        highlight=False,
    )
    if not placement.fits:
        raise CapacityExceeded(
            f"no placement within {capacity} bytes ({placement.status}); best arena found is {placement.arena_bytes}"
        )
    validate_placement(problem, placement)
    if output is not None:
        write_placement_csv(output, problem, placement.offsets_bytes)


def register(app: typer.Typer) -> None:
    app.command("place")(place_command)
