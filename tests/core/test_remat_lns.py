"""The large neighbourhood search (memplan.remat.lns) and its step, the CP model around a plan
(moccasin.solve_neighbourhood): against the whole CP model on small random graphs."""

from __future__ import annotations

import time

import pytest

from memplan.remat import RematProblem, lns, solve_remat
from memplan.remat.baselines import BASELINES, checkpoint_all
from memplan.remat.coarsen import identity
from memplan.remat.lns import Neighbourhoods, improve
from memplan.remat.lower import sequence_peak_bytes, validate_sequence
from memplan.remat.moccasin import build_events, most_runs, node_reads, rerun_nodes, solve_moccasin, solve_neighbourhood
from tests.core.test_remat_portfolio import small_graph, twice_read_graph

CASES = [(3, 0.7), (12, 0.8), (13, 0.7), (24, 0.8)]
"""(seed, fraction of the checkpoint-all peak) where DTR planned ahead is not optimal."""


def _start(seed: int, fraction: float):  # type: ignore[no-untyped-def]
    graph = small_graph(seed, 14)
    top = checkpoint_all(RematProblem(graph, 10**9)).peak_bytes
    problem = RematProblem(graph, int(top * fraction), time_limit_seconds=5.0, workers=1, max_solver_nodes=10**6)
    sg = identity(problem)
    start = BASELINES["dtr-planned"](problem)
    assert start.feasible
    return graph, problem, sg, start


def _record_kinds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Neighbourhoods that record their kinds, in order, and free nothing."""
    kinds: list[str] = []

    def record(self: Neighbourhoods, kind: str, *_args: object) -> set[int]:
        kinds.append(kind)
        return set()

    monkeypatch.setattr(Neighbourhoods, "pick", record)
    return kinds


def _runs(rows: list[list[int]], k: int) -> list[int]:
    return [t for t, row in enumerate(rows) if k in row]


@pytest.mark.parametrize(("seed", "fraction"), CASES)
def test_a_neighbourhood_keeps_the_runs_of_every_node_it_does_not_free(seed: int, fraction: float) -> None:
    graph, problem, sg, start = _start(seed, fraction)
    rows = start.details["rows"]
    again = rerun_nodes(rows)  # type: ignore[arg-type]
    events = build_events(sg, node_reads(sg))
    movable = [k for k in range(sg.size) if events.recompute[k]]
    nothing, status, _ = solve_neighbourhood(problem, sg, rows, set(), 3, 5.0)  # type: ignore[arg-type]
    assert nothing is not None and status.status == "optimal"
    assert nothing.compute_cost <= start.compute_cost
    free = set(movable[::2])
    plan, _, _ = solve_neighbourhood(problem, sg, rows, free, 3, 5.0)  # type: ignore[arg-type]
    assert plan is not None and plan.compute_cost <= start.compute_cost
    validate_sequence(graph, plan.steps)
    assert plan.peak_bytes == sequence_peak_bytes(graph, plan.steps) <= problem.budget_bytes
    found: list[list[int]] = plan.details["rows"]  # type: ignore[assignment]
    for k in range(sg.size):
        if k in free:
            continue
        if k in again:
            kept = [t for t in _runs(rows, k) if t == k or (t, k) in events.index]  # type: ignore[arg-type]
            assert _runs(found, k) == kept
        else:
            assert _runs(found, k) == [k]


@pytest.mark.parametrize(("seed", "fraction"), CASES)
def test_a_neighbourhood_of_every_node_is_the_whole_cp_model(seed: int, fraction: float) -> None:
    _graph, problem, sg, start = _start(seed, fraction)
    rows = start.details["rows"]
    runs = max(3, most_runs(rows))  # type: ignore[arg-type]
    whole, whole_status, _ = solve_moccasin(problem, sg, rows, runs, 10.0, probe_cuts=False)  # type: ignore[arg-type]
    every, status, _ = solve_neighbourhood(problem, sg, rows, set(range(sg.size)), 3, 10.0)  # type: ignore[arg-type]
    assert whole_status.status == status.status == "optimal"
    assert whole is not None and every is not None and every.compute_cost == whole.compute_cost


@pytest.mark.parametrize("guided", [False, True])
@pytest.mark.parametrize(("seed", "fraction"), CASES)
def test_the_search_improves_a_baseline_to_the_cp_models_optimum(
    seed: int, fraction: float, guided: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also when every round is a guided one (guided by two arbitrary nodes)."""
    monkeypatch.setattr(lns, "GUIDED_EVERY", 1)
    graph, problem, sg, start = _start(seed, fraction)
    rows = start.details["rows"]
    optimum, status, _ = solve_moccasin(problem, sg, rows, max(3, most_runs(rows)), 10.0, probe_cuts=False)  # type: ignore[arg-type]
    assert status.status == "optimal" and optimum is not None and optimum.compute_cost < start.compute_cost
    seen: list[float] = []
    result = improve(
        problem,
        sg,
        start,
        20.0,
        3,
        stop=lambda plan: plan.compute_cost <= optimum.compute_cost,
        on_better=lambda plan: seen.append(plan.compute_cost),
        guide=frozenset(Neighbourhoods(sg).movable[:2]) if guided else frozenset(),
    )
    assert result.plan is not None and result.plan.compute_cost <= optimum.compute_cost
    assert seen == sorted(seen, reverse=True) and seen[-1] == result.plan.compute_cost
    assert result.improvements == len(seen) >= 1
    validate_sequence(graph, result.plan.steps)
    assert result.plan.peak_bytes <= problem.budget_bytes


def test_the_neighbourhoods_are_re_runnable_nodes_around_the_plan() -> None:
    _graph, _problem, sg, start = _start(12, 0.8)
    chooser = Neighbourhoods(sg)
    rows = start.details["rows"]
    for kind in ("crossing", "re-runs", "window"):
        for _ in range(20):
            free = chooser.pick(kind, rows, 6)  # type: ignore[arg-type]
            assert free <= set(chooser.movable) | rerun_nodes(rows)  # type: ignore[arg-type]
    assert any(chooser.pick("re-runs", rows, 6) for _ in range(5))  # type: ignore[arg-type]


def test_the_portfolio_runs_the_search_on_large_models_and_keeps_its_plans_valid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Below :data:`LNS_MIN_EVENTS` the portfolio skips it; forced on a small graph, it runs,
    its plan beats DTR planned ahead's and the answer is still honest. The search has the time
    left (or ends proven), so the whole CP model does not run after it."""
    from memplan.remat import portfolio

    graph, problem, _sg, start = _start(24, 0.8)
    plain = solve_remat(graph, problem.budget_bytes, 10.0, workers=1)
    assert "neighbourhood search" not in [a["name"] for a in plain.details["attempts"]]
    monkeypatch.setattr(portfolio, "LNS_MIN_EVENTS", 0)
    monkeypatch.setattr(portfolio, "RESTRICTED_MAX_FRACTION", 0.0)  # no restricted search: the LNS finds the plan
    monkeypatch.setattr(portfolio, "EARLY_CP_EVENTS", 0)  # the later members are under test
    forced = solve_remat(graph, problem.budget_bytes, 10.0, workers=1)
    names = [a["name"] for a in forced.details["attempts"]]
    assert forced.feasible and forced.status != "infeasible"
    validate_sequence(graph, forced.steps)
    assert forced.compute_cost < start.compute_cost and forced.peak_bytes <= problem.budget_bytes
    assert "neighbourhood search" in names


def test_the_search_has_the_time_left_and_the_whole_model_does_not_follow(monkeypatch: pytest.MonkeyPatch) -> None:
    """The portfolio gives the neighbourhood search all the time left (less the margin for
    lowering), and runs the whole CP model after it only if the search left enough time."""
    from memplan.remat import lns, portfolio

    graph, problem, _sg, _start_plan = _start(24, 0.8)
    monkeypatch.setattr(portfolio, "LNS_MIN_EVENTS", 0)
    monkeypatch.setattr(portfolio, "RESTRICTED_MAX_FRACTION", 0.0)
    monkeypatch.setattr(portfolio, "EARLY_CP_EVENTS", 0)  # the later members are under test
    given: list[float] = []

    def spend(_problem: object, _sg: object, _plan: object, seconds: float, *_args: object, **_kw: object) -> object:
        given.append(seconds)
        time.sleep(seconds)  # a search that finds nothing better and is never proven
        return lns.LnsResult(None, 1, 0, seconds)

    monkeypatch.setattr(portfolio, "improve", spend)
    began = time.perf_counter()
    plan = solve_remat(graph, problem.budget_bytes, 4.0, workers=1, gap_limit=0.0)
    names = [a["name"] for a in plan.details["attempts"]]
    assert given and given[0] >= 4.0 - (time.perf_counter() - began - given[0]) - portfolio.MARGIN_SECONDS - 0.1
    assert "moccasin" not in names and "checkmate" not in names
    assert plan.feasible and plan.status == "feasible" and time.perf_counter() - began <= 4.0 + 0.5


def test_a_guided_neighbourhood_frees_the_guide_and_every_re_run() -> None:
    """The guided kind frees every node the plan re-runs, the re-runnable nodes of the guide
    (never a node that may not run again) and a few drawn by pressure."""
    _graph, _problem, sg, start = _start(12, 0.8)
    chooser = Neighbourhoods(sg)
    rows = start.details["rows"]
    guide = frozenset({0, *chooser.movable[:3], sg.size - 1})
    for _ in range(10):
        free = chooser.pick("guided", rows, 6, guide)  # type: ignore[arg-type]
        assert rerun_nodes(rows) <= free  # type: ignore[arg-type]
        assert guide & set(chooser.movable) <= free
        assert free <= set(chooser.movable) | rerun_nodes(rows)  # type: ignore[arg-type]


def test_a_disagree_neighbourhood_frees_where_the_plan_and_the_guide_differ() -> None:
    """The disagree kind (RINS) frees the nodes re-run by the plan or by the guide but not
    both, and of the nodes both re-run at most half the room left; only re-runnable nodes."""
    _graph, _problem, sg, start = _start(12, 0.8)
    chooser = Neighbourhoods(sg)
    rows = start.details["rows"]
    again = rerun_nodes(rows)  # type: ignore[arg-type]
    shared = sorted(again)[: len(again) // 2]
    others = [k for k in chooser.movable if k not in again][:2]
    guide = frozenset({*shared, *others, sg.size - 1})
    differ = again ^ (guide & set(chooser.movable))
    assert differ and shared
    for size in (len(differ), len(differ) + 4, 40):
        free = chooser.pick("disagree", rows, size, guide)  # type: ignore[arg-type]
        assert differ <= free and free <= differ | set(shared)
        assert len(free - differ) <= (size - len(differ)) // 2
    small = chooser.pick("disagree", rows, 1, guide)  # type: ignore[arg-type]
    assert len(small) == 1 and small <= differ


def test_disagree_rounds_only_while_a_guided_round_would_be_too_large(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a guide of more than :data:`GUIDED_MAX_NODES` nodes no round is guided and the
    rotation has disagree rounds; with a small guide, the guided rounds and the plain kinds."""
    from memplan.solvers import SolveStatus

    _graph, problem, sg, start = _start(12, 0.8)
    kinds = _record_kinds(monkeypatch)
    nothing = SolveStatus("unknown", None, None, None, 0.0)
    monkeypatch.setattr(lns, "solve_neighbourhood", lambda *_: (None, nothing, {}))
    movable = Neighbourhoods(sg).movable
    monkeypatch.setattr(lns, "GUIDED_MAX_NODES", len(rerun_nodes(start.details["rows"]) | {movable[0]}))  # type: ignore[arg-type]
    improve(problem, sg, start, 60.0, 3, stop=lambda _: len(kinds) >= 10, guide=frozenset(movable[:1]))
    assert kinds[0] == "guided" and "disagree" not in kinds
    kinds.clear()
    improve(problem, sg, start, 60.0, 3, stop=lambda _: len(kinds) >= 10, guide=frozenset(movable))
    assert kinds == list(lns.GUIDE_KINDS) * 2


def test_pressure_is_the_bytes_a_node_keeps_across_the_stages_over_the_budget() -> None:
    """By hand on the twice-read graph at 25 B: ``big1``, ``c1``, ``big2`` and ``c2`` are over
    the budget with every part kept; ``A`` (10 B) crosses all four, ``X1`` (1 B) too, ``C1`` and
    ``X2`` (1 B each) the last two. Nothing is over a budget above the checkpoint-all peak."""
    graph = twice_read_graph()
    sg = identity(RematProblem(graph, 25, time_limit_seconds=5.0, workers=1))
    tight = Neighbourhoods(sg, budget_bytes=25, persistent_bytes=graph.persistent_bytes)
    assert tight.pressure == [40, 4, 0, 2, 2, 0, 0, 0, 0]
    roomy = Neighbourhoods(sg, budget_bytes=10**6, persistent_bytes=graph.persistent_bytes)
    assert roomy.pressure == [0] * sg.size == Neighbourhoods(sg).pressure


def test_a_guided_neighbourhood_adds_nodes_under_pressure_first() -> None:
    """The nodes a guided neighbourhood adds come from those with pressure while there are
    enough of them, then uniformly from the rest; never a node outside the candidates."""
    graph = twice_read_graph()
    sg = identity(RematProblem(graph, 25, time_limit_seconds=5.0, workers=1))
    chooser = Neighbourhoods(sg, budget_bytes=25, persistent_bytes=graph.persistent_bytes)
    under = {k for k in chooser.movable if chooser.pressure[k] > 0}
    for count in range(1, len(chooser.movable) + 1):
        drawn = chooser._by_pressure(chooser.movable, count)
        assert len(drawn) == count and drawn <= set(chooser.movable)
        assert drawn <= under or under <= drawn
    assert chooser._by_pressure([2, 5], 1) <= {2, 5}  # no pressure among them: uniform


def test_guided_rounds_back_off_while_they_find_nothing_and_return_once_one_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Guided rounds come every :data:`GUIDED_EVERY` rounds from the first; each one that finds
    nothing better doubles the wait (up to :data:`GUIDED_MAX_EVERY`), one that does resets it.
    The neighbourhoods are recorded, not solved: only round 12 (a guided one) finds a plan."""
    from dataclasses import replace

    from memplan.solvers import SolveStatus

    _graph, problem, sg, start = _start(12, 0.8)
    kinds = _record_kinds(monkeypatch)

    def answer(*_args: object) -> tuple[object, SolveStatus, dict[str, object]]:
        if len(kinds) - 1 == 12:
            return replace(start, compute_cost=start.compute_cost / 2), SolveStatus("optimal", 0, 0, 0, 0.0), {}
        return None, SolveStatus("unknown", None, None, None, 0.0), {}

    monkeypatch.setattr(lns, "solve_neighbourhood", answer)
    guide = frozenset(Neighbourhoods(sg).movable[:1])
    found = improve(problem, sg, start, 60.0, 3, stop=lambda _: len(kinds) >= 60, guide=guide)
    assert found.improvements == 1 and found.rounds == 60
    assert lns.GUIDED_EVERY == 2 and lns.GUIDED_MAX_EVERY == 16
    assert [i for i, kind in enumerate(kinds) if kind == "guided"] == [0, 4, 12, 14, 18, 26, 42, 58]


@pytest.mark.parametrize(("seed", "fraction"), CASES[:2])
def test_two_threads_reach_the_cp_models_optimum_too(seed: int, fraction: float) -> None:
    graph, problem, sg, start = _start(seed, fraction)
    problem = problem.with_time_limit(5.0)
    rows = start.details["rows"]
    optimum, status, _ = solve_moccasin(problem, sg, rows, max(3, most_runs(rows)), 10.0, probe_cuts=False)  # type: ignore[arg-type]
    assert status.status == "optimal" and optimum is not None
    seen: list[float] = []
    two = RematProblem(problem.graph, problem.budget_bytes, workers=2, max_solver_nodes=problem.max_solver_nodes)
    result = improve(
        two,
        sg,
        start,
        20.0,
        3,
        stop=lambda plan: plan.compute_cost <= optimum.compute_cost,
        on_better=lambda plan: seen.append(plan.compute_cost),
        threads=2,
    )
    assert result.plan is not None and result.plan.compute_cost == optimum.compute_cost == seen[-1]
    assert seen == sorted(seen, reverse=True) and len(set(seen)) == len(seen) == result.improvements
    validate_sequence(graph, result.plan.steps)
    assert result.plan.peak_bytes <= problem.budget_bytes


def test_threads_solve_neighbourhoods_at_once_each_with_its_share_of_the_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two threads of one worker each (the problem's two workers shared) solve rounds at once;
    a round whose plan is cheaper than its start but not than the best found meanwhile is
    dropped. The neighbourhoods are answered, not solved: each round's plan is cheaper than the
    rounds' before it, and the even ones take longer, so some finish after a later, cheaper one."""
    import threading
    from dataclasses import replace

    from memplan.solvers import SolveStatus

    _graph, problem, sg, start = _start(12, 0.8)
    problem = replace(problem, workers=2)
    calls: list[tuple[int, int]] = []
    lock = threading.Lock()
    at_once = {"now": 0, "most": 0}

    def answer(p: RematProblem, *_args: object) -> tuple[object, SolveStatus, dict[str, object]]:
        with lock:
            k = len(calls)
            calls.append((threading.get_ident(), p.workers))
            at_once["now"] += 1
            at_once["most"] = max(at_once["most"], at_once["now"])
        time.sleep(0.02 if k % 2 else 0.05)
        with lock:
            at_once["now"] -= 1
        cheaper = replace(start, compute_cost=start.compute_cost * (1 - (k + 1) / 1000))
        return cheaper, SolveStatus("feasible", 0, 0, 0, 0.0), {}

    monkeypatch.setattr(lns, "solve_neighbourhood", answer)
    seen: list[float] = []
    found = improve(
        problem,
        sg,
        start,
        60.0,
        3,
        stop=lambda _: len(calls) >= 40,
        on_better=lambda p: seen.append(p.compute_cost),
        threads=2,
    )
    assert len({ident for ident, _ in calls}) == 2 and {workers for _, workers in calls} == {1}
    assert at_once["most"] == 2
    assert found.rounds == len(calls) and found.improvements == len(seen) < found.rounds
    assert seen == sorted(seen, reverse=True) and found.plan is not None and found.plan.compute_cost == seen[-1]


def test_an_error_in_another_thread_reaches_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    from dataclasses import replace

    from memplan.solvers import SolveStatus

    _graph, problem, sg, start = _start(12, 0.8)
    main = threading.get_ident()

    def answer(*_args: object) -> object:
        if threading.get_ident() != main:
            raise RuntimeError("boom in a search thread")
        time.sleep(0.01)
        return None, SolveStatus("unknown", None, None, None, 0.0), {}

    monkeypatch.setattr(lns, "solve_neighbourhood", answer)
    with pytest.raises(RuntimeError, match="boom in a search thread"):
        improve(replace(problem, workers=2), sg, start, 30.0, 3, threads=2)
