"""A validator for multi-stream placements that does not trust the safe-pair analysis.

It looks at executions directly. An op runs from its *start* to its *end*; an execution is a
sequence of these events in which every op starts after each of its happens-before
predecessors ended (:func:`memplan.graph.multistream.happens_before`: data and control edges,
and the previous op of its own stream) and ends after it started. Between a start and its end
other streams' events may come: ops of different streams run at the same time. A tensor is
live from the start of its source to the end of its last reader (its source's end when nobody
reads it; the end of the execution for an output of the step).

:func:`validate_stream_placement` checks that no two tensors live together at some point of
some execution share a byte of the arena. On small graphs it visits *every* state an execution
can pass through (a state is how far each stream has got: a prefix of its start/end events),
which covers every execution; on large ones it samples many executions, including adversarial
ones (one stream running as far ahead of the others as the waits allow, every op started as
early and ended as late as possible). Sampling can miss a race, so on large graphs the proof
comes from the safe-pair analysis, which this enumeration tests on small ones.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from memplan.graph.ir import Category, Graph, TensorId
from memplan.graph.multistream import happens_before, stream_sequences
from memplan.placement.check import InvalidPlacement

Event = tuple[int, bool]  # (op, True for its start / False for its end)


class UnsafeStreamPlacement(InvalidPlacement):
    """Two tensors that some execution holds together share bytes of the arena."""


@dataclass(frozen=True)
class StreamCheck:
    """What :func:`validate_stream_placement` looked at and found."""

    exhaustive: bool  # every reachable state visited (else: sampled executions)
    states: int  # states visited (exhaustive) or executions sampled
    overlapping_pairs: int  # pairs of tensors sharing bytes, each checked
    failures: tuple[UnsafeStreamPlacement, ...] = field(default=())

    @property
    def safe(self) -> bool:
        return not self.failures


class _Streams:
    """The event structure of ``graph`` run in ``order``: per stream, its ops in order."""

    def __init__(self, graph: Graph, order: Sequence[int] | None) -> None:
        self.graph = graph
        self.sequences = list(stream_sequences(graph, order).values())
        self.stream_of = {v: k for k, seq in enumerate(self.sequences) for v in seq}
        self.index_on_stream = {v: i for seq in self.sequences for i, v in enumerate(seq)}
        preds = happens_before(graph, order)
        # an op may start once each cross-stream predecessor ended: (stream, events done needed)
        self.needs = {
            v: [
                (self.stream_of[p], 2 * self.index_on_stream[p] + 2)
                for p in ps
                if self.stream_of[p] != self.stream_of[v]
            ]
            for v, ps in enumerate(preds)
        }

    def event(self, stream: int, done: int) -> Event:
        """The next event of ``stream`` after ``done`` of its events."""
        return self.sequences[stream][done // 2], done % 2 == 0

    def enabled(self, state: Sequence[int], stream: int) -> bool:
        done = state[stream]
        if done >= 2 * len(self.sequences[stream]):
            return False
        if done % 2:  # an end: its start is done
            return True
        v = self.sequences[stream][done // 2]
        return all(state[s] >= need for s, need in self.needs[v])


def _tensors_events(graph: Graph, tensors: Sequence[TensorId]) -> tuple[list[int], list[list[int]], list[bool]]:
    sources = [int(graph.producer[t]) for t in tensors]
    readers = [[int(c) for c in graph.consumers[t]] or [int(graph.producer[t])] for t in tensors]
    outputs = [graph.tensors[t].category is Category.OUTPUT for t in tensors]
    return sources, readers, outputs


def executions(
    graph: Graph, order: Sequence[int] | None = None, samples: int = 32, seed: int = 0
) -> Iterator[tuple[str, list[Event]]]:
    """Named executions: the recorded order, each stream running ahead, every op started as
    early and ended as late as possible, then ``samples`` random ones (half uniformly random
    among the events that may come next, half with random per-stream speeds)."""
    st = _Streams(graph, order)
    n = len(st.sequences)
    yield (
        "recorded",
        [(v, start) for v in (graph.program_order() if order is None else order) for start in (True, False)],
    )
    for k in range(n):
        yield f"stream {graph.ops[st.sequences[k][0]].stream} ahead", _run(st, lambda ready, k=k: _prefer(ready, k))
        yield f"stream {graph.ops[st.sequences[k][0]].stream} behind", _run(st, lambda ready, k=k: _avoid(ready, k))
    yield "starts early, ends late", _run(st, _starts_first)
    rng = random.Random(seed)
    for i in range(samples):
        if i % 2 == 0:
            yield f"random {i}", _run(st, lambda ready: rng.choice(ready))
        else:
            speed = [rng.random() for _ in range(n)]
            yield (
                f"random speeds {i}",
                _run(st, lambda ready, speed=speed: max(ready, key=lambda e: speed[e[0]] * rng.random())),
            )


def _prefer(ready: list[tuple[int, Event]], k: int) -> tuple[int, Event]:
    mine = [e for e in ready if e[0] == k]
    return mine[0] if mine else _starts_first(ready)


def _avoid(ready: list[tuple[int, Event]], k: int) -> tuple[int, Event]:
    others = [e for e in ready if e[0] != k]
    return _starts_first(others) if others else ready[0]


def _starts_first(ready: list[tuple[int, Event]]) -> tuple[int, Event]:
    starts = [e for e in ready if e[1][1]]
    return starts[0] if starts else ready[0]


def _run(st: _Streams, pick) -> list[Event]:  # type: ignore[no-untyped-def]
    state = [0] * len(st.sequences)
    events: list[Event] = []
    total = sum(2 * len(s) for s in st.sequences)
    while len(events) < total:
        ready = [(k, st.event(k, state[k])) for k in range(len(state)) if st.enabled(state, k)]
        k, event = pick(ready)
        events.append(event)
        state[k] += 1
    return events


def lifetimes_in(graph: Graph, tensors: Sequence[TensorId], events: Sequence[Event]) -> tuple[np.ndarray, np.ndarray]:
    """Each tensor's live span ``[first, last]`` (event indices, inclusive) in ``events``."""
    at = {event: i for i, event in enumerate(events)}
    sources, readers, outputs = _tensors_events(graph, tensors)
    first = np.array([at[(s, True)] for s in sources], dtype=np.int64)
    last = np.array(
        [len(events) if out else max(at[(r, False)] for r in rs) for rs, out in zip(readers, outputs, strict=True)],
        dtype=np.int64,
    )
    return first, last


def colive_in_every_state(
    graph: Graph,
    tensors: Sequence[TensorId],
    pairs: tuple[np.ndarray, np.ndarray],
    order: Sequence[int] | None = None,
    limit: int = 20_000,
) -> tuple[dict[int, str], int] | None:
    """Visit every state an execution can reach; return, for each pair ``k`` of ``pairs`` live
    together in one of them, a description of such a state, and the number of states
    (``None`` when there are more than ``limit``)."""
    st = _Streams(graph, order)
    sources, readers, outputs = _tensors_events(graph, tensors)
    src_stream = np.array([st.stream_of[s] for s in sources], dtype=np.int64)
    src_done = np.array([2 * st.index_on_stream[s] + 1 for s in sources], dtype=np.int64)  # started
    ends = [[(st.stream_of[r], 2 * st.index_on_stream[r] + 2) for r in rs] for rs in readers]  # ended
    a, b = pairs
    found: dict[int, str] = {}
    start = tuple(0 for _ in st.sequences)
    seen = {start}
    stack = [start]
    while stack:
        state = stack.pop()
        vec = np.array(state, dtype=np.int64)
        started = vec[src_stream] >= src_done
        live = started & np.array(
            [out or any(state[s] < e for s, e in ends_i) for ends_i, out in zip(ends, outputs, strict=True)]
        )
        for k in np.flatnonzero(live[a] & live[b]):
            found.setdefault(int(k), _describe_state(st, state))
        for k in range(len(state)):
            if st.enabled(state, k):
                nxt = (*state[:k], state[k] + 1, *state[k + 1 :])
                if nxt not in seen:
                    if len(seen) >= limit:
                        return None
                    seen.add(nxt)
                    stack.append(nxt)
    return found, len(seen)


def _describe_state(st: _Streams, state: Sequence[int]) -> str:
    parts = []
    for seq, done in zip(st.sequences, state, strict=True):
        stream = st.graph.ops[seq[0]].stream
        if done == 0:
            parts.append(f"stream {stream} has not started")
        elif done % 2:
            parts.append(f"stream {stream} runs {st.graph.ops[seq[done // 2]].name!r}")
        elif done == 2 * len(seq):
            parts.append(f"stream {stream} is done")
        else:
            parts.append(f"stream {stream} has finished {st.graph.ops[seq[done // 2 - 1]].name!r}")
    return "when " + ", ".join(parts)


def overlapping_pairs(sizes: Sequence[int], offsets: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Every pair ``(i, j)``, ``i < j``, whose byte ranges ``[offset, offset + size)`` intersect."""
    off = np.asarray(offsets, dtype=np.int64)
    end = off + np.asarray(sizes, dtype=np.int64)
    by_offset = np.argsort(off, kind="stable")
    firsts, seconds = [], []
    for pos, i in enumerate(by_offset):
        rest = by_offset[pos + 1 :]
        rest = rest[off[rest] < end[i]]  # sorted by offset: these start before i ends
        if len(rest):
            firsts.append(np.full(len(rest), i))
            seconds.append(rest)
    if not firsts:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    a, b = np.concatenate(firsts), np.concatenate(seconds)
    return np.minimum(a, b), np.maximum(a, b)


def validate_stream_placement(
    graph: Graph,
    offsets: Mapping[TensorId, int],
    order: Sequence[int] | None = None,
    *,
    state_limit: int = 2_000_000,
    samples: int = 32,
    seed: int = 0,
) -> StreamCheck:
    """Check ``offsets`` (tensor -> arena offset; sizes are the tensors' bytes) against the
    executions of ``graph`` run in ``order``: every reachable state when there are at most
    ``state_limit`` divided by the number of tensors, else the executions of :func:`executions`.
    Raises nothing: the returned :class:`StreamCheck` lists the failures (one per pair, with a
    witness)."""
    tensors = [TensorId(t) for t in offsets if graph.tensors[t].size_bytes > 0]
    sizes = [graph.tensors[t].size_bytes for t in tensors]
    a, b = overlapping_pairs(sizes, [offsets[t] for t in tensors])
    if len(a) == 0:
        return StreamCheck(True, 0, 0)
    exhaustive = colive_in_every_state(graph, tensors, (a, b), order, max(100, state_limit // len(tensors)))
    if exhaustive is not None:
        found, states = exhaustive
        failures = [
            _failure(graph, tensors, offsets, int(a[k]), int(b[k]), where) for k, where in sorted(found.items())
        ]
        return StreamCheck(True, states, len(a), tuple(failures))
    sampled: dict[tuple[int, int], UnsafeStreamPlacement] = {}
    count = 0
    for name, events in executions(graph, order, samples, seed):
        count += 1
        first, last = lifetimes_in(graph, tensors, events)
        bad = np.flatnonzero((first[a] <= last[b]) & (first[b] <= last[a]))
        for k in bad:
            key = (int(a[k]), int(b[k]))
            if key not in sampled:
                sampled[key] = _failure(graph, tensors, offsets, *key, f"in execution '{name}'")
    return StreamCheck(False, count, len(a), tuple(sampled.values()))


def _failure(
    graph: Graph, tensors: Sequence[TensorId], offsets: Mapping[TensorId, int], i: int, j: int, where: str
) -> UnsafeStreamPlacement:
    ti, tj = tensors[i], tensors[j]
    si, sj = graph.tensors[ti], graph.tensors[tj]
    return UnsafeStreamPlacement(
        f"tensors {si.name!r} [{offsets[ti]}, {offsets[ti] + si.size_bytes}) and {sj.name!r} "
        f"[{offsets[tj]}, {offsets[tj] + sj.size_bytes}) share bytes but are live together {where}"
    )
