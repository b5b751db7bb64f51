"""The compiled search over ideals (``csrc/ideal_search.c``), built on first use and cached.

It follows :class:`memplan.schedule.ideals._Search` step for step, tens of times faster; tests
compare both on the same graphs, node for node. Built by :func:`memplan.compiled.build`;
without a C compiler :func:`available` is False and the search runs in Python.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Sequence
from functools import cache, partial
from pathlib import Path

import numpy as np

from memplan.compiled import CompilerUnavailable, build, on_deep_stack

SOURCE = Path(__file__).parent / "csrc" / "ideal_search.c"
_P64 = ctypes.POINTER(ctypes.c_int64)
# The search recurses once per step; its frames are small.
STACK_BYTES_PER_OP = 512
MAIN_STACK_OPS = 4000


@cache
def load() -> ctypes.CDLL:
    """Build (once) and load the library; raises :class:`memplan.compiled.CompilerUnavailable`."""
    try:
        lib = ctypes.CDLL(str(build(SOURCE)))
    except OSError as err:
        raise CompilerUnavailable(f"loading the reordering search failed: {err}") from None
    lib.is_search.restype = ctypes.c_int
    lib.is_search.argtypes = [ctypes.c_int64, *[_P64] * 7, ctypes.c_int64, _P64, _P64]
    lib.is_search.argtypes += [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, _P64, ctypes.c_int64]
    lib.is_search.argtypes += [ctypes.c_int64, ctypes.c_int64, ctypes.c_double, _P64, _P64]
    return lib


@cache
def available() -> bool:
    """True when the compiled search builds and loads here (the answer is cached)."""
    try:
        load()
    except CompilerUnavailable:
        return False
    return True


def _csr(rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.zeros(len(rows) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([len(r) for r in rows])
    flat = np.fromiter((x for r in rows for x in r), dtype=np.int64, count=int(ptr[-1]))
    return ptr, flat


def _p(array: np.ndarray) -> ctypes._Pointer:  # type: ignore[type-arg]
    return array.ctypes.data_as(_P64)


class Kernel:
    """The arrays of one :class:`memplan.schedule.ideals.IdealGraph`, ready for the C search."""

    def __init__(self, ig: object) -> None:
        self.lib = load()
        self.n = ig.num_ops  # type: ignore[attr-defined]
        self.succ_ptr, self.succ = _csr(ig.successors)  # type: ignore[attr-defined]
        self.reads_ptr, self.reads = _csr(ig.reads)  # type: ignore[attr-defined]
        as_array = lambda xs: np.array(xs, dtype=np.int64)  # noqa: E731
        self.num_preds = as_array(ig.num_preds)  # type: ignore[attr-defined]
        self.alloc = as_array(ig.alloc_bytes)  # type: ignore[attr-defined]
        self.unread = as_array(ig.unread_bytes)  # type: ignore[attr-defined]
        self.tensor_bytes = as_array(ig.tensor_bytes)  # type: ignore[attr-defined]
        self.num_readers = as_array(ig.num_readers)  # type: ignore[attr-defined]
        self.base = int(ig.base_bytes)  # type: ignore[attr-defined]

    def search(
        self, cap: int, prefix: Sequence[int], goal: int, max_nodes: int, max_dead: int, deadline: float
    ) -> tuple[str, list[int] | None, int]:
        """("found" | "infeasible" | "aborted", the searched steps when found, nodes)."""
        pre = np.array(list(prefix), dtype=np.int64).reshape(-1)
        out = np.zeros(max(goal - len(pre), 1), dtype=np.int64)
        stats = np.zeros(2, dtype=np.int64)
        call = partial(
            self.lib.is_search,
            self.n,
            _p(self.succ_ptr),
            _p(self.succ),
            _p(self.num_preds),
            _p(self.alloc),
            _p(self.unread),
            _p(self.reads_ptr),
            _p(self.reads),
            len(self.tensor_bytes),
            _p(self.tensor_bytes),
            _p(self.num_readers),
            self.base,
            cap,
            len(pre),
            _p(pre),
            goal,
            max_nodes,
            max_dead,
            max(0.0, deadline - time.perf_counter()),
            _p(out),
            _p(stats),
        )
        code = _on_deep_stack(call, self.n)
        if stats[1]:
            raise CompilerUnavailable("the reordering search ran out of memory")
        outcome = {1: "found", 0: "infeasible"}.get(code, "aborted")
        steps = [int(x) for x in out[: goal - len(pre)]] if outcome == "found" else None
        return outcome, steps, int(stats[0])


def _on_deep_stack(call: Callable[[], int], n: int) -> int:
    """``call()``, in a thread with a stack deep enough for ``n`` nested steps when the main
    thread's might not be (the C call releases the GIL)."""
    if n <= MAIN_STACK_OPS:
        return call()
    return on_deep_stack(call, STACK_BYTES_PER_OP * n, "memplan-reorder-search")
