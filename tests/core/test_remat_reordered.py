"""Remat over the reordered step (issue 33): the stages keep the reordered plan's order, so
checkpoint-all is the reordered plan and the greedy at the peak only has to take its peak down
to the budget, where remat in program order starts from program order's peak (and its floor)."""

from __future__ import annotations

from memplan.graph.check import validate_graph, validate_order
from memplan.graph.ir import Category, Graph, Op, Tensor, TensorId
from memplan.graph.liveness import peak_bytes
from memplan.remat.baselines import ap_kept_greedy, peak_greedy
from memplan.remat.lower import sequence_peak_bytes, validate_sequence
from memplan.remat.portfolio import solve_remat, solve_remat_in_order
from memplan.remat.problem import RematProblem, memory_floor

PERSISTENT = 17  # W, V (8 each) and the batch x (1)


def _two_updates() -> tuple[Graph, list[int]]:
    """Two parameters W and V, each updated like Adam (a temporary as large as its gradient,
    then an in-place update). ``gV`` reads ``W``, so it may re-run only before ``W``'s update:
    in program order (both gradients, then both updates) ``gV`` is held across ``W``'s update,
    whatever is recomputed (the floor there: 120 B); the reordered order updates ``V`` first,
    and its peak (100 B at ``tV``: ``gV``, ``tV`` and the activation ``a``) comes down to
    80 B once ``a`` is dropped there and recomputed before ``gW`` (from ``x`` and ``W``)."""
    tensors = [
        Tensor("W", 8, Category.PARAMETER, True),
        Tensor("V", 8, Category.PARAMETER, True),
        Tensor("x", 1, Category.INPUT, True),
        Tensor("a", 20),  # 3
        Tensor("gV", 40, Category.GRADIENT),  # 4
        Tensor("gW", 40, Category.GRADIENT),  # 5
        Tensor("tW", 40, Category.TEMPORARY),  # 6
        Tensor("tV", 40, Category.TEMPORARY),  # 7
        Tensor("a.read_W", 0, Category.CONTROL),  # 8
        Tensor("gV.read_W", 0, Category.CONTROL),  # 9
    ]
    ops = [
        Op("W", "placeholder", (), (0,)),
        Op("V", "placeholder", (), (1,)),
        Op("x", "placeholder", (), (2,)),
        Op("a", "aten.mm.default", (2, 0), (3, 8), flops=20),  # 3
        Op("gV", "aten.mm.default", (3, 0), (4, 9), flops=400),  # 4
        Op("gW", "aten.mm.default", (3,), (5,), flops=400),  # 5
        Op("tW", "aten.sqrt.default", (5,), (6,), flops=40),  # 6
        Op("updW", "aten.addcdiv_.default", (0, 5, 6, 8, 9), (), mutates=(0,), flops=40),  # 7
        Op("tV", "aten.sqrt.default", (4,), (7,), flops=40),  # 8
        Op("updV", "aten.addcdiv_.default", (1, 4, 7), (), mutates=(1,), flops=40),  # 9
    ]
    graph = Graph(tuple(ops), tuple(tensors), "two-updates")
    validate_graph(graph)
    order = [0, 1, 2, 3, 4, 8, 9, 5, 6, 7]
    validate_order(graph, order)
    return graph, order


def test_remat_in_the_reordered_order_finds_a_plan_program_order_has_none() -> None:
    graph, order = _two_updates()
    budget = PERSISTENT + 90  # between the reordered order's floor (80) and its peak (100)
    assert peak_bytes(graph, order) == PERSISTENT + 100 < peak_bytes(graph, graph.program_order())
    assert memory_floor(RematProblem(graph, budget)).bytes == PERSISTENT + 120  # program order's floor
    old = solve_remat(graph, budget, 2.0, workers=1)
    assert not old.feasible and old.status == "infeasible"
    new = solve_remat_in_order(graph, order, budget, 2.0, workers=1)
    assert new.feasible and new.details["stage_order"] == "reordered", new.message
    validate_sequence(graph, new.steps)  # the steps name the graph's own ops
    assert new.peak_bytes == sequence_peak_bytes(graph, new.steps) == PERSISTENT + 80
    runs = [i for kind, i in new.steps if kind == "run"]
    assert runs.count(3) == 2 and sorted(set(runs)) == list(range(len(graph.ops)))  # ``a`` made again
    assert new.compute_cost == new.plain_cost + 20


def test_the_greedy_at_the_peak_starts_from_the_reordered_plan() -> None:
    graph, order = _two_updates()
    staged = Graph(tuple(graph.ops[v] for v in order), graph.tensors)
    fits = peak_greedy(RematProblem(staged, PERSISTENT + 100, max_solver_nodes=10**9))
    assert fits.feasible and fits.compute_cost == fits.plain_cost  # the reordered plan: nothing recomputed
    tight = peak_greedy(RematProblem(staged, PERSISTENT + 90, max_solver_nodes=10**9))
    assert tight.feasible and tight.peak_bytes == PERSISTENT + 80 and tight.compute_cost == tight.plain_cost + 20
    below = peak_greedy(RematProblem(staged, PERSISTENT + 79, max_solver_nodes=10**9))
    assert not below.feasible and below.status == "over-budget" and below.peak_bytes == PERSISTENT + 80


def test_below_both_floors_is_infeasible_and_says_the_lower_floor() -> None:
    """A floor is a proof only for plans whose first runs keep its order: "infeasible" needs the
    budget below the reordered order's floor (80) and program order's (120); the lower is named."""
    graph, order = _two_updates()
    none = solve_remat_in_order(graph, order, PERSISTENT + 79, 2.0, workers=1)
    assert none.status == "infeasible" and not none.steps
    assert none.details["floor_bytes"] == PERSISTENT + 80
    assert none.details["lowest_peak_bytes"] == PERSISTENT + 80  # the greedy at the floor: a peak a plan reaches


def test_below_the_floors_the_advice_is_the_lowest_peak_either_greedy_reaches_and_a_plan_reaches_it() -> None:
    """Proven infeasible by the floors, the refusal's advice is the lower of the two greedies'
    peaks at the floor (the greedy at the peak, per-block checkpoints: on GPT-2 with 12 layers at
    batch 30 the first alone named 7.03 GiB for a 3.37 GiB floor, the second 3.50 GiB), and a
    solve at that budget finds a plan."""
    from tests.core.test_remat_baselines import blocks_with_a_mask

    base = blocks_with_a_mask()
    aux = TensorId(len(base.tensors))  # an op off the blocks' path, so that another order exists
    graph = Graph(
        (*base.ops, Op("aux", "sum", (TensorId(0),), (aux,), flops=1)),
        (*base.tensors, Tensor("aux", 1, Category.OUTPUT)),
    )
    n = len(graph.ops)
    order = [0, n - 1, *range(1, n - 1)]
    floor = memory_floor(RematProblem(graph, 10**9)).bytes
    none = solve_remat_in_order(graph, order, floor - 1, 2.0, workers=1)
    assert none.status == "infeasible" and not none.steps
    staged = Graph(tuple(graph.ops[v] for v in order), graph.tensors)
    near = RematProblem(staged, none.details["floor_bytes"], max_solver_nodes=10**9)
    reached = [p.peak_bytes for p in (peak_greedy(near), ap_kept_greedy(near)) if p.steps]
    advice = none.details["lowest_peak_bytes"]
    assert advice == min(reached) >= none.details["floor_bytes"]
    there = solve_remat_in_order(graph, order, advice, 2.0, workers=1)
    assert there.feasible and there.peak_bytes <= advice
    validate_sequence(graph, there.steps)
