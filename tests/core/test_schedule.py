"""Operator reordering: heuristics, OLLA 4.3 control edges, the CP-SAT model (OLLA eq. 1-5, 14)
against brute force, and the estimator as the single judge of every peak."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.errors import InvalidOrder, MemplanError
from memplan.graph import Category, Graph, Op, Tensor, TensorId, peak_bytes, validate_graph, validate_order
from memplan.graph.generate import olla_figure3, random_dag
from memplan.schedule import ScheduleProblem, ScheduleResult, optimize_order, validate_schedule
from memplan.schedule.early_updates import enforce_early_weight_updates, map_order
from memplan.schedule.heuristics import (
    bfs_order,
    dfs_order,
    free_sources,
    greedy_lpmf,
    hoist_free_sources,
    optimizer_ops,
    portfolio,
    weight_updates_early,
)
from memplan.schedule.ilp import ilp_peak_of_order, optimize_ilp
from tests.core.naive import all_topological_orders, naive_peak

FAST = settings(max_examples=25, deadline=None)


def toy_training_graph(layers: int, seed: int) -> Graph:
    """x -> h1 .. hn -> loss; backward gi, dWi; update_i mutates Wi; release_i frees dWi.
    Program order: forward, backward, every update, every release (eager + zero_grad)."""
    rng = random.Random(seed)
    tensors: list[Tensor] = []
    ops: list[Op] = []

    def tensor(name: str, size: int, category: Category, persistent: bool = False) -> TensorId:
        tensors.append(Tensor(name, size, category, persistent))
        return TensorId(len(tensors) - 1)

    def op(name: str, inputs: list[TensorId], outputs: list[TensorId], mutates: tuple[TensorId, ...] = ()) -> None:
        ops.append(Op(name, name.split("_")[0], tuple(inputs), tuple(outputs), 0, mutates))

    x = tensor("x", 8, Category.INPUT, True)
    op("input", [], [x])
    weights = []
    for i in range(layers):
        weights.append(tensor(f"W{i}", rng.randint(10, 60), Category.PARAMETER, True))
        op(f"param_{i}", [], [weights[-1]])
    acts = [x]
    for i in range(layers):
        acts.append(tensor(f"h{i}", rng.randint(5, 40), Category.ACTIVATION))
        op(f"fwd_{i}", [acts[-2], weights[i]], [acts[-1]])
    loss = tensor("loss", 1, Category.OUTPUT)
    op("loss", [acts[-1]], [loss])
    grad = tensor("g_out", acts[-1] and tensors[acts[-1]].size_bytes, Category.ACTIVATION)
    op("seed", [loss, acts[-1]], [grad])
    grads, reads_done = {}, {}
    for i in reversed(range(layers)):
        grads[i] = tensor(f"dW{i}", tensors[weights[i]].size_bytes, Category.GRADIENT)
        op(f"dw_{i}", [grad, acts[i]], [grads[i]])
        done = tensor(f"ctrl_read_W{i}", 0, Category.CONTROL)
        outputs = [done]
        if i > 0:
            nxt = tensor(f"g{i}", tensors[acts[i]].size_bytes, Category.ACTIVATION)
            outputs.insert(0, nxt)
        op(f"dx_{i}", [grad, weights[i]], outputs)
        reads_done[i] = done
        if i > 0:
            grad = nxt
    for i in range(layers):
        op(f"update_{i}", [weights[i], grads[i], reads_done[i]], [], (weights[i],))
    for i in range(layers):
        op(f"release_{i}", [grads[i]], [])
    graph = Graph(tuple(ops), tuple(tensors), f"toy-{layers}-{seed}")
    validate_graph(graph)
    return graph


def brute_force_peak(graph: Graph) -> int:
    return min(peak_bytes(graph, order) for order in all_topological_orders(graph))


# ----------------------------------------------------------------------------- exact answers


def test_olla_figure3_is_solved_to_its_known_optimum():
    graph, best_order, best_bytes = olla_figure3()
    assert peak_bytes(graph, best_order) == best_bytes
    result = optimize_order(graph, time_limit_seconds=5, method="ilp", workers=1)
    assert result.peak_bytes == best_bytes == 41
    assert result.status == "optimal" and result.gap == 0
    assert list(result.order) == best_order
    validate_schedule(graph, result)


@FAST
@given(seed=st.integers(0, 10_000), num_ops=st.integers(2, 7))
def test_ilp_matches_brute_force_on_tiny_graphs(seed, num_ops):
    graph = random_dag(seed, num_ops, max_size=50)
    result = optimize_order(graph, time_limit_seconds=5, method="ilp", workers=1)
    validate_schedule(graph, result)
    assert result.peak_bytes == brute_force_peak(graph)
    assert result.status == "optimal"


def subset_dp_peak(graph: Graph) -> int:
    """The minimum peak over all orders by dynamic programming over sets of finished ops
    (the resident set while ``v`` runs depends only on the set already run): a second
    oracle, for graphs with too many orders to enumerate."""
    n = graph.num_ops
    preds = [sum(1 << p for p in graph.predecessors[v]) for v in range(n)]
    memo: dict[int, int] = {}

    def step_bytes(done: int, v: int) -> int:
        total = graph.persistent_bytes
        for t, tensor in enumerate(graph.tensors):
            if tensor.persistent:
                continue
            src = graph.producer[t]
            touched = src == v or t in graph.ops[v].inputs
            kept = bool((done >> src) & 1) and (
                tensor.category is Category.OUTPUT or any(not (done >> c) & 1 for c in graph.consumers[t])
            )
            total += tensor.size_bytes if touched or kept else 0
        return total

    def best(done: int) -> int:
        if done == (1 << n) - 1:
            return 0
        if done not in memo:
            memo[done] = min(
                max(step_bytes(done, v), best(done | 1 << v))
                for v in range(n)
                if not (done >> v) & 1 and preds[v] & done == preds[v]
            )
        return memo[done]

    return best(0)


def test_subset_dp_oracle_agrees_with_brute_force():
    for seed in range(5):
        graph = random_dag(seed, 6)
        assert subset_dp_peak(graph) == brute_force_peak(graph)


@pytest.mark.parametrize("seed", [0, 1])
def test_ilp_matches_the_exact_oracle_on_a_toy_training_step(seed):
    graph = toy_training_graph(2, seed=seed)
    result = optimize_order(graph, time_limit_seconds=5, method="ilp", workers=1)
    validate_schedule(graph, result)
    assert result.status == "optimal"
    assert result.peak_bytes == subset_dp_peak(graph)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), num_ops=st.integers(8, 30))
def test_ilp_is_never_worse_than_any_heuristic(seed, num_ops):
    graph = random_dag(seed, num_ops)
    result = optimize_order(graph, time_limit_seconds=1, method="ilp", workers=1)
    validate_schedule(graph, result)
    assert result.peak_bytes <= min(c.peak_bytes for c in portfolio(graph))
    assert result.peak_bytes <= peak_bytes(graph, graph.program_order())
    assert result.lower_bound_bytes <= result.peak_bytes


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_windowed_and_early_update_paths_stay_valid(seed):
    """Force the large-graph machinery on small graphs: windows (tiny literal budget) and
    OLLA 4.3 control edges; the answer must stay valid and no worse than the heuristics."""
    for graph in (random_dag(seed, 40), toy_training_graph(6, seed)):
        problem = ScheduleProblem(
            graph, time_limit_seconds=2, workers=1, max_model_literals=30, early_updates="always", ideal_search=False
        )
        messages: list[str] = []
        result = optimize_ilp(problem, messages.append)
        validate_schedule(graph, result)
        assert result.peak_bytes <= min(c.peak_bytes for c in portfolio(graph))
        if graph.name.startswith("random"):
            assert any("(window)" in m for m in messages), messages
        else:
            assert any("control edges" in m for m in messages), messages
            assert result.status == "feasible" or result.peak_bytes == result.lower_bound_bytes


def test_heuristic_method_never_worse_than_program_order():
    graph = toy_training_graph(8, seed=3)
    result = optimize_order(graph, method="heuristic")
    validate_schedule(graph, result)
    assert result.status == "heuristic"
    assert result.peak_bytes < peak_bytes(graph, graph.program_order())  # gradients released early


# ----------------------------------------------------------------------------- the objective


@FAST
@given(seed=st.integers(0, 10_000), num_ops=st.integers(1, 12), data=st.randoms(use_true_random=False))
def test_ilp_objective_of_an_order_equals_the_estimator(seed, num_ops, data):
    graph = random_dag(seed, num_ops)
    order = list(range(num_ops))  # program order, then a random topological one
    indegree = [len(p) for p in graph.predecessors]
    ready, shuffled = [v for v in order if indegree[v] == 0], []
    while ready:
        v = ready.pop(data.randrange(len(ready)))
        shuffled.append(v)
        for s in graph.successors[v]:
            indegree[s] -= 1
            if indegree[s] == 0:
                ready.append(s)
    for candidate in (order, shuffled):
        assert ilp_peak_of_order(graph, candidate) == peak_bytes(graph, candidate) == naive_peak(graph, candidate)


# ----------------------------------------------------------------------------- heuristics


@FAST
@given(seed=st.integers(0, 10_000), num_ops=st.integers(1, 60))
def test_greedy_running_peak_equals_the_estimator(seed, num_ops):
    graph = random_dag(seed, num_ops)
    run = greedy_lpmf(graph)
    validate_order(graph, run.order)
    assert run.running_peak_bytes == peak_bytes(graph, run.order)


@pytest.mark.parametrize("seed", range(4))
def test_greedy_running_peak_with_urgent_ops_equals_the_estimator(seed):
    graph = toy_training_graph(5, seed)
    run = greedy_lpmf(graph, optimizer_ops(graph))
    assert run.running_peak_bytes == peak_bytes(graph, run.order)


@FAST
@given(seed=st.integers(0, 10_000), num_ops=st.integers(1, 60))
def test_every_heuristic_order_is_topological(seed, num_ops):
    graph = random_dag(seed, num_ops)
    for order in (bfs_order(graph), dfs_order(graph), weight_updates_early(graph)):
        validate_order(graph, order)
    for candidate in portfolio(graph):
        validate_order(graph, candidate.order)
        assert candidate.peak_bytes == peak_bytes(graph, candidate.order)


@FAST
@given(seed=st.integers(0, 10_000), num_ops=st.integers(1, 40))
def test_hoisting_free_sources_never_raises_the_peak(seed, num_ops):
    graph = random_dag(seed, num_ops, persistent_fraction=0.4)
    for order in (graph.program_order(), bfs_order(graph)):
        hoisted = hoist_free_sources(graph, order)
        validate_order(graph, hoisted)
        assert peak_bytes(graph, hoisted) <= peak_bytes(graph, order)
        assert set(hoisted[: len(free_sources(graph))]) == set(free_sources(graph))


def test_updates_early_releases_gradients_before_the_backward_ends():
    graph = toy_training_graph(4, seed=0)
    order = weight_updates_early(graph)
    names = [graph.ops[v].name for v in order]
    assert names.index("release_3") < names.index("dw_0")
    assert peak_bytes(graph, order) <= peak_bytes(graph, graph.program_order())


# ----------------------------------------------------------------------------- OLLA 4.3


@pytest.mark.parametrize("seed", range(5))
def test_early_update_edges_keep_the_graph_valid_and_the_data_unchanged(seed):
    graph = toy_training_graph(5, seed)
    constrained, edges = enforce_early_weight_updates(graph)
    validate_graph(constrained)  # acyclic, listed topologically
    assert edges and constrained is not graph and len(graph.tensors) == len(constrained.tensors) - len(edges)
    extra = constrained.tensors[len(graph.tensors) :]
    assert all(t.size_bytes == 0 and t.category is Category.CONTROL for t in extra)
    for t_id, tensor in enumerate(graph.tensors):  # same producer and readers for every data tensor
        new_id = constrained.tensor_index[tensor.name]
        assert graph.ops[graph.producer[t_id]].name == constrained.ops[constrained.producer[new_id]].name
        assert {graph.ops[c].name for c in graph.consumers[t_id]} == {
            constrained.ops[c].name for c in constrained.consumers[new_id]
        }
    for update, anchor in edges:
        assert graph.ops[update].kind in ("update", "release")
        assert graph.ops[anchor].name in {
            constrained.ops[s].name for s in constrained.successors[constrained.op_index[graph.ops[update].name]]
        }
    order = map_order(constrained.program_order(), constrained, graph)
    validate_order(graph, order)  # every order of the constrained graph is one of the original
    assert peak_bytes(graph, order) == peak_bytes(constrained, constrained.program_order())


def test_early_updates_without_updates_return_the_same_graph():
    graph = random_dag(0, 20)
    constrained, edges = enforce_early_weight_updates(graph)
    assert edges == [] and constrained is graph


# ----------------------------------------------------------------------------- errors and hygiene


def test_bad_options_raise_typed_errors():
    graph, _, _ = olla_figure3()
    with pytest.raises(MemplanError, match="unknown schedule method"):
        optimize_order(graph, method="magic")
    with pytest.raises(MemplanError, match="time limit"):
        optimize_order(graph, time_limit_seconds=0)


def test_validate_schedule_rejects_a_wrong_peak_and_a_wrong_order():
    graph, order, best_bytes = olla_figure3()
    good = ScheduleResult(tuple(order), best_bytes, "test", "feasible", 0.0, None, 0)
    validate_schedule(graph, good)
    with pytest.raises(InvalidOrder, match="claims a peak"):
        validate_schedule(graph, ScheduleResult(tuple(order), best_bytes - 1, "test", "feasible", 0.0, None, 0))
    with pytest.raises(InvalidOrder):
        validate_schedule(graph, ScheduleResult((3, 2, 1, 0), best_bytes, "test", "feasible", 0.0, None, 0))


def test_schedule_never_imports_torch():
    code = "import sys, memplan.schedule, memplan.schedule.ilp; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
