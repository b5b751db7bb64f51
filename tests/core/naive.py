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


def naive_fits(
    sizes: Sequence[int], lives: Sequence[tuple[int, int]], capacity: int, fixed: dict[int, int] | None = None
) -> bool:
    """Can every buffer get an integer offset in ``[0, capacity - size]`` (its fixed one, if
    any) with no two live-together buffers overlapping? Plain backtracking in index order over
    every offset: slow, obviously right."""
    fixed = fixed or {}
    n = len(sizes)
    offsets: list[int] = []

    def clash(b: int, o: int) -> bool:
        for a in range(b):
            live_together = lives[a][0] < lives[b][1] and lives[b][0] < lives[a][1]
            if live_together and sizes[a] and sizes[b] and offsets[a] < o + sizes[b] and o < offsets[a] + sizes[a]:
                return True
        return False

    def place(b: int) -> bool:
        if b == n:
            return True
        choices = [fixed[b]] if b in fixed else range(capacity - sizes[b] + 1)
        for o in choices:
            if o + sizes[b] <= capacity and not clash(b, o):
                offsets.append(o)
                if place(b + 1):
                    return True
                offsets.pop()
        return False

    return place(0)


def naive_min_arena(sizes: Sequence[int], lives: Sequence[tuple[int, int]], fixed: dict[int, int] | None = None) -> int:
    """The smallest capacity :func:`naive_fits` accepts, counting up from the most bytes live at
    one time (no capacity below it can fit)."""
    load = max((sum(s for s, (a, z) in zip(sizes, lives, strict=True) if a <= t < z) for t, _ in lives), default=0)
    capacity = max([load, *((o + sizes[b]) for b, o in (fixed or {}).items())])
    while not naive_fits(sizes, lives, capacity, fixed):
        capacity += 1
    return capacity
