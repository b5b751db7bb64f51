"""The CP peer of bench/remat_proofs.py (memplan.remat.peer: Moccasin's two phases, as the paper
solves them) against brute force on tiny graphs: what it proves optimal is the optimum of its
scope, its plans are valid and within the budget, and it says "infeasible" only with a proof."""

from __future__ import annotations

import pytest

from memplan.remat.baselines import checkpoint_all
from memplan.remat.coarsen import identity
from memplan.remat.lower import sequence_peak_bytes, validate_sequence
from memplan.remat.moccasin import solve_moccasin
from memplan.remat.peer import solve_peer
from memplan.remat.problem import RematProblem
from tests.core.test_remat_portfolio import all_plans, cheapest, tiny

DAGS = [("dag", seed) for seed in range(4)]


@pytest.mark.parametrize(("kind", "seed"), DAGS)
def test_the_peer_proves_the_optimum_of_its_scope(kind: str, seed: int) -> None:
    """At each budget the peer's plan is valid and fits, costs no more than every plan in
    program order with at most 2 runs per op and no less than the best plan of all; when it
    says "optimal" its objective is the CP model's optimum without memplan's cuts and floors;
    with no plan at all it never claims one."""
    graph = tiny(kind, seed)
    plans = all_plans(graph)
    top = checkpoint_all(RematProblem(graph, 10**9)).peak_bytes
    for fraction in (1.0, 0.85, 0.7, 0.5):
        budget = int(top * fraction)
        problem = RematProblem(graph, budget, time_limit_seconds=5.0, workers=1)
        result = solve_peer(problem, 5.0, workers=1)
        in_order = cheapest(plans, budget, 2, in_order=True)
        if result.plan is None:
            assert result.status in ("infeasible", "unknown") and in_order is None
            continue
        plan = result.plan
        validate_sequence(graph, plan.steps)
        assert plan.peak_bytes == sequence_peak_bytes(graph, plan.steps) <= budget
        assert plan.compute_cost >= cheapest(plans, budget, 2)  # type: ignore[operator]
        if in_order is not None:
            assert plan.compute_cost <= in_order
        assert result.status == "optimal" and result.proof_seconds is not None and result.gap == 0.0
        _, status, _ = solve_moccasin(problem, identity(problem), runs_per_node=2)
        assert status.status == "optimal" and result.objective == status.objective


def test_the_peer_says_infeasible_below_the_floor() -> None:
    """A budget no plan meets: phase 1's least excess is above 0, proven, so "infeasible"."""
    graph = tiny("dag", 1)
    problem = RematProblem(graph, 1, time_limit_seconds=5.0, workers=1)
    result = solve_peer(problem, 5.0, workers=1)
    assert result.status == "infeasible" and result.plan is None
