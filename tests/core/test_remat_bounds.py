"""The drop-cover bound (memplan.remat.bounds): below every plan in program order (brute
force), tight on a hand-made chain, and what it lets the portfolio and the CP model do."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from memplan.graph.io import write_graph_json
from memplan.graph.ir import Graph
from memplan.remat import solve_remat
from memplan.remat.baselines import BASELINES, checkpoint_all, solver_graph
from memplan.remat.bounds import SCOPE, _greedy_cover, drop_cover_bound, exact_cover, lp_cover
from memplan.remat.coarsen import identity
from memplan.remat.moccasin import solve_moccasin
from memplan.remat.portfolio import ALWAYS_RUN
from memplan.remat.problem import RematProblem, memory_floor
from tests.core.test_remat import fwd_bwd_chain
from tests.core.test_remat_portfolio import TINY, all_plans, cheapest, small_graph, tiny, tiny_sweep


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), num_ops=st.integers(2, 5), fraction=st.floats(0.3, 1.0))
def test_the_bound_is_below_every_plan_in_program_order(seed: int, num_ops: int, fraction: float) -> None:
    graph = small_graph(seed, num_ops)
    top = checkpoint_all(RematProblem(graph, 10**9)).peak_bytes
    problem = RematProblem(graph, int(top * fraction))
    bound = drop_cover_bound(problem)
    cheapest_in_order = cheapest(all_plans(graph), problem.budget_bytes, in_order=True)
    assert bound.cost >= problem.plain_cost and bound.cost == problem.plain_cost + bound.extra
    if cheapest_in_order is not None:
        assert bound.cost <= cheapest_in_order + 1e-9
    assert math.isinf(bound.cost) == (memory_floor(problem).bytes > problem.budget_bytes)


@pytest.mark.parametrize(("kind", "seed"), TINY)
def test_the_bound_is_below_every_plan_of_the_tiny_graphs(kind: str, seed: int) -> None:
    graph, plans, budgets = tiny_sweep(kind, seed)
    for budget in budgets:
        problem = RematProblem(graph, budget)
        in_order = cheapest(plans, problem.budget_bytes, in_order=True)
        if in_order is not None:
            assert drop_cover_bound(problem).cost <= in_order + 1e-9


CHAIN = fwd_bwd_chain([10, 10, 10, 10], [3, 7, 5, 2])
"""f0..f3, the loss, b3..b1: plain cost 46, checkpoint-all peak 41 B, memory floor 31 B."""


def test_the_bound_is_the_optimum_at_the_floor_of_a_chain() -> None:
    """At 31 B the first run of f3 must drop 9 B of x0..x1 and the loss's 10 B of x0..x2;
    re-running f0 (cost 3) is the cheapest way, and the CP model proves 49 optimal: the bound
    is tight there (the exact cover attains it first at f3; the LP's sliver only at the loss)."""
    floor = memory_floor(RematProblem(CHAIN, 0)).bytes
    assert floor == 31
    problem = RematProblem(CHAIN, floor, time_limit_seconds=5.0, workers=1)
    bound = drop_cover_bound(problem)
    plan, status, _ = solve_moccasin(problem, identity(problem))
    assert plan is not None and status.status == "optimal"
    assert bound.cost == plan.compute_cost == 49.0 and CHAIN.ops[bound.op].name in ("f3", "loss")
    loose = RematProblem(CHAIN, 40)
    assert 46.0 < drop_cover_bound(loose).cost <= 49.0
    assert drop_cover_bound(RematProblem(CHAIN, 41)).extra == 0.0


def test_the_portfolio_proves_a_baseline_plan_with_the_bound_and_stops() -> None:
    """At the chain's floor a baseline's plan meets the bound: "optimal" without a solver;
    the baselines after the quick ones are skipped."""
    plan = solve_remat(CHAIN, 31, 5.0, workers=1)
    assert plan.status == "optimal" and plan.compute_cost == 49.0 and plan.details["scope"] == SCOPE
    attempts = plan.details["attempts"]
    names = [str(a["name"]) for a in attempts]  # type: ignore[union-attr]
    assert "moccasin" not in names and "checkmate" not in names
    skipped = {str(a["name"]) for a in attempts if a.get("status") == "skipped"}  # type: ignore[union-attr]
    assert skipped and not skipped & set(ALWAYS_RUN) and set(ALWAYS_RUN) <= set(names)


@pytest.mark.parametrize("integral", [True, False])
@pytest.mark.parametrize(("kind", "seed"), TINY[:4])
def test_the_cp_model_keeps_its_optimum_under_the_floor(kind: str, seed: int, integral: bool) -> None:
    """Given the optimum itself as ``objective_floor`` (exact or rounded costs), the CP model
    still finds it: the floor is lowered past the scaling's rounding, never above a plan."""
    graph = tiny(kind, seed)
    top = checkpoint_all(RematProblem(graph, 10**9)).peak_bytes
    cost = () if integral else tuple(1.0 + 0.37 * (v % 5) for v in range(len(graph.ops)))
    for fraction in (0.85, 0.7):
        problem = RematProblem(graph, int(top * fraction), cost, time_limit_seconds=5.0, workers=1)
        free, _, _ = solve_moccasin(problem, identity(problem))
        if free is None:
            continue
        floored, status, _ = solve_moccasin(problem, identity(problem), objective_floor=free.compute_cost)
        assert floored is not None and status.status == "optimal"
        assert floored.compute_cost == pytest.approx(free.compute_cost)


# --- the gap limit on the command line ---------------------------------------------------------


def test_cli_gap_limit_reaches_every_solver(tmp_path: Path) -> None:
    """``memplan remat --gap-limit``: the portfolio, the CP model and the MILP each stop within
    it and say "feasible" with their gap (or "optimal"); the JSON records it; a limit above 1
    is refused with a one-line message."""
    from memplan.cli import app

    write_graph_json(fwd_bwd_chain([40, 60, 50, 30, 20], [3, 1, 2, 2, 1]), tmp_path / "g.json")
    out = tmp_path / "r.json"
    args = ["remat", str(tmp_path / "g.json"), "--budget", "0.8", "--time-limit", "3", "--json", str(out)]
    result = CliRunner().invoke(app, [*args, "--strategy", "all", "--gap-limit", "0.5"])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["gap_limit"] == 0.5
    for name in ("portfolio", "moccasin", "checkmate"):
        plan = report["strategies"][name]
        assert plan["feasible"] and (plan["status"] == "optimal" or plan["gap"] <= 0.5), (name, plan)
    refused = CliRunner().invoke(app, [*args, "--gap-limit", "2"])
    assert refused.exit_code != 0 and "--gap-limit" in refused.output


# --- the CP model's hints over a coarsened graph -----------------------------------------------


@pytest.mark.parametrize("seed", [9, 11])
def test_hints_over_a_coarsened_cp_graph_are_over_that_graph(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """When the CP model's graph is coarsened, the quick baselines that hint it decide over
    the same groups (a graph with a prologue of placeholders: its node limit is not its size)."""
    from memplan.remat import portfolio
    from tests.core.test_remat_baselines import chain_with_updates

    graph = chain_with_updates(seed)
    top = checkpoint_all(RematProblem(graph, 10**9)).peak_bytes
    problem = RematProblem(graph, int(top * 0.9), time_limit_seconds=5.0, workers=1, max_solver_nodes=10**9)
    monkeypatch.setattr(portfolio, "EVENTS_PER_SECOND", 4)  # coarsen whatever the graph
    run = portfolio._Portfolio(problem, time.perf_counter(), 0.0, lambda _: None, ("moccasin",))
    sg = run.cp_graph()
    assert sg.size < run.whole.size and sg.groups[0] == run.whole.groups[0]  # the prologue stays
    assert solver_graph(run.problem_for(sg)).groups == sg.groups
    best, lowest = run.hint_for(sg)
    for rows in (best, lowest):
        assert rows is None or len(rows) == sg.size


@pytest.mark.parametrize("seed", [9, 11])
def test_coarse_baselines_run_when_no_plan_is_proven(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a graph larger than the MILP's, with nothing proven after the baselines, DTR planned
    ahead also runs over the MILP's coarsened graph; whichever plan wins validates and fits,
    and the CP model's hint is the cheapest plan over the whole graph."""
    from memplan.remat import portfolio
    from memplan.remat.lower import sequence_peak_bytes, validate_sequence
    from tests.core.test_remat_baselines import chain_with_updates

    monkeypatch.setattr(portfolio, "MILP_NODES", 12)
    graph = chain_with_updates(seed)
    top = checkpoint_all(RematProblem(graph, 10**9)).peak_bytes
    plan = solve_remat(graph, int(top * 0.8), 5.0, workers=1, gap_limit=0.0, formulations=())
    names = [str(a["name"]) for a in plan.details["attempts"]]  # type: ignore[union-attr]
    assert any(name.startswith("dtr-planned over ") for name in names), names
    if plan.feasible:
        validate_sequence(graph, plan.steps)
        assert plan.peak_bytes == sequence_peak_bytes(graph, plan.steps) <= int(top * 0.8)
    problem = RematProblem(graph, int(top * 0.8), time_limit_seconds=5.0, workers=1, max_solver_nodes=10**9)
    run = portfolio._Portfolio(problem, time.perf_counter(), 0.0, lambda _: None, ("moccasin",))
    run.baselines()
    best, _ = run.hint_for(run.whole)
    fits_whole = any(a.get("feasible") for a in run.attempts if a["name"] in BASELINES)
    assert (best is not None) == fits_whole and (best is None or len(best) == run.whole.size)


# --- the exact cover (issue 36: per-cut covering bounds solved exactly) -------------------------


@settings(max_examples=200, deadline=None)
@given(
    items=st.lists(st.tuples(st.integers(0, 50), st.integers(1, 40)), min_size=0, max_size=9),
    excess=st.integers(-5, 150),
)
def test_the_exact_cover_is_the_least_cover(items: list[tuple[int, int]], excess: int) -> None:
    """``exact_cover`` is the least cost over every subset that frees ``excess`` bytes (brute
    force), between its LP relaxation and the greedy cover; cut short it returns the LP's value."""
    covers = [
        sum(c for c, _ in chosen)
        for r in range(len(items) + 1)
        for chosen in itertools.combinations(items, r)
        if sum(s for _, s in chosen) >= excess
    ]
    best = min(covers, default=math.inf)
    pairs = [(float(c), s) for c, s in items]
    exact = exact_cover(excess, pairs)
    assert exact == best
    if excess > 0:
        assert lp_cover(excess, pairs) <= exact + 1e-9 and exact <= _greedy_cover(excess, pairs)
        assert exact_cover(excess, pairs, node_limit=0) == lp_cover(excess, pairs) <= exact + 1e-9


def test_the_exact_cover_beats_its_lp_where_the_optimum_is_one_recomputation() -> None:
    """The chain at 40 B: the loss's first run must drop 1 B; the LP takes a tenth of f0's
    re-run (46.3), the exact cover the whole of it (49): the CP model's proven optimum, so the
    bound is the optimum (no plan in program order costs less than the bound, none less than 49
    with at most 2 runs per op)."""
    problem = RematProblem(CHAIN, 40, time_limit_seconds=5.0, workers=1)
    plan, status, _ = solve_moccasin(problem, identity(problem))
    assert plan is not None and status.status == "optimal" and status.objective == 49.0
    assert drop_cover_bound(problem).cost == 49.0


def _recosted(graph: Graph, seed: int) -> Graph:
    """``graph`` with costs drawn so that cheap ops are far cheaper than dear ones (0-2 or
    50-100): where a cheap re-run frees a large tensor the exact cover and its LP part most."""
    rng = random.Random(seed)
    flops = [rng.choice((rng.randint(0, 2), rng.randint(50, 100))) for _ in graph.ops]
    ops = tuple(dataclasses.replace(op, flops=f) for op, f in zip(graph.ops, flops, strict=True))
    return Graph(ops, graph.tensors, graph.name)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), num_ops=st.integers(3, 5), fraction=st.floats(0.3, 1.0))
def test_the_exact_cover_bound_is_below_every_plan_in_program_order(seed: int, num_ops: int, fraction: float) -> None:
    """On random DAGs with far-apart costs, the bound never exceeds the cheapest plan in
    program order (brute force over Checkmate's R): a bound above the optimum is a bug."""
    graph = _recosted(small_graph(seed, num_ops), seed)
    top = checkpoint_all(RematProblem(graph, 10**9)).peak_bytes
    problem = RematProblem(graph, int(top * fraction))
    bound = drop_cover_bound(problem)
    optimum = cheapest(all_plans(graph), problem.budget_bytes, in_order=True)
    if optimum is not None:
        assert bound.cost <= optimum + 1e-9


def test_a_plan_at_the_plain_cost_under_the_bound_is_optimal_without_a_caveat() -> None:
    """In program order this graph has no plan at this budget, so the drop cover's bound (for
    that scope) is far above the plain step; the lowering runs an op first later and reaches
    the plain cost, which no plan beats: "optimal", with no word of an unproven plan."""
    graph = _recosted(small_graph(648406, 5), 648406)
    top = checkpoint_all(RematProblem(graph, 10**9)).peak_bytes
    problem = RematProblem(graph, int(top * 0.99))
    assert cheapest(all_plans(graph), problem.budget_bytes, in_order=True) is None
    assert drop_cover_bound(problem).cost > problem.plain_cost
    plan = solve_remat(graph, problem.budget_bytes, 5.0, workers=1)
    assert plan.feasible and plan.compute_cost == problem.plain_cost
    assert plan.status == "optimal" and plan.gap == 0.0 and plan.message == ""
