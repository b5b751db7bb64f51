"""Alignment (512 bytes on CUDA, as PyTorch's caching allocator rounds; 64 on the CPU): the
estimator, the order-free lower bound and the placement all count padded sizes, and agree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from memplan.commands.optimize import register as register_optimize
from memplan.commands.place import register as register_place
from memplan.graph import Category, Tensor, make_graph, memory_timeline, peak_bytes, peak_lower_bound, topological_order
from memplan.graph.generate import random_dag
from memplan.graph.io import write_graph_json
from memplan.graph.liveness import padded, persistent_bytes
from memplan.pipeline import make_plan
from memplan.placement import (
    PlacementProblem,
    lower_bound_bytes,
    place,
    problem_from_graph,
    validate_placement,
)
from tests.core.naive import all_topological_orders, naive_resident_sets

CUDA_ALIGNMENT = 512
alignments = st.sampled_from([1, 8, 64, 512])
dags = st.builds(random_dag, seed=st.integers(0, 10_000), num_ops=st.integers(1, 30), max_size=st.integers(1, 2000))
tiny_dags = st.builds(random_dag, seed=st.integers(0, 10_000), num_ops=st.integers(1, 6), max_size=st.integers(1, 1500))


def odd_chain():
    """Sizes that are not multiples of 512: the aligned peak is not the raw one."""
    return make_graph(
        [
            Tensor("w", 1000, Category.PARAMETER, True),
            Tensor("a", 10),
            Tensor("b", 600),
            Tensor("c", 513),
            Tensor("out", 4, Category.OUTPUT),
        ],
        [
            ("w_in", "placeholder", [], ["w"]),
            ("f", "x", ["w"], ["a"]),
            ("g", "y", ["a"], ["b"]),
            ("h", "z", ["a", "b"], ["c"]),
            ("k", "z", ["c"], ["out"]),
        ],
    )


def test_padded_sizes_by_hand():
    assert [padded(s, 512) for s in (0, 1, 512, 513, 1024)] == [0, 512, 512, 1024, 1024]
    with pytest.raises(ValueError, match="alignment"):
        padded(3, 0)


def test_aligned_timeline_by_hand():
    g = odd_chain()
    order = [0, 1, 2, 3, 4]
    # raw: persistent 1000; f: a; g: a+b; h: a+b+c; k: c+out
    assert memory_timeline(g, order) == [1000, 1010, 1610, 2123, 1517]
    # padded to 512: w 1024, a 512, b 1024, c 1024, out 512
    assert memory_timeline(g, order, 512) == [1024, 1536, 2560, 3584, 2560]
    assert peak_bytes(g, order, 512) == 3584
    assert peak_lower_bound(g, alignment=512) == 3584  # one order only: the bound is tight


def test_aligned_estimator_equals_the_placed_arenas_lower_bound_by_hand():
    g = odd_chain()
    order = [0, 1, 2, 3, 4]
    problem = problem_from_graph(g, order, alignment=CUDA_ALIGNMENT)
    assert lower_bound_bytes(problem) == peak_bytes(g, order, 512) - persistent_bytes(g, 512) == 2560
    solved = place(problem, time_limit_seconds=5)
    validate_placement(problem, solved)
    assert solved.arena_bytes == 2560 and solved.status == "optimal"
    assert all(o % CUDA_ALIGNMENT == 0 for o in solved.offsets_bytes)


@settings(max_examples=150, deadline=None)
@given(dags, alignments, st.randoms(use_true_random=False))
def test_aligned_estimator_matches_naive_resident_sets(graph, alignment, rnd):
    """Oracle: OLLA 2.2's resident sets word for word, each tensor's size padded by hand."""
    order = topological_order(graph, [rnd.random() for _ in graph.ops])
    naive = max(
        sum(-(-graph.tensors[t].size_bytes // alignment) * alignment for t in rs)
        for rs in naive_resident_sets(graph, order)
    )
    assert peak_bytes(graph, order, alignment) == naive
    assert peak_bytes(graph, order, alignment) >= peak_bytes(graph, order)


@settings(max_examples=100, deadline=None)
@given(dags, alignments, st.randoms(use_true_random=False))
def test_placement_lower_bound_is_the_aligned_estimator_peak(graph, alignment, rnd):
    """The same padded bytes on both sides: the arena bound is the estimator's peak less the
    (padded) persistent bytes, and a placed arena is never below it."""
    order = topological_order(graph, [rnd.random() for _ in graph.ops])
    problem = problem_from_graph(graph, order, alignment=alignment)
    bound = lower_bound_bytes(problem)
    assert bound == peak_bytes(graph, order, alignment) - persistent_bytes(graph, alignment)
    solved = place(problem, time_limit_seconds=2, method="heuristic")
    validate_placement(problem, solved)
    assert bound <= solved.arena_bytes
    assert all(o % alignment == 0 for o in solved.offsets_bytes)


@settings(max_examples=60, deadline=None)
@given(tiny_dags, alignments)
def test_aligned_order_free_bound_is_below_every_order(graph, alignment):
    bound = peak_lower_bound(graph, alignment=alignment)
    assert bound <= min(peak_bytes(graph, o, alignment) for o in all_topological_orders(graph))
    assert bound >= peak_lower_bound(graph)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 3000), st.integers(0, 12), st.integers(1, 6)),
        min_size=1,
        max_size=12,
    )
)
def test_placements_at_512_validate_and_match_a_naive_sweep(buffers):
    """Random interval instances at 512: every method's placement validates, is 512-aligned and
    at least the bound, and the bound equals a sweep written here over padded sizes."""
    sizes = [size for size, _, _ in buffers]
    lives = [(start, start + length) for _, start, length in buffers]
    problem = PlacementProblem.from_intervals(sizes, lives, alignment_bytes=CUDA_ALIGNMENT)
    sweep = max(
        sum(-(-s // 512) * 512 for s, (a, b) in zip(sizes, lives, strict=True) if a <= t < b) for t in range(20)
    )
    assert lower_bound_bytes(problem) == sweep
    for method in ("heuristic", "exact"):
        solved = place(problem, time_limit_seconds=2, method=method)
        validate_placement(problem, solved)
        assert solved.arena_bytes >= sweep
        assert all(o % CUDA_ALIGNMENT == 0 for o in solved.offsets_bytes)


@pytest.mark.parametrize("alignment", [64, 512])
def test_plan_reports_the_aligned_bound(alignment):
    g = random_dag(7, 40, max_size=3000)
    plan = make_plan(g, time_limit_seconds=2, reorder=False, alignment_bytes=alignment)
    report = plan.report
    assert report["alignment_bytes"] == alignment
    assert report["arena_lower_bound_bytes"] == peak_bytes(g, plan.order, alignment) - persistent_bytes(g, alignment)
    assert report["arena_bytes"] >= report["arena_lower_bound_bytes"]
    assert all(offset % alignment == 0 for offset in plan.offsets.values())


def _cli() -> typer.Typer:
    app = typer.Typer()
    register_place(app)
    register_optimize(app)
    return app


def test_cli_alignment_flag(tmp_path: Path):
    graph = random_dag(5, 30, max_size=3000)
    path = tmp_path / "g.json"
    write_graph_json(graph, path)
    for command in ("place", "optimize"):
        out = tmp_path / f"{command}.json"
        args = [command, str(path), "--alignment", "512", "--time-limit", "1", "--quiet", "--json", str(out)]
        result = CliRunner().invoke(_cli(), args)
        assert result.exit_code == 0, result.output
        report = json.loads(out.read_text())
        bound = report.get("lower_bound_bytes") if command == "place" else report["arena_lower_bound_bytes"]
        order = graph.program_order()
        if command == "place":
            assert bound == peak_bytes(graph, order, 512) - persistent_bytes(graph, 512)
        else:
            assert report["alignment_bytes"] == 512
            assert bound % 512 == 0
        assert report["arena_bytes"] >= bound
