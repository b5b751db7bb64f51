"""Naive re-implementations used as oracles: slow, obviously right, written apart."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from memplan.graph.ir import Category, Graph


def naive_resident_sets(graph: Graph, order: Sequence[int]) -> list[set[int]]:
    """OLLA 2.2 word for word: RS(t) = fanin and fanout of the op at t, plus every tensor
    created before t that some op after t still reads (or that is an output of the step),
    plus every persistent tensor."""
    done: set[int] = set()
    sets = []
    for t, op_id in enumerate(order):
        op = graph.ops[op_id]
        later = set(order[t + 1 :])
        rs = set(op.inputs) | set(op.outputs)
        for tid, tensor in enumerate(graph.tensors):
            if tensor.persistent or (
                graph.producer[tid] in done
                and (tensor.category is Category.OUTPUT or any(c in later for c in graph.consumers[tid]))
            ):
                rs.add(tid)
        sets.append(rs)
        done.add(op_id)
    return sets


def naive_peak(graph: Graph, order: Sequence[int]) -> int:
    return max(sum(graph.tensors[t].size_bytes for t in rs) for rs in naive_resident_sets(graph, order))


def all_topological_orders(graph: Graph) -> Iterator[list[int]]:
    """Every topological order, by brute force over permutations (tiny graphs only)."""
    n = len(graph.ops)
    for perm in itertools.permutations(range(n)):
        pos = {v: i for i, v in enumerate(perm)}
        if all(pos[p] < pos[v] for v in range(n) for p in graph.predecessors[v]):
            yield list(perm)
