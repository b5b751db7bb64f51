"""Multi-stream safety (SOMAS, Lamprou et al. 2023, section 3): which tensors may share memory.

An unordered pair of tensors is *safe* if no execution of the multi-stream step needs both in
memory at once (Definition 3). A tensor lives from the start of its source op to the end of its
last destination (the ops that read it; the source itself when nobody does; the end of the step
for an output), and an execution is any run consistent with the happens-before relation of
:mod:`memplan.graph.multistream` (ops of one stream one after another, other streams ordered
only by dependencies, ops on different streams possibly at the same time).

Two algorithms decide it for every pair of placed tensors (non-persistent, non-empty):

* **graph-based** (:func:`graph_based_safe_pairs`): ``AncTensors[t] = {t' : DestNodes[t'] ⊆
  AncNodes[source(t)]}``; ``{t, t'}`` is safe iff ``t' ∈ AncTensors[t]`` or ``t ∈ AncTensors[t']``.
  Ancestor sets are bitsets over the ops (as MindSpore's SOMAS keeps them).
* **stream-based** (:func:`stream_based_safe_pairs`, the paper's algorithm): pairs are unsafe by
  default; only tensors whose destination streams are all ancestor streams of ``t``'s stream
  (or that stream itself) are checked (AncestorStreamsReuse), the same stream last
  (SameStreamReuse). Because a stream is a chain, "op ``d`` of stream ``s`` is an ancestor of
  ``n``" is one comparison: ``d``'s position on ``s`` against the last op of ``s`` that happens
  before ``n`` (a per-stream frontier computed once per op), so no op bitsets are needed.

Both return the same pairs (Theorem 5 of the paper; tested against each other and against an
enumeration of every execution on small graphs). The relation is exact: an unsafe pair is live
together in some execution (see :mod:`memplan.streams.interleave`), so it must not overlap.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from memplan.graph.check import validate_order
from memplan.graph.ir import Category, Graph, OpId, TensorId
from memplan.graph.multistream import happens_before_ancestors


def placed_tensors(graph: Graph, exclude: Collection[int] = frozenset()) -> list[TensorId]:
    """The tensors an arena holds: non-persistent, with bytes, not in ``exclude``."""
    return [
        TensorId(t)
        for t, tensor in enumerate(graph.tensors)
        if not tensor.persistent and tensor.size_bytes > 0 and t not in exclude
    ]


def destinations(graph: Graph, t: int) -> tuple[int, ...]:
    """DestNodes[t] with memplan's lifetime rules: the source and every reader of ``t``."""
    return (graph.producer[t], *graph.consumers[t])


@dataclass(frozen=True)
class SafePairs:
    """The safe-pair relation over ``tensors``: ``unsafe[i, j]`` for placed tensors ``i, j``
    (indices into ``tensors``) that some execution holds in memory together."""

    tensors: tuple[TensorId, ...]
    unsafe: np.ndarray  # bool, symmetric, False on the diagonal
    method: str
    seconds: float

    @property
    def num_pairs(self) -> int:
        n = len(self.tensors)
        return n * (n - 1) // 2

    @property
    def num_unsafe(self) -> int:
        return int(np.count_nonzero(self.unsafe)) // 2

    @property
    def num_safe(self) -> int:
        return self.num_pairs - self.num_unsafe

    def unsafe_pairs(self) -> list[tuple[int, int]]:
        """Every unsafe pair ``(i, j)``, ``i < j``, as indices into ``tensors``."""
        i, j = np.nonzero(np.triu(self.unsafe, 1))
        return list(zip(i.tolist(), j.tolist(), strict=True))


def _finish(tensors: Sequence[TensorId], before: np.ndarray, method: str, t0: float) -> SafePairs:
    """``before[i, j]``: tensor ``i`` is in AncTensors[``j``] (dead before ``j`` is born)."""
    safe = before | before.T
    unsafe = ~safe
    np.fill_diagonal(unsafe, False)
    return SafePairs(tuple(tensors), unsafe, method, time.perf_counter() - t0)


def graph_based_safe_pairs(
    graph: Graph, order: Sequence[int] | None = None, exclude: Collection[int] = frozenset()
) -> SafePairs:
    """SOMAS's graph-based safety: ``t' ∈ AncTensors[t]`` iff every destination of ``t'`` is an
    ancestor of ``t``'s source in the happens-before relation of ``graph`` run in ``order``."""
    t0 = time.perf_counter()
    tensors = placed_tensors(graph, exclude)
    n_ops = len(graph.ops)
    ancestors = happens_before_ancestors(graph, order)
    dests = [destinations(graph, t) for t in tensors]
    width = max((len(d) for d in dests), default=1)
    sink = n_ops  # a virtual op after everything: an output of the step is read there
    dest_nodes = np.empty((len(tensors), width + 1), dtype=np.int64)
    for i, (t, d) in enumerate(zip(tensors, dests, strict=True)):
        dest_nodes[i, : len(d)] = d
        dest_nodes[i, len(d) :] = d[0]  # padding repeats the source: it changes nothing
        if graph.tensors[t].category is Category.OUTPUT:
            dest_nodes[i, width] = sink
    sources, column_source = _sources(graph, tensors)
    per_source = np.zeros((len(sources), len(tensors)), dtype=bool)
    for chunk in _chunks(len(sources), len(tensors) * (width + 1) + n_ops):
        anc_nodes = np.zeros((len(chunk), n_ops + 1), dtype=bool)  # AncNodes[source], one row each
        for row, k in enumerate(chunk):
            anc_nodes[row, :n_ops] = _unpack(ancestors[sources[k]], n_ops)
        per_source[chunk] = anc_nodes[:, dest_nodes].all(axis=2)
    return _finish(tensors, per_source[column_source].T, "graph-based", t0)


def _sources(graph: Graph, tensors: Sequence[TensorId]) -> tuple[list[OpId], np.ndarray]:
    """The distinct source ops of ``tensors``, and for each tensor the index of its source."""
    index: dict[OpId, int] = {}
    column_source = np.array([index.setdefault(graph.producer[t], len(index)) for t in tensors], dtype=np.int64)
    return list(index), column_source


def _chunks(count: int, cells_per_item: int, budget_cells: int = 1 << 24) -> list[np.ndarray]:
    """``range(count)`` cut into pieces of at most ``budget_cells / cells_per_item`` items."""
    step = max(1, budget_cells // max(1, cells_per_item))
    return [np.arange(k, min(k + step, count)) for k in range(0, count, step)]


def _unpack(bits: int, n: int) -> np.ndarray:
    raw = np.frombuffer(bits.to_bytes((n + 7) // 8 or 1, "little"), dtype=np.uint8)
    return np.unpackbits(raw, bitorder="little")[:n].astype(bool)


@dataclass(frozen=True)
class StreamFrontiers:
    """Per op, the last op of every stream that happens before it (``-1``: none), by position
    on that stream; and which streams are ancestors of which in the stream graph."""

    streams: tuple[int, ...]  # stream ids; column k of the arrays is stream streams[k]
    column: np.ndarray  # per op: its stream's column
    position: np.ndarray  # per op: its position on its stream
    frontier: np.ndarray  # (ops, streams): last ancestor position per stream, -1 if none
    ancestor_streams: np.ndarray  # per column: bitmask of columns with a path to it (itself included)

    @classmethod
    def of(cls, graph: Graph, order: Sequence[int] | None = None) -> StreamFrontiers:
        """One pass over ``order`` (a topological order; default the listing). Only the op
        before on the same stream and the cross-stream predecessors can raise a frontier: a
        same-stream predecessor already happens before the op just before."""
        if order is None:
            order = graph.program_order()
        else:
            validate_order(graph, order)
        streams = tuple(sorted({op.stream for op in graph.ops}))
        col_of = {s: k for k, s in enumerate(streams)}
        col = [col_of[op.stream] for op in graph.ops]
        pos = [0] * len(graph.ops)
        previous: list[int | None] = [None] * len(graph.ops)
        last_on: list[int | None] = [None] * len(streams)
        seen = [0] * len(streams)
        for v in order:
            pos[v], previous[v], last_on[col[v]] = seen[col[v]], last_on[col[v]], v
            seen[col[v]] += 1
        rows: list[list[int]] = [[]] * len(graph.ops)
        reach = [1 << k for k in range(len(streams))]
        blank = [-1] * len(streams)
        for v in order:
            c, before = col[v], previous[v]
            row = blank.copy() if before is None else rows[before].copy()
            if before is not None:
                row[c] = pos[before]
            for p in graph.predecessors[v]:
                if col[p] != c:  # a synchronisation: an event, a wait, a cross-stream read
                    row = list(map(max, row, rows[p]))
                    row[col[p]] = max(row[col[p]], pos[p])
                    reach[c] |= reach[col[p]]
            rows[v] = row
        frontier = np.array(rows, dtype=np.int64).reshape(len(graph.ops), len(streams))
        return cls(
            streams,
            np.array(col, dtype=np.int64),
            np.array(pos, dtype=np.int64),
            frontier,
            np.array(_closure(reach), dtype=np.int64),
        )


def _closure(reach: list[int]) -> list[int]:
    """Transitive closure of a small relation given as bitmasks of predecessors."""
    changed = True
    while changed:
        changed = False
        for k, mask in enumerate(reach):
            grown = mask
            for j in range(len(reach)):
                if (mask >> j) & 1:
                    grown |= reach[j]
            if grown != mask:
                reach[k], changed = grown, True
    return reach


def stream_based_safe_pairs(
    graph: Graph, order: Sequence[int] | None = None, exclude: Collection[int] = frozenset()
) -> SafePairs:
    """SOMAS's stream-based safety (AncestorStreamsReuse, then SameStreamReuse).

    For each tensor ``t'`` keep, per stream, the position of its last destination there
    (``last[t', s]``, ``-1`` if none) and the set of its destination streams. ``t'`` is in
    AncTensors[``t``] iff its destination streams are ancestor streams of ``t``'s source's
    stream (or that stream) and, on every stream, ``last[t', s]`` is at most the frontier of
    ``t``'s source there; on the source's own stream that frontier is the op just before it.
    An output of the step has a destination on a virtual stream nothing precedes.
    """
    t0 = time.perf_counter()
    tensors = placed_tensors(graph, exclude)
    fr = StreamFrontiers.of(graph, order)
    n_streams = len(fr.streams)
    last = np.full((len(tensors), n_streams), -1, dtype=np.int64)
    dest_streams = np.zeros(len(tensors), dtype=np.int64)
    for i, t in enumerate(tensors):
        for d in destinations(graph, t):
            k = fr.column[d]
            last[i, k] = max(last[i, k], fr.position[d])
            dest_streams[i] |= 1 << int(k)
        if graph.tensors[t].category is Category.OUTPUT:
            dest_streams[i] |= 1 << n_streams  # the step's end: no stream is its ancestor
    sources, column_source = _sources(graph, tensors)
    src = np.array(sources, dtype=np.int64)
    per_source = np.zeros((len(sources), len(tensors)), dtype=bool)
    for chunk in _chunks(len(sources), len(tensors) * (n_streams + 1)):
        per_source[chunk] = _reuse_before(fr, src[chunk], last, dest_streams)
    return _finish(tensors, per_source[column_source].T, "stream-based", t0)


def _reuse_before(fr: StreamFrontiers, src: np.ndarray, last: np.ndarray, dest_streams: np.ndarray) -> np.ndarray:
    """``result[k, i]``: tensor ``i`` is in AncTensors[t] for the tensors ``t`` made by op ``src[k]``."""
    own = fr.column[src]
    frontier = fr.frontier[src]  # (sources, streams)
    # AncestorStreamsReuse: a tensor with a destination on a stream that is not an ancestor of
    # the source's stream stays unsafe unchecked; the others must precede the source on every
    # other stream.
    result = (dest_streams[None, :] & ~fr.ancestor_streams[own][:, None]) == 0
    for s in range(len(fr.streams)):
        other = own != s
        result[other] &= last[None, :, s] <= frontier[other, s][:, None]
    # SameStreamReuse: on the source's own stream, every destination must come before it.
    result &= fr.position[src][:, None] > last[:, own].T
    return result


SAFETY_METHODS = {"stream": stream_based_safe_pairs, "graph": graph_based_safe_pairs}


def safe_pairs(
    graph: Graph,
    order: Sequence[int] | None = None,
    exclude: Collection[int] = frozenset(),
    method: str = "stream",
) -> SafePairs:
    """The safe pairs of ``graph`` run in ``order`` by ``method`` ("stream" or "graph")."""
    return SAFETY_METHODS[method](graph, order, exclude)
