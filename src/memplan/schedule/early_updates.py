"""OLLA 4.3, Functions 3 and 4: control edges that make weight updates run early.

A weight update frees its gradient; there is rarely a reason to delay it. For every update op
``v`` we find an *anchor*: an op whose forward level is above ``v``'s (so the new edge cannot
close a cycle) and whose backward level is as high as possible (it runs early), searching
outwards from ``v``'s fanin. A 0-byte control edge ``v -> anchor`` then bounds ``v``'s
latest position without changing the memory of any order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator

from memplan.graph.analysis import alap_levels, asap_levels, topological_order
from memplan.graph.ir import Category, Graph, Op, OpId, Tensor, TensorId
from memplan.schedule.heuristics import early_release_ops

Found = tuple[int | None, int]  # (candidate op or None, its backward level or -1)


def backward_levels(graph: Graph) -> list[int]:
    """Levelization of the reversed graph: the longest path, in edges, from ``v`` to a sink."""
    alap = alap_levels(graph)
    depth = max(alap, default=-1) + 1
    return [depth - 1 - level for level in alap]


class _AnchorSearch:
    """Function 4 (FindCandidate) with its memo, run without Python recursion."""

    def __init__(self, graph: Graph, fwd: list[int], bwd: list[int], min_fwd_level: int) -> None:
        self.graph = graph
        self.fwd = fwd
        self.bwd = bwd
        self.min_fwd_level = min_fwd_level
        self.visited: dict[int, Found] = {}

    def _frame(self, v: int) -> Generator[int, Found | None, Found]:
        best_level, best = -1, None
        for t in self.graph.ops[v].outputs:
            for snk in self.graph.consumers[t]:
                if self.bwd[snk] <= best_level:
                    continue
                if self.fwd[snk] <= self.min_fwd_level:
                    found = yield snk
                    assert found is not None
                    candidate, level = found
                    if level > best_level:
                        best_level, best = level, candidate
                else:
                    best_level, best = self.bwd[snk], snk
        return best, best_level

    def find(self, v: int) -> Found:
        if v in self.visited:
            return self.visited[v]
        stack = [(v, self._frame(v))]
        reply: Found | None = None
        while stack:
            node, frame = stack[-1]
            try:
                request = frame.send(reply)
            except StopIteration as done:
                stack.pop()
                self.visited[node] = reply = done.value
                continue
            if request in self.visited:
                reply = self.visited[request]
            else:
                stack.append((request, self._frame(request)))
                reply = None
        return self.visited[v]


def find_anchor(graph: Graph, update: int, fwd: list[int], bwd: list[int]) -> int | None:
    """Function 3's inner loop for one update op: widen the search ring over the fanin
    until some ring yields a candidate; return the candidate with the highest backward level."""
    search = _AnchorSearch(graph, fwd, bwd, fwd[update])
    starts = {update}
    while starts:
        starts = {graph.producer[t] for v in starts for t in graph.ops[v].inputs}
        best_level, best = -1, None
        for src in sorted(starts):
            candidate, level = search.find(src)
            if level > best_level:
                best_level, best = level, candidate
        if best is not None:
            return best
    return None


def enforce_early_weight_updates(graph: Graph) -> tuple[Graph, list[tuple[OpId, OpId]]]:
    """Function 3: a new graph with a 0-byte control edge from each weight update (and each
    pure deallocation, e.g. a gradient's release: same purpose) to its anchor (``graph`` is
    not modified), and the list of added ``(update, anchor)`` edges in ``graph``'s op ids.
    The new graph lists its ops in a topological order (so op ids differ; translate orders
    with :func:`map_order`).

    Acyclic by construction: each edge goes to a strictly higher forward level of the
    original graph, so those levels still increase along every edge."""
    fwd = asap_levels(graph)
    bwd = backward_levels(graph)
    edges: list[tuple[OpId, OpId]] = []
    for v in early_release_ops(graph):
        anchor = find_anchor(graph, v, fwd, bwd)
        if anchor is not None and anchor not in graph.successors[v]:
            edges.append((v, OpId(anchor)))
    return add_control_edges(graph, edges), edges


def add_control_edges(graph: Graph, edges: list[tuple[OpId, OpId]]) -> Graph:
    """A copy of ``graph`` with one new 0-byte CONTROL tensor per ``(before, after)`` edge."""
    if not edges:
        return graph
    tensors = list(graph.tensors)
    extra_out: dict[int, list[TensorId]] = {}
    extra_in: dict[int, list[TensorId]] = {}
    taken = {t.name for t in tensors}
    for before, after in edges:
        name = f"ctrl:{graph.ops[before].name}->{graph.ops[after].name}"
        while name in taken:
            name += "'"
        taken.add(name)
        tensors.append(Tensor(name, 0, Category.CONTROL, False))
        tid = TensorId(len(tensors) - 1)
        extra_out.setdefault(before, []).append(tid)
        extra_in.setdefault(after, []).append(tid)
    ops: list[Op] = [
        dataclasses.replace(
            op,
            inputs=op.inputs + tuple(extra_in.get(v, ())),
            outputs=op.outputs + tuple(extra_out.get(v, ())),
        )
        for v, op in enumerate(graph.ops)
    ]
    meta = dict(graph.meta)
    meta["early_update_edges"] = len(edges)
    constrained = Graph(tuple(ops), tuple(tensors), graph.name, meta)
    # Keep the convention that ``ops`` is a topological (program) order: an update now runs
    # before its anchor, which eager PyTorch ran earlier. Ties keep the original order.
    listing = topological_order(constrained)
    return relist_ops(constrained, listing)


def relist_ops(graph: Graph, listing: list[OpId]) -> Graph:
    """The same graph with its ops listed in ``listing`` order (tensors unchanged)."""
    if listing == graph.program_order():
        return graph
    return Graph(tuple(graph.ops[v] for v in listing), graph.tensors, graph.name, dict(graph.meta))


def map_order(order: list[OpId] | tuple[OpId, ...], source: Graph, target: Graph) -> list[OpId]:
    """Translate an order of ``source``'s op ids into ``target``'s, matching ops by name."""
    index = target.op_index
    return [index[source.ops[v].name] for v in order]
