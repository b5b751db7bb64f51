"""Exact reordering: the search over ideals and the cut bound, against brute force."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.graph import peak_bytes, validate_order
from memplan.graph.analysis import Reachability, necessarily_resident_bytes, peak_lower_bound
from memplan.graph.generate import random_dag
from memplan.graph.liveness import memory_timeline, positions
from memplan.schedule import ScheduleProblem, native, solve, validate_schedule
from memplan.schedule.bounds import CutNetwork, cut_lower_bound, ordering_bound, resident_floor
from memplan.schedule.heuristics import best_heuristic, hoist_free_sources
from memplan.schedule.ideals import IdealGraph, fit_under, minimise_peak
from memplan.schedule.ilp import Spans, segments
from tests.core.naive import all_topological_orders
from tests.core.test_schedule import brute_force_peak, subset_dp_peak, toy_training_graph

FAST = settings(max_examples=30, deadline=None)
needs_native = pytest.mark.skipif(not native.available(), reason="no C compiler here to build the compiled search")


def far() -> float:
    return time.perf_counter() + 60.0


@FAST
@given(seed=st.integers(0, 10_000), num_ops=st.integers(2, 7))
def test_search_over_ideals_finds_and_proves_the_brute_force_optimum(seed, num_ops):
    graph = random_dag(seed, num_ops, max_size=50)
    best = brute_force_peak(graph)
    found = fit_under(graph, best, far())
    assert found.order is not None and found.proven
    validate_order(graph, found.order)
    assert peak_bytes(graph, found.order) <= best
    below = fit_under(graph, best - 1, far())
    assert below.order is None and below.proven


@pytest.mark.parametrize(("layers", "seed"), [(2, 0), (3, 1), (4, 2)])
def test_cap_bisection_proves_the_optimum_of_a_training_step(layers, seed):
    graph = toy_training_graph(layers, seed=seed)
    optimum = subset_dp_peak(graph)
    result = minimise_peak(graph, peak_lower_bound(graph), graph.program_order(), far())
    assert result.peak_bytes == optimum == result.proven_lower_bytes
    if result.order is not None:
        assert peak_bytes(graph, result.order) == optimum


def test_out_of_time_proves_nothing():
    graph = toy_training_graph(4, seed=3)
    result = fit_under(graph, peak_lower_bound(graph) - 1, time.perf_counter() - 1.0, max_nodes=0)
    assert result.order is None and not result.proven


def brute_force_floor(graph, v: int) -> int:
    """The fewest bytes resident while ``v`` runs, over every order."""
    return min(memory_timeline(graph, order)[positions(order)[v]] for order in all_topological_orders(graph))


@FAST
@given(seed=st.integers(0, 10_000), num_ops=st.integers(2, 7))
def test_resident_floor_is_the_brute_force_minimum_at_each_op(seed, num_ops):
    graph = random_dag(seed, num_ops, max_size=50)
    reach = Reachability.of(graph)
    network = CutNetwork.of(graph)
    necessary = necessarily_resident_bytes(graph, reach)
    for v in range(graph.num_ops):
        floor = resident_floor(graph, reach, network, v)
        assert floor == brute_force_floor(graph, v)
        assert floor >= necessary[v]


@FAST
@given(seed=st.integers(0, 10_000), num_ops=st.integers(2, 7))
def test_cut_bound_is_valid_and_never_weaker(seed, num_ops):
    graph = random_dag(seed, num_ops, max_size=50)
    lower = peak_lower_bound(graph)
    cut = cut_lower_bound(graph, graph.program_order(), lower, far())
    assert lower <= cut.bound_bytes <= brute_force_peak(graph)
    assert cut.complete


def brute_force_sequence_floor(graph, ops: list[int]) -> int:
    """The fewest bytes any order holds at its worst step among ``ops``."""
    return min(
        max(memory_timeline(graph, order)[positions(order)[v]] for v in ops) for order in all_topological_orders(graph)
    )


@FAST
@given(seed=st.integers(0, 10_000), num_ops=st.integers(2, 7), picks=st.lists(st.integers(0, 6), max_size=3))
def test_floor_with_ops_forced_before_and_after_is_the_brute_force_minimum(seed, num_ops, picks):
    graph = random_dag(seed, num_ops, max_size=50)
    reach = Reachability.of(graph)
    network = CutNetwork.of(graph)
    v, *rest = [p % num_ops for p in [0, *picks]]
    rest = [u for u in rest if u != v]
    before, after = rest[: len(rest) // 2], rest[len(rest) // 2 :]
    fitting = [
        memory_timeline(graph, order)[positions(order)[v]]
        for order in all_topological_orders(graph)
        if all(positions(order)[u] < positions(order)[v] for u in before)
        and all(positions(order)[u] > positions(order)[v] for u in after)
    ]
    floor = resident_floor(graph, reach, network, v, before, after)
    assert floor == (min(fitting) if fitting else None)


@FAST
@given(
    seed=st.integers(0, 10_000), num_ops=st.integers(2, 7), picks=st.lists(st.integers(0, 6), min_size=1, max_size=4)
)
def test_ordering_bound_is_valid_and_never_weaker_than_its_floors(seed, num_ops, picks):
    graph = random_dag(seed, num_ops, max_size=50)
    reach = Reachability.of(graph)
    network = CutNetwork.of(graph)
    ops = list(dict.fromkeys(p % num_ops for p in picks))
    bound = ordering_bound(graph, ops, far(), reach, network)
    floors = [resident_floor(graph, reach, network, v) for v in ops]
    assert bound is not None
    assert max(floors) <= bound <= brute_force_sequence_floor(graph, ops) <= brute_force_peak(graph)
    if len(ops) == 1:
        assert bound == floors[0]


def test_ordering_bound_is_stronger_than_the_cut_bound():
    # Found by a sweep over random_dag: each op's floor comes from a different ideal; fixing
    # which op of the four runs first lifts the bound from 139 to the optimum, 167.
    graph = random_dag(210, 6, max_size=50)
    cut = cut_lower_bound(graph, graph.program_order(), peak_lower_bound(graph), far())
    top = [v for v, _ in sorted(cut.floors, key=lambda f: -f[1])[:4]]
    assert cut.bound_bytes == 139
    assert ordering_bound(graph, top, far()) == brute_force_peak(graph) == 167


def test_ordering_bound_out_of_time_proves_nothing():
    graph = random_dag(210, 6, max_size=50)
    assert ordering_bound(graph, [0, 1, 2], time.perf_counter() - 1.0) is None
    with pytest.raises(ValueError, match="at least one op"):
        ordering_bound(graph, [], far())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_optimize_order_is_optimal_only_at_its_proven_bound(seed):
    graph = toy_training_graph(3, seed=seed)
    for ideal_search in (True, False):
        result = solve(ScheduleProblem(graph, time_limit_seconds=5, workers=1, ideal_search=ideal_search))
        validate_schedule(graph, result)
        assert result.peak_bytes == subset_dp_peak(graph)
        assert (result.status == "optimal") == (result.peak_bytes == result.lower_bound_bytes)


def test_search_over_ideals_is_never_worse_than_the_heuristics():
    for seed in range(3):
        graph = random_dag(seed, 60)
        heuristic = best_heuristic(graph).peak_bytes
        result = solve(ScheduleProblem(graph, time_limit_seconds=5, workers=1, early_updates="never"))
        validate_schedule(graph, result)
        assert peak_lower_bound(graph) <= result.lower_bound_bytes <= result.peak_bytes <= heuristic
        searched = minimise_peak(graph, peak_lower_bound(graph), best_heuristic(graph).order, far())
        assert searched.peak_bytes <= heuristic and searched.proven_lower_bytes <= searched.peak_bytes


@needs_native
def test_compiled_search_follows_the_reference_node_for_node():
    for seed in range(60):
        graph = random_dag(seed, 5 + seed % 30)
        ig = IdealGraph.of(graph)
        lower, top = peak_lower_bound(graph), peak_bytes(graph, graph.program_order())
        for cap in (lower - 1, lower, (lower + top) // 2, top):
            a = fit_under(graph, cap, far(), ig=ig, engine="python")
            b = fit_under(graph, cap, far(), ig=ig, engine="native")
            assert (a.order, a.proven, a.nodes) == (b.order, b.proven, b.nodes), (seed, cap)


@needs_native
def test_segments_are_searched_alone_and_agree():
    for layers, seed in [(3, 0), (4, 1)]:
        graph = toy_training_graph(layers, seed=seed)
        parts = segments(Spans.of(graph, Reachability.of(graph)))
        start = hoist_free_sources(graph, graph.program_order())
        for engine in ("python", "native"):
            result = minimise_peak(graph, peak_lower_bound(graph), start, far(), parts=parts, engine=engine)
            assert result.peak_bytes == result.proven_lower_bytes == subset_dp_peak(graph)
