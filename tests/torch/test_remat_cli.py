"""``memplan remat`` end to end on a small zoo model: --max-batch, --cost profile, --workspace."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from memplan.cli import app


def remat_json(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "remat.json"
    result = CliRunner().invoke(app, ["remat", "mlp", *args, "--time-limit", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_max_batch_is_at_least_the_batch_that_fits_without_remat(tmp_path: Path) -> None:
    report = remat_json(tmp_path, "-b", "8", "--budget", "1", "--max-batch")
    found = report["max_batch"]["strategies"]
    assert found["checkpoint-all"]["batch"] >= 8  # the budget is checkpoint-all's peak at batch 8
    assert found["portfolio"]["batch"] >= found["checkpoint-all"]["batch"]
    assert found["portfolio"]["peak_bytes"] <= report["budget_bytes"]


def test_remat_with_profiled_costs_and_workspace(tmp_path: Path) -> None:
    report = remat_json(tmp_path, "-b", "4", "--budget", "1", "--cost", "profile", "--workspace")
    assert report["cost_model"] == "profile" and report["workspace"] is True
    plan = report["strategies"]["portfolio"]
    assert plan["feasible"] and plan["peak_bytes"] <= report["budget_bytes"]
