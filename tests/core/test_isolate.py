"""Solving in a forked child (memplan.isolate): the answer, the error and a dead child come
back as they would in-process, and the child's allocations stay out of this process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import types

import pytest

from memplan.errors import MemplanError
from memplan.isolate import IN_PROCESS_ENV, cuda_started, forking_enabled, in_child

pytestmark = pytest.mark.skipif(not forking_enabled(), reason="solving in a child forks on Linux only")


def test_the_answer_comes_from_another_process() -> None:
    pid, value = in_child(lambda x: (os.getpid(), x * 2), 21)
    assert pid != os.getpid()
    assert value == 42


def test_the_childs_exception_is_raised_here_with_its_type() -> None:
    def fails() -> None:
        raise ValueError("no placement within 5 bytes")

    with pytest.raises(ValueError, match="no placement within 5 bytes"):
        in_child(fails)


def test_a_child_that_dies_without_an_answer_is_one_clear_error() -> None:
    with pytest.raises(MemplanError, match=f"killed by signal {int(signal.SIGKILL)}.*{IN_PROCESS_ENV}=1"):
        in_child(lambda: os.kill(os.getpid(), signal.SIGKILL))


def test_an_answer_that_cannot_be_pickled_is_one_clear_error() -> None:
    with pytest.raises(MemplanError, match="could not be sent back"):
        in_child(lambda: lambda: None)


_KEPT: list[list[int]] = []


def _keeps_objects() -> int:
    """What a solver's caches do: objects that outlive the call."""
    _KEPT.extend([k] for k in range(10_000))
    return len(_KEPT)


def test_what_the_child_keeps_stays_in_the_child(monkeypatch: pytest.MonkeyPatch) -> None:
    _KEPT.clear()
    assert in_child(_keeps_objects) == 10_000
    assert _KEPT == []
    monkeypatch.setenv(IN_PROCESS_ENV, "1")  # the oracle: in this process they stay
    assert in_child(_keeps_objects) == 10_000
    assert len(_KEPT) == 10_000
    _KEPT.clear()


def test_the_environment_variable_keeps_the_solve_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(IN_PROCESS_ENV, "1")
    assert not forking_enabled()
    assert in_child(os.getpid) == os.getpid()


def test_a_process_that_started_cuda_solves_in_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fork`` is unsupported once CUDA is initialised: then the solve stays in this process.
    A stand-in module plays torch (this machine has no GPU)."""
    initialised = [False]
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: initialised[0]))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    assert forking_enabled() and in_child(os.getpid) != os.getpid()
    initialised[0] = True
    assert cuda_started() and not forking_enabled()
    assert in_child(os.getpid) == os.getpid()


def test_a_plan_that_needs_no_cp_sat_never_imports_or_tools() -> None:
    # the solver child of a first step pays OR-Tools' import (about 0.25 s) only when a CP-SAT
    # stage runs: a small chain's order is proven by the ideal search, its placement by the bound
    code = (
        "import sys\n"
        "from memplan.graph.generate import random_dag\n"
        "from memplan.pipeline import make_plan\n"
        "plan = make_plan(random_dag(3, 12), time_limit_seconds=5)\n"
        "assert plan.report['schedule']['status'] == 'optimal', plan.report['schedule']\n"
        "assert plan.report['placement']['status'] == 'optimal', plan.report['placement']\n"
        "print('ortools' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
