"""FSDP2's collectives on a communication stream: async all-gathers and reduce-scatters, their
waits and the prefetch depth as plan decisions (issue 35).

A captured FSDP2 step (:mod:`memplan.torch.distributed.fsdp`) has one ``memplan_fsdp::all_gather``
per gathered parameter and one ``memplan_fsdp::reduce_scatter`` per unit. :func:`stream_step`
makes it a two-stream step (SOMAS, Lamprou et al. 2023; :mod:`memplan.graph.multistream`) as
:func:`memplan.streams.data_parallel_step` does for DDP's buckets:

* each collective runs on stream 1 and outputs a 0-byte work handle;
* its wait (``memplan.wait``, stream 0) reads that handle *and the collective's byte inputs*
  (the padded shard, the chunk-cat gradient buffer): gloo reads them until the collective is
  done, so they live from the launch to the wait in every execution. Because the wait reads
  them on the compute stream, every unsafe pair also overlaps in the recorded order (SOMAS's
  interval cover, :func:`memplan.streams.covered_by_recorded_order`): the one estimator's
  peak of the recorded order is the step's, and the stream placement reaches it;
* every reader of the collective's output (views included) depends on the wait.

:func:`choose_streams` (rank 0) orders it (:func:`stream_order`) from its single-stream order (OLLA 3.2, the capture's
ops): pure views sunk to just before their first reader, then, as for DDP
(:func:`memplan.torch.distributed.plan.communicate_early_wait_late`), each collective launched as
soon as its inputs exist and each wait just before its first reader; then the two decisions:

* **prefetch depth** ``d`` (0, 1, 2): the gather events (a unit's gathers, forward or backward,
  in the order the step needs them) are launched ``d`` events ahead: event ``j``'s gathers, with
  the copy-in ops they read, move to just before the first wait of event ``max(0, j - d)``, as
  FSDP2's prefetch launches units up to ``k + d`` at unit ``k`` (its default: one unit ahead);
* **waits**: ``"serial"`` puts every wait right after its launch (one collective in flight, the
  synchronous plan's memory); ``"earliest"`` just before the first reader of its output;
  ``"next"`` also moves each reduce-scatter's wait (and the update that reads its shard) after
  the next collective's launch, so the reduction overlaps the backward of the next unit, as
  FSDP2 waits for a unit's reduce-scatter at the next one.

Each collective in flight also holds gloo's staging buffer (its output's size for an all-gather,
its input's for a reduce-scatter; :func:`stream_step`), counted in the planned peak. Each
candidate (:data:`CANDIDATES`) is placed (:func:`memplan.streams.plan_stream_placement`) and
the one chosen is the smallest planned peak, ties to the most overlap; under a
``memory_budget``, the most overlap whose planned peak fits (:func:`choose`). The chosen order is
checked by :func:`memplan.streams.validate_streams` and its placement by
:func:`memplan.streams.validate_stream_placement` (executions, not the safe-pair analysis).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from memplan.errors import MemplanError
from memplan.graph.check import validate_order
from memplan.graph.ir import Category, Graph, Op, OpId, Tensor, TensorId
from memplan.graph.liveness import peak_bytes
from memplan.streams.sync import WAIT_KIND, is_collective, is_wait

COMM_STREAM = 1
GATHER_KIND, SCATTER_KIND = "memplan.all_gather", "memplan.reduce_scatter"
FSDP_KINDS = {"memplan_fsdp.all_gather": GATHER_KIND, "memplan_fsdp.reduce_scatter": SCATTER_KIND}
PREFETCH_DEPTHS = (0, 1, 2)
WAIT_POLICIES = ("serial", "earliest", "next")
CANDIDATES = ((0, "serial"), (0, "earliest"), (0, "next"), (1, "next"), (2, "next"))
STAGING_SUFFIX = ".staging"


def fsdp_kind(op: Op) -> str | None:
    """``memplan.all_gather`` / ``memplan.reduce_scatter`` for a captured FSDP2 collective, else None."""
    base = op.kind.rsplit(".", 1)[0] if op.kind.count(".") > 1 else op.kind
    return FSDP_KINDS.get(base)


def staging_bytes(graph: Graph, op: Op) -> int:
    """gloo's staging buffer of the collective ``op``: its output's size for an all-gather, its
    input's for a reduce-scatter (the larger of the two, measured: ``allocator_peak_bytes`` of one
    ``all_gather_single`` is its output's bytes)."""
    size = graph.tensors
    return max(sum(size[t].size_bytes for t in dict.fromkeys(op.inputs)), sum(size[t].size_bytes for t in op.outputs))


def stream_step(graph: Graph) -> Graph:
    """``graph`` (a captured FSDP2 step) as a two-stream step (module docstring): each wait listed
    right after its collective; :func:`step_ids` maps the capture's op ids to the step's. Each
    collective also outputs gloo's staging buffer (``NAME.staging``, read by the wait): gloo runs
    an all-gather through a buffer of its output's size and a reduce-scatter through one of its
    input's (measured: ``allocator_peak_bytes`` of one ``all_gather_single`` is its output's bytes),
    so every collective in flight holds one; they are left to the allocator
    (:func:`staging_tensors`) and counted in the plan's peak."""
    ops, tensors = list(graph.ops), list(graph.tensors)
    names = {t.name for t in tensors}

    def control(name: str) -> TensorId:
        while name in names:
            name += "'"
        names.add(name)
        tensors.append(Tensor(name, 0, Category.CONTROL))
        return TensorId(len(tensors) - 1)

    waits: dict[int, Op] = {}
    for c, op in enumerate(graph.ops):
        kind = fsdp_kind(op)
        if kind is None:
            continue
        work, ready = control(f"{op.name}.work"), control(f"{op.name}.ready")
        held = tuple(dict.fromkeys(t for t in op.inputs if graph.tensors[t].size_bytes > 0))
        staged = staging_bytes(graph, op)
        names.add(f"{op.name}{STAGING_SUFFIX}")
        tensors.append(Tensor(f"{op.name}{STAGING_SUFFIX}", staged, Category.TEMPORARY))
        staging = TensorId(len(tensors) - 1)
        ops[c] = dataclasses.replace(op, kind=kind, outputs=(*op.outputs, work, staging), stream=COMM_STREAM)
        waits[c] = Op(f"wait:{op.name}", WAIT_KIND, (work, staging, *held), (ready,), 0)
        for t in op.outputs:
            for r in graph.consumers[t]:
                if r != c and ready not in ops[r].inputs:
                    ops[r] = dataclasses.replace(ops[r], inputs=(*ops[r].inputs, ready))
    listed = [o for v, op in enumerate(ops) for o in ((op, waits[v]) if v in waits else (op,))]
    return Graph(tuple(listed), tuple(tensors), graph.name, {**graph.meta, "fsdp_streams": True})


def staging_tensors(step: Graph) -> frozenset[TensorId]:
    """gloo's staging buffer of each collective (:func:`stream_step`): its own allocation, outside the arena."""
    return frozenset(TensorId(t) for t, x in enumerate(step.tensors) if x.name.endswith(STAGING_SUFFIX))


def step_ids(graph: Graph, step: Graph) -> list[OpId]:
    """``step_ids[v]``: the id in ``step`` (:func:`stream_step`) of the capture's op ``v``."""
    index = step.op_index
    return [index[op.name] for op in graph.ops]


def wait_of(step: Graph) -> dict[OpId, OpId]:
    """Each collective's wait (step op ids)."""
    from memplan.streams.sync import waits_of

    return {OpId(c): waits_of(step, c)[0] for c, op in enumerate(step.ops) if op.kind in (GATHER_KIND, SCATTER_KIND)}


# ---------------------------------------------------------------- order


def is_pure_view(graph: Graph, op: Op) -> bool:
    """An op that makes only 0-byte results (aliases, control edges) and writes nothing: a view."""
    return (
        not op.mutates
        and bool(op.outputs)
        and all(graph.tensors[t].size_bytes == 0 for t in op.outputs)
        and not is_collective(op)
        and not is_wait(op)
        and bool(op.inputs)
    )


def sink_views(graph: Graph, order: Sequence[int], movable: Collection[int]) -> list[OpId]:
    """``order`` with each pure view of ``movable`` moved to just before its first reader (last
    first, so a chain of views follows its reader). A view reads nothing: every reader of its
    result reads the viewed storage too, so no tensor's lifetime changes; a collective's wait
    can then go after the views of its output are made."""
    position = {v: i for i, v in enumerate(order)}
    anchor: dict[int, int] = {}  # a sunk view -> the position of the op it goes just before
    for v in reversed(order):
        if v in movable and is_pure_view(graph, graph.ops[v]) and graph.successors[v]:
            anchor[v] = min(anchor.get(s, position[s]) for s in graph.successors[v])
    key = {v: (anchor[v], 0, i) if v in anchor else (i, 1, i) for v, i in position.items()}
    result = sorted((OpId(v) for v in order), key=key.__getitem__)
    validate_order(graph, result)
    return result


def gather_events(step: Graph, unit_of_param: Mapping[str, int]) -> list[list[OpId]]:
    """The all-gathers grouped into gather events (one unit gathered once: its parameters'
    gathers, consecutive in program order), in program order. A gather's parameter is the
    ``param:NAME`` tensor its copy-in reads (a few ops up); its unit, ``unit_of_param[NAME]``."""
    events: list[list[OpId]] = []
    current: tuple[int, set[str]] | None = None
    for c, op in enumerate(step.ops):
        if op.kind != GATHER_KIND:
            continue
        name = _gathered_param(step, c)
        unit = unit_of_param.get(name, -1 - c) if name else -1 - c
        if current is None or current[0] != unit or name in current[1] or unit < 0:
            events.append([])
            current = (unit, set())
        events[-1].append(OpId(c))
        current[1].add(name or "")
    return events


def _gathered_param(graph: Graph, c: int, depth: int = 6) -> str | None:
    frontier, seen = [c], {c}
    for _ in range(depth):
        nxt = []
        for v in frontier:
            for t in graph.ops[v].inputs:
                name = graph.tensors[t].name
                if name.startswith("param:"):
                    return name.removeprefix("param:")
                p = graph.producer[t]
                if p not in seen:
                    seen.add(p)
                    nxt.append(p)
        frontier = nxt
    return None


def hoist(graph: Graph, order: list[OpId], op: int, before: int) -> list[OpId]:
    """``order`` with ``op`` and its ancestors between ``before`` (a position) and it moved, in
    their order, to position ``before``: always a valid order (the moved set is closed under
    predecessors within the window, and nothing before the window reads it)."""
    position = {v: i for i, v in enumerate(order)}
    here = position[op]
    if here < before:
        return order
    window = order[before : here + 1]
    inside = set(window)
    moved = {op}
    for v in reversed(window):
        if v in moved:
            moved.update(p for p in graph.predecessors[v] if p in inside)
    first = [v for v in window if v in moved]
    return order[:before] + first + [v for v in window if v not in moved] + order[here + 1 :]


def prefetch(step: Graph, order: list[OpId], events: Sequence[Sequence[int]], depth: int) -> list[OpId]:
    """Each gather event launched ``depth`` events ahead (FSDP2's prefetch: unit ``k``'s pre-hook
    launches the gathers of units up to ``k + depth``): event ``j``'s gathers, with the copy-in
    they read, moved to just before the first wait of event ``max(0, j - depth)``, events taken
    in the order the step first waits for them."""
    if depth <= 0 or len(events) <= 1:
        return order
    waits = wait_of(step)
    position = {v: i for i, v in enumerate(order)}
    by_need = sorted(events, key=lambda e: min(position[waits[c]] for c in e))
    for j in range(1, len(by_need)):
        position = {v: i for i, v in enumerate(order)}
        need = min(position[waits[c]] for c in by_need[max(0, j - depth)])
        for c in by_need[j]:
            order = hoist(step, order, c, need)
            need = order.index(c) + 1
    validate_order(step, order)
    return order


def serial(step: Graph, order: Sequence[int]) -> list[OpId]:
    """``order`` with each wait right after its collective: one collective in flight at a time,
    nothing overlapped (the synchronous plan's memory, gloo's staging included)."""
    waits = wait_of(step)
    result: list[OpId] = []
    for v in order:
        if is_wait(step.ops[v]):
            continue
        result.append(OpId(v))
        if v in waits:
            result.append(waits[v])
    return result


def delay_waits(step: Graph, order: list[OpId], groups: Sequence[Sequence[int]]) -> list[OpId]:
    """Each reduce-scatter's wait (with what depends on it before the target, closed under the
    update groups) moved after the launch of the next collective (DDP's "next-bucket" policy,
    :func:`memplan.torch.distributed.plan._move_after`; a move that would carry an op the
    target needs is not made)."""
    from memplan.torch.distributed.plan import _move_after

    group_of = {v: k for k, g in enumerate(groups) for v in g}
    members = [set(g) for g in groups]
    waits = wait_of(step)
    launches = [v for v in order if is_collective(step.ops[v])]
    for k, c in enumerate(launches[:-1]):
        if step.ops[c].kind == SCATTER_KIND:
            order = _move_after(step, order, waits[c], launches[k + 1], group_of, members)
    return order


def stream_order(
    step: Graph,
    base: Sequence[int],
    events: Sequence[Sequence[int]],
    groups: Sequence[Sequence[int]],
    depth: int,
    waits: str,
) -> list[OpId]:
    """The two-stream order of one candidate (module docstring), from ``base`` (the capture's
    single-stream order, its views sunk by :func:`sink_views`, as step op ids; ``groups`` too)."""
    from memplan.streams import validate_streams
    from memplan.torch.distributed.plan import communicate_early_wait_late

    if waits not in WAIT_POLICIES:
        raise MemplanError(f"unknown wait policy {waits!r}; choose one of {WAIT_POLICIES}")
    order = list(base) + [OpId(w) for w, op in enumerate(step.ops) if is_wait(op)]  # waits: placed next
    order = communicate_early_wait_late(step, order)
    if waits == "serial":
        order = serial(step, order)
    order = prefetch(step, order, events, depth)
    if waits == "next":
        order = delay_waits(step, order, groups)
    validate_order(step, order)
    validate_streams(step, order)
    return order


# ---------------------------------------------------------------- placement and the choice


@dataclass(frozen=True)
class Candidate:
    """One (prefetch depth, reduce-scatter waits) plan: its order and what it costs."""

    depth: int
    waits: str
    order: tuple[int, ...]
    estimated_peak_bytes: int  # the one estimator, recorded order (the interval cover)
    arena_bytes: int = 0
    planned_peak_bytes: int = 0  # persistent + arena + the allocator's tensors at their fullest
    overlap_ops: int = 0  # compute ops between the launches and the waits, summed over collectives

    def describe(self) -> dict[str, Any]:
        return {
            "prefetch": self.depth,
            "waits": self.waits,
            "estimated_peak_bytes": self.estimated_peak_bytes,
            "arena_bytes": self.arena_bytes,
            "planned_peak_bytes": self.planned_peak_bytes,
            "overlap_ops": self.overlap_ops,
        }


def overlap_ops(step: Graph, order: Sequence[int]) -> int:
    """Ops of the compute stream (not waits, not views) run while some collective is in flight:
    the plan's measure of overlap, summed over collectives."""
    position = {v: i for i, v in enumerate(order)}
    busy = [0] * (len(order) + 1)
    for i, v in enumerate(order):
        op = step.ops[v]
        heavy = op.stream == 0 and not is_wait(op) and not is_pure_view(step, op)
        busy[i + 1] = busy[i] + (1 if heavy else 0)
    return sum(busy[position[w]] - busy[position[c]] for c, w in wait_of(step).items())


@dataclass
class StreamChoice:
    """The chosen candidate and every one tried, with why."""

    chosen: Candidate
    candidates: list[Candidate] = field(default_factory=list)
    why: str = ""

    def report(self) -> dict[str, Any]:
        return {
            "prefetch": self.chosen.depth,
            "waits": self.chosen.waits,
            "why": self.why,
            "candidates": [c.describe() for c in self.candidates],
        }


def choose(candidates: Sequence[Candidate], budget_bytes: int | None = None) -> tuple[Candidate, str]:
    """The smallest placed peak, ties to the most overlap (deepest prefetch first); under
    ``budget_bytes``, the most overlap whose placed peak fits (else the smallest peak)."""
    smallest = min(c.planned_peak_bytes for c in candidates)
    if budget_bytes is not None:
        fits = [c for c in candidates if c.planned_peak_bytes <= budget_bytes]
        if fits:
            best = max(fits, key=lambda c: (c.overlap_ops, c.depth, -c.planned_peak_bytes))
            return best, (
                f"the most overlap ({best.overlap_ops} ops in flight) whose planned peak "
                f"{best.planned_peak_bytes} B fits memory_budget ({budget_bytes} B)"
            )
    tied = [c for c in candidates if c.planned_peak_bytes == smallest]
    best = max(tied, key=lambda c: (c.overlap_ops, c.depth))
    why = f"the smallest planned peak ({smallest} B)"
    if len(tied) > 1:
        why += f", shared by {len(tied)} candidates: the most overlap of them ({best.overlap_ops} ops in flight)"
    if budget_bytes is not None:
        why += f"; none fits memory_budget ({budget_bytes} B)"
    return best, why


def place(
    step: Graph,
    order: Sequence[int],
    exclude: Collection[int],
    time_limit_seconds: float,
    *,
    samples: int = 16,
) -> tuple[dict[TensorId, int], int, dict[str, Any]]:
    """Offsets safe in every execution of ``step`` run in ``order`` (the stream placement),
    checked by the execution validator: ``(offsets, arena_bytes, what was checked)``."""
    from memplan.streams import plan_stream_placement, validate_stream_placement

    exclude = frozenset(exclude) | staging_tensors(step)
    placed = plan_stream_placement(step, order, exclude=exclude, time_limit_seconds=time_limit_seconds)
    check = validate_stream_placement(step, placed.offsets, order, samples=samples)
    if not check.safe:
        raise MemplanError(f"the FSDP2 stream placement failed its execution check: {check.failures[0]}")
    info = {
        "method": placed.placement.method,
        "status": placed.placement.status,
        "interval_cover": placed.interval_cover,
        "stream_check": {"exhaustive": check.exhaustive, "states": check.states, "safe": check.safe},
        "unsafe_pairs": placed.stream_problem.safety.num_unsafe,
    }
    return placed.offsets, placed.arena_bytes, info


def evaluate(
    step: Graph,
    base: Sequence[int],
    events: Sequence[Sequence[int]],
    groups: Sequence[Sequence[int]],
    exclude: Collection[int],
    time_limit_seconds: float,
    candidates: Sequence[tuple[int, str]] = CANDIDATES,
) -> list[Candidate]:
    """Every candidate's order, placed: its planned peak (persistent + arena + allocator)."""
    from memplan.pipeline import _resident_peak

    result = []
    seen: dict[tuple[int, ...], Candidate] = {}
    for depth, scatter in candidates:
        order = tuple(stream_order(step, base, events, groups, depth, scatter))
        if order in seen:  # a deeper prefetch that moved nothing more: the same plan
            result.append(dataclasses.replace(seen[order], depth=depth, waits=scatter))
            continue
        _, arena, _ = place(step, order, exclude, time_limit_seconds / len(candidates), samples=4)
        outside = _resident_peak(step, list(order), frozenset(exclude) | staging_tensors(step))
        c = Candidate(
            depth,
            scatter,
            order,
            peak_bytes(step, list(order)),
            arena,
            step.persistent_bytes + arena + outside,
            overlap_ops(step, order),
        )
        seen[order] = c
        result.append(c)
    return result


def movable_ops(capture: Any) -> frozenset[int]:
    """The capture's forward and backward ops (views among them may be sunk; the optimizer's
    ops are run as update groups and stay where the plan put them)."""
    return frozenset(v for v, phase in enumerate(capture.op_phase) if phase in ("forward", "backward"))


def choose_streams(
    graph: Graph,
    base: Sequence[int],
    unit_of_param: Mapping[str, int],
    groups: Sequence[Sequence[int]],
    movable: Collection[int],
    exclude: Collection[int],
    time_limit_seconds: float,
    budget_bytes: int | None = None,
    depth: int | None = None,
) -> StreamChoice:
    """Rank 0's decision for the captured step ``graph`` in its single-stream order ``base``:
    every candidate (or those of the fixed ``depth``) ordered, placed, and one chosen
    (:func:`choose`)."""
    step = stream_step(graph)
    ids = step_ids(graph, step)
    events = gather_events(step, unit_of_param)
    base = [ids[v] for v in sink_views(graph, base, movable)]
    groups = [[ids[v] for v in g] for g in groups]
    tried = CANDIDATES if depth is None else tuple(c for c in CANDIDATES if c[0] == depth)
    candidates = evaluate(step, base, events, groups, exclude, time_limit_seconds, tried)
    chosen, why = choose(candidates, budget_bytes)
    if depth is not None:
        why = f"prefetch fixed at {depth}; " + why
    return StreamChoice(chosen, candidates, why)
