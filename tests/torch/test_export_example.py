"""The example of the exports runs, and writes what it says."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import memplan
from memplan.torch.export.snapshot import check_snapshot

ROOT = Path(__file__).resolve().parents[2]


def test_export_example_runs(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(memplan.__file__).resolve().parents[1])}
    env.pop("KINETO_LOG_LEVEL", None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "export_tools.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "USDT" not in done.stderr
    for name in ("planned.pickle", "eager.pickle"):
        check_snapshot(pickle.loads((tmp_path / name).read_bytes()))
    assert (tmp_path / "plan.json").stat().st_size > 0 and (tmp_path / "sac_policy.json").stat().st_size > 0
    assert "parameters identical: True" in done.stdout
    assert "torch.compile: loss" in done.stdout
