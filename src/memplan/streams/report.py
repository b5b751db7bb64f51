"""What ``memplan analyze`` and ``memplan optimize`` report about a multi-stream step."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from memplan.graph.ir import Graph
from memplan.graph.multistream import contiguous_groups, stream_sequences
from memplan.streams.interleave import StreamCheck, validate_stream_placement
from memplan.streams.offsets import interval_claim, plan_stream_placement
from memplan.streams.safety import graph_based_safe_pairs, stream_based_safe_pairs
from memplan.streams.sync import collectives, validate_streams


def stream_report(
    graph: Graph, order: Sequence[int] | None = None, *, time_limit_seconds: float = 10.0, samples: int = 32
) -> dict[str, Any]:
    """Safe pairs (both algorithms, timed), single- and many-object footprints, memplan's
    placement and the lower bound, what interval-based placement of the recorded order would
    claim and whether it is safe, each plan checked against executions."""
    validate_streams(graph, order)
    t0 = time.perf_counter()
    graph_based = graph_based_safe_pairs(graph, order)
    stream_based = stream_based_safe_pairs(graph, order)
    if not (graph_based.unsafe == stream_based.unsafe).all():
        raise AssertionError("graph-based and stream-based safe pairs disagree")
    plan = plan_stream_placement(graph, order, time_limit_seconds=time_limit_seconds)
    claim = interval_claim(plan.stream_problem, time_limit_seconds=time_limit_seconds)
    plan_check = validate_stream_placement(graph, plan.offsets, order, samples=samples)
    claim_check = validate_stream_placement(graph, claim.offsets, order, samples=samples)
    if not plan_check.safe:
        raise AssertionError(f"memplan's stream placement failed its check: {plan_check.failures[0]}")
    single = plan.candidates["single-object"]
    many = plan.candidates.get("many-objects")
    return {
        "streams": {str(graph.ops[seq[0]].stream): len(seq) for seq in stream_sequences(graph, order).values()},
        "collectives": len(collectives(graph)),
        "contiguous_groups": len(contiguous_groups(graph)),
        "placed_tensors": len(stream_based.tensors),
        "pairs": stream_based.num_pairs,
        "safe_pairs": stream_based.num_safe,
        "unsafe_pairs": stream_based.num_unsafe,
        "safe_pairs_seconds": {"graph_based": graph_based.seconds, "stream_based": stream_based.seconds},
        "single_object_bytes": single.arena_bytes,
        "many_objects_bytes": None if many is None else many.arena_bytes,
        "arena_bytes": plan.arena_bytes,
        "lower_bound_bytes": plan.lower_bound_bytes,
        "placement": {
            "method": plan.placement.method,
            "status": plan.placement.status,
            "gap": plan.placement.gap,
            "seconds": plan.placement.seconds,
            "candidates": {k: {"bytes": p.arena_bytes, "seconds": p.seconds} for k, p in plan.candidates.items()},
        },
        "interval_claim_bytes": claim.placement.arena_bytes,
        "interval_claim_unsafe_pairs": len(claim.unsafe_overlaps),
        "interval_claim_safe": claim.safe and claim_check.safe,
        "interval_claim_witness": str(claim_check.failures[0]) if claim_check.failures else None,
        "checks": {"plan": _check(plan_check), "interval_claim": _check(claim_check)},
        "seconds": time.perf_counter() - t0,
    }


def _check(check: StreamCheck) -> dict[str, Any]:
    return {
        "exhaustive": check.exhaustive,
        "states_or_executions": check.states,
        "overlapping_pairs": check.overlapping_pairs,
        "failures": len(check.failures),
    }


def print_stream_report(report: dict[str, Any], console: Any, title: str = "multi-stream placement") -> None:
    """A rich table of :func:`stream_report`'s numbers."""
    from rich.table import Table

    from memplan.report.format import format_bytes, format_percent

    table = Table(title=title, show_header=False)
    table.add_row("ops per stream", ", ".join(f"stream {s}: {n}" for s, n in report["streams"].items()))
    table.add_row("collectives / contiguous groups", f"{report['collectives']} / {report['contiguous_groups']}")
    table.add_row(
        "safe pairs (of all pairs)",
        f"{report['safe_pairs']} safe, {report['unsafe_pairs']} unsafe of {report['pairs']}",
    )
    seconds = report["safe_pairs_seconds"]
    table.add_row(
        "safe-pair seconds", f"graph-based {seconds['graph_based']:.4f}, stream-based {seconds['stream_based']:.4f}"
    )
    table.add_row("single object", format_bytes(report["single_object_bytes"]))
    if report["many_objects_bytes"] is not None:
        table.add_row("many objects", format_bytes(report["many_objects_bytes"]))
    p = report["placement"]
    table.add_row("memplan arena", f"{format_bytes(report['arena_bytes'])} ({p['method']}, {p['status']})")
    table.add_row("lower bound", f"{format_bytes(report['lower_bound_bytes'])} (gap {format_percent(p['gap'])})")
    verdict = "safe" if report["interval_claim_safe"] else f"UNSAFE: {report['interval_claim_unsafe_pairs']} pairs"
    table.add_row("interval-based placement claims", f"{format_bytes(report['interval_claim_bytes'])}, {verdict}")
    if report["interval_claim_witness"]:
        table.add_row("for example", report["interval_claim_witness"])
    check = report["checks"]["plan"]
    how = "every reachable state" if check["exhaustive"] else f"{check['states_or_executions']} executions"
    table.add_row("memplan's plan checked", f"{how}: {'safe' if check['failures'] == 0 else 'FAILED'}")
    console.print(table)
