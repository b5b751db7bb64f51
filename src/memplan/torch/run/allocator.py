"""Profile-guided allocation on the CPU (Sekiyama et al. 3-4): record the alloc/free sequence
of one step, solve the offsets of every allocation in one arena, and serve the same
allocations of later steps at their planned offsets.

The allocator itself is a small C++ library (``csrc/planned_allocator.cpp``) installed in front
of PyTorch's CPU allocator; it is compiled on first use with the system's C++ compiler against
the installed torch's headers and cached. Without a compiler, :func:`load` raises
:class:`AllocatorUnavailable` and callers fall back to arena views (``memplan.torch.run.interpreter``).
"""

from __future__ import annotations

import bisect
import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import sysconfig
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from memplan.errors import MemplanError

SOURCE = Path(__file__).parent / "csrc" / "planned_allocator.cpp"
ALIGNMENT_BYTES = 64  # PyTorch's CPU allocator aligns to 64 bytes too
_I64 = ctypes.c_int64
_P64 = ctypes.POINTER(ctypes.c_int64)


class AllocatorUnavailable(MemplanError):
    """The planned CPU allocator could not be built or installed here."""


@dataclass(frozen=True)
class AllocationTrace:
    """The allocations of one recorded step, in request order: ``sizes[k]`` bytes, alive over
    ``[alloc_at[k], free_at[k])`` in event time; ``free_at[k] is None`` when it outlived the
    step (the result, new optimizer state), which then never goes to the arena."""

    sizes: tuple[int, ...]
    alloc_at: tuple[int, ...]
    free_at: tuple[int | None, ...]

    @property
    def num_allocations(self) -> int:
        return len(self.sizes)

    def peak_live_bytes(self) -> int:
        """The most bytes the step's freed allocations held at once (aligned sizes)."""
        deltas: list[tuple[int, int]] = []
        for size, start, end in zip(self.sizes, self.alloc_at, self.free_at, strict=True):
            if end is not None:
                deltas += [(start, aligned(size)), (end, -aligned(size))]
        live = peak = 0
        for _, delta in sorted(deltas, key=lambda d: (d[0], d[1])):
            live += delta
            peak = max(peak, live)
        return peak


@dataclass(frozen=True)
class ReplayStats:
    """What one replayed step did."""

    served: int
    served_bytes: int
    fallback: int
    fallback_bytes: int
    blocked: int  # served by the base allocator because a planned free had not happened yet
    diverged_at: int | None  # first allocation whose size differed from the recording
    allocations: int
    arena_alive_after: int  # arena allocations that outlived the step (must be 0)


def aligned(size: int) -> int:
    return -(-size // ALIGNMENT_BYTES) * ALIGNMENT_BYTES


def cache_dir() -> Path:
    root = os.environ.get("MEMPLAN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "memplan"
    )
    return Path(root)


@cache
def load() -> ctypes.CDLL:
    """Build (once, cached by source and torch version) and load the allocator library, and
    install it as PyTorch's CPU allocator. Raises :class:`AllocatorUnavailable`."""
    # OR-Tools' native module crashes when it is first imported after the allocator is
    # installed (a segfault while loading it): load the placement solvers, which replay needs
    # anyway, first
    import memplan.placement  # noqa: F401

    library = _build()
    lib = ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    _declare(lib)
    if not lib.mp_install():
        raise AllocatorUnavailable("PyTorch's CPU allocator could not be replaced (another one is installed)")
    return lib


def available() -> bool:
    try:
        load()
    except AllocatorUnavailable:
        return False
    return True


def _build() -> Path:
    torch_dir = Path(torch.__file__).parent
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + torch.__version__.encode() + str(torch_dir).encode()).hexdigest()[:16]
    target = cache_dir() / f"planned_allocator-{key}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise AllocatorUnavailable("no C++ compiler found (set CXX or install g++) to build the planned allocator")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        command = [
            compiler,
            "-O2",
            "-std=c++17",
            "-shared",
            "-fPIC",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-I{torch_dir / 'include'}",
            f"-I{sysconfig.get_paths()['include']}",
            str(SOURCE),
            f"-L{torch_dir / 'lib'}",
            "-lc10",
            f"-Wl,-rpath,{torch_dir / 'lib'}",
            "-o",
            str(partial),
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise AllocatorUnavailable(f"building the planned allocator failed: {last}")
        partial.replace(target)
    return target


def _declare(lib: ctypes.CDLL) -> None:
    lib.mp_install.restype = ctypes.c_int
    lib.mp_installed.restype = ctypes.c_int
    lib.mp_begin_record.restype = None
    lib.mp_end_record.restype = _I64
    lib.mp_record_num_allocations.restype = _I64
    lib.mp_record_copy.argtypes = [_P64, _P64]
    lib.mp_begin_replay.restype = ctypes.c_int
    lib.mp_begin_replay.argtypes = [ctypes.c_void_p, _I64, _I64, _P64, _P64, _P64, _I64, _P64]
    lib.mp_end_replay.argtypes = [_P64]


def begin_record() -> None:
    load().mp_begin_record()


def end_record() -> AllocationTrace:
    """Stop recording and return the trace of the allocations made since :func:`begin_record`."""
    lib = load()
    num_events = lib.mp_end_record()
    num_allocations = lib.mp_record_num_allocations()
    sizes = (ctypes.c_int64 * max(num_allocations, 1))()
    events = (ctypes.c_int64 * max(num_events, 1))()
    lib.mp_record_copy(sizes, events)
    alloc_at: list[int] = [0] * num_allocations
    free_at: list[int | None] = [None] * num_allocations
    for time, event in enumerate(events[:num_events]):
        if event >= 0:
            alloc_at[event] = time
        else:
            free_at[-event - 1] = time
    return AllocationTrace(tuple(sizes[:num_allocations]), tuple(alloc_at), tuple(free_at))


@dataclass(frozen=True)
class ReplayPlan:
    """Planned offsets of a trace's allocations (-1: base allocator) and, for the safety check,
    the arena allocations in planned free order and how many of them precede each allocation."""

    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    need: tuple[int, ...]
    free_order: tuple[int, ...]
    arena_bytes: int


def replay_plan(trace: AllocationTrace, offsets: dict[int, int], arena_bytes: int) -> ReplayPlan:
    """The arrays the allocator replays; ``offsets`` maps allocation index -> arena offset."""
    freed = sorted((trace.free_at[k], k) for k in offsets)
    free_order = tuple(k for _, k in freed)
    free_times = [t for t, _ in freed]
    need = []
    for k in range(trace.num_allocations):
        need.append(_count_before(free_times, trace.alloc_at[k]) if k in offsets else 0)
    return ReplayPlan(
        trace.sizes,
        tuple(offsets.get(k, -1) for k in range(trace.num_allocations)),
        tuple(need),
        free_order,
        arena_bytes,
    )


def _count_before(sorted_times: list[int], time: int) -> int:
    return bisect.bisect_left(sorted_times, time)


def begin_replay(plan: ReplayPlan, arena: torch.Tensor) -> None:
    n = len(plan.sizes)
    arrays = [(ctypes.c_int64 * max(n, 1))(*values) for values in (plan.sizes, plan.offsets, plan.need)]
    free_order = (ctypes.c_int64 * max(len(plan.free_order), 1))(*plan.free_order)
    if arena.numel() < plan.arena_bytes:
        raise MemplanError(f"the arena holds {arena.numel()} bytes, the plan needs {plan.arena_bytes}")
    ok = load().mp_begin_replay(arena.data_ptr(), arena.numel(), n, *arrays, len(plan.free_order), free_order)
    if not ok:
        raise MemplanError("arena allocations of an earlier step are still alive; replay refused")


def end_replay() -> ReplayStats:
    values = (ctypes.c_int64 * 8)()
    load().mp_end_replay(values)
    served, served_bytes, fallback, fallback_bytes, blocked, diverged, seen, alive = values
    return ReplayStats(
        served, served_bytes, fallback, fallback_bytes, blocked, None if diverged < 0 else diverged, seen, alive
    )
