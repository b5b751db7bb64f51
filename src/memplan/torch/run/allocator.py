"""Profile-guided allocation (Sekiyama et al. 3-4): record the alloc/free sequence of one step,
solve the offsets of every allocation in one arena, and serve the same allocations of later
steps at their planned offsets.

The allocators are small C++ libraries compiled on first use with the system's C++ compiler and
cached; both compile the same record/replay state machine (``csrc/replay_core.h``) and expose
the same C interface, driven here through :class:`NativeReplay`:

- the CPU one (``csrc/planned_allocator.cpp``, built against the installed torch's c10 headers)
  is installed in front of PyTorch's CPU allocator (:func:`load`);
- the CUDA one (``csrc/cuda_planned_allocator.cpp``, no CUDA or torch headers) is a
  ``CUDAPluggableAllocator`` (:mod:`memplan.torch.run.cuda_allocator`).

Without a compiler, :func:`load` raises :class:`AllocatorUnavailable` and callers fall back to
arena views (``memplan.torch.run.interpreter``).
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
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path

import torch
from memplan.errors import MemplanError

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "planned_allocator.cpp"
CORE_HEADER = CSRC / "replay_core.h"
CPU_ALIGNMENT_BYTES = 64  # PyTorch's CPU allocator aligns to 64 bytes too
CUDA_ALIGNMENT_BYTES = 512  # PyTorch's CUDA caching allocator rounds every block to 512 bytes
ALIGNMENT_BYTES = CPU_ALIGNMENT_BYTES  # the planned CPU allocator's
_I64 = ctypes.c_int64
_P64 = ctypes.POINTER(ctypes.c_int64)
_NUM_STATS = 9
# what every arena's address must be a multiple of: PyTorch's CPU allocator gives 64, cudaMalloc
# 256; planned offsets are multiples of the device's alignment on top (kernels load 16 at most)
ARENA_BASE_ALIGNMENT_BYTES = 64


def alignment_for(device: torch.device | str) -> int:
    """The arena alignment for tensors on ``device``: what its PyTorch allocator rounds to."""
    return CUDA_ALIGNMENT_BYTES if torch.device(device).type == "cuda" else CPU_ALIGNMENT_BYTES


class AllocatorUnavailable(MemplanError):
    """A planned allocator could not be built or installed here."""


@dataclass(frozen=True)
class AllocationTrace:
    """The allocations of one recorded step, in request order: ``sizes[k]`` bytes, alive over
    ``[alloc_at[k], free_at[k])`` in event time; ``free_at[k] is None`` when it outlived the
    step (the result, new optimizer state), which then never goes to the arena. ``streams[k]``
    is the stream allocation k was made on (0 on the CPU); sizes are padded to
    ``alignment_bytes`` in the arena."""

    sizes: tuple[int, ...]
    alloc_at: tuple[int, ...]
    free_at: tuple[int | None, ...]
    streams: tuple[int, ...] = ()
    alignment_bytes: int = CPU_ALIGNMENT_BYTES

    @property
    def num_allocations(self) -> int:
        return len(self.sizes)

    def without(self, dropped: set[int]) -> AllocationTrace:
        """The trace with the allocations ``dropped`` (each one outliving the step) left out, as
        a step that never made them would record it: indices and event times renumbered."""
        if any(self.free_at[k] is not None for k in dropped):
            raise ValueError("only allocations that outlive the step can be left out")
        kept = [k for k in range(self.num_allocations) if k not in dropped]
        index = {k: i for i, k in enumerate(kept)}
        events = sorted(
            [(self.alloc_at[k], k, True) for k in kept]
            + [(f, k, False) for k in kept if (f := self.free_at[k]) is not None]
        )
        alloc_at, free_at = [0] * len(kept), [None] * len(kept)
        for time, (_, k, is_alloc) in enumerate(events):
            if is_alloc:
                alloc_at[index[k]] = time
            else:
                free_at[index[k]] = time
        streams = tuple(self.streams[k] for k in kept) if self.streams else ()
        sizes = tuple(self.sizes[k] for k in kept)
        return AllocationTrace(sizes, tuple(alloc_at), tuple(free_at), streams, self.alignment_bytes)

    def peak_live_bytes(self) -> int:
        """The most bytes the step's freed allocations held at once (aligned sizes)."""
        deltas: list[tuple[int, int]] = []
        for size, start, end in zip(self.sizes, self.alloc_at, self.free_at, strict=True):
            if end is not None:
                padded = aligned(size, self.alignment_bytes)
                deltas += [(start, padded), (end, -padded)]
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
    diverged_at: int | None  # first allocation that no branch of the plan makes there
    allocations: int
    arena_alive_after: int  # arena allocations that outlived the step (must be 0)
    branch: int = 0  # the branch of the plan the step ended on (BranchedPlan)


def aligned(size: int, alignment: int = CPU_ALIGNMENT_BYTES) -> int:
    return -(-size // alignment) * alignment


def cache_dir() -> Path:
    root = os.environ.get("MEMPLAN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "memplan"
    )
    return Path(root)


@cache
def load() -> ctypes.CDLL:
    """Build (once, cached by source and torch version) and load the CPU allocator library, and
    install it as PyTorch's CPU allocator. Raises :class:`AllocatorUnavailable`."""
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    library = build_library(
        SOURCE,
        "planned_allocator",
        [
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            f"-I{torch_dir / 'include'}",
            f"-I{sysconfig.get_paths()['include']}",
        ],
        [f"-L{torch_dir / 'lib'}", "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}"],
    )
    # RTLD_LOCAL: loaded globally, the library's weak C++ template instantiations (std::vector,
    # std::unordered_map) took the place of those of libraries loaded after it, and OR-Tools'
    # native module died while loading (SIGSEGV), in this process or in a solver's forked child
    lib = ctypes.CDLL(str(library), mode=ctypes.RTLD_LOCAL)
    declare_replay_api(lib)
    lib.mp_install.restype = ctypes.c_int
    lib.mp_installed.restype = ctypes.c_int
    if not lib.mp_install():
        raise AllocatorUnavailable("PyTorch's CPU allocator could not be replaced (another one is installed)")
    return lib


def available() -> bool:
    try:
        load()
    except AllocatorUnavailable:
        return False
    return True


def build_library(source: Path, name: str, compile_flags: Sequence[str], link_flags: Sequence[str]) -> Path:
    """Compile ``source`` (with ``replay_core.h``) into a shared library in the cache, once per
    content of both files, the flags and the torch version; returns its path. Builds by
    several processes at once are serialised by a lock file."""
    key_parts = source.read_bytes() + CORE_HEADER.read_bytes() + torch.__version__.encode()
    key_parts += " ".join([*compile_flags, *link_flags]).encode()
    target = cache_dir() / f"{name}-{hashlib.sha256(key_parts).hexdigest()[:16]}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise AllocatorUnavailable(f"no C++ compiler found (set CXX or install g++) to build {name}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        command = [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", f"-I{CSRC}", *compile_flags, str(source)]
        done = subprocess.run([*command, *link_flags, "-o", str(partial)], capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise AllocatorUnavailable(f"building {name} failed: {last}")
        partial.replace(target)
    return target


def declare_replay_api(lib: ctypes.CDLL) -> None:
    """Argument and result types of the C interface both libraries share (replay_core.h)."""
    lib.mp_begin_record.restype = None
    lib.mp_end_record.restype = _I64
    lib.mp_record_num_allocations.restype = _I64
    lib.mp_record_num_events.restype = _I64
    lib.mp_record_copy.argtypes = [_P64, _P64, _P64]
    lib.mp_record_copy.restype = None
    lib.mp_begin_replay.restype = ctypes.c_int
    lib.mp_begin_replay.argtypes = [ctypes.c_void_p, _I64, _I64, _P64, _P64, _P64, _P64, _P64, _P64, _P64, _P64]
    lib.mp_end_replay.argtypes = [_P64]
    lib.mp_end_replay.restype = None


@dataclass(frozen=True)
class ReplayPlan:
    """Planned offsets of a trace's allocations (-1: base allocator) and, for the safety check,
    the arena allocations in planned free order and how many of them precede each allocation."""

    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    need: tuple[int, ...]
    free_order: tuple[int, ...]
    arena_bytes: int
    streams: tuple[int, ...] = ()


@dataclass(frozen=True)
class BranchedPlan:
    """Several recorded steps replayed from one arena (:mod:`memplan.torch.run.branches`):
    ``shared[a][b]`` leading allocations of branches a and b are the same allocations at the
    same offsets; a step that departs from its branch at allocation k goes on along a branch
    that shares the first k with it and makes that request there."""

    branches: tuple[ReplayPlan, ...]
    shared: tuple[tuple[int, ...], ...]
    arena_bytes: int

    @classmethod
    def single(cls, plan: ReplayPlan) -> BranchedPlan:
        return cls((plan,), ((len(plan.sizes),),), plan.arena_bytes)

    @cached_property
    def native_arrays(self) -> tuple[ctypes.Array | None, ...]:
        """The arrays ``mp_begin_replay`` takes after the arena and the number of branches,
        built once per plan: the lists of a step's thousands of allocations cost about a
        millisecond to build, every replayed step."""
        branches = self.branches
        with_streams = any(b.streams for b in branches)
        streams = [s for b in branches for s in (b.streams or (0,) * len(b.sizes))] if with_streams else None
        return (
            _array([len(b.sizes) for b in branches]),
            _array([v for b in branches for v in b.sizes]),
            _array(streams) if streams is not None else None,
            _array([v for b in branches for v in b.offsets]),
            _array([v for b in branches for v in b.need]),
            _array([len(b.free_order) for b in branches]),
            _array([v for b in branches for v in b.free_order]),
            _array([v for row in self.shared for v in row]),
        )


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
        trace.streams,
    )


def _count_before(sorted_times: list[int], time: int) -> int:
    return bisect.bisect_left(sorted_times, time)


def _array(values: Sequence[int]) -> ctypes.Array:
    return (ctypes.c_int64 * max(len(values), 1))(*values)


class NativeReplay:
    """Record and replay through one library's C interface (``replay_core.h``): the same calls
    for the CPU and the CUDA allocator; ``alignment_bytes`` is the arena alignment of its device.
    ``verify_first_replay``: the first replayed step of each plan is run again on the ordinary
    allocator and compared bit for bit (:mod:`memplan.torch.run.verify`); the CPU allocator is
    covered by the tests, so it does not ask for it."""

    verify_first_replay = False
    # bytes the arena block holds before the plan's offset 0 (see :class:`CudaReplay`)
    arena_lead_bytes = 0

    def __init__(self, lib: ctypes.CDLL, alignment_bytes: int) -> None:
        self.lib = lib
        self.alignment_bytes = alignment_bytes

    def begin_record(self) -> None:
        self.lib.mp_begin_record()

    def recorded_allocations(self) -> int:
        """How many allocations the recording in progress has logged so far."""
        return int(self.lib.mp_record_num_allocations())

    def end_record(self) -> AllocationTrace:
        """Stop recording and return the trace of the allocations made since :meth:`begin_record`."""
        return self._logged(self.lib.mp_end_record())

    def replayed_trace(self) -> AllocationTrace:
        """The allocations of the latest replayed step, as a recording of it would give them
        (a step that diverged from its plan becomes a branch of it)."""
        return self._logged(self.lib.mp_record_num_events())

    def _logged(self, num_events: int) -> AllocationTrace:
        num_allocations = self.lib.mp_record_num_allocations()
        sizes = (ctypes.c_int64 * max(num_allocations, 1))()
        streams = (ctypes.c_int64 * max(num_allocations, 1))()
        events = (ctypes.c_int64 * max(num_events, 1))()
        self.lib.mp_record_copy(sizes, events, streams)
        alloc_at: list[int] = [0] * num_allocations
        free_at: list[int | None] = [None] * num_allocations
        for time, event in enumerate(events[:num_events]):
            if event >= 0:
                alloc_at[event] = time
            else:
                free_at[-event - 1] = time
        return AllocationTrace(
            tuple(sizes[:num_allocations]),
            tuple(alloc_at),
            tuple(free_at),
            tuple(streams[:num_allocations]),
            self.alignment_bytes,
        )

    def arena_block_bytes(self, plan_arena_bytes: int) -> int:
        """The arena block a plan of ``plan_arena_bytes`` needs here (its lead included)."""
        return plan_arena_bytes + self.arena_lead_bytes

    def begin_replay(self, plan: ReplayPlan | BranchedPlan, arena_address: int, arena_bytes: int) -> None:
        """Serve the plan's allocations at ``arena_address + arena_lead_bytes + offset`` until
        :meth:`end_replay`; ``arena_address``/``arena_bytes``: the whole arena block."""
        if isinstance(plan, ReplayPlan):
            plan = BranchedPlan.single(plan)
        arena_address, arena_bytes = arena_address + self.arena_lead_bytes, arena_bytes - self.arena_lead_bytes
        if arena_bytes < plan.arena_bytes:
            raise MemplanError(f"the arena holds {arena_bytes} bytes, the plan needs {plan.arena_bytes}")
        if arena_address % ARENA_BASE_ALIGNMENT_BYTES:
            raise MemplanError(f"the arena at {arena_address:#x} is not aligned to {ARENA_BASE_ALIGNMENT_BYTES} bytes")
        ok = self.lib.mp_begin_replay(arena_address, arena_bytes, len(plan.branches), *plan.native_arrays)
        if not ok:
            raise MemplanError("arena allocations of an earlier step are still alive; replay refused")

    def end_replay(self) -> ReplayStats:
        values = (ctypes.c_int64 * _NUM_STATS)()
        self.lib.mp_end_replay(values)
        served, served_bytes, fallback, fallback_bytes, blocked, diverged, seen, alive, branch = values
        return ReplayStats(
            served,
            served_bytes,
            fallback,
            fallback_bytes,
            blocked,
            None if diverged < 0 else diverged,
            seen,
            alive,
            branch,
        )

    def hold_cache_within(self, budget_bytes: int, placed_bytes: int) -> int:
        """Bound what the allocator keeps cached beyond the placed step (``placed_bytes``) so that
        both stay within ``budget_bytes``; returns the bound. The CPU allocator caches nothing of
        its own (the C heap's free pages are given back by :meth:`release_free_memory`): 0."""
        return 0

    def persistent_in_use(self, arena_bytes: int, kept_sizes: Sequence[int]) -> int | None:
        """Bytes in use besides the arena and a step's kept allocations, where the allocator
        counts them (the CUDA one); the CPU allocator does not: ``None``."""
        return None

    def release_free_memory(self) -> None:
        """Give freed memory back (the C heap's free pages on the CPU)."""
        from memplan.torch.rss import release_free_memory

        release_free_memory()


@cache
def cpu() -> NativeReplay:
    """The planned CPU allocator, built and installed."""
    return NativeReplay(load(), CPU_ALIGNMENT_BYTES)


def begin_record() -> None:
    cpu().begin_record()


def end_record() -> AllocationTrace:
    """Stop recording and return the trace of the allocations made since :func:`begin_record`."""
    return cpu().end_record()


def begin_replay(plan: ReplayPlan | BranchedPlan, arena: torch.Tensor) -> None:
    cpu().begin_replay(plan, arena.data_ptr(), arena.numel())


def end_replay() -> ReplayStats:
    return cpu().end_replay()
