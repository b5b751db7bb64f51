"""``memory_budget="fit"``: the budget is whatever this process may use.

On the CPU that is the tightest of the memory cgroup limits above this process (cgroup v2
``memory.max``, v1 ``memory.limit_in_bytes``, every level up to the root; the anonymous and
shared memory the group's other processes hold, from ``memory.stat``, is left to them, its
file cache is not counted as held) and
the machine's available memory (``MemAvailable``) on top of what the process holds now. On
CUDA it is the device's free memory plus what PyTorch's caching allocator already reserved.

The step's budget is that limit less what the process holds outside the step (its libraries,
Python, other tensors: the resident set less the step's own tensors, which the plan counts:
parameters, buffers, optimizer state, the batch) and a margin for what no plan counts (the
C library's heap, the planning child, the profiler's events). The limit, where it came from,
the margin and the resulting budget are reported (``report["budget"]["limit"]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch.utils import _pytree as pytree

import torch
from memplan.errors import InfeasibleBudget
from memplan.report.format import format_bytes
from memplan.torch.memlimit import MOUNTINFO, PROC_CGROUP, inside, memory_controller, mounts, own_groups

FIT_WORDS = ("fit", "device")
MIB = 2**20
MARGIN_FRACTION = 0.05  # of the limit
MIN_MARGIN_BYTES = {"cpu": 128 * MIB, "cuda": 256 * MIB}
UNLIMITED_BYTES = 2**60  # a cgroup "limit" at or above this is none (v1 writes 2^63 rounded to a page)
MEMINFO = Path("/proc/meminfo")


def is_fit(value: Any) -> bool:
    """``memory_budget`` asks for the limit of the process (``"fit"``, or ``"device"``)."""
    return isinstance(value, str) and value.strip().lower() in FIT_WORDS


@dataclass(frozen=True)
class GroupLimit:
    """One memory cgroup's limit and what it is charged now."""

    path: str
    limit_bytes: int
    anon_bytes: int | None  # anonymous memory of every process of the group (not file cache)

    def room_for(self, anon_bytes: int) -> int:
        """What a process holding ``anon_bytes`` (anonymous, not file cache) of this group may
        use: the limit less the anonymous memory of the group's other processes."""
        if self.anon_bytes is None:
            return self.limit_bytes
        return self.limit_bytes - max(0, self.anon_bytes - anon_bytes)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED_BYTES
    return int(text) if text.isdigit() else None


def _stat(path: Path, keys: Sequence[str]) -> int | None:
    """The sum of ``keys`` in a flat-keyed ``memory.stat`` (missing ones 0); None without the file."""
    try:
        rows = dict(line.split(" ", 1) for line in path.read_text().splitlines() if " " in line)
    except OSError:
        return None
    return sum(int(rows[key]) for key in keys if rows.get(key, "").strip().isdigit())


def read_group(directory: Path) -> GroupLimit | None:
    """The limit of the memory cgroup in ``directory`` (v2 ``memory.max`` or v1
    ``memory.limit_in_bytes``), or None when it has none."""
    v2 = (directory / "memory.max").exists()
    limit = _read_int(directory / ("memory.max" if v2 else "memory.limit_in_bytes"))
    if limit is None or limit >= UNLIMITED_BYTES:
        return None
    keys = ("anon", "shmem") if v2 else ("total_rss", "total_shmem")
    anon = _stat(directory / "memory.stat", keys)
    return GroupLimit(str(directory), limit, anon)


def own_group_dirs(proc_cgroup: Path = PROC_CGROUP, mountinfo: Path = MOUNTINFO) -> list[Path]:
    """This process's memory cgroup directories, its own first, then each parent up to the
    mount's root (v2's unified group and v1's memory group, where mounted)."""
    try:
        groups, mounted = own_groups(proc_cgroup), mounts(mountinfo)
    except OSError:
        return []
    found: list[Path] = []
    for root, point, fstype, options in mounted:
        key = memory_controller(fstype, options)
        relative = None if key is None or key not in groups else inside(root, groups[key])
        if relative is not None:
            parts = relative.split("/") if relative else []
            found += [Path(point, *parts[:k]) for k in range(len(parts), -1, -1)]
    return found


def cgroup_limits(directories: Sequence[Path] | None = None) -> list[GroupLimit]:
    """The limits of ``directories`` (default: :func:`own_group_dirs`) that have one."""
    dirs = own_group_dirs() if directories is None else directories
    return [g for g in (read_group(d) for d in dirs) if g is not None]


def mem_available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """The machine's ``MemAvailable`` (``/proc/meminfo``), or None."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class FitBudget:
    """What ``memory_budget="fit"`` resolved to (all bytes)."""

    device: str
    limit_bytes: int  # what this process may use in all
    source: str  # where the limit came from
    outside_bytes: int  # held by the process outside the step (resident less the step's own tensors)
    step_resident_bytes: int  # the step's tensors already held (counted by the plan)
    margin_bytes: int
    budget_bytes: int  # limit - outside - margin: the step's whole peak may use this

    def describe(self) -> str:
        return (
            f"memory_budget='fit': this process may use {format_bytes(self.limit_bytes)} ({self.source}), "
            f"{format_bytes(self.outside_bytes)} of it held outside the step and a margin of "
            f"{format_bytes(self.margin_bytes)} kept, leaving {format_bytes(self.budget_bytes)} for the step"
        )

    def as_report(self) -> dict[str, Any]:
        return asdict(self)


def anon_rss_bytes(status: Path = Path("/proc/self/status")) -> int:
    """This process's anonymous resident bytes (``RssAnon``; its mapped files are the
    group's file cache), or 0 where unknown."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def cpu_limit(
    rss_bytes: int,
    groups: Sequence[GroupLimit] | None = None,
    available_bytes: int | None = None,
    anon_bytes: int | None = None,
) -> tuple[int, str]:
    """``(bytes, source)``: the most a process holding ``rss_bytes`` (``anon_bytes`` of them
    anonymous) may use on this machine: the tightest cgroup limit (less what the group's other
    processes hold) or the resident set plus ``MemAvailable``."""
    groups = cgroup_limits() if groups is None else groups
    available = mem_available_bytes() if available_bytes is None else available_bytes
    anon = anon_rss_bytes() if anon_bytes is None else anon_bytes
    options = [(g.room_for(anon), f"cgroup limit {format_bytes(g.limit_bytes)} at {g.path}") for g in groups]
    if available is not None:
        options.append((rss_bytes + available, f"resident {format_bytes(rss_bytes)} + MemAvailable"))
    if not options:
        raise InfeasibleBudget(
            "memory_budget='fit': no cgroup limit and no /proc/meminfo here, so the limit is unknown; "
            "give memory_budget in bytes (e.g. '2GiB')"
        )
    return min(options)


def step_tensor_bytes(model: torch.nn.Module, optimizers: Sequence[Any], batch: Any, device: torch.device) -> int:
    """Bytes of the step's own tensors already allocated on ``device`` (each storage once):
    parameters, buffers, gradients, optimizer state, the batch."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    for optimizer in optimizers:
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    tensors += [x for x in pytree.tree_leaves(batch) if isinstance(x, torch.Tensor)]
    seen: dict[int, int] = {}
    for t in tensors:
        if t.device.type == device.type and t.untyped_storage().nbytes():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def margin_for(limit_bytes: int, device_type: str) -> int:
    return max(MIN_MARGIN_BYTES.get(device_type, MIN_MARGIN_BYTES["cpu"]), int(MARGIN_FRACTION * limit_bytes))


def fit_budget(model: torch.nn.Module, optimizers: Sequence[Any], batch: Any) -> FitBudget:
    """Resolve ``memory_budget="fit"`` for a step of ``model`` now (before it first runs)."""
    from memplan.torch.rss import release_free_memory, rss_bytes

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    counted = step_tensor_bytes(model, optimizers, batch, device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
        limit, source = free + reserved, f"{device}: free {format_bytes(free)} + reserved by PyTorch"
        outside = max(0, allocated - counted)
    else:
        release_free_memory()
        rss = rss_bytes()
        limit, source = cpu_limit(rss)
        outside = max(0, rss - counted)
    margin = margin_for(limit, device.type)
    fit = FitBudget(device.type, limit, source, outside, counted, margin, limit - outside - margin)
    if fit.budget_bytes <= counted:
        raise InfeasibleBudget(
            f"{fit.describe()}: that does not even hold the step's parameters, state and batch "
            f"({format_bytes(counted)}); raise the limit or use a smaller model or batch"
        )
    return fit


__all__ = [
    "FitBudget",
    "GroupLimit",
    "anon_rss_bytes",
    "cgroup_limits",
    "cpu_limit",
    "fit_budget",
    "is_fit",
    "margin_for",
    "mem_available_bytes",
    "own_group_dirs",
    "read_group",
    "step_tensor_bytes",
]
