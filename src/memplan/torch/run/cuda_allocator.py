"""The planned CUDA allocator: the CPU allocator's contract (record until two steps agree, place,
replay every allocation at its planned offset, the safety check, fall back and re-record on
divergence; :mod:`memplan.torch.run.replay`) for a step on a GPU.

The library (``csrc/cuda_planned_allocator.cpp``) compiles the same record/replay state machine
as the CPU one (``csrc/replay_core.h``) behind the two entry points of
:class:`torch.cuda.memory.CUDAPluggableAllocator`; it is built on first use with the system C++
compiler, with no nvcc and no CUDA or torch headers (a stream is an opaque pointer, the arena is a
block PyTorch allocates, offsets are pointer arithmetic). Requests outside a planned step go to a
small cache of 512-byte blocks over ``cudaMalloc``/``cudaFree``, taken from the CUDA runtime
PyTorch loaded. Its policies (the library's header states them; ``tests/torch/test_cuda_policies.py``
tests each against a host stand-in for the device): a free block serves a request on the same
device and stream when it is at most :data:`NEAR_SIZE_SLACK` larger; before a block is taken from
the device, cached blocks are given back, the largest first, so that what the allocator holds
never exceeds the most it handed out plus :data:`CACHE_BOUND_BYTES` plus the bound's growth
(``max_memory_reserved <= max_memory_allocated + bound + growth``); the bound grows by each block
it gave back that a later request asks for again (up to :data:`GROWTH_CEILING`: the most bytes
in use), so a step that repeats its requests on the cache (arena views on this allocator, issue
34) settles at what one step needs and stops calling the device; under a ``memory_budget`` the
device holds at most the budget beyond the bytes in use (:meth:`CudaReplay.hold_cache_within`).

Why not ``torch.cuda.MemPool(allocator=...)`` scoped to the step: a pool's allocator is asked
for *segments* (``allocPrimitive`` in ``c10/cuda/CUDACachingAllocator.cpp`` calls its
``raw_alloc`` with the caching allocator's segment size: 2 MiB for requests up to 1 MiB, 20 MiB
up to 10 MiB, else rounded to 2 MiB), and the caching allocator splits and caches blocks inside
them itself; freed tensors never reach the pool's allocator. A per-allocation plan cannot be
replayed there. So the planned allocator must be PyTorch's CUDA allocator itself
(``change_current_allocator``), which PyTorch allows only before the first CUDA allocation:
:func:`install` is an explicit, opt-in call at the start of a program, and it is scoped to the
planned step in the sense that matters: outside :class:`~memplan.torch.run.replay.ReplayedStep`'s
record/replay windows every request passes through to the cache.

Never loaded without CUDA: importing this module loads nothing; :func:`install` refuses with one
line when ``torch.cuda.is_available()`` is false, and :func:`runtime_choice` then keeps arena
views and says why. Tests drive the compiled state machine on the CPU through :func:`build`
(compile only) and ctypes, with host functions standing in for ``cudaMalloc``/``cudaFree``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from memplan.errors import MemplanError
from memplan.torch.run.allocator import (
    CSRC,
    CUDA_ALIGNMENT_BYTES,
    AllocatorUnavailable,
    NativeReplay,
    aligned,
    build_library,
    declare_replay_api,
)

SOURCE = CSRC / "cuda_planned_allocator.cpp"
LIBRARY_NAME = "cuda_planned_allocator"
MALLOC_SYMBOL = "mp_cuda_malloc"
FREE_SYMBOL = "mp_cuda_free"
_NUM_MEMORY_STATS = 15
INSTALL_HINT = "call memplan.torch.run.cuda_allocator.install() before the first CUDA tensor"

# the cache's policies (see the module docstring): the most free bytes it keeps beyond what is
# handed out when it must ask the device for more, how much larger than a request a reused block
# may be (1/8: a 4096-byte request may take a block of up to 4608 bytes, never a larger one), and
# the most the bound may grow by when blocks it gave back are asked for again (-1: as many bytes
# as were in use at the most; 0: no growth)
CACHE_BOUND_BYTES = 32 * 2**20
NEAR_SIZE_SLACK = (1, 8)
GROWTH_CEILING = -1

_installed: CudaReplay | None = None


@dataclass(frozen=True)
class CudaMemoryStats:
    """What the planned CUDA allocator holds (its own counters: PyTorch keeps none for a
    pluggable allocator). ``held``/``peak_held`` stand for ``memory_reserved`` /
    ``max_memory_reserved`` (bytes taken from cudaMalloc), ``in_use``/``peak_in_use`` for
    ``memory_allocated``/``max_memory_allocated`` (blocks handed out, the arena counted whole)."""

    held: int
    peak_held: int
    in_use: int
    peak_in_use: int
    raw_allocations: int
    cached: int = 0  # free blocks held (held - in_use)
    raw_frees: int = 0  # blocks given back to the device
    near_hits: int = 0  # requests served by a cached block larger than their rounded size
    evicted: int = 0  # cached blocks given back by the cache bound
    unknown_frees: int = 0  # frees of a pointer not live here (a second free): never passed to cudaFree
    cache_bound: int = -1  # the bound in force (-1: none)
    growth: int = 0  # bytes the bound grew by: blocks it gave back that later requests asked for again
    regrets: int = 0  # requests that a block the bound gave back would have served
    held_cap: int = -1  # the most bytes held, a memory_budget (-1: none)
    high_in_use: int = 0  # the most bytes in use since the policy was set


def build() -> Path:
    """Compile the library (no CUDA needed) and return its path; raises :class:`AllocatorUnavailable`."""
    return build_library(SOURCE, LIBRARY_NAME, [], [])


def declare_cuda_api(lib: ctypes.CDLL) -> None:
    """Argument and result types of the library's C interface."""
    declare_replay_api(lib)
    lib.mp_cuda_set_raw.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.mp_cuda_set_raw.restype = None
    lib.mp_cuda_set_device.argtypes = [ctypes.c_int]
    lib.mp_cuda_set_device.restype = None
    lib.mp_cuda_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.mp_cuda_malloc.restype = ctypes.c_void_p
    lib.mp_cuda_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.mp_cuda_free.restype = None
    lib.mp_cuda_empty_cache.restype = None
    lib.mp_cuda_memory_stats.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.mp_cuda_memory_stats.restype = None
    lib.mp_cuda_set_cache_policy.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    lib.mp_cuda_set_cache_policy.restype = None
    lib.mp_cuda_set_held_cap.argtypes = [ctypes.c_int64]
    lib.mp_cuda_set_held_cap.restype = None
    lib.mp_cuda_reset_peaks.restype = None


class CudaReplay(NativeReplay):
    """:class:`NativeReplay` over the CUDA library, with its memory counters. Its first replay of
    every plan is verified against PyTorch's allocator: no GPU was lent where it was written."""

    verify_first_replay = True
    # CUDAPluggableAllocator keeps its allocations by address: a planned block at offset 0 would
    # have the arena block's own address, freeing it would drop the arena's record, and freeing
    # the arena then aborts ("Trying to free a pointer not allocated here", seen on an H100).
    # So offset 0 starts one block into the arena.
    arena_lead_bytes = CUDA_ALIGNMENT_BYTES

    def __init__(
        self,
        lib: ctypes.CDLL,
        cache_bound_bytes: int = CACHE_BOUND_BYTES,
        slack: tuple[int, int] = NEAR_SIZE_SLACK,
        growth_ceiling: int = GROWTH_CEILING,
    ) -> None:
        super().__init__(lib, CUDA_ALIGNMENT_BYTES)
        self.cache_bound_bytes = cache_bound_bytes
        self.slack = slack
        self.growth_ceiling = growth_ceiling
        self.set_held_cap(None)
        self.set_cache_policy(cache_bound_bytes, slack, growth_ceiling)

    def set_cache_policy(
        self, cache_bound_bytes: int, slack: tuple[int, int] = NEAR_SIZE_SLACK, growth_ceiling: int = GROWTH_CEILING
    ) -> None:
        """The cache bound in bytes (-1: none), the near-size slack ``(num, den)`` (a cached block
        of ``s`` bytes serves a request rounded to ``r`` when ``r <= s <= r + r * num / den``;
        ``(0, 1)``: the same size only) and the most the bound may grow by (-1: the most bytes in
        use; 0: never). The growth starts over, and cached blocks above ``in_use + bound`` go back
        to the device now."""
        self.lib.mp_cuda_set_cache_policy(int(cache_bound_bytes), int(slack[0]), int(slack[1]), int(growth_ceiling))

    def set_held_cap(self, cap_bytes: int | None) -> None:
        """The most bytes the device may hold (``None``: no cap): cached blocks above it go back
        now and before every new block; only bytes in use can take it over the cap."""
        self.lib.mp_cuda_set_held_cap(-1 if cap_bytes is None else int(cap_bytes))

    def hold_cache_within(self, budget_bytes: int, placed_bytes: int) -> int:
        """Under a budget: the device holds at most ``budget_bytes`` from now on, cached blocks
        above it given back at once (:meth:`set_held_cap`), and the cache bound is lowered to what
        the budget leaves above the placed step (``placed_bytes``, or what is in use now if more:
        512-byte rounding, tensors of the caller), so that held <= placed step + bound <= budget
        while the step's bytes in use stay within it; returns the bound."""
        self.set_held_cap(budget_bytes)
        in_use = max(int(placed_bytes), self.memory_stats().in_use)
        bound = max(0, min(self.cache_bound_bytes, int(budget_bytes) - in_use))
        self.cache_bound_bytes = bound
        self.set_cache_policy(bound, self.slack, self.growth_ceiling)
        return bound

    def persistent_in_use(self, arena_bytes: int, kept_sizes: Sequence[int]) -> int:
        """Bytes in use on the device besides the arena block (``arena_bytes``) and the kept
        allocations of the step just recorded (``kept_sizes``, alive now): the parameters, the
        optimizer's state, the caller's tensors and the libraries' own blocks (cuBLAS' workspace)
        that a graph's count of persistent bytes does not see."""
        kept = sum(aligned(max(int(n), 1), CUDA_ALIGNMENT_BYTES) for n in kept_sizes)
        arena = aligned(int(arena_bytes), CUDA_ALIGNMENT_BYTES) if arena_bytes else 0
        return max(0, self.memory_stats().in_use - arena - kept)

    def release_free_memory(self) -> None:
        """Give the cached (free) blocks back to the device."""
        self.lib.mp_cuda_empty_cache()

    def memory_stats(self) -> CudaMemoryStats:
        values = (ctypes.c_int64 * _NUM_MEMORY_STATS)()
        self.lib.mp_cuda_memory_stats(values)
        return CudaMemoryStats(*values)

    def reset_peaks(self) -> None:
        self.lib.mp_cuda_reset_peaks()


def install(device: int | None = None) -> CudaReplay:
    """Make the planned CUDA allocator PyTorch's CUDA allocator for this process (opt-in).

    Call it before the first CUDA tensor; afterwards :func:`memplan.compile_step` on a model on
    the GPU records and replays its steps (``allocator="auto"`` or ``"replay"``). Raises
    :class:`AllocatorUnavailable` with one line when CUDA is absent, no compiler is found, the
    CUDA runtime library is not loaded, or PyTorch's allocator was already used.
    """
    global _installed
    if _installed is not None:
        return _installed
    if not torch.cuda.is_available():
        raise AllocatorUnavailable("CUDA is not available: the planned CUDA allocator is not loaded")
    if torch.cuda.is_initialized():
        raise AllocatorUnavailable(f"CUDA is already initialised, with PyTorch's allocator; {INSTALL_HINT}")
    path = build()
    lib = ctypes.CDLL(str(path))
    declare_cuda_api(lib)
    runtime = _cuda_runtime()
    # nothing here may initialise CUDA (torch.cuda.current_device() would, and PyTorch then
    # refuses to swap its allocator): the device is asked for once the swap is done
    lib.mp_cuda_set_raw(_address(runtime.cudaMalloc), _address(runtime.cudaFree), -1)
    pluggable = torch.cuda.memory.CUDAPluggableAllocator(str(path), MALLOC_SYMBOL, FREE_SYMBOL)
    try:
        torch.cuda.memory.change_current_allocator(pluggable)
    except RuntimeError as error:
        raise AllocatorUnavailable(
            f"PyTorch's CUDA allocator is already in use ({str(error).splitlines()[0]}); {INSTALL_HINT}"
        ) from None
    lib.mp_cuda_set_device(torch.cuda.current_device() if device is None else device)
    _installed = CudaReplay(lib)
    return _installed


def installed() -> bool:
    return _installed is not None


def native() -> CudaReplay:
    """The installed planned CUDA allocator; raises :class:`AllocatorUnavailable` otherwise."""
    if _installed is None:
        raise AllocatorUnavailable(f"the planned CUDA allocator is not installed; {INSTALL_HINT}")
    return _installed


def release_free_memory() -> None:
    """Cached free CUDA blocks back to the device (ours when installed, else PyTorch's)."""
    if _installed is not None:
        _installed.release_free_memory()
    elif torch.cuda.is_available():
        torch.cuda.empty_cache()


def runtime_choice(requested: str) -> tuple[str, str]:
    """The allocator mode a step on a CUDA device runs in, and one line saying why."""
    if not torch.cuda.is_available():
        return "views", "CUDA is not available: the planned CUDA allocator is not loaded; arena views"
    if requested == "views":
        return "views", "allocator='views' requested"
    if _installed is not None:
        return "replay", "the planned CUDA allocator (CUDAPluggableAllocator) records and replays the step"
    if requested == "replay":
        raise MemplanError(f"allocator='replay' on CUDA needs the planned CUDA allocator; {INSTALL_HINT}")
    return "views", f"the planned CUDA allocator is not installed ({INSTALL_HINT}); arena views"


def _cuda_runtime() -> ctypes.CDLL:
    """The CUDA runtime library PyTorch loaded (its cudaMalloc and cudaFree serve our cache)."""
    for path in _loaded_libraries():
        if "libcudart" in Path(path).name:
            return ctypes.CDLL(path)
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise AllocatorUnavailable("the CUDA runtime library (libcudart) is not loaded in this process")


def _loaded_libraries() -> list[str]:
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if ".so" in line})
    except OSError:
        return []


def _address(function: ctypes._CFuncPtr) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value or 0
