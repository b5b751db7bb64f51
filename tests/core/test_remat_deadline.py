"""Every remat entry point honours its time limit (issue 36): the baselines cut at their
deadline and say so, DTR's incremental remake costs equal the recursive ones bit for bit, and
long solves report how they stand."""

from __future__ import annotations

import json
import random
import time
from functools import cache
from pathlib import Path

import pytest
from bench.remat_graphs import layered_dag
from typer.testing import CliRunner

from memplan.graph.generate import random_dag
from memplan.graph.io import write_graph_json
from memplan.graph.ir import Graph
from memplan.remat import deadline as deadline_module
from memplan.remat.baselines import (
    BASELINES,
    PLANNED_DTR_VARIANTS,
    _Dtr,
    _PlannedDtr,
    checkpoint_all,
    dtr,
    dtr_planned_rows,
    dtr_rows,
    revolve_events,
    run_baselines,
    solver_graph,
)
from memplan.remat.deadline import Deadline, is_tick, progress_line, ticking, within
from memplan.remat.problem import RematProblem
from tests.core.dtr_reference import NaiveDtr, NaivePlannedDtr, naive_dtr_planned_rows, naive_dtr_rows
from tests.core.test_remat import fwd_bwd_chain

SLACK = 1.5
"""Seconds a cut baseline may run past its deadline here: the check between two evictions, or
between two candidate plans, and lowering the plans in hand (on a loaded 2-core machine)."""
WHOLE = 10**9


@cache
def big_dag() -> Graph:
    """A random layered DAG of 1000 nodes: DTR's remakes thrash on it at 0.9 of its peak (the
    recursive simulation took 144 s for one staleness power)."""
    return layered_dag(3, 1000)


def big_problem(seconds: float) -> RematProblem:
    graph = big_dag()
    top = checkpoint_all(RematProblem(graph, 10**18)).peak_bytes
    return RematProblem(graph, int(0.9 * top), time_limit_seconds=seconds, max_solver_nodes=WHOLE)


def _small_problems(seed: int) -> list[tuple[RematProblem, int]]:
    """Small graphs, each with a budget: layered DAGs and random DAGs, FLOPs and float costs."""
    rng = random.Random(seed)
    out = []
    for graph in (layered_dag(seed, 40 + seed * 7 % 50), random_dag(seed, 30 + seed % 20)):
        for cost in ((), tuple(rng.uniform(0.1, 3.0) for _ in graph.ops)):
            problem = RematProblem(graph, 10**18, cost, max_solver_nodes=WHOLE)
            top = checkpoint_all(problem).peak_bytes
            out += [(problem, int(fraction * top)) for fraction in (0.95, 0.85, 0.7)]
    return out


def _same_simulation(fast: _Dtr, naive: _Dtr) -> bool:
    """Both simulations ran alike: the same answer, and (where one fails) the same rows, runs and
    residents up to the failure."""
    return (fast.simulate(), fast.rows, fast.clock, fast.resident) == (
        naive.simulate(),
        naive.rows,
        naive.clock,
        naive.resident,
    )


@pytest.mark.parametrize("seed", range(4))
def test_incremental_dtr_simulates_as_the_recursive_one(seed: int) -> None:
    """The cached remake costs (forgotten as residency changes) and the stack-driven remakes give
    DTR and DTR planned ahead the very simulation of the first, recursive one: same rows, runs and
    residents, on integer and float costs, whether it fits or fails."""
    for problem, budget in _small_problems(seed):
        sg = solver_graph(problem)
        for power in (0.0, 1.0, 2.0):
            assert _same_simulation(_Dtr(sg, budget, power), NaiveDtr(sg, budget, power))
        for power, ahead in PLANNED_DTR_VARIANTS:
            assert _same_simulation(_PlannedDtr(sg, budget, power, ahead), NaivePlannedDtr(sg, budget, power, ahead))


def test_incremental_dtr_finds_the_recursive_ones_plans() -> None:
    """Where the simulations fit (the layered DAGs at 0.95 of their peak), the plans are equal."""
    plans = 0
    for seed in (0, 4, 5):
        graph = layered_dag(seed, 40 + seed * 7 % 50)
        problem = RematProblem(graph, 10**18, max_solver_nodes=WHOLE)
        sg, budget = solver_graph(problem), int(0.95 * checkpoint_all(problem).peak_bytes)
        for power in (0.0, 1.0, 2.0):
            fast = dtr_rows(sg, budget, power)
            assert fast == naive_dtr_rows(sg, budget, power)
            plans += fast is not None
        for power, ahead in PLANNED_DTR_VARIANTS:
            fast = dtr_planned_rows(sg, budget, power, ahead)
            assert fast == naive_dtr_planned_rows(sg, budget, power, ahead)
            plans += fast is not None
    assert plans >= 20


def test_dtr_is_cut_at_its_deadline_on_a_large_dag_and_says_so() -> None:
    """Without a clock DTR ran minutes on this graph: with a time limit of 0.5 s it returns within
    the slack, no plan, status "unknown", and a message that says where it was cut."""
    problem = big_problem(0.5)
    solver_graph(problem)  # built outside the clock: what the portfolio shares between baselines
    began = time.perf_counter()
    plan = dtr(problem)
    assert time.perf_counter() - began < 0.5 + SLACK
    assert plan.status == "unknown" and not plan.feasible
    assert plan.message.startswith("dtr: cut at ") and "before any plan" in plan.message
    assert plan.details["cut_seconds"] >= 0.5


def test_the_callers_deadline_cuts_a_baseline_sooner_than_its_problems() -> None:
    problem = big_problem(60.0)
    solver_graph(problem)
    began = time.perf_counter()
    with within(Deadline.after(0.3)):
        plan = dtr(problem)
    assert time.perf_counter() - began < 0.3 + SLACK
    assert "cut at" in plan.message


def test_every_baseline_honours_a_short_time_limit_on_a_large_dag() -> None:
    """Each baseline, given 0.3 s on the 1000-node DAG, returns within the slack; one that was
    cut says so, and has a plan or the status "unknown"."""
    problem = big_problem(0.3)
    solver_graph(problem)
    for name, solve in BASELINES.items():
        began = time.perf_counter()
        plan = solve(problem)
        assert time.perf_counter() - began < 0.3 + SLACK, name
        if "cut at" in plan.message:
            assert plan.steps or plan.status == "unknown", name


def test_the_baselines_phase_ends_in_its_share() -> None:
    """:func:`run_baselines` in a 1 s phase: every baseline answers (a plan, a reason, or "not
    run"), and the phase ends within the slack."""
    problem = big_problem(60.0)
    solver_graph(problem)
    began = time.perf_counter()
    plans = run_baselines(problem, BASELINES, 1.0)
    assert time.perf_counter() - began < 1.0 + SLACK
    assert set(plans) == set(BASELINES)
    assert all(p.steps or p.message for p in plans.values())


def _revolve_recursive(steps: int, slots: int) -> list[tuple[int, frozenset[int]]]:
    """Revolve as first written: memo filled along the lengths, recursive reversal."""
    best_split: dict[tuple[int, int], int] = {}
    memo: dict[tuple[int, int], int] = {}

    def cost(length: int, c: int) -> int:
        if length <= 1:
            return 0
        if c == 0:
            return length * (length - 1) // 2
        if (length, c) not in memo:
            memo[length, c], best_split[length, c] = min(
                (m + cost(length - m, c - 1) + cost(m, c), m) for m in range(1, length)
            )
        return memo[length, c]

    events: list[tuple[int, frozenset[int]]] = []
    stored: set[int] = set()

    def rev(start: int, length: int, c: int) -> None:
        if length <= 1 or c == 0:
            events.extend((j, frozenset(stored)) for j in range(start + length, start, -1))
            return
        cost(length, c)
        m = best_split[length, c]
        stored.add(start + m)
        rev(start + m, length - m, c - 1)
        stored.discard(start + m)
        rev(start, m, c)

    rev(0, steps, slots)
    return events


def test_revolve_without_recursion_reverses_as_the_recursive_one() -> None:
    for steps in range(1, 14):
        for slots in range(1, 6):
            assert revolve_events(steps, slots) == _revolve_recursive(steps, slots), (steps, slots)


def test_griewank_on_a_long_chain_is_cut_not_crashed() -> None:
    """Revolve's table grows with the chain's length times its slots, and its recursion once went
    as deep as the chain: on 1200 forward ops, a 0.5 s limit cuts it (no RecursionError)."""
    n = 1200
    rng = random.Random(0)
    graph = fwd_bwd_chain([rng.randint(1, 50) for _ in range(n)], [rng.randint(1, 9) for _ in range(n)])
    top = checkpoint_all(RematProblem(graph, 10**18)).peak_bytes
    problem = RematProblem(graph, int(0.5 * top), time_limit_seconds=0.5, max_solver_nodes=WHOLE)
    solver_graph(problem)
    began = time.perf_counter()
    plan = BASELINES["griewank"](problem)
    assert time.perf_counter() - began < 0.5 + SLACK
    assert "cut at" in plan.message


def test_progress_lines_say_time_best_bound_and_gap() -> None:
    line = progress_line("moccasin on 100 nodes (20 s)", 12.4, 110.0, 104.0, 100.0)
    assert line == "moccasin on 100 nodes (20 s) [12 s: best +10.00%, bound +4.00%, gap 5.45%]"
    assert is_tick(line) and not is_tick("moccasin on 100 nodes (20 s)")
    assert progress_line("baselines", 3.0, None, None, 100.0) == "baselines [3 s: no plan yet]"


def test_a_solve_reports_how_it_stands_while_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The portfolio tells its progress callback each stage and, every PROGRESS_SECONDS, the
    elapsed time with the best plan's cost, the bound and the gap."""
    from memplan.remat import solve_remat

    monkeypatch.setattr(deadline_module, "PROGRESS_SECONDS", 0.05)
    graph = layered_dag(0, 100)
    top = checkpoint_all(RematProblem(graph, 10**18)).peak_bytes
    heard: list[str] = []
    plan = solve_remat(graph, int(0.95 * top), 2.0, progress=heard.append, gap_limit=0.0)
    assert plan.feasible
    ticks = [line for line in heard if is_tick(line)]
    assert any(not is_tick(line) for line in heard), heard  # the stages' starts
    assert ticks and all(" s: " in line for line in ticks)
    assert any("best +" in line and "bound +" in line and "gap " in line for line in ticks), ticks


def test_ticking_stops_with_its_block() -> None:
    heard: list[str] = []
    with ticking(heard.append, "x", lambda: (2.0, 1.0, None), every=0.02):
        time.sleep(0.2)
    count = len(heard)
    time.sleep(0.1)
    assert count >= 2 and len(heard) == count
    assert heard[0].startswith("x [0 s: best 2, bound 1, gap 50.00%")


def test_cli_portfolio_on_a_large_dag_returns_in_its_time_limit_and_says_what_it_cut(tmp_path: Path) -> None:
    """``memplan remat GRAPH --time-limit 4`` on the 1000-node DAG (DTR alone ran minutes there)
    returns within the slack; its report says where DTR was cut, and stderr (not a terminal
    here) has the stages and how the solve stood."""
    from memplan.cli import app

    write_graph_json(big_dag(), tmp_path / "g.json")
    out = tmp_path / "r.json"
    args = ["remat", str(tmp_path / "g.json"), "--budget", "0.9", "--time-limit", "4", "--json", str(out)]
    began = time.perf_counter()
    result = CliRunner().invoke(app, args)
    wall = time.perf_counter() - began
    assert result.exit_code == 0, result.output
    assert wall < 4 + 2 * SLACK, wall
    plan = json.loads(out.read_text())["strategies"]["portfolio"]
    assert plan["status"] in ("optimal", "feasible", "unknown")
    (dtr_attempt,) = [a for a in plan["attempts"] if a["name"] == "dtr"]
    assert dtr_attempt["message"].startswith("dtr: cut at ")
    assert "portfolio: baselines" in result.stderr
    assert any(is_tick(line) for line in result.stderr.splitlines()), result.stderr
