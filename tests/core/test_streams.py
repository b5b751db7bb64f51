"""Multi-stream graphs (SOMAS): JSON, bad input, safe pairs vs every execution, the execution
validator, offset assignment, and the data-parallel (DDP buckets) transformation."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.errors import ContiguityConflict, DanglingReference, MissingWait, WaitCycle
from memplan.graph.analysis import Reachability
from memplan.graph.check import validate_graph, validate_order
from memplan.graph.io import graph_from_dict, graph_to_dict
from memplan.graph.ir import Category, Graph, Op, Tensor, TensorId, make_graph
from memplan.graph.multistream import contiguous_groups, relist_streams, stream_sequences, with_contiguous_groups
from memplan.placement import (
    PairConflicts,
    Placement,
    PlacementError,
    PlacementProblem,
    solve_exact,
    validate_placement,
)
from memplan.placement.somas import many_objects, single_object
from memplan.schedule.early_updates import enforce_early_weight_updates
from memplan.streams import (
    GradientMismatch,
    add_gradient_buckets,
    assign_buckets,
    data_parallel_step,
    ddp_buckets,
    gradient_parameters,
    graph_based_safe_pairs,
    interval_claim,
    plan_stream_placement,
    stream_based_safe_pairs,
    stream_problem,
    validate_stream_placement,
    validate_streams,
)
from memplan.streams.generate import ddp_like_graph, prefetch_chain, random_stream_graph, somas_example
from memplan.streams.interleave import colive_in_every_state

# ----------------------------------------------------------------------------- helpers


def names(graph: Graph, pairs) -> set[frozenset[str]]:
    return {frozenset((graph.tensors[a].name, graph.tensors[b].name)) for a, b in pairs}


def unsafe_names(graph: Graph) -> set[frozenset[str]]:
    sp = stream_based_safe_pairs(graph)
    return names(graph, [(sp.tensors[i], sp.tensors[j]) for i, j in sp.unsafe_pairs()])


def colive_oracle(graph: Graph, order=None) -> np.ndarray:
    """Pairs live together in some reachable state of some execution, by visiting every state."""
    sp = stream_based_safe_pairs(graph, order)
    n = len(sp.tensors)
    a, b = np.triu_indices(n, 1)
    found = colive_in_every_state(graph, sp.tensors, (a, b), order, limit=10**6)
    assert found is not None
    colive = np.zeros((n, n), dtype=bool)
    for k in found[0]:
        colive[a[k], b[k]] = colive[b[k], a[k]] = True
    return colive


def two_streams_with(extra_ops: list, extra_tensors: list[Tensor] = ()) -> dict:
    """A JSON dict of a small two-stream graph plus ``extra_ops`` (JSON op dicts)."""
    tensors = [Tensor("a", 8), Tensor("b", 8), Tensor("c", 8, Category.OUTPUT), *extra_tensors]
    g = make_graph(tensors, [("p", "make", [], ["a"]), ("q", "use", ["a"], ["b"], 1), ("r", "use", ["b"], ["c"])])
    data = graph_to_dict(g)
    data["ops"] += extra_ops
    return data


# ----------------------------------------------------------------------------- JSON and bad input


def test_json_round_trips_streams_and_contiguous_groups() -> None:
    g = with_contiguous_groups(somas_example(), [[0, 3]])
    back = graph_from_dict(json.loads(json.dumps(graph_to_dict(g))))
    assert [op.stream for op in back.ops] == [op.stream for op in g.ops] == [0, 0, 1, 0, 0, 0]
    assert contiguous_groups(back) == ((0, 3),)


def test_streams_listed_one_after_another_are_relisted_keeping_each_streams_order() -> None:
    data = graph_to_dict(somas_example())
    data["ops"] = [o for o in data["ops"] if o["stream"] == 1] + [o for o in data["ops"] if o["stream"] == 0]
    g = graph_from_dict(data)  # op3 (stream 1) reads a, made later in the listing by op1
    validate_graph(g)
    assert stream_sequences(g)[1] == [g.op_index["op3"]]
    assert [g.ops[v].name for v in stream_sequences(g)[0]] == ["op1", "op2", "op4", "op5", "op6"]


def test_cycle_through_waits_is_one_line() -> None:
    # stream 0: x then y; stream 1: u then w; x waits for w's event, u waits for y's event
    tensors = [Tensor(n, 0, Category.CONTROL) for n in ("ev_w", "ev_y")] + [Tensor("d", 4)]
    ops = [
        {"name": "x", "kind": "k", "inputs": ["ev_w"], "outputs": ["d"], "stream": 0},
        {"name": "y", "kind": "k", "inputs": ["d"], "outputs": ["ev_y"], "stream": 0},
        {"name": "u", "kind": "k", "inputs": ["ev_y"], "outputs": [], "stream": 1},
        {"name": "w", "kind": "k", "inputs": [], "outputs": ["ev_w"], "stream": 1},
    ]
    data = {
        "format": "memplan-graph",
        "version": 1,
        "tensors": [{"name": t.name, "size_bytes": t.size_bytes, "category": t.category.value} for t in tensors],
        "ops": ops,
    }
    with pytest.raises(WaitCycle) as err:
        graph_from_dict(data)
    message = str(err.value)
    assert "\n" not in message and "cycle" in message
    assert all(f"'{n}'" in message for n in ("x", "y", "u", "w"))


ALL_REDUCE_WITHOUT_WAIT = {
    "name": "ar",
    "kind": "memplan.all_reduce",
    "inputs": ["b"],
    "outputs": ["h"],
    "mutates": ["b"],
    "stream": 1,
}


def test_collective_without_a_wait_is_one_line() -> None:
    data = two_streams_with(
        [ALL_REDUCE_WITHOUT_WAIT],
        [Tensor("h", 0, Category.CONTROL)],
    )
    with pytest.raises(MissingWait, match=r"'ar' .* is never waited for") as err:
        validate_streams(graph_from_dict(data))
    assert "\n" not in str(err.value)


def test_reading_a_collectives_result_without_its_wait_is_one_line() -> None:
    g = data_parallel_step(ddp_like_graph(4), bucket_cap_bytes=2000)
    validate_streams(g)
    data = graph_to_dict(g)
    ops = data["ops"]
    sgd3 = next(op for op in ops if op["name"] == "sgd3")
    sgd3["inputs"] = [t for t in sgd3["inputs"] if not t.endswith(".ready")]
    ops.remove(sgd3)  # and run it on stream 0 before the wait: it may overlap the all-reduce
    ops.insert(next(i for i, op in enumerate(ops) if op["name"] == "all_reduce:bucket0") + 1, sgd3)
    with pytest.raises(MissingWait, match=r"'sgd3' .* reads 'grad:w3'.* without waiting for it"):
        validate_streams(graph_from_dict(data))


def test_contiguous_group_errors_are_one_line_each() -> None:
    g = data_parallel_step(ddp_like_graph(4), bucket_cap_bytes=2000)
    groups = contiguous_groups(g)
    idx = g.tensor_index
    cases = [
        ([*groups, (groups[0][0],)], "in contiguous groups 0 and 2"),
        ([(*groups[0], groups[0][0]), groups[1]], "twice in contiguous group 0"),
        ([groups[0], (*groups[1], idx["param:w0"])], "is persistent"),
        ([(*groups[0], groups[1][0]), groups[1][1:]], "does not read its member 'grad:w1'"),
    ]
    for bad, message in cases:
        with pytest.raises(ContiguityConflict, match=message) as err:
            validate_streams(with_contiguous_groups(g, bad))
        assert "\n" not in str(err.value)
    data = graph_to_dict(g)
    data["meta"]["contiguous"] = [["no-such-tensor"]]
    with pytest.raises(DanglingReference, match="no-such-tensor"):
        graph_from_dict(data)


def test_cli_reports_bad_stream_graphs_in_one_line(tmp_path: Path) -> None:
    data = two_streams_with(
        [ALL_REDUCE_WITHOUT_WAIT],
        [Tensor("h", 0, Category.CONTROL)],
    )
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    run = subprocess.run([sys.executable, "-m", "memplan.cli", "analyze", str(path)], capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr.strip().startswith("memplan: error:") and "never waited for" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- safe pairs


def test_somas_example_a_and_f_are_unsafe_though_their_intervals_are_disjoint() -> None:
    g = somas_example()
    unsafe = unsafe_names(g)
    assert frozenset(("a", "f")) in unsafe  # op3 (stream 1) may read a after op4 made f
    assert frozenset(("x", "z")) not in unsafe  # same stream, one after the other
    claim = interval_claim(stream_problem(g))
    assert names(g, claim.unsafe_overlaps) == {frozenset(("a", "f"))}


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 40), st.integers(1, 4), st.floats(0.0, 0.6))
def test_graph_based_and_stream_based_agree(seed: int, num_ops: int, streams: int, events: float) -> None:
    g = random_stream_graph(seed, num_ops, streams, event_fraction=events)
    a, b = graph_based_safe_pairs(g), stream_based_safe_pairs(g)
    assert a.tensors == b.tensors
    assert (a.unsafe == b.unsafe).all()
    assert (a.unsafe == a.unsafe.T).all() and not a.unsafe.diagonal().any()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 9), st.integers(1, 3))
def test_unsafe_pairs_are_exactly_those_live_together_in_some_execution(seed: int, num_ops: int, streams: int) -> None:
    g = random_stream_graph(seed, num_ops, streams, event_fraction=0.3)
    assert (stream_based_safe_pairs(g).unsafe == colive_oracle(g)).all()


def test_safe_pairs_follow_the_given_order() -> None:
    g = random_stream_graph(7, 14, 2)
    reach = Reachability.of(g)
    # another topological order changes each stream's order, hence the relation
    order = sorted(range(g.num_ops), key=lambda v: (reach.ancestors[v].bit_count(), -v))
    validate_order(g, order)
    assert (stream_based_safe_pairs(g, order).unsafe == colive_oracle(g, order)).all()
    assert (graph_based_safe_pairs(g, order).unsafe == stream_based_safe_pairs(g, order).unsafe).all()


def test_single_stream_safe_pairs_are_the_interval_overlaps() -> None:
    g = random_stream_graph(3, 30, 1)
    sp = stream_problem(g)
    lives = np.array(sp.recorded_lifetimes)
    s, e = lives[:, 0], lives[:, 1]
    overlap = (s[:, None] < e[None, :]) & (s[None, :] < e[:, None])
    np.fill_diagonal(overlap, False)
    assert (sp.safety.unsafe == overlap).all()


# ----------------------------------------------------------------------------- the execution validator


@pytest.mark.parametrize("make", [somas_example, lambda: prefetch_chain(5), lambda: random_stream_graph(11, 12, 2)])
def test_validator_catches_the_interval_plan_and_passes_the_stream_plan(make) -> None:
    g = make()
    sp = stream_problem(g)
    claim = interval_claim(sp)
    check = validate_stream_placement(g, claim.offsets)
    assert check.exhaustive and not check.safe
    assert "share bytes but are live together when" in str(check.failures[0])
    plan = plan_stream_placement(g)
    assert validate_stream_placement(g, plan.offsets).safe
    assert plan.arena_bytes >= plan.lower_bound_bytes
    assert claim.placement.arena_bytes < plan.arena_bytes  # the interval plan's saving is the race


def test_sampled_executions_also_catch_the_prefetch_race() -> None:
    g = prefetch_chain(8)
    claim = interval_claim(stream_problem(g))
    check = validate_stream_placement(g, claim.offsets, state_limit=0)  # force sampling
    assert not check.exhaustive and not check.safe
    limited = prefetch_chain(8, rate_limit=True)
    assert interval_claim(stream_problem(limited)).safe  # FSDP's rate limit makes it safe
    assert validate_stream_placement(limited, interval_claim(stream_problem(limited)).offsets).safe


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(3, 12), st.integers(1, 3))
def test_stream_plans_are_safe_in_every_execution(seed: int, num_ops: int, streams: int) -> None:
    g = random_stream_graph(seed, num_ops, streams, event_fraction=0.3)
    plan = plan_stream_placement(g, time_limit_seconds=1.0)
    validate_placement(plan.stream_problem.problem, plan.placement)
    check = validate_stream_placement(g, plan.offsets)
    assert check.exhaustive and check.safe, check.failures[:1]
    claim = interval_claim(plan.stream_problem)
    assert claim.safe == validate_stream_placement(g, claim.offsets).safe


# ----------------------------------------------------------------------------- offset assignment


def random_pair_problem(seed: int, n: int, groups: bool) -> PlacementProblem:
    rng = np.random.default_rng(seed)
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n) if rng.random() < 0.4]
    contiguous = ((0, 1, 2), (4, 3)) if groups and n >= 5 else ()
    sizes = tuple(int(s) for s in rng.integers(1, 6, n))
    return PlacementProblem(sizes, PairConflicts(n, pairs), contiguous=contiguous)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 9), st.booleans())
def test_single_and_many_objects_are_valid_and_never_below_the_optimum(seed: int, n: int, groups: bool) -> None:
    problem = random_pair_problem(seed, n, groups)
    exact = solve_exact(problem, 5.0, workers=1)
    assert exact.status == "optimal"
    for found in (single_object(problem), many_objects(problem)):
        assert found is not None
        validate_placement(problem, found)
        assert found.arena_bytes >= exact.arena_bytes >= problem.lower_bound_bytes


def test_many_objects_stacks_objects_as_high_as_their_first_block() -> None:
    # three buffers that all conflict: one object each, stacked
    problem = PlacementProblem((4, 2, 1), PairConflicts(3, [(0, 1), (0, 2), (1, 2)]))
    found = many_objects(problem)
    assert found is not None and sorted(found.offsets_bytes) == [0, 4, 6] and found.arena_bytes == 7
    # a small buffer safe with the big one shares its object
    problem = PlacementProblem((4, 2, 1), PairConflicts(3, [(1, 2)]))
    assert many_objects(problem).arena_bytes == 4


def test_known_cliques_raise_the_bound_and_false_ones_are_refused() -> None:
    problem = PlacementProblem((3, 3, 3), PairConflicts(3, [(0, 1), (1, 2), (0, 2)]), cliques=((0, 1, 2),))
    assert problem.lower_bound_bytes == 9
    with pytest.raises(PlacementError, match="do not conflict"):
        PlacementProblem((3, 3, 3), PairConflicts(3, [(0, 1)]), cliques=((0, 1, 2),))


def test_stream_problem_bound_is_a_clique_of_unsafe_pairs_and_plan_meets_it_on_somas_example() -> None:
    sp = stream_problem(somas_example())
    for clique in sp.problem.cliques:
        sub = sp.safety.unsafe[np.ix_(clique, clique)]
        assert sub.sum() == len(clique) * (len(clique) - 1)
    plan = plan_stream_placement(somas_example())
    assert plan.placement.status == "optimal" and plan.arena_bytes == plan.lower_bound_bytes


# ----------------------------------------------------------------------------- data parallel


def test_ddp_bucket_assignment_closes_a_bucket_when_it_reaches_its_limit() -> None:
    assert assign_buckets([4, 4, 4, 4, 4], 8) == [[0, 1], [2, 3], [4]]
    assert assign_buckets([10, 1, 1], 8) == [[0], [1, 2]]
    assert assign_buckets([2, 2, 8, 8], 8, first_bucket_cap_bytes=3) == [[0, 1], [2], [3]]


def test_ddp_buckets_take_parameters_in_reverse_order() -> None:
    g = ddp_like_graph(4)
    pairs = gradient_parameters(g)
    assert [(g.tensors[p].name, g.tensors[q].name) for p, q in pairs] == [
        (f"param:w{i}", f"grad:w{i}") for i in range(4)
    ]
    buckets = ddp_buckets(g, bucket_cap_bytes=2000)
    assert [[g.tensors[t].name for t in b.gradients] for b in buckets] == [
        ["grad:w3", "grad:w2"],
        ["grad:w1", "grad:w0"],
    ]


def updates_after_their_waits(g: Graph) -> bool:
    reach = Reachability.of(g)
    for bucket in g.meta["buckets"]:
        wait = g.op_index[bucket["wait"]]
        grads = {g.tensor_index[n] for n in bucket["gradients"]}
        for v, op in enumerate(g.ops):
            updates = any(g.tensors[p].category is Category.PARAMETER for p in op.mutates)
            if updates and grads & set(op.inputs) and not reach.is_ancestor(wait, v):
                return False
    return True


def test_gradient_buckets_are_all_reduced_on_stream_1_and_waited_for_before_updates() -> None:
    g = data_parallel_step(ddp_like_graph(4), bucket_cap_bytes=2000)
    validate_streams(g)
    assert len(g.meta["buckets"]) == 2
    for bucket in g.meta["buckets"]:
        ar = g.ops[g.op_index[bucket["all_reduce"]]]
        assert ar.stream == 1 and ar.kind == "memplan.all_reduce"
        assert [g.tensors[t].name for t in ar.mutates] == bucket["gradients"]
        assert g.ops[g.op_index[bucket["wait"]]].stream == 0
    assert [[g.tensors[t].name for t in grp] for grp in contiguous_groups(g)] == [
        b["gradients"] for b in g.meta["buckets"]
    ]
    assert updates_after_their_waits(g)
    # the first bucket's all-reduce starts right after its last gradient, before the rest of the backward
    listing = [op.name for op in g.ops]
    assert listing.index("all_reduce:bucket0") == listing.index("bwd2") + 1 < listing.index("bwd1")


def test_waits_can_be_pinned_after_the_whole_backward() -> None:
    g = data_parallel_step(ddp_like_graph(4), bucket_cap_bytes=2000, waits_after_backward=True)
    validate_streams(g)
    reach = Reachability.of(g)
    last_backward = g.op_index["bwd0"]
    for bucket in g.meta["buckets"]:
        assert reach.is_ancestor(last_backward, g.op_index[bucket["wait"]])
    early, _ = enforce_early_weight_updates(g)
    validate_streams(early)
    assert updates_after_their_waits(early)


def test_early_weight_updates_respect_the_waits() -> None:
    g = data_parallel_step(ddp_like_graph(6), bucket_cap_bytes=2000)
    early, edges = enforce_early_weight_updates(g)
    assert edges
    validate_streams(early)
    assert updates_after_their_waits(early)
    plan = plan_stream_placement(early, time_limit_seconds=2.0)
    assert validate_stream_placement(early, plan.offsets).safe


def test_ddp_plan_is_safe_and_the_collective_runs_on_one_block() -> None:
    g = data_parallel_step(ddp_like_graph(4), bucket_cap_bytes=2000)
    plan = plan_stream_placement(g, time_limit_seconds=2.0)
    assert plan.interval_cover and validate_stream_placement(g, plan.offsets).safe
    offsets = plan.offsets
    for group in contiguous_groups(g):
        for a, b in itertools.pairwise(group):
            assert offsets[b] == offsets[a] + -(-g.tensors[a].size_bytes // 64) * 64


def test_excluding_a_bucket_member_from_the_arena_is_refused() -> None:
    g = data_parallel_step(ddp_like_graph(4), bucket_cap_bytes=2000)
    with pytest.raises(ContiguityConflict, match="'grad:w3' of contiguous group 0 is not placed"):
        stream_problem(g, exclude={g.tensor_index["grad:w3"]})


def test_an_update_reading_two_gradients_is_refused() -> None:
    g = ddp_like_graph(2)
    ops = list(g.ops)
    k = g.op_index["sgd0"]
    ops[k] = Op(ops[k].name, ops[k].kind, (*ops[k].inputs, g.tensor_index["grad:w1"]), (), 0, ops[k].mutates)
    with pytest.raises(GradientMismatch, match="param:w0"):
        gradient_parameters(Graph(tuple(ops), g.tensors))


def test_buckets_after_early_updates_are_refused_when_they_would_cycle() -> None:
    g = ddp_like_graph(4)
    early, _ = enforce_early_weight_updates(g)
    buckets = ddp_buckets(early, bucket_cap_bytes=10**9)  # one bucket: its updates anchor the backward
    try:
        add_gradient_buckets(early, buckets)
    except Exception as err:  # a one-line CycleError is the only acceptable failure
        assert "enforcing early weight updates" in str(err)


def test_relisting_a_valid_listing_changes_nothing() -> None:
    g = random_stream_graph(5, 20, 3)
    assert relist_streams(g) is g


def test_streams_core_never_imports_torch() -> None:
    code = (
        "import sys, memplan.streams, memplan.streams.ddp, memplan.streams.generate, memplan.placement.somas;"
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_placement_of_tensor_ids() -> None:
    plan = plan_stream_placement(somas_example())
    assert set(plan.offsets) == {TensorId(t) for t in range(6)}
    assert isinstance(plan.placement, Placement)
