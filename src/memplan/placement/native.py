"""The compiled canonical search (``csrc/canonical_search.c``): built on first use, cached.

The C file follows :class:`memplan.placement.search.ReferenceSearch` step for step, about a
hundred times faster; tests run both on the same instances and compare answers and node
counts. It is compiled on first use by :func:`memplan.compiled.build`; without a C compiler
:func:`available` is False and the search runs in Python.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from functools import cache, partial
from pathlib import Path

import numpy as np

from memplan.compiled import CompilerUnavailable, build, on_deep_stack
from memplan.placement.search import Cancel, Runner, SearchOptions, Sweep

SOURCE = Path(__file__).parent / "csrc" / "canonical_search.c"
_P64 = ctypes.POINTER(ctypes.c_int64)


NativeUnavailable = CompilerUnavailable


@cache
def load() -> ctypes.CDLL:
    """Build (once, cached by the source's hash) and load the library; raises :class:`NativeUnavailable`."""
    try:
        lib = ctypes.CDLL(str(build(SOURCE)))
    except OSError as err:
        raise NativeUnavailable(f"loading the placement search failed: {err}") from None
    lib.mm_search.restype = ctypes.c_int
    lib.mm_search.argtypes = [ctypes.c_int64, *[_P64] * 4, ctypes.c_int64, *[_P64] * 6, ctypes.c_int64]
    lib.mm_search.argtypes += [*[_P64] * 4, ctypes.c_int64, ctypes.c_int64, ctypes.c_char_p, ctypes.c_int64]
    lib.mm_search.argtypes += [ctypes.c_double, ctypes.POINTER(ctypes.c_int), _P64, _P64]
    return lib


@cache
def available() -> bool:
    """True when the compiled search builds and loads here (the answer is cached)."""
    try:
        load()
    except NativeUnavailable:
        return False
    return True


def flags(options: SearchOptions) -> int:
    """The option bits of the C kernel, in :meth:`SearchOptions.flag_names` order."""
    return sum(1 << i for i, name in enumerate(SearchOptions.flag_names()) if getattr(options, name))


def _csr(rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.zeros(len(rows) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([len(r) for r in rows])
    flat = np.fromiter((x for r in rows for x in r), dtype=np.int64, count=int(ptr[-1]))
    return ptr, flat


def _p(array: np.ndarray) -> ctypes._Pointer:  # type: ignore[type-arg]
    return array.ctypes.data_as(_P64)


# The search recurses once per placed buffer; a few hundred bytes of C stack each.
STACK_BYTES_PER_BUFFER = 1024
MAIN_STACK_BUFFERS = 2000


def _on_deep_stack(call: Callable[[], int], n: int) -> int:
    """``call()``, in a thread with a stack deep enough for ``n`` nested placements when the
    main thread's might not be (the C call releases the GIL, so this costs one thread start)."""
    if n <= MAIN_STACK_BUFFERS:
        return call()
    return on_deep_stack(call, STACK_BYTES_PER_BUFFER * n, "memplan-placement-search")


def runner(
    sizes: Sequence[int],
    lives: Sequence[tuple[int, int]],
    fixed: Sequence[int],
    data: Sweep,
    capacity: int,
    options: SearchOptions,
    deadline: float,
    cancel: Cancel | None = None,
) -> Runner:
    """A runner for :func:`memplan.placement.search.fit` backed by the compiled kernel."""
    lib = load()
    n = len(sizes)
    arrays = {
        "size": np.array(sizes, dtype=np.int64),
        "start": np.array([s for s, _ in lives], dtype=np.int64).reshape(n),
        "end": np.array([e for _, e in lives], dtype=np.int64).reshape(n),
        "fixed": np.array(fixed, dtype=np.int64),
        "first": np.array(data.first, dtype=np.int64),
        "last": np.array(data.last, dtype=np.int64),
    }
    sec_ptr, sec_buf = _csr(data.sections)
    ov_ptr, ov_buf = _csr(data.overlaps)
    part_ptr, part_buf = _csr([members for members, _, _ in data.partitions])
    part_lo = np.array([lo for _, lo, _ in data.partitions], dtype=np.int64)
    part_hi = np.array([hi for _, _, hi in data.partitions], dtype=np.int64)
    bits = flags(options)

    def run(heuristic: str, node_limit: int) -> tuple[str, list[int], int, int]:
        solution = np.zeros(max(n, 1), dtype=np.int64)
        stats = np.zeros(3, dtype=np.int64)
        call = partial(
            lib.mm_search,
            n,
            *(_p(arrays[k]) for k in ("size", "start", "end", "fixed")),
            len(data.sections),
            _p(arrays["first"]),
            _p(arrays["last"]),
            _p(sec_ptr),
            _p(sec_buf),
            _p(ov_ptr),
            _p(ov_buf),
            len(data.partitions),
            _p(part_ptr),
            _p(part_buf),
            _p(part_lo),
            _p(part_hi),
            capacity,
            bits,
            heuristic.encode()[:4].ljust(4, b"\0"),
            node_limit,
            max(0.0, deadline - time.perf_counter()),
            None if cancel is None else ctypes.byref(cancel.flag),
            _p(solution),
            _p(stats),
        )
        code = _on_deep_stack(call, n)
        if stats[2]:
            raise NativeUnavailable("the placement search ran out of memory")
        outcome = {1: "found", 0: "infeasible"}.get(code, "aborted")
        return outcome, [int(x) for x in solution[:n]], int(stats[0]), int(stats[1])

    return run
