"""Graph core: validation errors, JSON round-trip, the estimator against a naive oracle."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.errors import (
    CycleError,
    DanglingReference,
    DuplicateName,
    GraphFormatError,
    InvalidOrder,
    NegativeSize,
    ProducerError,
)
from memplan.graph import (
    Category,
    Graph,
    Op,
    Reachability,
    Tensor,
    TensorId,
    alap_levels,
    asap_levels,
    lifetimes,
    make_graph,
    memory_timeline,
    peak_bytes,
    peak_lower_bound,
    read_graph_json,
    topological_order,
    validate_graph,
    validate_order,
    write_graph_json,
)
from memplan.graph.generate import olla_figure3, random_dag
from tests.core.naive import all_topological_orders, naive_peak

dags = st.builds(random_dag, seed=st.integers(0, 10_000), num_ops=st.integers(1, 40))
tiny_dags = st.builds(random_dag, seed=st.integers(0, 10_000), num_ops=st.integers(1, 7))


def chain() -> Graph:
    return make_graph(
        [Tensor("w", 100, Category.PARAMETER, True), Tensor("a", 4), Tensor("b", 8), Tensor("c", 2, Category.OUTPUT)],
        [
            ("w_in", "placeholder", [], ["w"]),
            ("f", "x", ["w"], ["a"]),
            ("g", "y", ["a"], ["b"]),
            ("h", "z", ["b"], ["c"]),
        ],
    )


def test_chain_timeline_by_hand():
    g = chain()
    validate_graph(g)
    # persistent 100; f: a(4); g: a+b (12); h: b+c (10)
    assert memory_timeline(g, [0, 1, 2, 3]) == [100, 104, 112, 110]
    assert peak_bytes(g, [0, 1, 2, 3]) == 112
    lives = {g.tensors[life.tensor].name: (life.start, life.end) for life in lifetimes(g, [0, 1, 2, 3])}
    assert lives == {"w": (0, 4), "a": (1, 3), "b": (2, 4), "c": (3, 4)}


def test_olla_figure3_best_order():
    g, best, best_peak = olla_figure3()
    peaks = {tuple(o): peak_bytes(g, o) for o in all_topological_orders(g)}
    assert min(peaks.values()) == best_peak == peaks[tuple(best)]
    assert max(peaks.values()) == 60


@pytest.mark.parametrize(
    ("ops", "tensors", "error"),
    [
        ([Op("a", "k", (), (TensorId(0),)), Op("a", "k", (TensorId(0),), ())], [Tensor("t", 1)], DuplicateName),
        ([Op("a", "k", (), (TensorId(0),))], [Tensor("t", 1), Tensor("t", 2)], DuplicateName),
        ([Op("a", "k", (TensorId(3),), (TensorId(0),))], [Tensor("t", 1)], DanglingReference),
        ([Op("a", "k", (), ())], [Tensor("t", 1)], ProducerError),
        ([Op("a", "k", (), (TensorId(0),)), Op("b", "k", (), (TensorId(0),))], [Tensor("t", 1)], ProducerError),
        ([Op("a", "k", (), (TensorId(0),))], [Tensor("t", -1)], NegativeSize),
        ([Op("a", "k", (), (TensorId(0),))], [Tensor("t", 3, Category.CONTROL)], NegativeSize),
        (
            [Op("a", "k", (TensorId(1),), (TensorId(0),)), Op("b", "k", (TensorId(0),), (TensorId(1),))],
            [Tensor("t", 1), Tensor("u", 1)],
            CycleError,
        ),
        (
            [Op("a", "k", (TensorId(1),), (TensorId(0),)), Op("b", "k", (), (TensorId(1),))],
            [Tensor("t", 1), Tensor("u", 1)],
            InvalidOrder,
        ),
    ],
)
def test_validate_graph_names_each_failure(ops, tensors, error):
    with pytest.raises(error) as info:
        validate_graph(Graph(tuple(ops), tuple(tensors)))
    assert "\n" not in str(info.value)


def test_validate_order_rejects_bad_orders():
    g = chain()
    validate_order(g, [0, 1, 2, 3])
    for bad in ([0, 1, 2], [0, 1, 1, 3], [0, 2, 1, 3], [0, 1, 2, 9]):
        with pytest.raises(InvalidOrder):
            validate_order(g, bad)


@settings(max_examples=200, deadline=None)
@given(dags, st.randoms(use_true_random=False))
def test_estimator_matches_naive_resident_sets(graph, rnd):
    order = topological_order(graph, [rnd.random() for _ in graph.ops])
    validate_order(graph, order)
    assert peak_bytes(graph, order) == naive_peak(graph, order)


@settings(max_examples=100, deadline=None)
@given(tiny_dags)
def test_lower_bound_is_below_every_order_and_tight_on_chains(graph):
    bound = peak_lower_bound(graph)
    best = min(peak_bytes(graph, o) for o in all_topological_orders(graph))
    assert bound <= best


def test_lower_bound_equals_peak_when_only_one_order():
    g = chain()
    assert peak_lower_bound(g) == peak_bytes(g, [0, 1, 2, 3]) == 112


@settings(max_examples=100, deadline=None)
@given(dags)
def test_asap_alap_and_reachability_agree_with_orders(graph):
    asap, alap = asap_levels(graph), alap_levels(graph)
    reach = Reachability.of(graph)
    for v in range(graph.num_ops):
        assert asap[v] <= alap[v]
        for p in graph.predecessors[v]:
            assert asap[p] < asap[v] and alap[p] < alap[v]
            assert reach.is_ancestor(p, v) and not reach.is_ancestor(v, p)
        assert reach.earliest_positions[v] <= reach.latest_positions[v]
    order = topological_order(graph)
    pos = {v: i for i, v in enumerate(order)}
    for v in range(graph.num_ops):
        assert reach.earliest_positions[v] <= pos[v] <= reach.latest_positions[v]


def test_reachability_by_brute_force():
    g = random_dag(7, 30)
    reach = Reachability.of(g)

    def reaches(a, b):
        stack, seen = [a], set()
        while stack:
            v = stack.pop()
            for s in g.successors[v]:
                if s not in seen:
                    seen.add(s)
                    stack.append(s)
        return b in seen

    for a in range(g.num_ops):
        for b in range(g.num_ops):
            assert reach.is_ancestor(a, b) == reaches(a, b)


@settings(max_examples=50, deadline=None)
@given(dags)
def test_json_round_trip(tmp_path_factory, graph):
    path = tmp_path_factory.mktemp("g") / "g.json"
    write_graph_json(graph, path)
    assert read_graph_json(path) == graph


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        "[]",
        '{"format": "memplan-graph", "version": 99}',
        '{"format": "memplan-graph", "version": 1}',
        '{"format": "memplan-graph", "version": 1, "tensors": [], "ops": [{"name": "a", "inputs": ["x"]}]}',
    ],
)
def test_malformed_json_gives_one_line(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(GraphFormatError) as info:
        read_graph_json(path)
    assert ("\n" not in str(info.value) and str(path) in str(info.value)) or "unknown tensor" in str(info.value)


def test_large_graph_reachability_is_fast_enough():
    g = random_dag(1, 20_000, max_inputs=2)
    reach = Reachability.of(g)  # must finish in seconds; timed by bench, not here
    assert reach.is_ancestor(0, 0) is False


def test_core_never_imports_torch():
    code = (
        "import sys, memplan.graph, memplan.schedule, memplan.placement, memplan.remat, memplan.streams;"
        "import memplan.graph.analysis, memplan.graph.liveness, memplan.graph.io;"
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_json_is_human_readable(tmp_path):
    write_graph_json(chain(), tmp_path / "g.json")
    data = json.loads((tmp_path / "g.json").read_text())
    assert data["ops"][1] == {"name": "f", "kind": "x", "inputs": ["w"], "outputs": ["a"], "stream": 0}
