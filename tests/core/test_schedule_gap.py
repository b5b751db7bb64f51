"""The reorder's relative-gap stop (issue 37): feasible within the limit, optimal only when proven."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from memplan.commands.optimize import register as register_optimize
from memplan.commands.place import register as register_place
from memplan.errors import MemplanError
from memplan.graph.analysis import peak_lower_bound
from memplan.graph.io import write_graph_json
from memplan.graph.liveness import peak_bytes
from memplan.schedule import ScheduleProblem, optimize_order, solve, validate_schedule
from memplan.schedule.ideals import minimise_peak
from memplan.schedule.problem import gap_met
from tests.core.test_schedule import toy_training_graph

# Toy training steps whose trivial lower bound is below the optimum (the subset DP's), so the
# search must prove more than the bound it starts from; (layers, seed, optimum bytes).
STEPS = [(6, 0, 429), (4, 2, 196), (6, 2, 314)]
LIMIT = 0.1


@pytest.mark.parametrize(("layers", "seed", "optimum"), STEPS)
def test_gap_stop_returns_a_feasible_order_within_the_limit(layers, seed, optimum):
    graph = toy_training_graph(layers, seed=seed)
    result = optimize_order(graph, time_limit_seconds=5, method="ilp", workers=1, relative_gap_limit=LIMIT)
    validate_schedule(graph, result)
    assert result.status == "feasible"  # stopped before the bound met the order: never called optimal
    assert result.peak_bytes == peak_bytes(graph, result.order)  # the claim is the estimator's
    assert result.lower_bound_bytes <= optimum <= result.peak_bytes  # the bound is valid
    assert 0 < result.gap <= LIMIT
    assert gap_met(result.peak_bytes, result.lower_bound_bytes, LIMIT)


@pytest.mark.parametrize(("layers", "seed", "optimum"), STEPS)
def test_gap_zero_proves_the_optimum(layers, seed, optimum):
    graph = toy_training_graph(layers, seed=seed)
    result = optimize_order(graph, time_limit_seconds=5, method="ilp", workers=1, relative_gap_limit=0.0)
    validate_schedule(graph, result)
    assert result.status == "optimal" and result.gap == 0
    assert result.peak_bytes == result.lower_bound_bytes == optimum


@pytest.mark.parametrize(("layers", "seed", "optimum"), STEPS)
def test_gap_stop_in_the_cp_sat_model_stays_honest(layers, seed, optimum):
    """Without the search over ideals and with a limit the heuristics miss, the CP-SAT model
    runs with its own relative gap limit: optimal only where the order meets the bound."""
    graph = toy_training_graph(layers, seed=seed)
    limit = 0.02
    problem = ScheduleProblem(graph, 5, "ilp", workers=1, ideal_search=False, relative_gap_limit=limit)
    result = solve(problem)
    validate_schedule(graph, result)
    assert result.lower_bound_bytes <= optimum <= result.peak_bytes
    assert (result.status == "optimal") == (result.peak_bytes == result.lower_bound_bytes)
    assert gap_met(result.peak_bytes, result.lower_bound_bytes, limit)


def test_bisection_stops_at_the_gap_after_probing_the_bound():
    graph = toy_training_graph(6, seed=2)
    lower = peak_lower_bound(graph)
    far = time.perf_counter() + 60
    full = minimise_peak(graph, lower, graph.program_order(), far)
    stopped = minimise_peak(graph, lower, graph.program_order(), far, stop_gap=LIMIT)
    assert full.peak_bytes == full.proven_lower_bytes == 314
    assert 1 <= len(stopped.probes) < len(full.probes)
    assert stopped.proven_lower_bytes <= 314 <= stopped.peak_bytes
    assert gap_met(stopped.peak_bytes, stopped.proven_lower_bytes, LIMIT)


@pytest.mark.parametrize("limit", [-0.1, 1.0, float("nan")])
def test_a_bad_gap_limit_is_refused_in_one_line(limit):
    graph = toy_training_graph(3, seed=1)
    with pytest.raises(MemplanError, match="relative gap limit"):
        optimize_order(graph, relative_gap_limit=limit)


@pytest.mark.parametrize(("gap", "status"), [("0.1", "feasible"), ("0", "optimal")])
def test_the_optimize_command_proves_unless_given_a_gap(tmp_path: Path, gap, status):
    graph = toy_training_graph(6, seed=2)
    path, out = tmp_path / "g.json", tmp_path / "r.json"
    write_graph_json(graph, path)
    app = typer.Typer()
    register_optimize(app)
    register_place(app)  # with two commands typer dispatches by name
    args = ["optimize", str(path), "--time-limit", "5", "--quiet", "--json", str(out)]
    result = CliRunner().invoke(app, [*args, "--gap", gap] if gap != "0" else args)
    assert result.exit_code == 0, result.output
    schedule = json.loads(out.read_text())["schedule"]
    assert schedule["status"] == status
    assert schedule["gap"] <= float(gap)
