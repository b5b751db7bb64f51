"""Joint order and recomputation (memplan.remat.joint): the expanded DAG of a plan keeps the
plan's semantics and peak in every order, the order-free bound is below the exact joint
optimum (brute force over every step sequence), and the alternating search lands between that
optimum and the sequential plan it starts from."""

from __future__ import annotations

import heapq
import math
import random
from pathlib import Path

import pytest

from memplan.graph.io import read_graph_json
from memplan.graph.ir import Category, Graph, Op, Tensor, TensorId
from memplan.graph.liveness import peak_bytes
from memplan.remat.baselines import checkpoint_all, dtr
from memplan.remat.joint import (
    cut_cover_bound,
    drop_reruns,
    expand,
    order_free_bound,
    refit_reruns,
    reorder_runs,
    solve_joint,
    steps_in_order,
)
from memplan.remat.lower import insert_frees, sequence_peak_bytes, validate_sequence
from memplan.remat.problem import RematProblem, rerun_limits, run_cost
from tests.core.test_remat_portfolio import TINY, tiny

GPU_GRAPH = Path(__file__).resolve().parents[2] / "bench" / "graphs" / "resnet50-b32-h100.json.gz"


def joint_optimum(graph: Graph, budget: int) -> float | None:
    """The least compute of every valid step sequence within ``budget`` (any order of the first
    runs, any re-runs, frees anywhere), by Dijkstra over (ops run, tensors live); None if none fits.
    Pure ops only (no mutation: the versions of validate_sequence never matter)."""
    assert not any(op.mutates for op in graph.ops)
    n, limits = len(graph.ops), rerun_limits(graph)
    fresh = [[t for t in op.outputs if not graph.tensors[t].persistent] for op in graph.ops]
    outputs = [t for t, x in enumerate(graph.tensors) if x.category is Category.OUTPUT]
    size = [x.size_bytes for x in graph.tensors]
    start = (0, frozenset())
    best = {start: 0.0}
    queue = [(0.0, 0, frozenset())]
    while queue:
        cost, ran, live = heapq.heappop(queue)
        if cost > best.get((ran, live), math.inf):
            continue
        if ran == (1 << n) - 1 and all(t in live for t in outputs):
            return cost
        moves = [(cost, ran, live - {t}) for t in live]
        for v, op in enumerate(graph.ops):
            again = ran >> v & 1
            if again and (limits[v] <= v or ran >> limits[v] & 1 or any(size[t] and t in live for t in fresh[v])):
                continue
            if not all(t in live or (graph.tensors[t].persistent and ran >> graph.producer[t] & 1) for t in op.inputs):
                continue
            made = live | set(fresh[v])
            if graph.persistent_bytes + sum(size[t] for t in made) > budget:
                continue
            moves.append((cost + graph.ops[v].flops, ran | 1 << v, frozenset(made)))
        for c, r, lv in moves:
            if c < best.get((r, lv), math.inf):
                best[r, lv] = c
                heapq.heappush(queue, (c, r, lv))
    return None


def budgets(graph: Graph) -> list[int]:
    top = checkpoint_all(RematProblem(graph, 10**9)).peak_bytes
    return sorted({int(top * f) for f in (1.0, 0.85, 0.7, 0.55, 0.4)}, reverse=True)


def random_order(graph: Graph, rng: random.Random) -> list[int]:
    """A uniformly drawn ready op at each step: a random topological order."""
    indegree = [len(p) for p in graph.predecessors]
    ready = [v for v in range(len(graph.ops)) if not indegree[v]]
    order = []
    while ready:
        v = ready.pop(rng.randrange(len(ready)))
        order.append(v)
        for s in graph.successors[v]:
            indegree[s] -= 1
            if not indegree[s]:
                ready.append(s)
    return order


def check_expansion(graph: Graph, steps: list, rng: random.Random, orders: int) -> None:
    """The expanded DAG's peak is the sequence's, in its own order and in random orders of it,
    each of which is a valid plan of the same runs."""
    expanded = expand(graph, steps)
    own = list(range(len(expanded.op_of)))
    assert peak_bytes(expanded.graph, own) == sequence_peak_bytes(graph, steps)
    for _ in range(orders):
        order = random_order(expanded.graph, rng)
        moved = steps_in_order(expanded, order)  # validate_sequence inside
        assert sorted(i for k, i in moved if k == "run") == sorted(i for k, i in steps if k == "run")
        assert sequence_peak_bytes(graph, moved) == peak_bytes(expanded.graph, order)


@pytest.mark.parametrize(("kind", "seed"), TINY)
def test_every_order_of_the_expanded_dag_is_a_plan_with_its_peak(kind: str, seed: int) -> None:
    graph = tiny(kind, seed)
    rng = random.Random(seed)
    for budget in budgets(graph):
        plan = dtr(RematProblem(graph, budget))
        if plan.steps:
            check_expansion(graph, plan.steps, rng, orders=5)


def test_the_expanded_dag_of_a_gpu_step_keeps_views_mutations_and_batch_norms() -> None:
    """ResNet-50 on an H100 (cuDNN batch norms re-run without their statistics, in-place ReLUs,
    views, Adam's in-place updates): reordered at random, every plan is valid with its peak."""
    graph = read_graph_json(GPU_GRAPH)
    reference = checkpoint_all(RematProblem(graph, 10**18)).peak_bytes
    plan = dtr(RematProblem(graph, int(0.8 * reference)))
    assert plan.feasible
    assert sum(1 for k, _ in plan.steps if k == "run") > len(graph.ops)  # it recomputes
    check_expansion(graph, plan.steps, random.Random(0), orders=2)


def with_a_random_op(graph: Graph, v: int) -> Graph:
    """``graph`` with op ``v`` made random: it runs once, so what it makes can never be dropped."""
    ops = list(graph.ops)
    ops[v] = Op(ops[v].name, "dropout", ops[v].inputs, ops[v].outputs, flops=ops[v].flops)
    return Graph(tuple(ops), graph.tensors, graph.name)


@pytest.mark.parametrize("run_once", [False, True])
@pytest.mark.parametrize(("kind", "seed"), TINY)
def test_the_order_free_bound_is_below_the_joint_optimum(kind: str, seed: int, run_once: bool) -> None:
    graph = tiny(kind, seed)
    graph = with_a_random_op(graph, seed % 3) if run_once else graph
    for budget in budgets(graph):
        problem = RematProblem(graph, budget)
        optimum = joint_optimum(graph, budget)
        bound = order_free_bound(problem, seconds=5.0)
        assert bound.cost >= problem.plain_cost
        if optimum is None:
            continue
        assert not math.isinf(bound.cost), "a plan fits, yet the bound says none does"
        assert bound.cost <= optimum + 1e-9, (budget, bound, optimum)
        ops = list(range(len(graph.ops)))
        extra, _ = cut_cover_bound(problem, ops, [0.01, 0.1, 0.5, 1.0, 2.0, 10.0], math.inf)
        assert problem.plain_cost + extra <= optimum + 1e-9


def test_the_bound_says_no_plan_fits_only_when_none_does() -> None:
    for kind, seed in TINY:
        graph = tiny(kind, seed)
        for budget in range(1, budgets(graph)[-1]):
            if math.isinf(order_free_bound(RematProblem(graph, budget), seconds=0).cost):
                assert joint_optimum(graph, budget) is None, (kind, seed, budget)


@pytest.mark.parametrize(("kind", "seed"), TINY[::2])
def test_joint_is_between_the_joint_optimum_and_the_sequential_plan(kind: str, seed: int) -> None:
    graph = tiny(kind, seed)
    for budget in budgets(graph)[1:4]:
        optimum = joint_optimum(graph, budget)
        order = random_order(graph, random.Random(seed))
        search = solve_joint(graph, order, budget, 4.0, workers=1)
        sequential, best = search.sequential, search.best
        if optimum is None:
            assert not best.feasible
            continue
        if not sequential.feasible:
            continue
        validate_sequence(graph, best.steps)
        assert best.peak_bytes == sequence_peak_bytes(graph, best.steps) <= budget
        assert best.compute_cost == run_cost(RematProblem(graph, budget).cost, best.steps)
        assert optimum - 1e-9 <= best.compute_cost <= sequential.compute_cost


def two_branches() -> Graph:
    """``a`` and ``c`` make 10 B each, ``b`` and ``d`` shrink them to 1 B, ``e`` joins: run
    branch by branch the step peaks at 12 B, both big values at once at 21 B."""
    names = ["A", "B", "C", "D", "E"]
    tensors = [Tensor(n, 10 if n in "AC" else 1, Category.OUTPUT if n == "E" else Category.ACTIVATION) for n in names]
    t = {n: TensorId(i) for i, n in enumerate(names)}
    ops = (
        Op("a", "mm", (), (t["A"],), flops=5),
        Op("b", "mm", (t["A"],), (t["B"],), flops=1),
        Op("c", "mm", (), (t["C"],), flops=5),
        Op("d", "mm", (t["C"],), (t["D"],), flops=1),
        Op("e", "mm", (t["B"], t["D"]), (t["E"],), flops=1),
    )
    return Graph(ops, tuple(tensors), "two-branches")


def test_reordering_a_plan_frees_what_its_recomputation_bought() -> None:
    """A plan that runs ``a``, then ``c`` while ``A`` waits, drops ``A`` and re-runs ``a``:
    reordered given that re-run it needs less memory, and the re-run then goes."""
    graph = two_branches()
    problem = RematProblem(graph, 12)
    a, b, c, d, e = range(5)
    bad = insert_frees(graph, [a, c, a, b, d, e])  # the first A is read by nobody before the re-run
    validate_sequence(graph, bad)
    assert sequence_peak_bytes(graph, bad) == 21  # at b: A made again, C waiting, B
    reordered = reorder_runs(problem, bad, 2.0, workers=1)
    assert reordered is not None and sequence_peak_bytes(graph, reordered) <= 12
    kept = drop_reruns(problem, reordered)
    validate_sequence(graph, kept)
    assert run_cost(problem.cost, kept) == problem.plain_cost
    assert sequence_peak_bytes(graph, kept) <= 12


def test_joint_over_a_bad_order_reaches_the_optimum_the_bound_proves() -> None:
    """Over the order a, c, b, d, e both big values are live at once; the joint plan runs
    branch by branch without recomputation, and the order-free bound proves that optimal."""
    graph = two_branches()
    search = solve_joint(graph, [0, 2, 1, 3, 4], 12, 4.0, workers=1)
    validate_sequence(graph, search.best.steps)
    assert search.best.peak_bytes <= 12
    assert search.best.compute_cost == joint_optimum(graph, 12) == order_free_bound(RematProblem(graph, 12)).cost


def test_a_rerun_goes_where_another_order_of_the_runs_left_fits() -> None:
    """Without ``a``'s re-run the plan peaks at 21 B over 12; the search over ideals finds the
    order of the runs left that fits, so the re-run goes."""
    graph = two_branches()
    problem = RematProblem(graph, 12)
    a, b, c, d, e = range(5)
    bad = insert_frees(graph, [a, c, a, b, d, e])
    refit, dropped = refit_reruns(problem, bad, math.inf)
    validate_sequence(graph, refit)
    assert dropped == 1
    assert run_cost(problem.cost, refit) == problem.plain_cost
    assert sequence_peak_bytes(graph, refit) <= 12


def test_random_ops_keep_their_order_in_every_order_of_the_expanded_dag() -> None:
    """Two independent dropouts: each draws from the generator, so no reorder may swap them."""
    graph = with_a_random_op(with_a_random_op(two_branches(), 0), 2)
    steps = insert_frees(graph, [0, 1, 2, 3, 4])
    expanded = expand(graph, steps)
    rng = random.Random(0)
    for _ in range(20):
        order = random_order(expanded.graph, rng)
        assert order.index(0) < order.index(2)
