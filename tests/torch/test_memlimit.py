"""The memory-limit helper: a child allocating past the limit is killed and reported so, one
within it fits; the kernel's cgroup where this machine has one, and the RSS watcher always."""

from __future__ import annotations

import sys

import pytest

from memplan.torch import memlimit
from memplan.torch.memlimit import LimitUnavailable, run_limited

MIB = 2**20
LIMIT = 150 * MIB


def _allocating(mib: int) -> list[str]:
    """A Python child that touches ``mib`` MiB (bytes written, so resident) and holds them a moment."""
    return [sys.executable, "-c", f"import time; b = b'x' * ({mib} << 20); time.sleep(0.5); print('done')"]


def _cgroup_or_skip_reason() -> str:
    mechanism, why = memlimit.probe()
    return "" if mechanism.startswith("cgroup") else why


@pytest.mark.parametrize("mechanism", ["auto", "watch"])
def test_child_past_the_limit_is_killed(mechanism: str) -> None:
    run = run_limited(_allocating(400), LIMIT, mechanism=mechanism, timeout=60)
    assert run.oom_killed and not run.fits
    assert run.outcome == "killed (OOM)"
    assert run.returncode == -9  # SIGKILL, from the kernel's OOM killer or from the watcher
    assert "done" not in run.stdout
    if run.enforced:
        assert run.peak_bytes is not None and run.peak_bytes <= LIMIT
    else:
        assert run.watched_peak_bytes is not None and run.watched_peak_bytes > LIMIT


@pytest.mark.parametrize("mechanism", ["auto", "watch"])
def test_child_within_the_limit_fits(mechanism: str) -> None:
    run = run_limited(_allocating(40), LIMIT, mechanism=mechanism, timeout=60)
    assert run.fits and run.outcome == "fits" and not run.oom_killed
    assert "done" in run.stdout
    assert run.max_rss_bytes is not None and run.max_rss_bytes >= 40 * MIB
    peak = run.peak_bytes if run.enforced else run.watched_peak_bytes
    assert peak is not None and 40 * MIB <= peak <= LIMIT


def test_auto_uses_the_cgroup_where_one_can_be_made() -> None:
    """On this machine (Linux, root, a memory cgroup) the kernel enforces the limit; elsewhere
    the run says it was only watched and why."""
    run = run_limited(_allocating(1), LIMIT, timeout=60)
    reason = _cgroup_or_skip_reason()
    assert run.enforced == (reason == "")
    assert run.mechanism.startswith("cgroup") if run.enforced else run.note


def test_the_group_is_removed_after() -> None:
    if _cgroup_or_skip_reason():
        with pytest.raises(LimitUnavailable):
            run_limited(_allocating(1), LIMIT, mechanism="cgroup")
        return
    base = memlimit._find_hierarchy().base
    before = {p.name for p in base.iterdir() if p.name.startswith("memplan-limit-")}
    run_limited(_allocating(400), LIMIT, mechanism="cgroup", timeout=60)
    after = {p.name for p in base.iterdir() if p.name.startswith("memplan-limit-")}
    assert after == before


def test_timeout_kills_the_child() -> None:
    run = run_limited([sys.executable, "-c", "import time; time.sleep(30)"], LIMIT, timeout=0.5)
    assert run.timed_out and run.outcome == "timeout" and not run.oom_killed
    assert run.seconds < 20


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="mechanism"):
        run_limited(["true"], LIMIT, mechanism="ulimit")
    with pytest.raises(ValueError, match="positive"):
        run_limited(["true"], 0)
