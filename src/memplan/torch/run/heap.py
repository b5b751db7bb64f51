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


__all__ = ["blocks_mapped", "set_mmap_threshold"]
