"""Remat over a reordered step with the optimizer's calls moved early (issue 33: the Llama of
``bench/llama_budget.py`` at batch 2). The reordered plan keeps the updates after the backward
when its peak is elsewhere; once recomputation lowers that peak, the update region's (every
gradient held, the update's temporaries) binds, and no recomputation lowers it.
:func:`memplan.remat.stage_order.early_update_order` moves each update group to where its
inputs are ready; :func:`memplan.remat.portfolio.solve_remat_in_order` keeps whichever order the
greedy at the peak does better in."""

from __future__ import annotations

from memplan.graph.check import validate_graph, validate_order
from memplan.graph.ir import Category, Graph, Op, Tensor
from memplan.graph.liveness import peak_bytes
from memplan.remat.baselines import peak_greedy
from memplan.remat.lower import sequence_peak_bytes, validate_sequence
from memplan.remat.portfolio import EARLY_UPDATES, solve_remat_in_order
from memplan.remat.problem import RematProblem
from memplan.remat.stage_order import CALL_KIND, broken_group, call_groups, early_update_order
from tests.core.test_remat_reordered import _two_updates

PERSISTENT = 17  # W1, W2 (8 each) and the batch x (1)
START, T2, U2, T1, U1, END = range(9, 15)
GROUPS = ((T2, U2), (T1, U1))
"""The update groups, one per parameter, as the runtime splits an optimizer that updates them one by one."""


def _step() -> Graph:
    """A two-layer step with an Adam-like update per parameter inside one captured call (a
    start op whose control output every op of the call reads, an end op). ``h`` (50 B) is held
    from the forward for ``gW1``; ``gW2`` (40 B) is made first in the backward and, in program
    order, held until its update after the backward: at ``gW1`` 140 B are live (``h``, ``gh``,
    ``gW1``, ``gW2``), and the update region holds both gradients and a temporary (120 B). Moved
    early, ``W2``'s update runs while ``h`` is live (140 B) but ``h`` can be dropped there and
    made again from ``x`` for ``gW1`` (the plan: 110 B, at ``gh``)."""
    t = [
        Tensor("W1", 8, Category.PARAMETER, True),  # 0
        Tensor("W2", 8, Category.PARAMETER, True),  # 1
        Tensor("x", 1, Category.INPUT, True),  # 2
        Tensor("a1", 20),  # 3
        Tensor("h", 50),  # 4
        Tensor("a2", 10),  # 5
        Tensor("gW2", 40, Category.GRADIENT),  # 6
        Tensor("gh", 10),  # 7
        Tensor("gW1", 40, Category.GRADIENT),  # 8
        Tensor("call.start.ctl", 0, Category.CONTROL),  # 9
        Tensor("t2", 40, Category.TEMPORARY),  # 10
        Tensor("t1", 40, Category.TEMPORARY),  # 11
        Tensor("a1.read_W1", 0, Category.CONTROL),  # 12
        Tensor("a2.read_W2", 0, Category.CONTROL),  # 13
        Tensor("gh.read_W2", 0, Category.CONTROL),  # 14
        Tensor("u2.ctl", 0, Category.CONTROL),  # 15
        Tensor("u1.ctl", 0, Category.CONTROL),  # 16
    ]
    ops = [
        Op("W1", "placeholder", (), (0,)),
        Op("W2", "placeholder", (), (1,)),
        Op("x", "placeholder", (), (2,)),
        Op("a1", "aten.mm.default", (2, 0), (3, 12), flops=20),  # 3
        Op("h", "aten.relu.default", (3,), (4,), flops=30),  # 4
        Op("a2", "aten.mm.default", (4, 1), (5, 13), flops=40),  # 5
        Op("gW2", "aten.mm.default", (4, 5), (6,), flops=400),  # 6
        Op("gh", "aten.mm.default", (5, 1), (7, 14), flops=400),  # 7
        Op("gW1", "aten.mm.default", (4, 7), (8,), flops=400),  # 8
        Op("memplan::call:0:start", CALL_KIND, (), (9,)),  # 9
        Op("t2", "aten.sqrt.default", (6, 9), (10,), flops=40),  # 10
        Op("u2", "aten.addcdiv_.default", (1, 6, 10, 9, 13, 14), (15,), mutates=(1,), flops=40),  # 11
        Op("t1", "aten.sqrt.default", (8, 9), (11,), flops=40),  # 12
        Op("u1", "aten.addcdiv_.default", (0, 8, 11, 9, 12), (16,), mutates=(0,), flops=40),  # 13
        Op("memplan::call:0:end", CALL_KIND, (15, 16), ()),  # 14
    ]
    graph = Graph(tuple(ops), tuple(t), "two-layer-adam")
    validate_graph(graph)
    return graph


def _given() -> list[int]:
    """A reordered plan's order that keeps the updates after the backward (the call's start
    first: it reads nothing)."""
    return [0, 1, 2, START, 3, 4, 5, 6, 7, 8, T2, U2, T1, U1, END]


def test_the_groups_the_graph_shows_are_one_per_parameter() -> None:
    """Split in several, the call's marks stay out of its groups (as the runtime's split leaves them;
    a call of one component is one group with its marks: tests/torch/test_remat_stage_order.py)."""
    assert sorted(sorted(g) for g in call_groups(_step())) == sorted(sorted(g) for g in GROUPS)


def test_the_early_order_moves_each_update_after_its_inputs_and_keeps_groups_whole() -> None:
    graph, given = _step(), _given()
    early = early_update_order(graph, given, GROUPS)
    validate_order(graph, early)
    assert early == [0, 1, 2, START, 3, 4, 5, 6, 7, T2, U2, 8, T1, U1, END]
    assert early_update_order(graph, early, GROUPS) == early  # nothing moves twice
    assert early_update_order(graph, given, ()) == given  # without the runtime's groups nothing moves
    for group in GROUPS:
        where = sorted(early.index(v) for v in group)
        assert where == list(range(where[0], where[0] + len(group)))  # contiguous, as the runtime runs it
    # the non-call ops keep their relative order
    assert [v for v in early if v in range(3, 9)] == [v for v in given if v in range(3, 9)]
    assert peak_bytes(graph, given) == peak_bytes(graph, early) == PERSISTENT + 140


def test_remat_keeps_the_early_order_where_the_greedy_does_better_there() -> None:
    """In the given order the greedy at the peak is stuck over the budget (the update region:
    both gradients and a temporary); in the early one it fits. Given the groups, the portfolio
    keeps the early order and no group is broken."""
    graph, given, early = _step(), _given(), early_update_order(_step(), _given(), GROUPS)
    budget = PERSISTENT + 115
    staged = [Graph(tuple(graph.ops[v] for v in o), graph.tensors) for o in (given, early)]
    stuck, fits = (peak_greedy(RematProblem(g, budget, max_solver_nodes=10**9)) for g in staged)
    assert not stuck.feasible and fits.feasible
    plan = solve_remat_in_order(graph, given, budget, 3.0, workers=1, groups=GROUPS)
    assert plan.feasible and plan.details["stage_order"] == EARLY_UPDATES, plan.message
    assert broken_group(plan.steps, GROUPS) is None  # each update group runs as one call
    without = solve_remat_in_order(graph, given, budget, 2.0, workers=1, groups=())  # the given order only
    assert without.details["stage_order"] == "reordered"
    assert not without.feasible or plan.compute_cost <= without.compute_cost
    validate_sequence(graph, plan.steps)
    assert plan.peak_bytes == sequence_peak_bytes(graph, plan.steps) <= budget
    runs = [i for kind, i in plan.steps if kind == "run"]
    assert sorted(set(runs)) == list(range(len(graph.ops))) and len(runs) > len(graph.ops)  # something made again


def test_without_calls_the_order_is_kept() -> None:
    """Updates that already run as early as they may (the reordered plan did OLLA 4.3): nothing moves."""
    graph, order = _two_updates()
    assert early_update_order(graph, order, ((7,), (9,))) == order  # each update already runs once it may


def test_a_run_inside_a_group_breaks_it() -> None:
    steps = [("run", v) for v in range(9)] + [("run", T2), ("run", 4), ("run", U2), ("free", 4)]
    assert broken_group(steps, GROUPS) == 0
    assert broken_group([s for s in steps if s != ("run", 4)], GROUPS) is None
