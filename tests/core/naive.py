"""Naive re-implementations used as oracles: slow, obviously right, written apart."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet

from memplan.graph.ir import Category, Graph
from memplan.remat.baselines import Carry, forward_nodes, reads_bytes
from memplan.remat.coarsen import SolverGraph
from memplan.remat.lower import InvalidPlan


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


def rows_for_policy_naive(
    sg: SolverGraph,
    carry: Carry,
    required: Callable[[int], set[int]] | None = None,
    on_stage: Callable[[int, list[int]], None] | None = None,
    droppable: AbstractSet[int] | None = None,
) -> list[list[int]]:
    """:func:`memplan.remat.baselines.rows_for_policy` as first written: the resident set
    rebuilt from every node at every stage (O(n^2)). ``droppable`` is ignored."""
    pinned = {i for i in range(sg.size) if any(j >= sg.limit[i] for j in sg.users[i] if reads_bytes(sg, i, j))}
    available: set[int] = set()
    result = []
    for t in range(sg.size):
        row = {t}
        wanted = [t, *sorted(i for i in (required(t) if required else ()) if i < t and i not in available)]
        row.update(wanted)
        stack = list(wanted)
        while stack:
            j = stack.pop()
            for p in sg.preds[j]:
                if p in available or p in row or not reads_bytes(sg, p, j):
                    continue
                if not sg.may_run(t, p):
                    raise InvalidPlan(f"stage {t} needs node {p}, which was dropped and may not be recomputed")
                row.add(p)
                stack.append(p)
        ordered = sorted(row)
        result.append(ordered)
        if on_stage:
            on_stage(t, ordered)
        nxt = t + 1
        available = {i for i in available | row if i in pinned or not sg.may_run(nxt, i) or carry(t, i)}
    return result


def naive_chen_rows(sg: SolverGraph, checkpoints: set[int]) -> list[list[int]]:
    """``memplan.remat.baselines._chen_rows`` as first written (segments opened by index)."""
    fwd = [k for k in forward_nodes(sg) if sg.recomputable(k)]
    marks = sorted(checkpoints)
    segment = {k: bisect.bisect_left(marks, k) for k in fwd}
    opened: set[int] = set()
    dropped = set(fwd) - checkpoints

    def carry(t: int, i: int) -> bool:
        return i not in dropped or t + 1 < sg.num_forward or segment[i] in opened

    def on_stage(t: int, row: list[int]) -> None:
        if t >= sg.num_forward:
            opened.update(segment[i] for i in row if i in dropped and i < t)

    return rows_for_policy_naive(sg, carry, on_stage=on_stage)


def naive_drop_rows(sg: SolverGraph, dropped: set[int]) -> list[list[int]]:
    """``memplan.remat.baselines._drop_rows`` as first written."""
    opened: set[int] = set()

    def carry(t: int, i: int) -> bool:
        return i not in dropped or t + 1 < sg.num_forward or i in opened

    def on_stage(t: int, row: list[int]) -> None:
        if t >= sg.num_forward:
            opened.update(i for i in row if i in dropped and i < t)

    return rows_for_policy_naive(sg, carry, on_stage=on_stage)
