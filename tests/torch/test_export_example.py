"""The example of the exports runs, writes what it says, and writes it where it says: run as the
README shows (no folder given), into a fresh temporary folder it prints, nothing into the
current folder."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import memplan
from memplan.torch.export.snapshot import check_snapshot

ROOT = Path(__file__).resolve().parents[2]


def test_export_example_runs_and_writes_only_to_a_temporary_folder(tmp_path: Path) -> None:
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(memplan.__file__).resolve().parents[1]), "TMPDIR": str(tmp)}
    env.pop("KINETO_LOG_LEVEL", None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "export_tools.py")],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "USDT" not in done.stderr
    assert list(cwd.iterdir()) == []  # nothing written where the user ran it
    written = re.search(r"^writing to (.+)$", done.stdout, re.MULTILINE)
    assert written is not None, done.stdout
    out = Path(written.group(1))
    assert out.parent == tmp and out.name.startswith("memplan-exports-")
    for name in ("planned.pickle", "eager.pickle"):
        check_snapshot(pickle.loads((out / name).read_bytes()))
    assert (out / "plan.json").stat().st_size > 0 and (out / "sac_policy.json").stat().st_size > 0
    assert "parameters identical: True" in done.stdout
    assert "torch.compile: loss" in done.stdout
