"""A portfolio of fast topological orders, each scored by the one estimator (OLLA 2.2).

Members: program order; LPMF greedy ("least peak memory first", after PyTorch inductor's
``topological_sort_lpmf``); inductor-style BFS and DFS orders; and orders that run every
weight update as soon as its gradient is ready (the heuristic form of OLLA 4.3). The best one
warm-starts the exact solver and is its fallback.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from memplan.graph.analysis import topological_order
from memplan.graph.ir import Category, Graph, OpId
from memplan.graph.liveness import peak_bytes

UPDATED_CATEGORIES = frozenset({Category.PARAMETER, Category.OPTIMIZER_STATE})


@dataclass(frozen=True)
class Candidate:
    """One heuristic's order and its estimator peak."""

    name: str
    order: tuple[OpId, ...]
    peak_bytes: int


@dataclass(frozen=True)
class GreedyRun:
    """An LPMF order and the peak that the greedy tracked while building it."""

    order: tuple[OpId, ...]
    running_peak_bytes: int


def is_weight_update(graph: Graph, op_id: int) -> bool:
    """True if the op writes a parameter in place (OLLA 4.3's "gradient update node")."""
    return any(graph.tensors[t].category is Category.PARAMETER for t in graph.ops[op_id].mutates)


def weight_update_ops(graph: Graph) -> list[OpId]:
    return [OpId(v) for v in range(graph.num_ops) if is_weight_update(graph, v)]


def _occupies_memory(graph: Graph, t: int) -> bool:
    tensor = graph.tensors[t]
    return not tensor.persistent and tensor.size_bytes > 0


def is_deallocation(graph: Graph, op_id: int) -> bool:
    """True for a pure "free" op: no successors, allocates nothing, reads some memory (e.g.
    the release of a gradient after the optimizer step). Running it earlier never hurts."""
    op = graph.ops[op_id]
    return (
        not graph.successors[op_id]
        and not any(_occupies_memory(graph, t) for t in op.outputs)
        and any(_occupies_memory(graph, t) for t in op.inputs)
        and not any(graph.tensors[t].category is Category.OUTPUT for t in op.inputs)
    )


def early_release_ops(graph: Graph) -> list[OpId]:
    """Weight updates and deallocations: the ops OLLA 4.3 makes run early."""
    return [OpId(v) for v in range(graph.num_ops) if is_weight_update(graph, v) or is_deallocation(graph, v)]


def free_sources(graph: Graph) -> frozenset[int]:
    """Ops that touch no memory that an order can change (they read and write only persistent
    or 0-byte tensors) and whose predecessors are such ops too: parameter placeholders,
    their views. Running them all first, in the graph's listed (topological) order, is as
    good as any other place."""
    free: set[int] = set()
    for v in topological_order(graph):
        op = graph.ops[v]
        if all(p in free for p in graph.predecessors[v]) and not any(
            _occupies_memory(graph, t) for t in (*op.inputs, *op.outputs)
        ):
            free.add(v)
    return frozenset(free)


def hoist_free_sources(graph: Graph, order: tuple[OpId, ...] | list[OpId]) -> list[OpId]:
    """``order`` with the :func:`free_sources` moved to the front (peak never grows: those
    steps hold only persistent bytes, and the other ops keep their relative order)."""
    free = free_sources(graph)
    return [OpId(v) for v in sorted(free)] + [OpId(v) for v in order if v not in free]


def _allocated_bytes(graph: Graph) -> list[int]:
    """Bytes each op allocates: its non-persistent outputs."""
    return [
        sum(graph.tensors[t].size_bytes for t in dict.fromkeys(op.outputs) if not graph.tensors[t].persistent)
        for op in graph.ops
    ]


def _freeable(graph: Graph, t: int) -> bool:
    tensor = graph.tensors[t]
    return not tensor.persistent and tensor.category is not Category.OUTPUT and tensor.size_bytes > 0


def program_order(graph: Graph) -> list[OpId]:
    return graph.program_order()


def greedy_lpmf(graph: Graph, urgent: frozenset[int] = frozenset()) -> GreedyRun:
    """LPMF greedy: among ready ops, if some op fits under the peak so far, run the one that
    frees most net of what it allocates; else run the one that allocates least. Ops in
    ``urgent`` run first whenever ready. Tracks the running peak with the estimator's rules
    (a tensor lives from its producer's step to its last reader's step inclusive)."""
    alloc = _allocated_bytes(graph)
    remaining = [len(c) for c in graph.consumers]
    free = [0] * graph.num_ops
    for t in range(graph.num_tensors):
        if not _freeable(graph, t):
            continue
        if remaining[t] == 0:
            free[graph.producer[t]] += graph.tensors[t].size_bytes
        elif remaining[t] == 1:
            free[graph.consumers[t][0]] += graph.tensors[t].size_bytes
    indegree = [len(p) for p in graph.predecessors]
    ready = {v for v in range(graph.num_ops) if indegree[v] == 0}
    scheduled = [False] * graph.num_ops
    live_bytes = graph.persistent_bytes
    peak_so_far = live_bytes
    order: list[OpId] = []
    while ready:
        gap_bytes = peak_so_far - live_bytes
        chosen = min(
            ready,
            key=lambda v: (v not in urgent, alloc[v] if alloc[v] > gap_bytes else 0, alloc[v] - free[v], v),
        )
        ready.remove(chosen)
        scheduled[chosen] = True
        order.append(OpId(chosen))
        peak_so_far = max(peak_so_far, live_bytes + alloc[chosen])
        live_bytes += alloc[chosen] - free[chosen]
        for t in dict.fromkeys(graph.ops[chosen].inputs):
            remaining[t] -= 1
            if remaining[t] == 1 and _freeable(graph, t):
                last = next(c for c in graph.consumers[t] if not scheduled[c])
                free[last] += graph.tensors[t].size_bytes
        for s in graph.successors[chosen]:
            indegree[s] -= 1
            if indegree[s] == 0:
                ready.add(s)
    return GreedyRun(tuple(order), peak_so_far)


def bfs_order(graph: Graph) -> list[OpId]:
    """Inductor's BFS: run first the ready op whose predecessors ran earliest (FIFO)."""
    indegree = [len(p) for p in graph.predecessors]
    ran_at = [-1] * graph.num_ops

    def entry(v: int) -> tuple[list[int], int]:
        return sorted(ran_at[p] for p in graph.predecessors[v]), v

    heap = [entry(v) for v in range(graph.num_ops) if indegree[v] == 0]
    heapq.heapify(heap)
    order: list[OpId] = []
    while heap:
        _, v = heapq.heappop(heap)
        ran_at[v] = len(order)
        order.append(OpId(v))
        for s in graph.successors[v]:
            indegree[s] -= 1
            if indegree[s] == 0:
                heapq.heappush(heap, entry(s))
    return order


def dfs_order(graph: Graph) -> list[OpId]:
    """Inductor's DFS: visit ops by increasing bytes touched; before an op, visit its
    predecessors in the same order (post-order)."""
    alloc = _allocated_bytes(graph)
    touched = [
        alloc[v] + sum(graph.tensors[t].size_bytes for t in dict.fromkeys(op.inputs) if not graph.tensors[t].persistent)
        for v, op in enumerate(graph.ops)
    ]

    def by_size(ops: tuple[OpId, ...] | range) -> list[int]:
        return sorted(ops, key=lambda v: (touched[v], v))

    seen = [False] * graph.num_ops
    order: list[OpId] = []
    for root in by_size(range(graph.num_ops)):
        if seen[root]:
            continue
        seen[root] = True
        stack = [(root, iter(by_size(graph.predecessors[root])))]
        while stack:
            node, preds = stack[-1]
            nxt = next((p for p in preds if not seen[p]), None)
            if nxt is None:
                stack.pop()
                order.append(OpId(node))
            else:
                seen[nxt] = True
                stack.append((nxt, iter(by_size(graph.predecessors[nxt]))))
    return order


def optimizer_ops(graph: Graph) -> frozenset[int]:
    """Weight updates, optimizer-state updates, deallocations, and the ops that only feed them
    (Adam's temporaries), stopping at ops that make gradients: the ops that may run as soon as
    their gradient is ready."""
    tier = set()
    for v in reversed(topological_order(graph)):
        op = graph.ops[v]
        mutates_state = any(graph.tensors[t].category in UPDATED_CATEGORIES for t in op.mutates)
        makes_gradient = any(graph.tensors[t].category is Category.GRADIENT for t in op.outputs)
        feeds_only_updates = bool(graph.successors[v]) and all(s in tier for s in graph.successors[v])
        if mutates_state or is_deallocation(graph, v) or (feeds_only_updates and not makes_gradient and op.inputs):
            tier.add(v)
    return frozenset(tier)


def weight_updates_early(graph: Graph) -> list[OpId]:
    """Program order, except that optimizer ops run as soon as they are ready (OLLA 4.3)."""
    urgent = optimizer_ops(graph)
    n = graph.num_ops
    return topological_order(graph, [v - n if v in urgent else v for v in range(n)])


def portfolio(graph: Graph) -> list[Candidate]:
    """Every member's order and estimator peak, best first (ties: listed order)."""
    urgent = optimizer_ops(graph)
    members: list[tuple[str, Callable[[], tuple[OpId, ...] | list[OpId]]]] = [
        ("program", lambda: program_order(graph)),
        ("lpmf", lambda: greedy_lpmf(graph).order),
        ("bfs", lambda: bfs_order(graph)),
        ("dfs", lambda: dfs_order(graph)),
        ("updates-early", lambda: weight_updates_early(graph)),
    ]
    if urgent:
        members.append(("lpmf-updates-early", lambda: greedy_lpmf(graph, urgent).order))
    scored = []
    for index, (name, make) in enumerate(members):
        order = tuple(make())
        if name != "program":
            order = tuple(hoist_free_sources(graph, order))
        order_bytes = peak_bytes(graph, order)
        scored.append((order_bytes, index, Candidate(name, order, order_bytes)))
    scored.sort(key=lambda item: (item[0], item[1]))
    return [candidate for _, _, candidate in scored]


def best_heuristic(graph: Graph) -> Candidate:
    """The portfolio member with the smallest estimator peak."""
    return portfolio(graph)[0]
