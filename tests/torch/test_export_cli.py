"""The command line: ``--quiet`` on every command, no profiler lines on stderr, progress only
where it belongs, and the export flags."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import typer
from typer.testing import CliRunner

from memplan.cli import app
from memplan.commands import console as console_module
from memplan.graph.generate import random_dag
from memplan.graph.io import write_graph_json
from memplan.torch.export.snapshot import check_snapshot

PROFILE_SNIPPET = "import torch\n{setup}\nprofile(lambda: torch.ones(1000) * 2)\n"


def test_every_command_takes_quiet() -> None:
    group = typer.main.get_command(app)
    missing = [name for name, cmd in group.commands.items() if not any("--quiet" in p.opts for p in cmd.params)]
    assert not missing and len(group.commands) >= 8


def test_quiet_prints_nothing_and_still_writes_the_results(tmp_path: Path) -> None:
    graph = tmp_path / "g.json"
    write_graph_json(random_dag(3, 40), graph)
    out = {name: tmp_path / name for name in ("r.json", "t.json", "s.pickle")}
    args = ["optimize", str(graph), "--time-limit", "1", "--quiet", "--json", str(out["r.json"])]
    result = CliRunner().invoke(app, [*args, "--trace", str(out["t.json"]), "--snapshot", str(out["s.pickle"])])
    assert result.exit_code == 0, result.output
    assert result.output == ""
    report = json.loads(out["r.json"].read_text())
    snapshot = pickle.loads(out["s.pickle"].read_bytes())
    assert check_snapshot(snapshot)["peak_allocated_bytes"] == report["optimized_order_peak_bytes"]
    assert json.loads(out["t.json"].read_text())["otherData"]["peak_bytes"] == report["optimized_order_peak_bytes"]
    loud = CliRunner().invoke(app, ["optimize", str(graph), "--time-limit", "1"])
    assert loud.exit_code == 0 and "optimised order" in loud.output
    assert CliRunner().invoke(app, ["models", "--quiet"]).output == ""


def _stderr_of(setup: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    code = PROFILE_SNIPPET.format(setup=setup)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_no_usdt_lines_from_memplans_profiling() -> None:
    raw = (
        "from torch.profiler import profile as p, ProfilerActivity as A\n"
        "def profile(fn):\n"
        "    with p(activities=[A.CPU], profile_memory=True):\n"
        "        fn()"
    )
    assert "USDT" in _stderr_of(raw)  # what kineto prints by itself: the test can fail
    assert "USDT" not in _stderr_of("from memplan.torch.measure import allocator_peak_bytes as profile")


def test_progress_shows_only_for_long_stages(monkeypatch) -> None:
    monkeypatch.setattr(console_module, "PROGRESS_DELAY_SECONDS", 0.05)
    quick = console_module._DelayedProgress("quick", None)
    quick.timer.start()
    quick.close()
    assert not quick.started
    slow = console_module._DelayedProgress("slow", 3)
    slow.timer.start()
    time.sleep(0.3)
    slow.advance()
    slow.close()
    assert slow.started and slow.progress.tasks[0].completed == 1
    console_module.set_quiet(True)
    try:
        with console_module.progress("anything") as shown:
            assert isinstance(shown, console_module._Silent)
    finally:
        console_module.set_quiet(False)


def test_remat_writes_a_sac_policy(tmp_path: Path) -> None:
    policy = tmp_path / "policy.json"
    args = ["remat", "mlp", "-b", "1024", "--budget", "0.9", "--strategy", "linearized-greedy", "--time-limit", "1"]
    result = CliRunner().invoke(app, [*args, "--sac-policy", str(policy), "--quiet"])
    assert result.exit_code == 0, result.output
    data = json.loads(policy.read_text())
    assert data["format"] == "memplan-sac-policy" and data["meta"]["model"] == "mlp"
    assert any(op["save"] for op in data["ops"]) and any(not op["save"] for op in data["ops"])
    bad = CliRunner().invoke(app, [*args, "--sac-measure"])
    assert bad.exit_code != 0
