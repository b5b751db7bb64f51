"""bench/fit.py: its search for the largest batch, its limits and its tables (fast); the whole
bench on its --quick model under a real limit (slow: minutes on the shared CI machine)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20


def _bench():
    spec = importlib.util.spec_from_file_location("bench_fit", ROOT / "bench" / "fit.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_fit"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


fit = _bench()


@pytest.mark.parametrize("start", [1, 3, 16, 64])
@pytest.mark.parametrize("cap", [1, 40, 256])
def test_largest_batch_finds_the_threshold(start: int, cap: int) -> None:
    """Against the oracle min(threshold, cap), every threshold; each batch probed at most once."""
    for threshold in range(0, 300):
        probed: list[int] = []

        def fits(batch: int, threshold: int = threshold, probed: list[int] = probed) -> bool:
            assert 1 <= batch <= cap
            probed.append(batch)
            return batch <= threshold

        assert fit.largest_batch(fits, start, cap) == min(threshold, cap)
        assert len(probed) == len(set(probed))


@pytest.mark.parametrize("grain", [2, 4])
@pytest.mark.parametrize("start", [1, 16])
def test_coarse_largest_batch_brackets_the_threshold(start: int, grain: int) -> None:
    """With a grain: the answer fits, a failing probe lies at most ``grain`` above it (or it is the
    oracle), and it never needs more probes than the exact search."""
    cap, saved = 40, 0
    for threshold in range(0, 60):
        coarse: list[int] = []
        exact: list[int] = []
        answer = fit.largest_batch(lambda b, p=coarse, t=threshold: p.append(b) or b <= t, start, cap, grain)
        fit.largest_batch(lambda b, p=exact, t=threshold: p.append(b) or b <= t, start, cap)
        best = min(threshold, cap)
        assert answer <= best
        assert answer == best or any(answer < b <= answer + grain and b > threshold for b in coarse)
        assert len(coarse) <= len(exact) and len(coarse) == len(set(coarse))
        saved += len(exact) - len(coarse)
    assert saved > 0, "the grain saved no probe"


def test_limits_are_fractions_or_bytes() -> None:
    assert fit.parse_limit("0.6") == 0.6
    assert fit.parse_limit("2600MiB") == 2600 * MIB
    assert fit.parse_limit("2.5GiB") == int(2.5 * 2**30)
    assert fit.limit_bytes(0.5, 1000) == 500
    assert fit.limit_bytes(2600 * MIB, 1000) == 2600 * MIB


def test_table_rows_say_what_happened() -> None:
    """A killed try names the phase it died in; a fitting one its ratio to eager's step time."""
    killed = {
        "contender": "memplan",
        "batch": 16,
        "limit_bytes": 2600 * MIB,
        "outcome": "killed (OOM)",
        "cgroup_peak_bytes": 2600 * MIB,
        "last_phase": "step 1",
        "setting": "memory_budget=1.8GiB",
    }
    fits = {
        "contender": "checkpoint",
        "batch": 16,
        "limit_bytes": 2600 * MIB,
        "outcome": "fits",
        "step_seconds": [9.0, 2.0, 3.0, 4.0],
        "flops": 4.0,
        "losses": [1.0, 2.0],
    }
    fit.compare(fits, {"flops": 3.0, "losses": [1.0, 2.5]})
    assert fits["max_abs_diff_loss"] == 0.5 and abs(fits["overhead"] - 1 / 3) < 1e-12
    line = fit._row(killed, 2.0)
    assert "**killed (OOM)**" in line and "ended during: step 1" in line and "| 2600 |" in line
    assert "| - | 3.00 | 1.50 |" in fit._row(fits, 2.0)  # median of the steps after the first; / eager's


@pytest.mark.slow
def test_quick_bench_runs_under_a_real_limit(tmp_path: Path) -> None:
    """--quick end to end: a reference, then eager and memplan each in its own limited process."""
    out = tmp_path / "fit.md"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "fit.py"),
            "--quick",
            "--contenders",
            "eager,memplan-fit",
            "--steps",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.with_suffix(".json").read_text())
    (entry,) = report["models"]
    assert entry["reference"]["outcome"] == "fits"
    rows = {r["contender"]: r for r in entry["rows"]}
    assert set(rows) == {"eager", "memplan-fit"}
    limit = rows["eager"]["limit_bytes"]
    assert rows["eager"]["outcome"] == "killed (OOM)"  # the limit is below eager's peak
    if report["mechanism"].startswith("cgroup"):
        assert rows["eager"]["cgroup_peak_bytes"] <= limit
    if rows["memplan-fit"]["outcome"] == "fits":
        assert rows["memplan-fit"]["max_abs_diff_params"] == 0.0 and rows["memplan-fit"]["max_abs_diff_loss"] == 0.0
    assert out.read_text().startswith("# Fit under a hard memory limit")
