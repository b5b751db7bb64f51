"""The baselines' fast R (incremental ``rows_for_policy``) against the first, naive one (tests/core/naive.py)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from memplan.graph.generate import random_dag
from memplan.graph.ir import Category, Graph, Op, Tensor, TensorId
from memplan.remat import baselines
from memplan.remat.baselines import (
    BASELINES,
    _revolve_rows,
    chain_nodes,
    checkpoint_all,
    forward_nodes,
    solver_graph,
)
from memplan.remat.lower import InvalidPlan, validate_sequence
from memplan.remat.problem import RematProblem
from tests.core.naive import naive_chen_rows, naive_drop_rows, rows_for_policy_naive
from tests.core.test_remat import _with_flops, bn_relu_graph, fwd_bwd_chain
from tests.core.test_remat_portfolio import without_marks

Rows = list[list[int]] | str


def _rows(make: Callable[[], list[list[int]]]) -> Rows:
    try:
        return make()
    except InvalidPlan as err:
        return f"invalid: {err}"


def _fast_and_naive(monkeypatch: pytest.MonkeyPatch, make: Callable[[], object]) -> tuple[object, object]:
    fast = make()
    with monkeypatch.context() as m:
        m.setattr(baselines, "rows_for_policy", rows_for_policy_naive)
        m.setattr(baselines, "_chen_rows", naive_chen_rows)
        m.setattr(baselines, "_drop_rows", naive_drop_rows)
        naive = make()
    return fast, naive


def chain_with_updates(seed: int) -> Graph:
    """A training step like the zoo's: f_i reads weight w_i, an optimizer op rewrites w_i at a
    random point of the backward (closing f_i's re-run window: x_i may then have to stay
    resident to its last read), b_i reads the gradient and x_{i-1} (sometimes x_i too, as a
    relu's backward does)."""
    rng = random.Random(seed)
    n = rng.randint(3, 10)
    tensors = [Tensor(f"w{i}", 8, Category.PARAMETER, True) for i in range(n)]
    tensors += [Tensor(f"x{i}", rng.randint(1, 60)) for i in range(n)]
    tensors += [Tensor("loss", 1, Category.OUTPUT)] + [Tensor(f"g{i}", rng.randint(1, 60)) for i in range(n)]
    tensors += [Tensor(f"u{i}", 0, Category.CONTROL) for i in range(n)]
    loss = TensorId(2 * n)

    def w(i: int) -> TensorId:
        return TensorId(i)

    def x(i: int) -> TensorId:
        return TensorId(n + i)

    def g(i: int) -> TensorId:
        return TensorId(2 * n + 1 + i)

    def u(i: int) -> TensorId:
        return TensorId(3 * n + 1 + i)

    ops = [Op(f"w{i}", "placeholder", (), (w(i),)) for i in range(n)]
    ops += [Op(f"f{i}", "mm", ((x(i - 1),) if i else ()) + (w(i),), (x(i),), flops=rng.randint(1, 9)) for i in range(n)]
    ops.append(Op("loss", "sum", (x(n - 1),), (loss,), flops=1))
    backward, grad = [], loss
    for i in range(n - 1, -1, -1):
        reads = (grad, x(i - 1) if i else w(0), *((x(i),) if rng.random() < 0.4 else ()))
        backward.append(Op(f"b{i}", "mm_backward", reads, (g(i),), flops=rng.randint(1, 9)))
        grad = g(i)
    for i in range(n):
        backward.insert(rng.randint(0, len(backward)), Op(f"sgd{i}", "add_", (w(i),), (u(i),), mutates=(w(i),)))
    return Graph(tuple(ops + backward), tuple(tensors), "chain-with-updates")


def _graphs(seed: int) -> list[Graph]:
    """A marked chain, the same without marks (split found from the structure), a chain with
    optimizer updates, a random DAG, a batch norm with its in-place relu."""
    rng = random.Random(seed)
    n = rng.randint(3, 12)
    chain = fwd_bwd_chain([rng.randint(1, 60) for _ in range(n)], [rng.randint(1, 9) for _ in range(n)])
    dag = _with_flops(random_dag(seed, rng.randint(6, 30)), seed)
    return [chain, without_marks(chain), chain_with_updates(seed), dag, bn_relu_graph()]


def _policies(sg: baselines.SolverGraph, rng: random.Random) -> list[Callable[[], Rows]]:
    """Chen's segments, Chen 4.2's drops and revolve, on random choices of what to keep."""
    fwd = [k for k in forward_nodes(sg) if sg.recomputable(k)]
    chain = chain_nodes(sg)
    out: list[Callable[[], Rows]] = []
    for _ in range(4):
        marks = {k for k in fwd if rng.random() < 0.4}
        dropped = {k for k in chain if rng.random() < 0.5}
        out.append(lambda m=marks: _rows(lambda: baselines._chen_rows(sg, m)))
        out.append(lambda d=dropped: _rows(lambda: baselines._drop_rows(sg, d)))
    if baselines.is_linear(sg):
        out += [lambda c=c: _rows(lambda: _revolve_rows(sg, c)) for c in range(1, len(chain) + 2)]
    return out


@pytest.mark.parametrize("seed", range(12))
def test_fast_rows_equal_the_naive_rows(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    compared = 0
    for graph in _graphs(seed):
        for nodes in (200, 4):
            sg = solver_graph(RematProblem(graph, 10**9, max_solver_nodes=nodes))
            for policy in _policies(sg, rng):
                fast, naive = _fast_and_naive(monkeypatch, policy)
                assert fast == naive
                compared += isinstance(fast, list)
    assert compared > 0


def _plan(plan: baselines.RematSchedule) -> tuple[object, ...]:
    return (plan.status, plan.steps, plan.peak_bytes, plan.compute_cost, plan.message)


def assert_same_baseline_plans(
    graph: Graph, monkeypatch: pytest.MonkeyPatch, fractions: tuple[float, ...], max_solver_nodes: int = 200
) -> int:
    """Every baseline's plan, with the fast and with the naive R, at ``fractions`` of the
    checkpoint-all peak; returns how many plans fit."""
    whole = RematProblem(graph, 10**15, max_solver_nodes=max_solver_nodes)
    top = checkpoint_all(whole).peak_bytes
    fits = 0
    for fraction in fractions:
        problem = whole.with_budget(int(top * fraction))
        for name, solve in BASELINES.items():
            fast, naive = _fast_and_naive(monkeypatch, lambda s=solve, p=problem: s(p))
            assert _plan(fast) == _plan(naive), (name, fraction)  # type: ignore[arg-type]
            fits += fast.feasible  # type: ignore[attr-defined]
    return fits


@pytest.mark.parametrize("seed", range(8))
def test_every_baseline_plans_alike_with_the_fast_and_the_naive_rows(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    fits = sum(assert_same_baseline_plans(g, monkeypatch, (1.0, 0.8, 0.6)) for g in _graphs(seed))
    assert fits > 0


def blocks_with_a_mask(blocks: int = 6, width: int = 64) -> Graph:
    """A transformer-like step: a small mask made first and read by every block (its edges
    leave the forward graph no cut vertex), each block ``r -> a -> b -> r' = r + b`` with two
    large activations, a loss, and a backward block by block reading the activations."""
    tensors = [Tensor("x", width, Category.INPUT, True), Tensor("mask", 1)]
    ops = [Op("x", "placeholder", (), (TensorId(0),)), Op("mask", "mm", (TensorId(0),), (TensorId(1),), flops=1)]

    def tensor(name: str, size: int) -> TensorId:
        tensors.append(Tensor(name, size))
        return TensorId(len(tensors) - 1)

    r, saved = TensorId(0), []
    for k in range(blocks):
        a = tensor(f"a{k}", 4 * width)
        b = tensor(f"b{k}", 4 * width)
        out = tensor(f"r{k}", width)
        ops += [
            Op(f"a{k}", "mm", (r, TensorId(1)), (a,), flops=4),
            Op(f"b{k}", "mm", (a,), (b,), flops=4),
            Op(f"r{k}", "add", (r, b), (out,), flops=1),
        ]
        saved.append((r, a, b))
        r = out
    tensors.append(Tensor("loss", 1, Category.OUTPUT))
    ops.append(Op("loss", "sum", (r,), (TensorId(len(tensors) - 1),), flops=1))
    grad = TensorId(len(tensors) - 1)
    for k in reversed(range(blocks)):
        r_in, a, b = saved[k]
        gb = tensor(f"gb{k}", width)
        ops.append(Op(f"gb{k}", "mm_backward", (grad, r_in, a, b, TensorId(1)), (gb,), flops=8))
        grad = gb
    return Graph(tuple(ops), tuple(tensors), "blocks")


def test_kept_small_values_show_the_blocks_a_mask_hides() -> None:
    """The mask reaches across every block: AP greedy finds no cut vertex and keeps every
    activation; with the mask kept resident, the residual stream cuts the graph between blocks
    and the per-block plan fits a budget AP greedy cannot reach."""
    graph = blocks_with_a_mask()
    top = checkpoint_all(RematProblem(graph, 10**9)).peak_bytes
    problem = RematProblem(graph, int(top * 0.6))
    sg = solver_graph(problem)
    kept, points = baselines._kept_small_candidates(sg)[0]
    assert graph.op_index["mask"] in {v for k in kept for v in sg.groups[k]}
    assert len(points) >= 4  # the residual stream's adds
    assert len([k for k in baselines.articulation_points(sg) if k in set(chain_nodes(sg))]) <= 1  # the last add
    ap = BASELINES["ap-greedy"](problem)
    kept_plan = BASELINES["ap-kept-greedy"](problem)
    assert not ap.feasible
    assert kept_plan.feasible and kept_plan.peak_bytes <= problem.budget_bytes
    validate_sequence(graph, kept_plan.steps)
