"""Joint order and recomputation with update groups (issue 36): the ops the runtime runs as one
call (an optimizer update group, run at the place of its last op) stay contiguous in every plan
the joint search makes, and the budget path's choice between the sequential and the joint plan
takes the joint one only when it is better, within its time."""

from __future__ import annotations

import random
import time

from memplan.graph.check import validate_graph, validate_order
from memplan.graph.ir import Category, Graph, Op, Tensor, TensorId
from memplan.remat.joint import (
    choose_joint,
    contiguous_order,
    expand,
    groups_breach,
    solve_joint,
    steps_in_order,
)
from memplan.remat.lower import sequence_peak_bytes, validate_sequence
from memplan.remat.portfolio import solve_remat_in_order
from tests.core.test_remat_joint import random_order

GROUP = [[4, 5]]
"""``g1`` and ``g2`` of :func:`grouped_step` run as one call."""
UNIT = 64
"""Bytes per unit of size: a multiple of the placement's alignment, so the placed peaks are the live ones."""
BUDGET = 21 * UNIT


def grouped_step() -> Graph:
    """``p`` makes ``A`` (10 units), read by ``q`` early and by ``g1`` at the end, where ``g1,
    g2`` are one call (``GROUP``). At 21 units, out of program order, ``g1`` may run right after
    ``q`` (``A`` goes before ``r`` makes ``C``): no recomputation. With ``g1`` next to ``g2``,
    ``A`` would cross ``r`` (30 units): ``p`` must run again (1 of 6 FLOPs)."""
    tensors = [
        Tensor("A", 10 * UNIT),
        Tensor("B", 10 * UNIT),
        Tensor("C", 10 * UNIT),
        Tensor("D", 1 * UNIT),
        Tensor("a", 1 * UNIT),
        Tensor("out", UNIT, Category.OUTPUT),
    ]
    A, B, C, D, a, out = (TensorId(t) for t in range(len(tensors)))
    ops = [
        Op("p", "mm", (), (A,), flops=1),
        Op("q", "mm", (A,), (B,), flops=1),
        Op("r", "mm", (B,), (C,), flops=1),
        Op("s", "mm", (C,), (D,), flops=1),
        Op("g1", "mm", (A,), (a,), flops=1),
        Op("g2", "mm", (a, D), (out,), flops=1),
    ]
    graph = Graph(tuple(ops), tuple(tensors), "grouped-step")
    validate_graph(graph)
    return graph


def recomputes(steps: list) -> int:
    runs = [i for kind, i in steps if kind == "run"]
    return len(runs) - len(set(runs))


def sequential_plan(graph: Graph):
    plan = solve_remat_in_order(graph, list(range(len(graph.ops))), BUDGET, 5.0, workers=1)
    assert plan.feasible and recomputes(plan.steps) == 1
    assert groups_breach(graph, plan.steps, GROUP) is None
    return plan


def test_joint_keeps_an_update_group_contiguous_where_interleaving_it_would_be_cheaper() -> None:
    graph = grouped_step()
    sequential = sequential_plan(graph)
    free = solve_joint(graph, None, BUDGET, 10.0, workers=1, sequential=sequential).best
    assert free.compute_cost < sequential.compute_cost  # the groups bind: without them joint interleaves
    assert groups_breach(graph, free.steps, GROUP) is not None
    held = solve_joint(graph, None, BUDGET, 10.0, workers=1, sequential=sequential, groups=GROUP).best
    validate_sequence(graph, held.steps)
    assert groups_breach(graph, held.steps, GROUP) is None
    assert held.peak_bytes == sequence_peak_bytes(graph, held.steps) <= BUDGET
    assert held.compute_cost == sequential.compute_cost  # the one plan that keeps the group: p runs again


def test_contiguous_orders_of_the_expanded_dag_are_topological_with_each_group_in_one_piece() -> None:
    graph = grouped_step()
    expanded = expand(graph, sequential_plan(graph).steps)
    rng = random.Random(0)
    broken = fixed = 0
    for _ in range(40):
        order = random_order(expanded.graph, rng)
        steps = steps_in_order(expanded, order)
        broken += groups_breach(graph, steps, GROUP) is not None
        moved = contiguous_order(expanded, order, GROUP)
        if moved is None:
            continue
        validate_order(expanded.graph, moved)
        fixed_steps = steps_in_order(expanded, moved, GROUP)  # checks the groups too
        assert groups_breach(graph, fixed_steps, GROUP) is None
        fixed += 1
    assert broken and fixed


def test_the_budget_path_takes_the_joint_plan_only_when_it_is_better_and_in_time() -> None:
    graph = grouped_step()
    sequential = sequential_plan(graph)
    began = time.perf_counter()
    free = choose_joint(graph, sequential, 6.0, limit_bytes=BUDGET, workers=1)
    assert time.perf_counter() - began <= 6.0 + 1.0
    assert free.report["remat_plan"] == "joint" and free.plan is not sequential
    assert free.report["joint_overhead"] < free.report["sequential_overhead"]
    assert free.report["joint_placed_bytes"] <= BUDGET
    held = choose_joint(graph, sequential, 6.0, limit_bytes=BUDGET, workers=1, groups=GROUP)
    assert held.report["remat_plan"] == "sequential" and held.plan is sequential
    over = choose_joint(graph, sequential, 6.0, limit_bytes=BUDGET - 1, workers=1)  # placed over the user's budget
    assert over.report["remat_plan"] == "sequential"
    late = choose_joint(graph, sequential, 1.0, limit_bytes=BUDGET, workers=1)
    assert late.plan is sequential and str(late.report["joint"]).startswith("not run")
