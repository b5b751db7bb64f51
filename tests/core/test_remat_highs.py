"""The optional HiGHS backend of Checkmate's MILP: the exported model, the isolated worker,
and equal optima with CP-SAT (and brute force).

highspy is never imported in this process: next to OR-Tools it fails to load (undefined
symbol) or crashes, and ``pytest.importorskip`` would then skip every test. Availability is
looked up with :func:`memplan.remat.highs.highs_available` instead.
"""

from __future__ import annotations

import ast
import itertools
import os
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from ortools.sat.python import cp_model
from typer.testing import CliRunner

from memplan.errors import MemplanError
from memplan.graph.io import write_graph_json
from memplan.remat import STRATEGIES, RematProblem, rematerialize
from memplan.remat import highs as highs_backend
from memplan.remat.baselines import solver_graph
from memplan.remat.highs import (
    WORKER,
    Milp,
    MilpInBackground,
    highs_available,
    milp_from_cp_model,
    solve_highs,
    solve_milp,
)
from memplan.remat.highs_worker import EXIT_NO_HIGHS, MISSING_HIGHS
from memplan.remat.lower import sequence_peak_bytes, validate_sequence
from memplan.remat.milp import best_baseline, build_model, complete_hints, solve_checkmate
from memplan.solvers import solve_cp_sat
from tests.core.test_remat import _brute_force_cost, fwd_bwd_chain

needs_highs = pytest.mark.skipif(not highs_available(), reason="HiGHS is optional")


def checkmate_model(graph, budget: int, hinted: bool = True):  # type: ignore[no-untyped-def]
    """The CP-SAT model that solve_checkmate builds, with its hints."""
    problem = RematProblem(graph, budget, time_limit_seconds=5.0, workers=1)
    sg = solver_graph(problem)
    mm = build_model(sg, budget, graph.persistent_bytes)
    warm = best_baseline(problem)
    if hinted and warm is not None:
        complete_hints(mm, sg, warm.details["rows"], 2.0)  # type: ignore[arg-type]
    return mm


def random_chain(layers: int):  # type: ignore[no-untyped-def]
    """A forward/backward chain with random sizes and costs (seeded by ``layers``)."""
    rng = random.Random(layers)
    return fwd_bwd_chain([rng.randint(2, 9) for _ in range(layers)], [rng.randint(1, 5) for _ in range(layers)])


def top_peak(graph) -> int:  # type: ignore[no-untyped-def]
    return STRATEGIES["checkpoint-all"](RematProblem(graph, 10**9)).peak_bytes


def small_milp() -> Milp:
    """min x0 + 2 x1 s.t. x0 + x1 >= 1, x0 <= 0.5 (so x0 = 0 in an integer solution): optimum 2."""
    milp = Milp(np.array([1.0, 2.0]), 0.0, np.zeros(2), np.ones(2), np.ones(2, dtype=bool))
    milp.add_row({0: 1.0, 1: 1.0}, 1.0, np.inf)
    milp.add_row({0: 1.0}, -np.inf, 0.5)
    return milp


# --- export: no highspy needed -------------------------------------------------------------


def test_export_handles_negated_literals_and_enforced_bool_and() -> None:
    model = cp_model.CpModel()
    a, b, f = (model.new_bool_var(n) for n in "abf")
    model.add(a + b >= 1)
    model.add_bool_and([a, b.Not()]).only_enforce_if(f)
    model.minimize(3 * a + 2 * b - 5 * f + 1)
    milp = milp_from_cp_model(model.proto)
    for x in itertools.product((0, 1), repeat=3):
        feasible = x[0] + x[1] >= 1 and (not x[2] or (x[0] and not x[1]))
        assert (milp.violation(np.array(x, dtype=float)) <= 0) == feasible
        assert milp.evaluate(np.array(x, dtype=float)) == 3 * x[0] + 2 * x[1] - 5 * x[2] + 1


def test_export_turns_a_bool_or_into_at_least_one_literal() -> None:
    model = cp_model.CpModel()
    a, b, c = (model.new_bool_var(n) for n in "abc")
    model.add_bool_or([a, b.Not(), c])
    model.minimize(a + c)
    milp = milp_from_cp_model(model.proto)
    for x in itertools.product((0, 1), repeat=3):
        assert (milp.violation(np.array(x, dtype=float)) <= 0) == bool(x[0] or not x[1] or x[2])
    enforced = cp_model.CpModel()
    d, e = enforced.new_bool_var("d"), enforced.new_bool_var("e")
    enforced.add_bool_or([d]).only_enforce_if(e)
    with pytest.raises(MemplanError, match="unsupported constraint"):
        milp_from_cp_model(enforced.proto)


@pytest.mark.parametrize(("layers", "fraction"), [(6, 0.9), (8, 0.8), (8, 0.7)])
def test_exported_milp_is_the_cp_sat_model(layers: int, fraction: float) -> None:
    """CP-SAT's optimum is feasible in the export with the same objective, and so are the hints."""
    graph = random_chain(layers)
    mm = checkmate_model(graph, int(top_peak(graph) * fraction))
    milp = milp_from_cp_model(mm.model.proto, [u.index for u in mm.U.values()])
    if milp.start is not None:
        assert milp.violation(milp.start) <= 1e-9
    solver, status = solve_cp_sat(mm.model, 5.0, workers=1)
    assert status.status == "optimal"
    x = np.array([solver.value(mm.model.get_int_var_from_proto_index(j)) for j in range(milp.num_cols)], dtype=float)
    assert milp.violation(x) <= 1e-9
    assert milp.evaluate(x) == pytest.approx(status.objective)


# --- isolation of the worker ---------------------------------------------------------------


def test_worker_imports_only_the_standard_library_numpy_and_highspy() -> None:
    tree = ast.parse(WORKER.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    allowed = set(sys.stdlib_module_names) | {"numpy", "highspy", "__future__"}
    assert imported <= allowed, imported - allowed
    top_level = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    assert "highspy" not in top_level  # imported inside main(): the parent may import the constants


def poisoned(tmp_path: Path, *names: str) -> dict[str, str]:
    """An environment where importing any of ``names`` fails."""
    for name in names:
        package = tmp_path / "poison" / name
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(f"raise ImportError('{name} is poisoned in this test')\n")
    return {**os.environ, "PYTHONPATH": str(tmp_path / "poison")}


def run_worker(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    src, dst = tmp_path / "in.npz", tmp_path / "out.npz"
    np.savez(src, **small_milp().arrays({"time_limit": 5.0}))
    command = [sys.executable, str(WORKER), str(src), str(dst)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, check=False)


@needs_highs
def test_worker_solves_without_ortools_or_memplan(tmp_path: Path) -> None:
    done = run_worker(tmp_path, poisoned(tmp_path, "ortools", "memplan"))
    assert done.returncode == 0, done.stderr
    with np.load(tmp_path / "out.npz") as out:
        assert list(out["x"]) == [0.0, 1.0]
        assert '"optimal"' in str(out["meta"])


def test_worker_without_highspy_says_one_line(tmp_path: Path) -> None:
    done = run_worker(tmp_path, poisoned(tmp_path, "highspy"))
    assert done.returncode == EXIT_NO_HIGHS
    assert done.stderr.strip() == MISSING_HIGHS == "HiGHS is optional: pip install highspy"


def test_missing_highspy_is_one_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(highs_backend, "highs_available", lambda: False)
    graph = fwd_bwd_chain([4, 6, 5], [3, 1, 2])
    with pytest.raises(MemplanError, match=r"^HiGHS is optional: pip install highspy$"):
        rematerialize(graph, 15, solver="highs")
    with pytest.raises(MemplanError, match="unknown MILP solver"):
        rematerialize(graph, 15, solver="gurobi")
    path = tmp_path / "chain.json"
    write_graph_json(graph, path)
    result = CliRunner().invoke(_cli_app(), ["remat", str(path), "--budget", "15", "--solver", "highs"])
    assert result.exit_code != 0
    assert isinstance(result.exception, MemplanError) and str(result.exception) == MISSING_HIGHS


def _cli_app():  # type: ignore[no-untyped-def]
    from memplan.cli import app

    return app


# --- HiGHS against CP-SAT and brute force ---------------------------------------------------


@needs_highs
def test_highs_solves_a_small_milp() -> None:
    status, x = solve_milp(small_milp(), 5.0)
    assert status.status == "optimal" and status.objective == pytest.approx(2.0) and status.gap == 0.0
    assert x is not None and list(x) == [0.0, 1.0]
    infeasible = small_milp()
    infeasible.add_row({1: 1.0}, -np.inf, 0.0)
    assert solve_milp(infeasible, 5.0)[0].status == "infeasible"


@needs_highs
def test_a_milp_in_the_background_answers_as_in_the_foreground() -> None:
    """poll() never waits and gives the answer once the child has ended; finish() waits;
    closing kills a child still running and removes its files."""
    with MilpInBackground(small_milp(), 5.0) as child:
        status, x = child.finish(30.0)
        assert child.poll() == (status, x)
    foreground, y = solve_milp(small_milp(), 5.0)
    assert status == replace(foreground, seconds=status.seconds) and x is not None and list(x) == list(y)
    failed = MilpInBackground(small_milp(), 5.0)
    failed._process.wait()
    failed._process = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(7)"])  # a worker that died
    assert failed.finish(30.0)[0].status == "unknown"  # in the background: no bound, no error
    failed.close()
    running = MilpInBackground(small_milp(), 5.0, nice=5)
    folder = running._src.parent
    running.close()
    assert running._process.returncode is not None and not folder.exists()


@needs_highs
@pytest.mark.parametrize(("layers", "fraction"), [(6, 0.9), (6, 0.8), (8, 0.8), (8, 0.7)])
def test_highs_and_cp_sat_reach_the_same_optimum(layers: int, fraction: float) -> None:
    graph = random_chain(layers)
    budget = int(top_peak(graph) * fraction)
    for hinted in (True, False):
        mm = checkmate_model(graph, budget, hinted)
        _, cp_status = solve_cp_sat(mm.model, 10.0, workers=1)
        status, x = solve_highs(mm.model, 10.0, continuous=[u.index for u in mm.U.values()])
        assert status.status == cp_status.status in ("optimal", "infeasible")
        if status.status == "optimal":
            assert status.objective == pytest.approx(cp_status.objective)
            assert x is not None and milp_from_cp_model(mm.model.proto).violation(np.round(x)) <= 1e-6
    problem = RematProblem(graph, budget, time_limit_seconds=10.0, workers=1)
    plans = {solver: solve_checkmate(problem, solver=solver) for solver in ("cp-sat", "highs")}
    for solver, plan in plans.items():
        assert plan.details["solver"] == solver
        if plan.steps:
            validate_sequence(graph, plan.steps)
            assert plan.peak_bytes == sequence_peak_bytes(graph, plan.steps)
        if plan.feasible:
            assert plan.peak_bytes <= budget
    assert plans["highs"].feasible == plans["cp-sat"].feasible
    assert plans["highs"].compute_cost == plans["cp-sat"].compute_cost


@needs_highs
@pytest.mark.parametrize("budget", [14, 15, 17, 30])  # checkpoint-all peaks at 17
def test_highs_is_exact_on_a_tiny_chain(budget: int) -> None:
    graph = fwd_bwd_chain([4, 6, 5], [3, 1, 2])
    expected = _brute_force_cost(graph, budget)
    plan = rematerialize(graph, budget, time_limit_seconds=5.0, workers=1, strict=False, solver="highs")
    cp_plan = rematerialize(graph, budget, time_limit_seconds=5.0, workers=1, strict=False)
    assert plan.feasible == cp_plan.feasible == (expected is not None)
    if expected is not None:
        assert plan.compute_cost == cp_plan.compute_cost == expected
        validate_sequence(graph, plan.steps)
        assert plan.peak_bytes == sequence_peak_bytes(graph, plan.steps) <= budget
    else:
        assert plan.status == "infeasible"
