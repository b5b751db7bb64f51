"""The C library's heap while a budgeted step runs on the ordinary allocator.

A step recorded on PyTorch's CPU allocator (before its arena is placed) gets its blocks from
glibc's ``malloc``: blocks below the mmap threshold (which glibc raises on its own up to
32 MiB) come from the heap, where freed blocks stay resident and fragment. GPT-2 (2 layers,
AdamW, batch 16) recorded at 1.85 GiB held 260 MiB more resident than the same plan replayed
from its arena. Inside :func:`blocks_mapped`, every block above ``threshold_bytes`` is mapped
on its own and unmapped when freed, so the resident set follows the live bytes; afterwards
the threshold is glibc's dynamic maximum (a value once set stays fixed in glibc). Elsewhere
than glibc nothing changes.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator

from memplan.torch.rss import _libc

M_MMAP_THRESHOLD = -3  # mallopt(3)
RECORDING_THRESHOLD_BYTES = 256 * 2**10
GLIBC_MAX_THRESHOLD_BYTES = 32 * 2**20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit


def set_mmap_threshold(nbytes: int) -> bool:
    """``mallopt(M_MMAP_THRESHOLD, nbytes)``; False where there is no glibc ``mallopt``."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, int(nbytes)))


@contextlib.contextmanager
def blocks_mapped(threshold_bytes: int = RECORDING_THRESHOLD_BYTES) -> Iterator[bool]:
    """Blocks above ``threshold_bytes`` mapped on their own while inside; yields whether the
    C library took the setting."""
    applied = set_mmap_threshold(threshold_bytes)
    try:
        yield applied
    finally:
        if applied:
            set_mmap_threshold(GLIBC_MAX_THRESHOLD_BYTES)


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc >= 2.33), every field a ``size_t``."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def heap_free_bytes() -> int:
    """Bytes the C library's heaps hold free (``mallinfo2().fordblks``, every arena): after
    ``malloc_trim`` their pages are handed back, so the resident set does not show them, but the
    next small allocations land in them and make them resident again (issue 33: the Llama's heap
    held 7.3 MiB free after capture's objects were freed, and a step touched 2.5-3.9 MiB of it
    again). 0 where there is no glibc ``mallinfo2``."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return 0
    libc.mallinfo2.restype = _MallInfo2
    libc.mallinfo2.argtypes = []
    return int(libc.mallinfo2().fordblks)


__all__ = ["blocks_mapped", "heap_free_bytes", "set_mmap_threshold"]
