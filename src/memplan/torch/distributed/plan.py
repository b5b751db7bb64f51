"""Plan one rank's data-parallel training step: DDP's gradient buckets on a communication stream.

A captured training step (:mod:`memplan.torch.capture`) becomes a two-stream step with
:func:`memplan.streams.data_parallel_step`: per bucket, an asynchronous all-reduce on stream 1
reading and writing the bucket's gradients in place, and its wait on the compute stream before
the first op that reads a reduced gradient; each bucket's gradients form one contiguous group.
Then, as for one stream (:mod:`memplan.pipeline`), but with SOMAS's safety (Lamprou et al. 2023):

1. the order: memplan's reordering of the two-stream graph (OLLA 3.2; its early weight updates,
   OLLA 4.3, only add edges, so every update stays after its bucket's wait), each optimizer
   update group made contiguous (the runtime runs it as one ``optimizer.step()``), then every
   all-reduce moved to just after its last gradient is ready and every wait to just before
   the first op that needs it (0-byte ops: the move changes no lifetime, it only gives the
   communication the most time to overlap the backward), then the waits delayed by the wait
   policy (:func:`delay_waits`: a memory-optimal order may update a bucket's parameters right
   after its all-reduce, leaving the compute thread nothing to do while it runs);
2. offsets safe in every execution of the two streams, each bucket one block
   (:func:`memplan.streams.plan_stream_placement`), checked by enumerating executions
   (:func:`memplan.streams.validate_stream_placement`), which trusts no safe-pair analysis.

The buckets are DDP's steady-state buckets: from its second iteration on, DDP rebuilds them in
the order the gradients became ready in the first backward (autograd's order, which the
capture records), closing the first at ``first_bucket_cap_bytes`` (1 MiB when ``bucket_cap_mb``
is left to its default) and every later one at ``bucket_cap_bytes``.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from memplan.errors import MemplanError
from memplan.graph.check import validate_order
from memplan.graph.ir import Graph, OpId, TensorId
from memplan.graph.liveness import peak_bytes
from memplan.pipeline import _resident_peak, make_groups_contiguous
from memplan.streams import (
    data_parallel_step,
    is_collective,
    is_wait,
    plan_stream_placement,
    validate_stream_placement,
    validate_streams,
    waits_of,
)
from memplan.torch.capture import Capture

ARENA_ALIGNMENT_BYTES = 64
DEFAULT_BUCKET_CAP_MB = 25
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
WAIT_POLICIES = ("earliest", "next-bucket", "end-of-backward")


def bucket_caps(bucket_cap_mb: float | None) -> tuple[int, int]:
    """``(bucket_cap_bytes, first_bucket_cap_bytes)`` as DDP derives them from ``bucket_cap_mb``
    (``_BucketCapacityConfig.create``: a smaller first bucket only with the default size)."""
    cap = int((DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * 1024 * 1024)
    if cap <= 0:
        raise MemplanError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
    return cap, DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap


@dataclass(frozen=True)
class BucketLayout:
    """One bucket as it lies in the arena: ``gradients`` back to back from ``offset_bytes``
    (members at sizes padded to the arena's alignment), ``size_bytes`` in all."""

    name: str
    all_reduce: OpId  # op of the step graph
    wait: OpId
    parameters: tuple[str, ...]  # the model's parameter names, in layout order
    gradients: tuple[TensorId, ...]
    offset_bytes: int
    size_bytes: int
    gradient_bytes: int  # the gradients' own bytes (DDP's bucket size)


@dataclass(frozen=True)
class DataParallelPlan:
    """What every rank runs: the two-stream ``step`` graph in ``order`` (its op ids), every
    planned tensor at ``offsets`` in an arena of ``arena_bytes``, the buckets, and the report."""

    step: Graph
    order: tuple[int, ...]
    offsets: dict[TensorId, int]
    arena_bytes: int
    buckets: tuple[BucketLayout, ...]
    fingerprint: str
    outside_tensors: frozenset[TensorId] = frozenset()  # left to the allocator (no arena kernel)
    report: dict[str, Any] = field(default_factory=dict)


def capture_fingerprint(capture: Capture) -> str:
    """A digest of the captured graph (ops, their tensors, sizes): ranks that capture the same
    model and batch shapes get the same one, so one rank's plan is valid on all of them."""
    digest = hashlib.sha256()
    for op in capture.graph.ops:
        digest.update(f"{op.name}|{op.kind}|{op.inputs}|{op.outputs}|{op.mutates}\n".encode())
    for t in capture.graph.tensors:
        digest.update(f"{t.name}|{t.size_bytes}|{t.category.value}|{t.persistent}\n".encode())
    return digest.hexdigest()


def ready_order_pairs(capture: Capture) -> list[tuple[TensorId, TensorId]]:
    """``(parameter, gradient)`` of every parameter that gets a gradient, in the order autograd
    accumulated the gradients in the captured backward: capture's post-accumulate-grad hooks
    recorded them in that order, the order in which DDP's own autograd hooks mark them ready
    (and so the order DDP rebuilds its buckets in)."""
    graph = capture.graph
    index = graph.tensor_index
    pairs = []
    for name, key in capture.grad_storage_by_param.items():
        param = index.get(f"param:{name}")
        grad = capture.tensor_of_storage.get(key)
        if param is None or grad is None:
            raise MemplanError(f"capture lost track of parameter {name!r} or its gradient; please report it")
        pairs.append((param, grad))
    return pairs


def plan_data_parallel(
    capture: Capture,
    *,
    update_groups: Sequence[Sequence[int]] = (),
    allocator_tensors: Collection[int] = frozenset(),
    bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_MB * 1024 * 1024,
    first_bucket_cap_bytes: int | None = DEFAULT_FIRST_BUCKET_BYTES,
    waits: str = "next-bucket",
    reorder: bool = True,
    time_limit_seconds: float = 10.0,
    samples: int = 32,
) -> DataParallelPlan:
    """Plan the data-parallel step of ``capture`` (module docstring). ``update_groups`` are the
    capture's optimizer update groups (capture op ids, see :func:`memplan.torch.run.interpreter.
    optimizer_update_groups`); ``allocator_tensors`` the tensors the runtime cannot write into
    the arena (a bucket's gradients are placed there all the same: their op's result is copied
    into the bucket, as DDP copies it). ``waits`` (one of :data:`WAIT_POLICIES`) says where a
    bucket's wait may go, and so how early the updates it gates may run:

    * ``"earliest"``: wherever the reordering puts it (the smallest peak: a bucket's updates may
      run right after its all-reduce, whose time the compute stream then waits out);
    * ``"next-bucket"``: after the next bucket's all-reduce is launched, so each all-reduce
      overlaps the backward of the next bucket (two buckets of gradients live at a time, not one);
    * ``"end-of-backward"``: after the last all-reduce is launched, as DDP waits at the end of
      the backward (every gradient lives until then).

    A policy moves waits (and the updates behind them) later in the reordered step, which may
    raise its peak; placement is solved on the final order, so the plan's claim includes that.
    """
    if waits not in WAIT_POLICIES:
        raise MemplanError(f"unknown wait policy {waits!r}; choose one of {', '.join(WAIT_POLICIES)}")
    t0 = time.perf_counter()
    pairs = ready_order_pairs(capture)
    param_name = {p: capture.graph.tensors[p].name.partition(":")[2] for p, _ in pairs}
    # data_parallel_step takes parameter order and reverses it, as DDP does without a rebuild
    step = data_parallel_step(
        capture.graph,
        bucket_cap_bytes,
        first_bucket_cap_bytes,
        pairs=pairs[::-1],
    )
    validate_streams(step)
    order, schedule = _order(step, capture, update_groups, reorder, time_limit_seconds, waits)
    bucket_grads = {t for b in step.meta["buckets"] for t in _ids(step, b["gradients"])}
    exclude = frozenset(TensorId(t) for t in allocator_tensors) - bucket_grads
    placed = plan_stream_placement(step, order, exclude=exclude, time_limit_seconds=time_limit_seconds)
    check = validate_stream_placement(step, placed.offsets, order, samples=samples)
    if not check.safe:
        raise MemplanError(f"the data-parallel placement failed its execution check: {check.failures[0]}")
    offsets = placed.offsets
    buckets = tuple(_layout(step, b, offsets, param_name) for b in step.meta["buckets"])
    outside = _resident_peak(step, list(order), exclude)
    report = {
        "num_ops": step.num_ops,
        "buckets": len(buckets),
        "bucket_bytes": [b.gradient_bytes for b in buckets],
        "bucket_cap_bytes": bucket_cap_bytes,
        "first_bucket_cap_bytes": first_bucket_cap_bytes,
        "waits": waits,
        "persistent_bytes": step.persistent_bytes,
        "arena_bytes": placed.arena_bytes,
        "arena_lower_bound_bytes": placed.lower_bound_bytes,
        "allocator_tensor_bytes": sum(step.tensors[t].size_bytes for t in exclude),
        "allocator_peak_bytes": outside,
        "planned_peak_bytes": step.persistent_bytes + placed.arena_bytes + outside,
        "schedule": schedule,
        "placement": {
            "method": placed.placement.method,
            "status": placed.placement.status,
            "gap": round(placed.placement.gap, 6),
            "seconds": round(placed.placement.seconds, 3),
            "interval_cover": placed.interval_cover,
        },
        "stream_check": {"exhaustive": check.exhaustive, "states": check.states, "safe": check.safe},
        "unsafe_pairs": placed.stream_problem.safety.num_unsafe,
        "plan_seconds": round(time.perf_counter() - t0, 3),
    }
    return DataParallelPlan(
        step, tuple(order), offsets, placed.arena_bytes, buckets, capture_fingerprint(capture), exclude, report
    )


def _ids(graph: Graph, names: Sequence[str]) -> list[TensorId]:
    index = graph.tensor_index
    return [index[n] for n in names]


def _order(
    step: Graph,
    capture: Capture,
    update_groups: Sequence[Sequence[int]],
    reorder: bool,
    time_limit_seconds: float,
    waits: str,
) -> tuple[list[OpId], dict[str, Any]]:
    if reorder:
        from memplan.schedule import optimize_order

        result = optimize_order(step, time_limit_seconds=time_limit_seconds)
        order = list(result.order)
        schedule = {"method": result.method, "status": result.status, "seconds": round(result.seconds, 3)}
    else:
        order = step.program_order()
        schedule = {"method": "program-order", "status": "heuristic", "seconds": 0.0}
    step_id = step.op_index
    groups = [[step_id[capture.graph.ops[v].name] for v in g] for g in update_groups]
    order = communicate_early_wait_late(step, make_groups_contiguous(order, groups))
    schedule["peak_bytes"] = peak_bytes(step, order)
    order = delay_waits(step, order, waits, groups)
    validate_order(step, order)
    schedule["delayed_peak_bytes"] = peak_bytes(step, order)
    return order, schedule


def communicate_early_wait_late(graph: Graph, order: Sequence[int]) -> list[OpId]:
    """``order`` with each collective moved to just after its last predecessor (the stream runs
    them in that order: as their inputs become ready) and each wait to just before its first
    successor (waits before the same op in launch order). Both only
    make 0-byte control tensors, so no tensor's lifetime changes; the collective gets all the
    time from the moment its inputs exist to the moment its result is needed."""
    comm = [v for v in order if is_collective(graph.ops[v])]
    waits = [v for v in order if is_wait(graph.ops[v])]
    moved = set(comm) | set(waits)
    base = [OpId(v) for v in order if v not in moved]
    position = {v: i for i, v in enumerate(base)}
    preds, succs = graph.predecessors, graph.successors
    ready = {c: max((position[p] for p in preds[c] if p in position), default=-1) for c in comm}
    launch = sorted(comm, key=ready.__getitem__)  # the stream's order: as its inputs become ready
    after: dict[int, list[OpId]] = {}  # base position -> collectives right after it
    for c in launch:
        after.setdefault(ready[c], []).append(OpId(c))
    before: dict[int, list[OpId]] = {}  # base position -> waits right before it
    launched = {c: i for i, c in enumerate(launch)}
    for w in waits:
        first = min((position[s] for s in succs[w] if s in position), default=len(base))
        before.setdefault(first, []).append(OpId(w))
    result: list[OpId] = []
    for c in after.get(-1, []):
        result.append(c)
    for i, v in enumerate([*base, None]):  # type: ignore[operator]
        for w in sorted(before.get(i, []), key=lambda w: launched.get(_collective_of(graph, w), 0)):
            result.append(w)
        if v is None:
            break
        result.append(v)
        result.extend(after.get(i, []))
    return result


def delay_waits(graph: Graph, order: Sequence[int], policy: str, groups: Sequence[Sequence[int]]) -> list[OpId]:
    """``order`` with waits moved later by ``policy`` (see :func:`plan_data_parallel`): with
    "next-bucket", each bucket's wait after the launch of the next bucket's all-reduce; with
    "end-of-backward", every wait after the last launch. A wait moves with every op of the
    span it crosses that depends on it, and with the whole update group of any such op (the
    runtime runs a group as one call); a move that would carry an op the target launch needs
    is not made. Lifetimes change, so placement must follow this."""
    order = [OpId(v) for v in order]
    if policy == "earliest":
        return order
    group_of = {v: k for k, g in enumerate(groups) for v in g}
    members = [set(g) for g in groups]
    launch = [v for v in order if is_collective(graph.ops[v])]
    for k, collective in enumerate(launch[:-1]):
        target = launch[k + 1] if policy == "next-bucket" else launch[-1]
        for wait in waits_of(graph, collective):
            order = _move_after(graph, order, wait, target, group_of, members)
    return order


def _move_after(
    graph: Graph, order: list[OpId], wait: int, target: int, group_of: dict[int, int], members: list[set[int]]
) -> list[OpId]:
    """``order`` with ``wait`` and what in ``order`` between it and ``target`` depends on it
    (closed under update groups) moved to just after ``target``, when that is possible."""
    position = {v: i for i, v in enumerate(order)}
    lo, hi = position[wait], position[target]
    if lo > hi:
        return order
    window = order[lo : hi + 1]
    inside = set(window)
    moved = {wait}
    changed = True
    while changed:
        changed = False
        for v in window:
            if v in moved:
                continue
            mates = members[group_of[v]] if v in group_of else set()
            if any(p in moved for p in graph.predecessors[v]) or any(m in moved for m in mates & inside):
                moved.add(v)
                changed = True
    if target in moved or any(p in moved for p in graph.predecessors[target]):
        return order
    kept = [v for v in window if v not in moved]
    result = order[:lo] + kept + [v for v in window if v in moved] + order[hi + 1 :]
    try:
        validate_order(graph, result)
    except MemplanError:
        return order
    return result


def _collective_of(graph: Graph, wait: int) -> int:
    preds = [p for p in graph.predecessors[wait] if is_collective(graph.ops[p])]
    return preds[0] if preds else -1


def _layout(step: Graph, bucket: dict[str, Any], offsets: dict[TensorId, int], param_name: dict) -> BucketLayout:
    """The bucket's block in the arena, checked to be one contiguous run of its gradients."""
    grads = _ids(step, bucket["gradients"])
    index = step.tensor_index
    start = offsets[grads[0]]
    cursor = start
    for g in grads:
        if offsets[g] != cursor:
            raise MemplanError(f"bucket {bucket['name']}'s gradients are not back to back in the arena")
        cursor += -(-step.tensors[g].size_bytes // ARENA_ALIGNMENT_BYTES) * ARENA_ALIGNMENT_BYTES
    op_index = step.op_index
    return BucketLayout(
        bucket["name"],
        op_index[bucket["all_reduce"]],
        op_index[bucket["wait"]],
        tuple(param_name[index[p]] for p in bucket["parameters"]),
        tuple(grads),
        start,
        cursor - start,
        sum(step.tensors[g].size_bytes for g in grads),
    )
