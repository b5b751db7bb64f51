"""Small C kernels of the core, compiled on first use with the system's C compiler and cached.

The exact searches of placement (``memplan/placement/csrc``) and reordering
(``memplan/schedule/csrc``) have C versions that follow their Python reference step for step.
Each source is compiled once (``$CC``, ``cc``, ``gcc`` or ``clang``, ``-O2``) into
``~/.cache/memplan`` (or ``$MEMPLAN_CACHE_DIR``), keyed by the source's hash; without a
compiler :func:`build` raises :class:`CompilerUnavailable` and callers run the Python version.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from memplan.errors import MemplanError


class CompilerUnavailable(MemplanError):
    """A C kernel could not be built or loaded here."""


def cache_dir() -> Path:
    root = os.environ.get("MEMPLAN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "memplan"
    )
    return Path(root)


def build(source: Path) -> Path:
    """The shared library of ``source`` (a C99 file), built once and cached by its hash."""
    text = source.read_bytes()
    target = cache_dir() / f"{source.stem}-{hashlib.sha256(text).hexdigest()[:16]}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise CompilerUnavailable(f"no C compiler found (set CC or install gcc) to build {source.name}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        command = [compiler, "-O2", "-std=c99", "-shared", "-fPIC", str(source), "-o", str(partial)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise CompilerUnavailable(f"building {source.name} failed: {err}") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise CompilerUnavailable(f"building {source.name} failed: {last}")
        partial.replace(target)
    return target


def on_deep_stack(call: Callable[[], int], stack_bytes: int, name: str) -> int:
    """``call()`` (a C search that recurses once per level and releases the GIL) in a thread
    with ``stack_bytes`` of stack more than the default 16 MiB; raises
    :class:`CompilerUnavailable` if the thread died without a result."""
    result: list[int] = []
    old = threading.stack_size()
    threading.stack_size(16 * 2**20 + stack_bytes)
    try:
        worker = threading.Thread(target=lambda: result.append(call()), name=name)
        worker.start()
    finally:
        threading.stack_size(old)
    worker.join()
    if not result:
        raise CompilerUnavailable(f"the {name} thread failed")
    return result[0]
