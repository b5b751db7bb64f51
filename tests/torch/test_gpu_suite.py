"""bench/gpu_suite.py, the one-shot GPU run (issue 34), rehearsed on the CPU: its dry run goes
through every part on tiny models and writes the JSON issue 34 asks for; a job that dies or
hangs costs that job only."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "bench" / "gpu_suite.py"


def _load_suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", SUITE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_suite"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_suite = _load_suite()


def _check_row(row: dict) -> None:
    """The row shape issue 34 fixes, with its types."""
    missing = [k for k in gpu_suite.REQUIRED_KEYS if k not in row]
    assert not missing, missing
    assert isinstance(row["model"], str) and isinstance(row["batch"], int)
    for key in ("eager_reserved_bytes", "eager_allocated_bytes", "memplan_reserved_bytes", "memplan_allocated_bytes"):
        assert row[key] is None or (isinstance(row[key], int) and row[key] >= 0), (key, row[key])
    for key in ("time_ratio", "max_abs_diff"):
        assert row[key] is None or (isinstance(row[key], (int, float)) and row[key] >= 0), (key, row[key])
    assert row["budget_bytes"] is None or (isinstance(row["budget_bytes"], int) and row["budget_bytes"] > 0)
    assert row["held"] is None or isinstance(row["held"], bool)
    if row["budget_bytes"] is None:
        assert row["held"] is None, "held without a budget"


@pytest.mark.slow  # a rehearsal of the bench (27 s): make test-all, and before device time (-m "")
def test_gpu_suite_dry_run(tmp_path: Path) -> None:
    """Every part of the suite on the CPU, in a process of its own (as on the device: PYTHONPATH=src,
    nothing from the wheelhouse), then the JSON checked: the issue's shape, and the oracles the CPU
    can give (memplan's planned steps bit-identical to eager's, a budget held, the crash check
    passed, eager over the simulated card where memplan fits)."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    command = [sys.executable, str(SUITE), "--dry-run", "--out", str(out), "--wheelhouse", str(tmp_path / "none")]
    done = subprocess.run(
        [*command, "--work", str(tmp_path / "work")], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == {"gpu_suite.json", "gpu_suite.md", "gpu_suite.log"}
    doc = json.loads((out / "gpu_suite.json").read_text())
    assert doc["device"] == "cpu (dry run)" and doc["torch"].startswith(("2.", "3."))
    assert isinstance(doc["rows"], list) and doc["skipped"] == []
    for row in doc["rows"]:
        _check_row(row)
    zoo = {(r["model"], r["batch"]): r for r in doc["rows"] if r["part"] == "zoo"}
    assert set(zoo) == {(m, b) for m in gpu_suite.DRY["zoo"] for b in (1, 4)}
    for row in zoo.values():
        assert row["max_abs_diff"] == 0 and row["bit_identical"] is True, row
        assert row["memplan_reserved_bytes"] > 0 and row["time_ratio"] > 0 and row["held"] is None
    budget = [r for r in doc["rows"] if r["part"] == "budget"]
    assert [r["model"] for r in budget] == list(gpu_suite.DRY["budget"])
    for row in budget:  # held and bit-identical, or refused in one line
        assert (row["held"] is True and row["bit_identical"] is True) or "InfeasibleBudget" in (row["note"] or ""), row
    assert any(r["held"] for r in budget), "no budget row held on the CPU"
    (fit,) = [r for r in doc["rows"] if r["part"] == "fit"]
    assert fit["eager_fits"] is False and fit["held"] is True and fit["memplan_reserved_bytes"] > 0, fit
    assert doc["crash_check"]["ok"] and doc["crash_check"]["bit_identical"] is True, doc["crash_check"]
    planned = doc["crash_check"]["planned_allocator"]  # the same with the planned allocator
    assert planned["ok"] and planned["bit_identical"] is True and planned["allocator"] == "replay", planned
    (compiled,) = doc["torch_compile"]
    assert compiled["step_s"] > 0 and compiled["error"] is None and compiled["max_abs_diff"] is not None
    text = (out / "gpu_suite.md").read_text()
    assert "## The zoo" in text and "## Crash check" in text and "tiny-gpt2" in text


def _suite(tmp_path: Path):
    args = gpu_suite.parse_args(["--dry-run", "--out", str(tmp_path), "--work", str(tmp_path / "work")])
    args.setup_s = 0.0
    return gpu_suite.Suite(args, {})


def _dies(spec: dict, emit) -> None:
    emit({"stage": "before the crash"})
    os.kill(os.getpid(), signal.SIGSEGV)


def _hangs(spec: dict, emit) -> None:
    emit({"stage": "hanging"})
    time.sleep(600)


def test_a_job_that_crashes_or_hangs_costs_only_that_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(gpu_suite.JOBS, "die", _dies)
    monkeypatch.setitem(gpu_suite.JOBS, "hang", _hangs)
    suite = _suite(tmp_path)
    crashed = suite.run_job({"kind": "die"}, 60, "die")
    assert crashed.rc == -signal.SIGSEGV and not crashed.timed_out
    assert crashed.results == [{"stage": "before the crash"}]
    assert "Fatal Python error" in crashed.tail  # faulthandler's report reaches the job's log
    start = time.monotonic()
    hung = suite.run_job({"kind": "hang"}, 1.5, "hang")
    assert hung.timed_out and hung.rc == -signal.SIGKILL and time.monotonic() - start < 30
    assert hung.results == [{"stage": "hanging"}]
    record = gpu_suite._crash_record(crashed)
    assert record["ok"] is False and record["last_stage"] == "before the crash" and record["stderr_tail"]


def test_a_job_past_the_budget_is_skipped_and_listed(tmp_path: Path) -> None:
    suite = _suite(tmp_path)
    assert suite.admit("small", 1.0, "zoo")
    assert not suite.admit("too long", 10 * suite.args.budget_s, "zoo")
    assert suite.doc["skipped"][-1]["what"] == "too long"
    suite.account("zoo", 10.0, 30.0)  # the zoo's jobs took 3x their estimates: so will the next
    assert suite.calibration("zoo-rest") == 3.0 and suite.calibration("fit") == 1.0


def test_rows_say_held_only_with_a_budget() -> None:
    cuda = {"reserved_bytes": 900, "allocated_bytes": 800, "counters": "planned", "step_s": 2.0}
    eager = {"reserved_bytes": 1200, "allocated_bytes": 1000, "step_s": 1.0}
    row = gpu_suite.make_row("zoo", "m", 32, eager, cuda)
    _check_row(row)
    assert row["held"] is None and row["time_ratio"] == 2.0 and row["reserved_below_eager_allocated"] is True
    over = gpu_suite.make_row("budget", "m", 32, eager, {**cuda, "budget": {"budget_bytes": 899}})
    within = gpu_suite.make_row("budget", "m", 32, eager, {**cuda, "budget": {"budget_bytes": 900}})
    assert over["held"] is False and within["held"] is True
    refused = gpu_suite.make_row("budget", "m", 32, eager, {"refused": "InfeasibleBudget: no plan (proven)"})
    _check_row(refused)
    assert refused["held"] is None and "proven" in refused["note"]


def test_the_wheelhouse_is_read_by_name_and_a_missing_module_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert gpu_suite.wheel_distribution(Path("absl_py-2.5.1-py3-none-any.whl")) == ("absl-py", "2.5.1")
    name = "ortools-9.15.6755-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl"
    assert gpu_suite.wheel_distribution(Path(name)) == ("ortools", "9.15.6755")
    missing = "no_such_module_memplan_needs"
    monkeypatch.setattr(gpu_suite, "NEEDED_MODULES", ("numpy", missing))
    messages = []
    for carried in ((missing,), ()):  # one the wheelhouse should hold, then one it never holds (torch)
        monkeypatch.setattr(gpu_suite, "CARRIED_MODULES", carried)
        with pytest.raises(SystemExit) as raised:
            gpu_suite.ensure_dependencies(tmp_path / "no-wheels", str(tmp_path / "site"))
        messages.append(str(raised.value))
        assert "\n" not in messages[-1] and missing in messages[-1]
    assert "pip download" in messages[0] and "carry .whl" in messages[0]
    assert "pip" not in messages[1] and "python3" in messages[1]


@pytest.mark.slow
def test_spawned_jobs_probe_like_forked_ones(tmp_path: Path) -> None:
    """``--spawn`` (a new interpreter per job, the fallback when a fork cannot start CUDA) reads
    the same probe as a forked job."""
    suite = _suite(tmp_path)
    forked = suite.run_job({"kind": "probe"}, 120, "probe")
    suite.spawn = True
    spawned = suite.run_job({"kind": "probe"}, 300, "probe (spawned)")
    assert forked.rc == spawned.rc == 0, spawned.tail
    assert forked.results == spawned.results and forked.results[0]["device"] == "cpu (dry run)"


def test_merged_calls_keep_measured_rows_and_name_their_call() -> None:
    """``--merge``: a later call's measured row replaces a crashed one, never the other way round."""
    recorded = sorted((ROOT / "bench" / "results" / "gpu").glob("*.json"))
    assert len(recorded) >= 2, "the recorded H100 calls are missing"
    docs = [json.loads(p.read_text()) for p in recorded]
    merged = gpu_suite.merge_runs(docs)
    keys = [(r["part"], r["model"], r["batch"]) for r in merged["rows"]]
    assert len(keys) == len(set(keys))
    every = {(r["part"], r["model"], r["batch"]) for d in docs for r in d["rows"]}
    assert set(keys) == every
    for row in merged["rows"]:
        _check_row(row)
        measured_anywhere = [
            n
            for n, d in enumerate(docs, 1)
            for r in d["rows"]
            if (r["part"], r["model"], r["batch"]) == (row["part"], row["model"], row["batch"])
            and r["memplan_reserved_bytes"] is not None
        ]
        assert (row["memplan_reserved_bytes"] is not None) == bool(measured_anywhere)
        if measured_anywhere:
            assert row["run"] == measured_anywhere[-1]
    text = gpu_suite.markdown(merged)
    assert all(f"({n}) " in text for n in range(1, len(docs) + 1))
    reversed_docs = gpu_suite.merge_runs(docs[::-1])
    assert {k for k, r in zip(keys, merged["rows"], strict=True) if r["memplan_reserved_bytes"] is not None} == {
        (r["part"], r["model"], r["batch"]) for r in reversed_docs["rows"] if r["memplan_reserved_bytes"] is not None
    }


def test_a_job_stopped_by_strict_determinism_is_recognised() -> None:
    """Jobs run with ``use_deterministic_algorithms(True)``; one stopped by an op without a
    deterministic kernel (PyTorch's own message) is run again with warn_only, others are not."""
    stopped = "RuntimeError: nll_loss2d_forward_out_cuda_template does not have a deterministic implementation"
    assert gpu_suite._needs_warn_only(gpu_suite.Outcome(1, [{"error": stopped}], "", 1.0, False), "")
    assert gpu_suite._needs_warn_only(gpu_suite.Outcome(1, [], "", 1.0, False), "Traceback ...\n" + stopped)
    crashed = gpu_suite.Outcome(-11, [], "Fatal Python error: Segmentation fault", 1.0, False)
    assert not gpu_suite._needs_warn_only(crashed, "Fatal Python error: Segmentation fault")
    row = gpu_suite.make_row("zoo", "unet", 32, {"step_s": 1.0, "determinism": "warn_only"}, {"step_s": 1.0})
    assert "warn_only" in row["note"]
