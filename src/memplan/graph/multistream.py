"""Streams in the graph: which op may run concurrently with which (SOMAS, Lamprou et al. 2023).

Every op runs on ``op.stream``. The ops of one stream run one after another (a CUDA stream, a
communication thread): in a given *order* of the graph, stream ``s`` runs the ops of ``s`` in the
order they appear in it. Ops on different streams are ordered only by explicit dependencies:
data edges and 0-byte control edges (an event recorded on one stream and waited for on another,
the wait of a collective). So the *happens-before* relation of a multi-stream step is

    the data and control edges, plus an edge from each op to the next op of its own stream,

and any order of the ops consistent with it may really happen, while the listed (recorded)
order is only one of them. In a graph file each stream's ops are listed in that stream's order;
the list as a whole need not be topological across streams: :func:`relist_streams` finds a
global order that is, or names the cycle that makes none exist (streams waiting on each other).

Contiguous groups (SOMAS: an all-reduce bucket laid out back to back so the collective runs in
place) are kept in ``graph.meta["contiguous"]`` as lists of tensor names, so that every pass
that rebuilds a graph keeps them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from memplan.errors import DanglingReference, WaitCycle
from memplan.graph.check import validate_order
from memplan.graph.ir import Graph, OpId, TensorId

CONTIGUOUS_KEY = "contiguous"


def streams_of(graph: Graph) -> list[int]:
    """The streams the ops of ``graph`` run on, sorted."""
    return sorted({op.stream for op in graph.ops})


def is_multi_stream(graph: Graph) -> bool:
    """True if some ops run on another stream than the others."""
    return len(streams_of(graph)) > 1


def stream_sequences(graph: Graph, order: Sequence[int] | None = None) -> dict[int, list[OpId]]:
    """Each stream's ops in the order it runs them: ``order`` (default: the listing) restricted to it."""
    sequences: dict[int, list[OpId]] = {}
    for v in graph.program_order() if order is None else order:
        sequences.setdefault(graph.ops[v].stream, []).append(OpId(v))
    return sequences


def happens_before(graph: Graph, order: Sequence[int] | None = None) -> tuple[tuple[OpId, ...], ...]:
    """Predecessors of each op in the happens-before relation: its data and control
    predecessors, and the op before it on its own stream in ``order`` (default: the listing)."""
    previous: dict[int, OpId] = {}
    for sequence in stream_sequences(graph, order).values():
        for before, after in itertools.pairwise(sequence):
            previous[after] = before
    result = []
    for v, preds in enumerate(graph.predecessors):
        if v in previous and previous[v] not in preds:
            preds = (*preds, previous[v])
        result.append(tuple(OpId(p) for p in preds))
    return tuple(result)


def topological_happens_before(graph: Graph, preds: Sequence[Sequence[int]]) -> list[OpId] | None:
    """Kahn's algorithm over ``preds``, smallest listed position first; ``None`` on a cycle."""
    import heapq

    succ: list[list[int]] = [[] for _ in graph.ops]
    indegree = [0] * len(graph.ops)
    for v, ps in enumerate(preds):
        for p in ps:
            succ[p].append(v)
        indegree[v] = len(ps)
    ready = [v for v, d in enumerate(indegree) if d == 0]
    heapq.heapify(ready)
    order: list[OpId] = []
    while ready:
        v = heapq.heappop(ready)
        order.append(OpId(v))
        for s in succ[v]:
            indegree[s] -= 1
            if indegree[s] == 0:
                heapq.heappush(ready, s)
    return order if len(order) == len(graph.ops) else None


def relist_streams(graph: Graph) -> Graph:
    """``graph`` with its ops listed in a global order that keeps each stream's listed order and
    runs every op after its dependencies (the earliest-listed ready op first, so a listing that
    already is such an order is kept). Raises :class:`WaitCycle` naming the ops of a cycle when
    none exists: the streams would wait for each other forever."""
    preds = happens_before(graph)
    order = topological_happens_before(graph, preds)
    if order is None:
        cycle = find_cycle(preds)
        raise WaitCycle(f"streams wait on each other in a cycle, so none can go on: {_describe(graph, cycle)}")
    if order == graph.program_order():
        return graph
    return Graph(tuple(graph.ops[v] for v in order), graph.tensors, graph.name, dict(graph.meta))


def find_cycle(preds: Sequence[Sequence[int]]) -> list[int]:
    """One cycle of the relation ``preds`` (empty if there is none), as a list of ops in
    the direction of the edges."""
    n = len(preds)
    state = [0] * n  # 0 unvisited, 1 on the stack, 2 done
    for root in range(n):
        if state[root]:
            continue
        stack = [(root, iter(preds[root]))]
        path = [root]
        state[root] = 1
        while stack:
            v, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[v] = 2
                stack.pop()
                path.pop()
            elif state[nxt] == 1:
                cycle = path[path.index(nxt) :]
                return list(reversed(cycle))  # preds point backwards; report forwards
            elif state[nxt] == 0:
                state[nxt] = 1
                stack.append((nxt, iter(preds[nxt])))
                path.append(nxt)
    return []


def _describe(graph: Graph, cycle: Sequence[int], most: int = 6) -> str:
    names = [f"{graph.ops[v].name!r} (stream {graph.ops[v].stream})" for v in cycle]
    if len(names) > most:
        names = [*names[: most - 1], f"... {len(names) - most + 1} more"]
    return " -> ".join([*names, names[0]]) + "; make every wait follow its event's record in each stream's order"


def contiguous_groups(graph: Graph) -> tuple[tuple[TensorId, ...], ...]:
    """The contiguous groups of ``graph`` (``meta["contiguous"]``: lists of tensor names) as ids.

    Raises :class:`DanglingReference` if a group names a tensor the graph does not have."""
    groups = graph.meta.get(CONTIGUOUS_KEY, ())
    index = graph.tensor_index
    result = []
    for members in groups:  # type: ignore[attr-defined]
        for name in members:
            if name not in index:
                raise DanglingReference(f"contiguous group names tensor {name!r}, which the graph does not have")
        result.append(tuple(index[name] for name in members))
    return tuple(result)


def with_contiguous_groups(graph: Graph, groups: Sequence[Sequence[int]]) -> Graph:
    """A copy of ``graph`` whose ``meta["contiguous"]`` is ``groups`` (tensor ids), by name."""
    meta = dict(graph.meta)
    meta[CONTIGUOUS_KEY] = [[graph.tensors[t].name for t in members] for members in groups]
    return Graph(graph.ops, graph.tensors, graph.name, meta)


def happens_before_ancestors(graph: Graph, order: Sequence[int] | None = None) -> list[int]:
    """``ancestors[v]``: the ops that happen before ``v`` in every execution, as an int bitset
    (bit ``u`` set: ``u`` is a strict ancestor of ``v`` in :func:`happens_before`).

    ``order`` (default: the listing) must be a topological order of the graph; the stream
    edges follow it, so it is one of the happens-before relation too."""
    if order is None:
        order = graph.program_order()
    else:
        validate_order(graph, order)
    preds = happens_before(graph, order)
    anc = [0] * len(graph.ops)
    for v in order:
        bits = 0
        for p in preds[v]:
            bits |= anc[p] | (1 << p)
        anc[v] = bits
    return anc
