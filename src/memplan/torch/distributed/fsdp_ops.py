"""FSDP2's two collectives as traceable ops: ``memplan_fsdp::all_gather`` and ``memplan_fsdp::reduce_scatter``.

A captured FSDP2 step (:mod:`memplan.torch.distributed.fsdp`) contains one op per unit for each
collective FSDP2 runs, so the plan orders and places their buffers like any other op; the
runtime runs the real op, which calls ``torch.distributed`` synchronously. Both use FSDP2's own
layout (``torch.distributed.fsdp._fully_shard._fsdp_collectives``), so the bits are FSDP2's:

* shards are dim-0 chunks of ``ceil(rows / world)`` rows, the last ones padded (FSDP2's
  ``_get_dim0_padded_size``); a parameter's padded shard is all-gathered on its own into the
  padded full parameter, whose first ``rows`` rows are the parameter (FSDP2 gathers a unit at
  once and copies each parameter out: a gather is a copy, so the bits are the same, and no
  copy-out buffer is needed);
* the reduce-scatter input is FSDP2's ``chunk_cat``: for each rank, chunk ``r`` of every padded
  gradient, back to back in the unit's parameter order; it is reduced exactly as
  ``dist.reduce_scatter_single(op=AVG)`` (what ``_get_gradient_divide_factors`` picks for fp32
  and bf16 gradients with no divide factor) reduces it on gloo, on the same buffer as FSDP2's, so
  every element is summed in the same order (:func:`_launch_reduce`, :func:`_scatter_out`). Each
  parameter's gradient shard is a view of the output at the padded offset FSDP2 uses.

Both ops have ``out=`` variants, so the runtime writes their results into the arena. Padding is
left uninitialised (``new_empty``): it is gathered or reduced, and never read.

The process group is passed as an index into :data:`GROUPS` (an op's schema takes no Python
object); :func:`register_group` adds one.

Asynchronous collectives (the communication stream, :mod:`memplan.torch.distributed.fsdp_plan`):
inside ``with launching(inflight)``, the ``out=`` kernels launch their collective with
``async_op=True`` (gloo runs it on its process group's threads) and return at once; ``inflight``
keeps the work handle, the input and the output (so an input left to the allocator is not freed
while gloo reads it) until the plan's wait (:meth:`Inflight.wait`). Outside, they run
synchronously, as before.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.profiler import record_function

import torch

GROUPS: list[dist.ProcessGroup] = []


def register_group(group: dist.ProcessGroup) -> int:
    """The index of ``group`` in :data:`GROUPS` (added on first use)."""
    for k, g in enumerate(GROUPS):
        if g is group:
            return k
    GROUPS.append(group)
    return len(GROUPS) - 1


def padded_rows(rows: int, world: int) -> int:
    """Rows of one shard: FSDP2's dim-0 chunk, ``ceil(rows / world)``."""
    return -(-rows // world)


def _row_numel(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:])


_LIB = torch.library.Library("memplan_fsdp", "DEF")  # the ops live as long as the process
_LIB.define("all_gather(Tensor input, int group) -> Tensor")
_LIB.define("all_gather.out(Tensor input, int group, *, Tensor(a!) out) -> Tensor(a!)", tags=torch.Tag.out)
_LIB.define("reduce_scatter(Tensor input, int group) -> Tensor")
_LIB.define("reduce_scatter.out(Tensor input, int group, *, Tensor(a!) out) -> Tensor(a!)", tags=torch.Tag.out)


@dataclass
class Launch:
    """One asynchronous collective of a step: its work handle, the buffers gloo uses, and when
    it was launched, done (its future completed, on gloo's thread; 0 where the work has none, as
    gloo's reduce-scatter) and waited for (the compute thread's ``wait_start`` to ``wait_end``), in
    ``time.perf_counter`` seconds."""

    kind: str
    work: Any
    buffers: tuple[torch.Tensor, ...]
    size_bytes: int
    launched: float = 0.0
    done: float = 0.0
    wait_start: float = 0.0
    wait_end: float = 0.0
    finish: Callable[[], None] | None = None


@dataclass
class Inflight:
    """The collectives a step launched, in launch order (index = launch number)."""

    launches: list[Launch] = field(default_factory=list)
    waited: set[int] = field(default_factory=set)
    record_times: bool = False

    def launch(
        self, kind: str, work: Any, inp: torch.Tensor, out: torch.Tensor, finish: Callable[[], None] | None = None
    ) -> None:
        """``finish``: what the wait does once the work is done (a reduce-scatter's copy-out)."""
        size = max(inp.numel() * inp.element_size(), out.numel() * out.element_size())
        entry = Launch(kind, work, (inp, out), size, launched=time.perf_counter() if self.record_times else 0.0)
        entry.finish = finish
        if self.record_times:
            try:
                future = work.get_future()
            except RuntimeError:  # a work without a future: ``done`` stays 0 (unknown)
                future = None
            if future is not None:
                future.add_done_callback(lambda _f, e=entry: setattr(e, "done", time.perf_counter()))
        self.launches.append(entry)

    def wait(self, k: int) -> None:
        """Wait for the ``k``-th collective launched in this step, then drop its buffers."""
        if k >= len(self.launches) or k in self.waited:
            raise RuntimeError(f"collective {k} is waited for before its launch or twice; the plan is broken")
        entry = self.launches[k]
        start = time.perf_counter()
        with record_function(f"memplan.wait:{entry.kind}{k}"):
            entry.work.wait()
            entry.work = None
            if entry.finish is not None:
                entry.finish()
        if self.record_times:
            entry.wait_start, entry.wait_end = start, time.perf_counter()
        entry.buffers, entry.finish = (), None
        self.waited.add(k)

    def drain(self) -> int:
        """Wait for every collective not yet waited for (a failed step); how many there were."""
        left = [k for k in range(len(self.launches)) if k not in self.waited]
        for k in left:
            self.wait(k)
        return len(left)


_INFLIGHT: list[Inflight] = []


@contextlib.contextmanager
def launching(inflight: Inflight) -> Iterator[Inflight]:
    """Within: the collectives' ``out=`` kernels launch asynchronously into ``inflight``."""
    _INFLIGHT.append(inflight)
    try:
        yield inflight
    finally:
        _INFLIGHT.remove(inflight)


def _all_gather_out(inp: torch.Tensor, group: int, *, out: torch.Tensor) -> torch.Tensor:
    if _INFLIGHT:
        with record_function("memplan.launch:all_gather"):
            work = dist.all_gather_single(out, inp, group=GROUPS[group], async_op=True)
        _INFLIGHT[-1].launch("all_gather", work, inp, out)
        return out
    dist.all_gather_single(out, inp, group=GROUPS[group])
    return out


def _all_gather(inp: torch.Tensor, group: int) -> torch.Tensor:
    return _all_gather_out(inp, group, out=inp.new_empty(dist.get_world_size(GROUPS[group]) * inp.numel()))


def _reduce_scatter_out(inp: torch.Tensor, group: int, *, out: torch.Tensor) -> torch.Tensor:
    if _INFLIGHT:
        with record_function("memplan.launch:reduce_scatter"):
            staging, work, own = _launch_reduce(inp, group)
        _INFLIGHT[-1].launch("reduce_scatter", work, inp, out, lambda: _scatter_out(staging, own, group, out))
        return out
    staging, work, own = _launch_reduce(inp, group)
    work.wait()
    del work
    return _scatter_out(staging, own, group, out)


def _launch_reduce(inp: torch.Tensor, group: int) -> tuple[torch.Tensor, Any, int]:
    """The first half of gloo's reduce-scatter (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``,
    what ``dist.reduce_scatter_single`` runs): a copy of the input, all-reduced (SUM) on gloo's
    thread. The copy is this process's, not gloo's: gloo's thread keeps its work, and with it
    the buffer it reduced, until it takes the next one, after the wait has returned; the next
    reduce-scatter's copy was then made beside it (4 ranks on 2 cores: one or two units' gradients
    above the plan, issue 35). :func:`_scatter_out` waits for that reference to go first: it
    gets the copy, the work, and the copy's storage's use count while only this process held it."""
    staging = inp.clone()
    own = _use_count(staging)
    work = dist.all_reduce(staging.view(-1), group=GROUPS[group], async_op=True)  # gloo holds the view
    return staging, work, own


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


RELEASE_SECONDS = 2.0
"""How long :func:`_scatter_out` waits for gloo's thread to drop the reduced buffer (it does so
right after marking the work done; a descheduled thread takes a time slice or two)."""


def _scatter_out(staging: torch.Tensor, own: int, group: int, out: torch.Tensor) -> torch.Tensor:
    """The second half, once the all-reduce is done: this rank's chunk of the sum, divided by the
    world size (``ReduceOp.AVG`` on gloo: the bits of ``dist.reduce_scatter_single(op=AVG)``,
    tested), after gloo's thread has dropped its view of ``staging``, so the copy is freed here,
    before the next one is made (``own``: the storage's use count without gloo's view)."""
    global LATE_RELEASES
    world, rank = dist.get_world_size(GROUPS[group]), dist.get_rank(GROUPS[group])
    end = time.perf_counter() + RELEASE_SECONDS
    while _use_count(staging) > own:
        if time.perf_counter() > end:
            LATE_RELEASES += 1  # freed by gloo's thread later, above the plan for a while
            break
        time.sleep(0)  # lets gloo's thread run (and take the GIL, to drop the view's Python object)
    out.copy_(staging.view(world, -1)[rank])
    return out.div_(world)


LATE_RELEASES = 0
"""How many reduce-scatters' buffers gloo's thread still held after :data:`RELEASE_SECONDS`."""


def _reduce_scatter(inp: torch.Tensor, group: int) -> torch.Tensor:
    return _reduce_scatter_out(inp, group, out=inp.new_empty(inp.numel() // dist.get_world_size(GROUPS[group])))


_LIB.impl("all_gather", _all_gather, "CPU")
_LIB.impl("all_gather.out", _all_gather_out, "CPU")
_LIB.impl("reduce_scatter", _reduce_scatter, "CPU")
_LIB.impl("reduce_scatter.out", _reduce_scatter_out, "CPU")
_LIB.impl("all_gather", lambda inp, group: inp.new_empty(dist.get_world_size(GROUPS[group]) * inp.numel()), "Meta")
_LIB.impl("reduce_scatter", lambda inp, group: inp.new_empty(inp.numel() // dist.get_world_size(GROUPS[group])), "Meta")


def gather_unit(
    shards: list[torch.Tensor], full_rows: list[int], group: int, dtypes: list[torch.dtype | None] | None = None
) -> list[torch.Tensor]:
    """The full parameters of one unit from every rank's (unpadded) dim-0 shards: one all-gather
    per parameter of its shard padded to ``ceil(rows / world)`` rows, whose output is the padded
    full parameter (rank-major), so no copy-out is needed (FSDP2 gathers a unit at once and
    copies each parameter out; a gather is a copy, so the bits are the same). ``dtypes``: each
    parameter's gathered dtype (mixed precision's ``param_dtype``): the shard is cast into the
    padded all-gather input, as FSDP2's ``_get_param_all_gather_inputs`` copies it in."""
    world = dist.get_world_size(GROUPS[group])
    result = []
    for s, rows, dtype in zip(shards, full_rows, dtypes or [None] * len(shards), strict=True):
        chunk = padded_rows(rows, world)
        # the same ops on every rank; the padding is never read
        padded = s.new_empty((chunk, *s.shape[1:]), dtype=dtype or s.dtype)
        padded[: s.shape[0]].copy_(s)
        full = torch.ops.memplan_fsdp.all_gather(padded.view(-1), group).view(world * chunk, *s.shape[1:])
        result.append(full[:rows])
    return result


def scatter_numels(grads: list[torch.Tensor], world: int) -> list[int]:
    """Each gradient's share of one rank's reduce-scatter output (its padded shard's numel)."""
    return [padded_rows(g.shape[0], world) * _row_numel(g) for g in grads]


def reduce_scatter_unit(grads: list[torch.Tensor], group: int, reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """This rank's flat shard of the unit's gradients averaged over the ranks: FSDP2's
    ``chunk_cat`` copy-in (rank ``r``'s row: chunk ``r`` of every padded gradient, zeros past
    its last row) and its reduce-scatter. ``reduce_dtype`` (mixed precision): the buffer's dtype,
    the gradients cast into it by the copy-in (FSDP2 casts each gradient first,
    ``to_accumulated_grad_if_needed``: the same rounding, one copy fewer)."""
    world = dist.get_world_size(GROUPS[group])
    numels = scatter_numels(grads, world)
    inp = grads[0].new_empty((world, sum(numels)), dtype=reduce_dtype or grads[0].dtype)  # padding: never read
    offset = 0
    for g, n in zip(grads, numels, strict=True):
        rows, row_numel = g.shape[0], _row_numel(g)
        chunk = padded_rows(rows, world)
        for r in range(world):
            lo, hi = min(r * chunk, rows), min((r + 1) * chunk, rows)
            if hi > lo:
                inp[r, offset : offset + (hi - lo) * row_numel].copy_(g[lo:hi].reshape(-1))
        offset += n
    return torch.ops.memplan_fsdp.reduce_scatter(inp.view(-1), group)
