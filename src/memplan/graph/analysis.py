"""Order-independent analysis: topological orders, ASAP/ALAP (OLLA 4.1), reachability, and a
lower bound on the peak over every order.

Reachability is kept as one Python ``int`` bitset per op, so that "is ``a`` an ancestor of
``b``" is one shift and one AND, and a 20k-op graph needs about 20k x 2.5 KB.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from memplan.errors import CycleError
from memplan.graph.ir import Category, Graph, OpId
from memplan.graph.liveness import padded, persistent_bytes


def topological_order(graph: Graph, priority: Sequence[float] | None = None) -> list[OpId]:
    """Kahn's algorithm; among ready ops, the smallest ``priority`` (default: program
    position) runs first. Raises :class:`CycleError` if the graph has a cycle."""
    key = priority if priority is not None else range(len(graph.ops))
    indegree = [len(p) for p in graph.predecessors]
    ready = [(key[v], v) for v, d in enumerate(indegree) if d == 0]
    heapq.heapify(ready)
    order: list[OpId] = []
    while ready:
        _, v = heapq.heappop(ready)
        order.append(OpId(v))
        for s in graph.successors[v]:
            indegree[s] -= 1
            if indegree[s] == 0:
                heapq.heappush(ready, (key[s], s))
    if len(order) != len(graph.ops):
        raise CycleError("the graph has a cycle; graphs must be acyclic")
    return order


def asap_levels(graph: Graph) -> list[int]:
    """ASAP(v): the longest path, in edges, from a source of the graph to ``v`` (OLLA 4.1)."""
    level = [0] * len(graph.ops)
    for v in topological_order(graph):
        level[v] = max((level[p] + 1 for p in graph.predecessors[v]), default=0)
    return level


def alap_levels(graph: Graph) -> list[int]:
    """ALAP(v): the latest level at which ``v`` can run when the step has ``depth`` levels,
    i.e. ``depth - 1`` minus the longest path from ``v`` to a sink (OLLA 4.1)."""
    to_sink = [0] * len(graph.ops)
    for v in reversed(topological_order(graph)):
        to_sink[v] = max((to_sink[s] + 1 for s in graph.successors[v]), default=0)
    depth = max(to_sink, default=-1) + 1
    return [depth - 1 - d for d in to_sink]


@dataclass(frozen=True)
class Reachability:
    """Ancestor and descendant sets of every op as int bitsets (bit ``u`` set: ``u`` in set)."""

    ancestors: tuple[int, ...]
    descendants: tuple[int, ...]

    @classmethod
    def of(cls, graph: Graph) -> Reachability:
        order = topological_order(graph)
        anc = [0] * len(graph.ops)
        for v in order:
            bits = 0
            for p in graph.predecessors[v]:
                bits |= anc[p] | (1 << p)
            anc[v] = bits
        desc = [0] * len(graph.ops)
        for v in reversed(order):
            bits = 0
            for s in graph.successors[v]:
                bits |= desc[s] | (1 << s)
            desc[v] = bits
        return cls(tuple(anc), tuple(desc))

    def is_ancestor(self, a: int, b: int) -> bool:
        """True if a path leads from op ``a`` to op ``b`` (``a != b``)."""
        return bool((self.ancestors[b] >> a) & 1)

    def comparable(self, a: int, b: int) -> bool:
        """True if every order runs ``a`` and ``b`` in the same relative order."""
        return a == b or self.is_ancestor(a, b) or self.is_ancestor(b, a)

    @cached_property
    def earliest_positions(self) -> list[int]:
        """No order runs ``v`` before timestep ``|ancestors(v)|``."""
        return [a.bit_count() for a in self.ancestors]

    @cached_property
    def latest_positions(self) -> list[int]:
        """No order runs ``v`` after timestep ``n - 1 - |descendants(v)|``."""
        n = len(self.descendants)
        return [n - 1 - d.bit_count() for d in self.descendants]


def _bits_to_array(bits: int, n: int) -> np.ndarray:
    raw = np.frombuffer(bits.to_bytes((n + 7) // 8, "little"), dtype=np.uint8)
    return np.unpackbits(raw, bitorder="little")[:n].astype(bool)


def necessarily_resident_bytes(graph: Graph, reach: Reachability | None = None, alignment: int = 1) -> list[int]:
    """For each op ``v``: bytes that every order must hold while ``v`` runs, each tensor
    counted at its size padded to ``alignment`` (as :func:`memplan.graph.liveness.peak_bytes`).

    A non-persistent tensor ``e`` is resident at ``v`` in every order if ``v`` produces or
    reads ``e``, or if ``src(e)`` is an ancestor of ``v`` and some reader of ``e`` is a
    descendant of ``v`` (an output of the step counts as read at the end). Persistent bytes
    are included.
    """
    reach = reach or Reachability.of(graph)
    n = len(graph.ops)
    total = np.full(n, persistent_bytes(graph, alignment), dtype=np.int64)
    for t_id, tensor in enumerate(graph.tensors):
        if tensor.persistent or tensor.size_bytes == 0:
            continue
        src = graph.producer[t_id]
        readers = graph.consumers[t_id]
        mask = 1 << src
        later = 0
        for c in readers:
            mask |= 1 << c
            later |= reach.ancestors[c]
        if tensor.category is Category.OUTPUT:
            later = reach.descendants[src]
        mask |= reach.descendants[src] & later
        total += padded(tensor.size_bytes, alignment) * _bits_to_array(mask, n)
    return [int(x) for x in total]


def peak_lower_bound(graph: Graph, reach: Reachability | None = None, alignment: int = 1) -> int:
    """A lower bound on the peak resident set of every topological order of ``graph``:
    the largest :func:`necessarily_resident_bytes` over all ops (sizes padded to ``alignment``)."""
    return max(necessarily_resident_bytes(graph, reach, alignment), default=persistent_bytes(graph, alignment))
