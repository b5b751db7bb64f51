"""Memory snapshots in the layout of ``torch.cuda.memory._snapshot()``, for PyTorch's memory
visualizer (https://pytorch.org/memory_viz, ``python -m torch.cuda._memory_viz``).

A snapshot is a dict: ``segments`` (the allocator's state when the snapshot is taken: each
segment a run of ``blocks``, active or inactive, that tile it) and ``device_traces`` (one list
per device of the events that led there: ``segment_alloc``, ``alloc``, ``free_requested``,
``free_completed``, ``segment_free``, each with ``addr``, ``size``, ``stream`` and ``frames``).
The viewer replays the events backwards from the segments, so every block an event touches
must lie in a segment that is mapped at that moment; :func:`check_snapshot` checks this and
the rest apart from the builders.

Three builders, one per source:

* :func:`plan_snapshot`: the plan itself, as memplan states it. Every planned tensor is a
  block of one arena segment at ``arena_address + offset``, allocated when its producer runs
  and freed after its last reader (the lifetimes of :mod:`memplan.graph.liveness`, one event
  time per op of the order); tensors left to PyTorch's allocator (``outside``) and the
  persistent ones (parameters, optimizer state, batch) are segments of their own. Frames
  name the op, its kind and the tensor's category. Addresses are made up (the arena at
  :data:`PLAN_ARENA_ADDRESS` unless given), sizes and times are the plan's.
* :func:`eager_snapshot`: one real eager step on the CPU, observed with the PyTorch profiler's
  memory events (``profile_memory=True``): every allocation and free of PyTorch's CPU
  allocator, with its real address and size, in order, attributed to the profiler spans
  (ATen ops, autograd nodes, ``record_function`` ranges) open on its thread at that moment,
  innermost first. PyTorch's CPU allocator keeps no cache, so each allocation is its own
  segment (``segment_alloc`` before the ``alloc``, ``segment_free`` after the free):
  reserved equals allocated, as it does on the CPU. Tensors alive before the step (pass
  them as ``persistent``) are segments at the end.
* :func:`replay_snapshot`: a step of memplan's planned CPU allocator
  (:class:`memplan.torch.run.replay.ReplayedStep`): the allocation sequence it recorded, each
  allocation at the arena offset it is replayed at (the real arena's address), the ones
  outside the arena (alive after the step) as segments of their own at made-up addresses
  after it. The allocator records sizes and order only, so frames say which allocation of
  the step it is, not which op made it.
"""

from __future__ import annotations

import bisect
import json
import os
import pickle
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memplan.errors import MemplanError
from memplan.graph.ir import Graph
from memplan.graph.liveness import lifetimes

PLAN_ARENA_ADDRESS = 0x7F0000000000  # where plan_snapshot puts the arena (made-up, page aligned)
SEPARATE_ADDRESS_GAP = 1 << 20  # gap between made-up addresses of separate segments
DEVICE = 0  # the snapshot's device index (the CPU's trace goes in device_traces[0])


class SnapshotError(MemplanError):
    """A snapshot breaks a rule of the memory visualizer's format (one line: which, where)."""


# --------------------------------------------------------------------------- building blocks


def frame(name: str, filename: str = "memplan", line: int = 0) -> dict[str, Any]:
    """One stack frame as the visualizer prints it: ``filename:line:name``."""
    return {"filename": filename, "line": int(line), "name": name}


@dataclass(frozen=True)
class Allocation:
    """One allocation of a snapshot: where, how big, when (event times), and why."""

    address: int
    size_bytes: int
    alloc_at: int | None  # event time; None: allocated before the snapshot's trace began
    free_at: int | None  # event time; None: still alive when the snapshot is taken
    frames: tuple[dict[str, Any], ...] = ()
    segment: int | None = None  # address of the shared segment it lies in (None: its own)


@dataclass(frozen=True)
class Segment:
    """A segment that exists for the whole trace (an arena)."""

    address: int
    size_bytes: int
    frames: tuple[dict[str, Any], ...] = ()


def build_snapshot(allocations: Iterable[Allocation], shared: Iterable[Segment] = ()) -> dict[str, Any]:
    """The snapshot dict of ``allocations``: events in time order (allocations without a segment
    of their own are mapped and unmapped with them) and the segments alive at the end, each
    tiled by its active blocks and inactive gaps."""
    allocations = [a for a in allocations if a.size_bytes > 0]
    shared = list(shared)
    events: list[tuple[int, int, list[dict[str, Any]]]] = []
    for k, a in enumerate(allocations):
        if a.alloc_at is not None:
            events.append((a.alloc_at, 1, _alloc_events(a, k)))
        if a.free_at is not None:
            events.append((a.free_at, 0, _free_events(a, k)))
    events.sort(key=lambda e: (e[0], e[1]))  # frees before allocations at the same time
    trace = [event for _, _, batch in events for event in batch]
    alive = [a for a in allocations if a.free_at is None]
    segments = [_shared_segment(s, [a for a in alive if a.segment == s.address]) for s in shared]
    segments += [_own_segment(a) for a in alive if a.segment is None]
    segments.sort(key=lambda s: s["address"])
    return {"segments": segments, "device_traces": [trace], "allocator_settings": {}}


def _event(action: str, address: int, size: int, time: int, frames: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {"action": action, "addr": address, "size": size, "stream": 0, "time_us": time, "frames": list(frames)}


def _alloc_events(a: Allocation, k: int) -> list[dict[str, Any]]:
    events = [] if a.segment is not None else [_event("segment_alloc", a.address, a.size_bytes, a.alloc_at, a.frames)]
    return [*events, _event("alloc", a.address, a.size_bytes, a.alloc_at, a.frames)]


def _free_events(a: Allocation, k: int) -> list[dict[str, Any]]:
    events = [
        _event("free_requested", a.address, a.size_bytes, a.free_at, a.frames),
        _event("free_completed", a.address, a.size_bytes, a.free_at, a.frames),
    ]
    if a.segment is None:
        events.append(_event("segment_free", a.address, a.size_bytes, a.free_at, a.frames))
    return events


def _block(address: int, size: int, active: bool, frames: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    return {
        "address": address,
        "size": size,
        "requested_size": size if active else 0,
        "state": "active_allocated" if active else "inactive",
        "frames": list(frames),
    }


def _segment(address: int, size: int, blocks: list[dict[str, Any]], frames: Sequence[dict[str, Any]]) -> dict:
    active = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return {
        "device": DEVICE,
        "address": address,
        "total_size": size,
        "allocated_size": active,
        "active_size": active,
        "requested_size": active,
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 0),
        "is_expandable": False,
        "frames": list(frames),
        "blocks": blocks,
    }


def _own_segment(a: Allocation) -> dict[str, Any]:
    return _segment(a.address, a.size_bytes, [_block(a.address, a.size_bytes, True, a.frames)], a.frames)


def _shared_segment(s: Segment, alive: list[Allocation]) -> dict[str, Any]:
    blocks, cursor = [], s.address
    for a in sorted(alive, key=lambda a: a.address):
        if a.address > cursor:
            blocks.append(_block(cursor, a.address - cursor, False))
        blocks.append(_block(a.address, a.size_bytes, True, a.frames))
        cursor = a.address + a.size_bytes
    if cursor < s.address + s.size_bytes:
        blocks.append(_block(cursor, s.address + s.size_bytes - cursor, False))
    return _segment(s.address, s.size_bytes, blocks, s.frames)


class _Addresses:
    """Made-up addresses for separate segments: increasing, never reused, page aligned."""

    def __init__(self, start: int) -> None:
        self.next = start

    def take(self, size: int) -> int:
        address = self.next
        self.next += -(-max(size, 1) // 4096) * 4096 + SEPARATE_ADDRESS_GAP
        return address


# --------------------------------------------------------------------------- the plan


def plan_snapshot(
    graph: Graph,
    order: Sequence[int],
    offsets: Mapping[int, int],
    arena_bytes: int,
    *,
    phases: Sequence[str] | None = None,
    arena_address: int = PLAN_ARENA_ADDRESS,
) -> dict[str, Any]:
    """The plan ``(order, offsets, arena_bytes)`` of ``graph`` as a snapshot (module docstring).
    ``phases[op]`` ("forward", "backward", ...) goes into the frames when given."""
    position = {op: i for i, op in enumerate(order)}
    addresses = _Addresses(arena_address + _round_up(arena_bytes) + SEPARATE_ADDRESS_GAP)
    allocations = []
    for life in lifetimes(graph, order):
        tensor = graph.tensors[life.tensor]
        if tensor.size_bytes == 0:
            continue
        producer = graph.producer[life.tensor]
        frames = _tensor_frames(graph, life.tensor, producer, position.get(producer, 0), phases)
        if tensor.persistent:
            allocations.append(Allocation(addresses.take(tensor.size_bytes), tensor.size_bytes, None, None, frames))
            continue
        free_at = None if life.end >= len(order) and tensor.category.value == "output" else life.end
        if life.tensor in offsets:
            address, segment = arena_address + offsets[life.tensor], arena_address
        else:
            address, segment = addresses.take(tensor.size_bytes), None
        allocations.append(Allocation(address, tensor.size_bytes, life.start, free_at, frames, segment))
    arena = Segment(arena_address, arena_bytes, (frame(f"memplan arena ({arena_bytes} bytes)", "memplan:arena"),))
    return build_snapshot(allocations, [arena] if arena_bytes else [])


def _tensor_frames(
    graph: Graph, tensor: int, producer: int, position: int, phases: Sequence[str] | None
) -> tuple[dict[str, Any], ...]:
    t, op = graph.tensors[tensor], graph.ops[producer]
    where = f"memplan:{phases[producer]}" if phases is not None else "memplan"
    return (
        frame(f"{t.name} [{t.category.value}]", where, position),
        frame(f"{op.name} = {op.kind}", where, position),
    )


def _round_up(size: int, page: int = 4096) -> int:
    return -(-size // page) * page


# --------------------------------------------------------------------------- a real eager step


def eager_snapshot(step: Callable[[], Any], persistent: Mapping[str, Any] | None = None) -> tuple[dict, Any]:
    """Run ``step()`` once under the PyTorch profiler with memory events and return the
    snapshot of what PyTorch's CPU allocator did (module docstring) and ``step``'s result.
    ``persistent``: name -> tensor (or nested tensors) alive before the step (parameters,
    optimizer state, the batch), shown as segments of their own."""
    from torch.profiler import ProfilerActivity, profile

    from memplan.torch.measure import quiet_profiler

    quiet_profiler()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        result = step()
    events = _chrome_events(prof)
    allocations = allocations_from_profile(events)
    seen = {a.address for a in allocations if a.free_at is None or a.alloc_at is None}
    allocations += [a for a in _persistent_allocations(persistent or {}) if a.address not in seen]
    return build_snapshot(allocations), result


def _chrome_events(prof: Any) -> list[dict[str, Any]]:
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)


def allocations_from_profile(events: Sequence[dict[str, Any]]) -> list[Allocation]:
    """The allocations of a profiler trace's ``[memory]`` events (CPU only), paired by address
    in event order, each with the spans open on its thread when it was made (or freed, for
    one made before the trace) as frames, innermost first."""
    memory = sorted(
        (e for e in events if e.get("name") == "[memory]" and _on_cpu(e)),
        key=lambda e: (float(e["ts"]), int(e["args"].get("Ev Idx", 0))),
    )
    spans = _SpanIndex(e for e in events if e.get("ph") == "X")
    open_allocs: dict[int, tuple[int, int, tuple]] = {}
    allocations: list[Allocation] = []
    for time, e in enumerate(memory):
        address, size = int(e["args"]["Addr"]), int(e["args"]["Bytes"])
        frames = spans.frames(e.get("tid"), float(e["ts"]))
        if size > 0:
            open_allocs[address] = (time, size, frames)
        elif address in open_allocs:
            start, alloc_size, alloc_frames = open_allocs.pop(address)
            allocations.append(Allocation(address, alloc_size, start, time, alloc_frames))
        else:  # made before the trace began
            allocations.append(Allocation(address, -size, None, time, frames))
    for address, (start, size, frames) in open_allocs.items():
        allocations.append(Allocation(address, size, start, None, frames))
    return allocations


def _on_cpu(event: dict[str, Any]) -> bool:
    args = event.get("args", {})
    return {"Addr", "Bytes"} <= args.keys() and int(args.get("Device Type", 0)) == 0


class _SpanIndex:
    """The profiler's complete events ("X") per thread, to find the spans open at a time."""

    def __init__(self, spans: Iterable[dict[str, Any]]) -> None:
        by_thread: dict[Any, list[tuple[float, float, str, str]]] = {}
        for s in spans:
            start = float(s["ts"])
            by_thread.setdefault(s.get("tid"), []).append(
                (start, start + float(s.get("dur", 0)), str(s.get("name", "")), str(s.get("cat", "")))
            )
        self.spans = {tid: sorted(v, key=lambda s: (s[0], -s[1])) for tid, v in by_thread.items()}
        self.starts = {tid: [s[0] for s in v] for tid, v in self.spans.items()}

    def frames(self, tid: Any, time: float) -> tuple[dict[str, Any], ...]:
        spans = self.spans.get(tid, [])
        last = bisect.bisect_right(self.starts.get(tid, []), time)
        open_spans = [s for s in spans[:last] if s[1] >= time]
        return tuple(frame(name, cat or "profiler") for _, _, name, cat in reversed(open_spans))


def _persistent_allocations(persistent: Mapping[str, Any]) -> list[Allocation]:
    from torch.utils import _pytree as pytree

    import torch

    seen: dict[int, Allocation] = {}
    for name, value in persistent.items():
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu":
                storage = leaf.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in seen:
                    frames = (frame(name, "memplan:persistent"),)
                    seen[storage.data_ptr()] = Allocation(storage.data_ptr(), storage.nbytes(), None, None, frames)
    return list(seen.values())


# --------------------------------------------------------------------------- the planned allocator


def replay_snapshot(replayed: Any, persistent: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The allocations of a :class:`memplan.torch.run.replay.ReplayedStep` that replays (module
    docstring): its recorded trace (the plan's first branch) at the offsets it serves them from,
    in its real arena."""
    traces = getattr(replayed, "traces", [])
    plan, trace = replayed.plan, traces[0] if traces else None
    if plan is None or trace is None:
        raise SnapshotError("the planned allocator has not planned this step yet: run the step until it replays")
    arena_address = replayed.arena.data_ptr()
    held = _persistent_allocations(persistent or {})
    # made-up addresses above every real one: the arena and the persistent tensors (which the
    # C heap may have put just past the arena) are at their real addresses
    highest = max([arena_address + plan.arena_bytes, *(a.address + a.size_bytes for a in held)])
    addresses = _Addresses(_round_up(highest) + SEPARATE_ADDRESS_GAP)
    allocations = []
    for k in range(trace.num_allocations):
        size, offset = trace.sizes[k], plan.branches[0].offsets[k]
        frames = (frame(f"allocation {k} of the step ({size} bytes)", "memplan:planned-allocator", k),)
        if offset >= 0:
            address, segment = arena_address + offset, arena_address
        else:
            address, segment = addresses.take(size), None
        allocations.append(Allocation(address, size, trace.alloc_at[k], trace.free_at[k], frames, segment))
    allocations += held
    arena = Segment(arena_address, plan.arena_bytes, (frame("memplan arena (planned CPU allocator)", "memplan:arena"),))
    return build_snapshot(allocations, [arena] if plan.arena_bytes else [])


# --------------------------------------------------------------------------- check and write


def check_snapshot(snapshot: Mapping[str, Any]) -> dict[str, int]:
    """Check ``snapshot`` against the rules the visualizer relies on, from first principles;
    returns ``{"events", "peak_allocated_bytes", "peak_reserved_bytes"}`` (allocations alive
    before the trace included). Raises :class:`SnapshotError` naming the first rule broken.

    Rules: every segment is tiled by its blocks; replaying the trace from the state before it
    (the listed segments and blocks that no event of the trace creates, and what the trace
    frees without having made), every alloc lies in a mapped segment and overlaps no live
    allocation, every free frees a live allocation of its size, every segment_free unmaps a
    mapped, empty segment; at the end, the mapped segments are the listed ones and every
    live allocation is an active block of them."""
    for seg in snapshot["segments"]:
        _check_tiling(seg)
    trace = snapshot["device_traces"][DEVICE] if snapshot["device_traces"] else []
    mapped, live = _state_before(snapshot, trace)
    allocated = peak_allocated = sum(live.values())
    peak_reserved = sum(mapped.values())
    for i, e in enumerate(trace):
        action, address, size = e["action"], e["addr"], e["size"]
        if action == "segment_alloc":
            if address in mapped:
                raise SnapshotError(f"event {i}: segment {address:#x} mapped twice")
            mapped[address] = size
        elif action == "segment_free":
            if address not in mapped or any(address <= a < address + mapped[address] for a in live):
                raise SnapshotError(f"event {i}: segment {address:#x} unmapped while not mapped or not empty")
            del mapped[address]
        elif action == "alloc":
            if not _inside(mapped, address, size):
                raise SnapshotError(f"event {i}: alloc at {address:#x} ({size} B) outside every mapped segment")
            if any(a < address + size and address < a + s for a, s in live.items()):
                raise SnapshotError(f"event {i}: alloc at {address:#x} overlaps a live allocation")
            live[address] = size
            allocated += size
        elif action == "free_completed":
            if live.get(address) != size:
                raise SnapshotError(f"event {i}: free of {address:#x} ({size} B), which is not a live allocation")
            del live[address]
            allocated -= size
        peak_allocated = max(peak_allocated, allocated)
        peak_reserved = max(peak_reserved, sum(mapped.values()))
    _check_end_state(snapshot, mapped, live)
    return {"events": len(trace), "peak_allocated_bytes": peak_allocated, "peak_reserved_bytes": peak_reserved}


def _state_before(snapshot: Mapping[str, Any], trace: Sequence[Mapping[str, Any]]) -> tuple[dict, dict]:
    """Segments mapped and allocations live before the first event: the listed ones no event
    creates, and those whose first event in the trace frees them."""
    first: dict[tuple[str, int], str] = {}
    for e in trace:
        kind = "segment" if e["action"].startswith("segment") else "block"
        first.setdefault((kind, e["addr"]), e["action"])
    mapped = {
        s["address"]: s["total_size"]
        for s in snapshot["segments"]
        if first.get(("segment", s["address"]), "segment_free") == "segment_free"
    }
    live = {
        b["address"]: b["size"]
        for s in snapshot["segments"]
        for b in s["blocks"]
        if b["state"] == "active_allocated" and first.get(("block", b["address"]), "free_requested") != "alloc"
    }
    for e in trace:
        if first.get(("segment", e["addr"])) == "segment_free" and e["action"] == "segment_free":
            mapped.setdefault(e["addr"], e["size"])
        if first.get(("block", e["addr"])) == "free_requested" and e["action"] == "free_requested":
            live.setdefault(e["addr"], e["size"])
    return mapped, live


def _check_tiling(seg: Mapping[str, Any]) -> None:
    start = cursor = seg["address"]
    for b in seg["blocks"]:
        if b.get("address", cursor) != cursor:
            raise SnapshotError(f"segment {start:#x}: a block starts at {b['address']:#x}, expected {cursor:#x}")
        if b["size"] <= 0 or b["state"] not in ("active_allocated", "active_pending_free", "inactive"):
            raise SnapshotError(f"segment {start:#x}: a block of size {b['size']} in state {b['state']}")
        cursor += b["size"]
    if cursor != start + seg["total_size"]:
        raise SnapshotError(f"segment {start:#x}: its blocks cover {cursor - start} of {seg['total_size']} bytes")


def _inside(mapped: Mapping[int, int], address: int, size: int) -> bool:
    return any(s <= address and address + size <= s + n for s, n in mapped.items())


def _check_end_state(snapshot: Mapping[str, Any], mapped: dict[int, int], live: dict[int, int]) -> None:
    listed = {s["address"]: s["total_size"] for s in snapshot["segments"]}
    if listed != mapped:
        raise SnapshotError(f"the trace ends with {len(mapped)} segments mapped, the snapshot lists {len(listed)}")
    active = {
        b["address"]: b["size"] for s in snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated"
    }
    traced = {a: s for a, s in live.items()}
    missing = [a for a in traced if a not in active]
    if missing:
        raise SnapshotError(f"allocation {missing[0]:#x} is alive after the trace but no active block in the segments")


def write_snapshot(snapshot: Mapping[str, Any], path: str | Path) -> Path:
    """Pickle ``snapshot`` to ``path`` (what ``torch.cuda.memory._dump_snapshot`` writes)."""
    path = Path(path)
    if path.exists() and path.suffix not in (".pickle", ".pkl"):
        raise MemplanError(f"refusing to overwrite {path}: a snapshot must be a .pickle file")
    with open(path, "wb") as f:
        pickle.dump(dict(snapshot), f)
    return path


def read_snapshot(path: str | Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return pickle.load(f)


__all__ = [
    "PLAN_ARENA_ADDRESS",
    "Allocation",
    "Segment",
    "SnapshotError",
    "allocations_from_profile",
    "build_snapshot",
    "check_snapshot",
    "eager_snapshot",
    "plan_snapshot",
    "read_snapshot",
    "replay_snapshot",
    "write_snapshot",
]
