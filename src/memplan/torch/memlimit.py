"""Run a command in a child process under a hard memory limit, as the operating system enforces it.

On Linux as root the limit is a cgroup made for the child alone and removed after: cgroup v2
(``memory.max``, ``memory.swap.max = 0``; ``memory.peak`` and ``memory.events``' ``oom_kill``
read after) or cgroup v1 (``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes``;
``memory.max_usage_in_bytes`` and ``memory.oom_control``' ``oom_kill``). The group is made
inside this process's own memory cgroup, so nothing outside it is touched. The kernel's OOM
killer ends a child that needs more: :attr:`LimitedRun.oom_killed`.

Where no writable memory cgroup exists (not Linux, not root, a v2 hierarchy without the memory
controller delegated) the helper says so (:attr:`LimitedRun.enforced` is ``False``, and
:attr:`LimitedRun.mechanism` is ``"watched"``) and falls back to watching the resident set of
the child's process tree every few milliseconds, killing it when it passes the limit: a spike
shorter than the polling interval can pass unseen.

    run = run_limited([sys.executable, "train.py"], limit_bytes=2 * 2**30)
    run.outcome        # "fits", "killed (OOM)", "timeout" or "failed (exit 1)"
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

MECHANISMS = ("auto", "cgroup", "watch")
WATCH_INTERVAL_S = 0.02
TAIL_CHARS = 4000
_counter = itertools.count()


class LimitUnavailable(OSError):
    """No memory cgroup can be made here (the reason is the message)."""


@dataclass(frozen=True)
class LimitedRun:
    """What happened to one command run under a memory limit."""

    returncode: int
    limit_bytes: int
    mechanism: str  # "cgroup-v2", "cgroup-v1" or "watched"
    enforced: bool  # the kernel enforced the limit (a cgroup), not a watcher
    oom_killed: bool
    peak_bytes: int | None  # the cgroup's peak charge (memory.peak / max_usage_in_bytes); None when watched
    max_rss_bytes: int | None  # the child's ru_maxrss (largest resident set of it and its waited-for children)
    watched_peak_bytes: int | None  # the largest tree RSS the watcher saw (watched only)
    seconds: float
    timed_out: bool
    stdout: str
    stderr: str
    note: str  # why the limit was not enforced by the kernel, or ""

    @property
    def fits(self) -> bool:
        """It ran to completion with exit status 0."""
        return self.returncode == 0 and not self.oom_killed and not self.timed_out

    @property
    def outcome(self) -> str:
        if self.timed_out:
            return "timeout"
        if self.oom_killed:
            return "killed (OOM)"
        if self.returncode == 0:
            return "fits"
        if self.returncode < 0:
            return f"failed (signal {-self.returncode})"
        return f"failed (exit {self.returncode})"


# ---------------------------------------------------------------- cgroups


@dataclass(frozen=True)
class _Hierarchy:
    version: int
    base: Path  # this process's own memory cgroup directory


PROC_CGROUP = Path("/proc/self/cgroup")
MOUNTINFO = Path("/proc/self/mountinfo")


def mounts(mountinfo: Path = MOUNTINFO) -> list[tuple[str, str, str, str]]:
    """(root, mount point, fstype, super options) of each mount (``/proc/self/mountinfo``)."""
    rows = []
    for line in mountinfo.read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3:
            rows.append((fields[3], fields[4].replace("\\040", " "), tail[0], tail[2]))
    return rows


def own_groups(proc_cgroup: Path = PROC_CGROUP) -> dict[str, str]:
    """Controller (``""`` for the v2 hierarchy) -> this process's cgroup path (``/proc/self/cgroup``)."""
    groups = {}
    for line in proc_cgroup.read_text().splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for name in controllers.split(",") if controllers else [""]:
            groups[name] = path
    return groups


def memory_controller(fstype: str, options: str) -> str | None:
    """The key of :func:`own_groups` a memory-cgroup mount answers to (``"memory"`` for v1,
    ``""`` for v2), or None for any other mount."""
    if fstype == "cgroup" and "memory" in options.split(","):
        return "memory"
    return "" if fstype == "cgroup2" else None


def inside(mount_root: str, path: str) -> str | None:
    """``path`` relative to a mount whose root is ``mount_root``, or None when outside it."""
    if mount_root == "/":
        return path.lstrip("/")
    if path == mount_root or path.startswith(mount_root.rstrip("/") + "/"):
        return path[len(mount_root) :].lstrip("/")
    return None


def _find_hierarchy() -> _Hierarchy:
    """The memory cgroup this process may make children in, or :class:`LimitUnavailable`."""
    if not PROC_CGROUP.exists():
        raise LimitUnavailable("no /proc/self/cgroup: memory cgroups are Linux-only")
    if os.geteuid() != 0:
        raise LimitUnavailable("not root: a memory cgroup cannot be made")
    groups = own_groups()
    reasons = []
    for root, point, fstype, options in mounts():
        if fstype == "cgroup" and "memory" in options.split(",") and "memory" in groups:
            rel = inside(root, groups["memory"])
            if rel is not None and Path(point, rel).is_dir():
                return _Hierarchy(1, Path(point, rel))
            reasons.append(f"v1 memory group {groups['memory']} not under {point}")
        if fstype == "cgroup2" and "" in groups:
            rel = inside(root, groups[""])
            base = Path(point, rel or "")
            controllers = base / "cgroup.controllers"
            if rel is not None and controllers.exists() and "memory" in controllers.read_text().split():
                return _Hierarchy(2, base)
            reasons.append(f"v2 group {groups['']} has no memory controller")
    raise LimitUnavailable("no memory cgroup here" + (f" ({'; '.join(reasons)})" if reasons else ""))


def _write(path: Path, value: str) -> None:
    path.write_text(value)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _read_key(path: Path, key: str) -> int | None:
    """``key N`` from a flat-keyed cgroup file (``memory.events``, ``memory.oom_control``)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


class _Group:
    """One memory cgroup made for one child and removed after."""

    def __init__(self, hierarchy: _Hierarchy, limit_bytes: int) -> None:
        self.version = hierarchy.version
        self.path = hierarchy.base / f"memplan-limit-{os.getpid()}-{next(_counter)}"
        self.path.mkdir()
        try:
            self._set_limit(limit_bytes)
        except OSError:
            self.remove()
            raise

    def _set_limit(self, limit_bytes: int) -> None:
        if self.version == 2:
            if not (self.path / "memory.max").exists():
                _write(self.path.parent / "cgroup.subtree_control", "+memory")
            _write(self.path / "memory.max", str(limit_bytes))
            if (self.path / "memory.swap.max").exists():
                _write(self.path / "memory.swap.max", "0")
            return
        _write(self.path / "memory.limit_in_bytes", str(limit_bytes))
        if (self.path / "memory.memsw.limit_in_bytes").exists():
            _write(self.path / "memory.memsw.limit_in_bytes", str(limit_bytes))  # no swapping past it

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def peak_bytes(self) -> int | None:
        return _read_int(self.path / ("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"))

    def oom_kills(self) -> int:
        events = self.path / ("memory.events" if self.version == 2 else "memory.oom_control")
        return _read_key(events, "oom_kill") or 0

    def remove(self) -> None:
        """Kill what is left in the group (processes this helper started) and remove it."""
        for _ in range(100):
            with contextlib.suppress(OSError):
                for pid in self.procs.read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.05)


def probe() -> tuple[str, str]:
    """``(mechanism, why)``: ``("cgroup-v1", path)``/``("cgroup-v2", path)`` where a limit can
    be enforced here (a group is made and removed to check), else ``("watched", reason)``."""
    try:
        hierarchy = _find_hierarchy()
        _Group(hierarchy, 2**30).remove()
    except OSError as err:
        return "watched", str(err)
    return f"cgroup-v{hierarchy.version}", str(hierarchy.base)


# ---------------------------------------------------------------- the watcher


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (``/proc/PID/task/*/children``)."""
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        seen.append(p)
        for children in Path(f"/proc/{p}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo.extend(int(c) for c in children.read_text().split())
    return seen


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# ---------------------------------------------------------------- running


def _tail(path: Path) -> str:
    text = path.read_text(errors="replace")
    return text[-TAIL_CHARS:]


@contextlib.contextmanager
def _group_or_reason(limit_bytes: int, mechanism: str) -> Iterator[tuple[_Group | None, str]]:
    if mechanism == "watch":
        yield None, "the watcher was asked for (mechanism='watch')"
        return
    try:
        group = _Group(_find_hierarchy(), limit_bytes)
    except OSError as err:
        if mechanism == "cgroup":
            raise LimitUnavailable(f"cannot make a memory cgroup: {err}") from err
        yield None, f"no cgroup limit here ({err}): RSS watched every {WATCH_INTERVAL_S * 1000:.0f} ms instead"
        return
    try:
        yield group, ""
    finally:
        group.remove()


def run_limited(
    command: Sequence[str],
    limit_bytes: int,
    *,
    timeout: float | None = None,
    mechanism: str = "auto",
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
) -> LimitedRun:
    """Run ``command`` in a child process that may use at most ``limit_bytes`` of memory.

    ``mechanism``: ``"auto"`` (a cgroup where possible, else the watcher), ``"cgroup"`` (a
    cgroup or :class:`LimitUnavailable`), ``"watch"`` (the watcher only). The child is killed
    at ``timeout`` seconds. stdout and stderr are kept (their last characters)."""
    if mechanism not in MECHANISMS:
        raise ValueError(f"mechanism must be one of {', '.join(MECHANISMS)}, not {mechanism!r}")
    if limit_bytes <= 0:
        raise ValueError(f"limit_bytes must be positive, not {limit_bytes}")
    with _group_or_reason(limit_bytes, mechanism) as (group, note), tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        with out.open("w") as fo, err.open("w") as fe:
            result = _supervise(command, limit_bytes, group, timeout, fo, fe, env, cwd)
        returncode, rusage, seconds, timed_out, watched_kill, watched_peak = result
        oom = group.oom_kills() > 0 if group is not None else watched_kill
        return LimitedRun(
            returncode=returncode,
            limit_bytes=limit_bytes,
            mechanism=f"cgroup-v{group.version}" if group is not None else "watched",
            enforced=group is not None,
            oom_killed=oom and returncode != 0,
            peak_bytes=group.peak_bytes() if group is not None else None,
            max_rss_bytes=rusage.ru_maxrss * 1024 if rusage is not None else None,
            watched_peak_bytes=None if group is not None else watched_peak,
            seconds=seconds,
            timed_out=timed_out,
            stdout=_tail(out),
            stderr=_tail(err),
            note=note,
        )


def _supervise(command, limit_bytes, group, timeout, stdout, stderr, env, cwd):
    """Start the child (inside ``group`` before it execs), wait, watch when there is no group."""
    procs = str(group.procs) if group is not None else None

    def join_group() -> None:  # runs in the child between fork and exec
        if procs is not None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

    start = time.perf_counter()
    child = subprocess.Popen(
        list(command), stdout=stdout, stderr=stderr, preexec_fn=join_group, env=env, cwd=cwd, start_new_session=True
    )
    timed_out = watched_kill = False
    watched_peak = 0
    while True:
        pid, status, rusage = os.wait4(child.pid, os.WNOHANG)
        if pid:
            break
        if group is None:
            pids = _tree(child.pid)
            rss = sum(_rss(p) for p in pids)
            watched_peak = max(watched_peak, rss)
            if rss > limit_bytes:
                watched_kill = True
                _kill(pids)
        if timeout is not None and time.perf_counter() - start > timeout:
            timed_out = True
            _kill(_tree(child.pid))
        time.sleep(WATCH_INTERVAL_S if group is None else 0.05)
    child.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    return child.returncode, rusage, time.perf_counter() - start, timed_out, watched_kill, watched_peak


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
