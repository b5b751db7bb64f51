"""Memory as the operating system sees it: the resident set of this process (Linux ``/proc``).

memplan's own trackers count the bytes of allocations (:mod:`memplan.torch.measure`); a process
can hold many more pages than that (freed blocks the C library keeps in its heap, the pages an
arena touched once). These helpers read what the kernel charges: ``VmRSS`` (resident now) and
``VmHWM`` (the high-water mark, which writing ``5`` to ``/proc/self/clear_refs`` resets to the
current resident set, so a steady-state step can be measured alone).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from functools import cache
from pathlib import Path

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")
RESET_PEAK = "5"  # proc(5): "5" resets the peak resident set size ("high water mark") to the current one


class RssUnavailable(OSError):
    """This system has no ``/proc/self/status`` with ``VmRSS``/``VmHWM`` (not Linux)."""


def _status_kib(field: str) -> int:
    try:
        lines = STATUS.read_text().splitlines()
    except OSError as err:
        raise RssUnavailable(f"cannot read {STATUS} ({err}); RSS is measured on Linux only") from err
    for line in lines:
        if line.startswith(field + ":"):
            return int(line.split()[1])  # "VmHWM:   123456 kB"
    raise RssUnavailable(f"{STATUS} has no {field} line; RSS is measured on Linux only")


def rss_bytes() -> int:
    """Bytes resident now (``VmRSS``)."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """The most bytes resident at once since the process started or :func:`reset_peak_rss`
    (``VmHWM``)."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Reset ``VmHWM`` to the current resident set (Linux >= 4.0)."""
    try:
        CLEAR_REFS.write_text(RESET_PEAK)
    except OSError as err:
        raise RssUnavailable(f"cannot reset the peak RSS through {CLEAR_REFS} ({err})") from err


@cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def release_free_memory() -> bool:
    """Hand the heap pages the C library holds free back to the operating system (glibc's
    ``malloc_trim(0)``, which also releases free pages inside the heap, not only at its top);
    elsewhere nothing. Without it the blocks that capture, the solvers and the recording steps
    freed stay resident, and the process's RSS stays as high as planning made it. Returns
    whether anything was released."""
    gc.collect()
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    return bool(libc.malloc_trim(0))
