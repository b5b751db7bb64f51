"""A lower bound on the compute of every plan within a budget: the drop cover.

The portfolio's gap (:mod:`memplan.remat.portfolio`) is taken from a bound; without one it
is the plain step's cost (every op runs once), and a baseline's plan that recomputes 0.12%
of the step is "feasible, gap 0.12%" until a solver proves more, which on a 472-node graph
takes the whole time limit. This bound is closed-form and takes milliseconds.

Checkmate's memory constraint (4.4) at the first run of op ``v`` (first runs in program
order): what is resident then is at most the budget. Part of it is forced whatever the plan
(:func:`memplan.remat.problem.floor_by_op`: the memory floor at ``v``). The rest are tensors
``t`` made before ``v`` by an op ``u`` that may still run again, and read after ``v``: each is
resident at ``v`` or *dropped*, and a dropped tensor is made again before its read, so ``u``
runs again after ``v`` (cost at least ``C_u``, Checkmate 4.9; one re-run remakes all of
``u``'s outputs). So the plan drops at least ``excess(v) = floor(v) + sum of those tensors'
bytes - budget`` bytes, and its recomputation costs at least the cheapest cover of that
excess: the set ``S`` of producers re-run after ``v`` holds ``sum_{u in S} bytes(u) >= excess``
and costs ``sum_{u in S} C_u``. That knapsack cover is solved exactly, as a small covering
problem (:func:`exact_cover`: a branch and bound over the producers in order of cost per
byte, each node bounded by its LP relaxation, the producers taken in that order and the last
one fractionally); where it needs more than :data:`COVER_NODES` nodes, its LP relaxation
stands in (still a bound). The bound is the plain step's cost plus the largest cover over
``v`` (one re-run can serve several ``v``, so the covers do not add). Exact covers matter where
the optimum is a few cheap recomputations: the LP takes a sliver of a cheap large tensor
(a few FLOPs), the cover must take the whole re-run.

It is the stage cuts of :mod:`memplan.remat.moccasin` without their recursion through what a
re-run reads, and without a solver: weaker where re-runs need re-runs, but known before any
search starts. Its scope: plans whose first runs keep program order (every plan of
Checkmate's MILP, the CP model without ``defer``, the baselines), any number of re-runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memplan.graph.ir import Category
from memplan.remat.problem import RematProblem, floor_by_op, rerun_limits

SCOPE = "plans whose first runs keep program order (memory floor and drop cover)"
"""What :func:`drop_cover_bound` speaks for."""


@dataclass(frozen=True)
class DropCoverBound:
    """``cost``: no plan in the scope computes less; ``extra`` of it is above the plain step,
    attained at ``op``'s first run (-1: nothing needs dropping). ``cost`` is infinite when
    the memory floor is over the budget (no plan at all)."""

    cost: float
    extra: float
    op: int


def drop_cover_bound(problem: RematProblem) -> DropCoverBound:
    """The drop-cover bound of ``problem`` (see the module docstring)."""
    budget, cost = problem.budget_bytes, problem.cost
    floors = floor_by_op(problem)
    best = DropCoverBound(problem.plain_cost, 0.0, -1)
    live: dict[int, int] = {}  # producer -> bytes of its droppable tensors live across the op
    nodes_left = TOTAL_COVER_NODES
    for v, (starting, ending) in enumerate(_droppable_events(problem)):
        for u, size in ending:
            live[u] -= size
        for u, size in starting:
            live[u] = live.get(u, 0) + size
        own = _own_droppable(problem, v)
        excess = floors[v] + sum(live.values()) - sum(own.values()) - budget
        if excess <= 0:
            continue
        sizes = {u: live[u] - own.get(u, 0) for u in live}
        items = [(cost[u], sizes[u]) for u in sizes if sizes[u] > 0]
        if _greedy_cover(excess, items) <= best.extra:
            continue  # this stage's cover cannot beat the best one
        extra, used = cover_search(excess, items, min(COVER_NODES, nodes_left))
        nodes_left = max(0, nodes_left - used)
        if extra > best.extra:
            best = DropCoverBound(problem.plain_cost + extra, extra, v)
    return best


def _droppable_events(problem: RematProblem) -> list[tuple[list[tuple[int, int]], list[tuple[int, int]]]]:
    """Per op ``v``: the droppable tensors (as (producer, bytes)) whose span starts at ``v``,
    and those whose span ended just before ``v``. A tensor ``t`` made by ``u`` is droppable
    over ``[u + 1, min(limit(u), last read))``: after that the floor holds it (its producer's
    re-run window closed) or nobody reads it again."""
    graph = problem.graph
    n = len(graph.ops)
    limits = rerun_limits(graph)
    events: list[tuple[list[tuple[int, int]], list[tuple[int, int]]]] = [([], []) for _ in range(n + 1)]
    for t, tensor in enumerate(graph.tensors):
        u = graph.producer[t]
        if tensor.persistent or tensor.size_bytes == 0 or u < 0 or tensor.category is Category.OUTPUT:
            continue
        end = min(limits[u], max(graph.consumers[t], default=-1))
        if u + 1 < end:
            events[u + 1][0].append((u, tensor.size_bytes))
            events[end][1].append((u, tensor.size_bytes))
    return events[:n]


def _own_droppable(problem: RematProblem, v: int) -> dict[int, int]:
    """Bytes per producer of ``v``'s droppable inputs: the floor already counts them at ``v``."""
    graph = problem.graph
    limits = rerun_limits(graph)
    own: dict[int, int] = {}
    for t in set(graph.ops[v].inputs):
        tensor, u = graph.tensors[t], graph.producer[t]
        if tensor.persistent or tensor.size_bytes == 0 or u < 0 or tensor.category is Category.OUTPUT:
            continue
        if u + 1 <= v < min(limits[u], max(graph.consumers[t], default=-1)):
            own[u] = own.get(u, 0) + tensor.size_bytes
    return own


COVER_NODES = 20_000
"""The most branch-and-bound nodes :func:`exact_cover` visits; past them its LP value stands in."""
TOTAL_COVER_NODES = 200_000
"""The most nodes all the covers of one :func:`drop_cover_bound` visit together (a second or
so); once spent, the rest of the stages take their LP value."""

Item = tuple[float, int]
"""``(cost, bytes)``: one producer of a cover (its re-run's cost, the bytes it frees)."""


def lp_cover(excess: int, items: list[Item]) -> float:
    """The knapsack cover's LP relaxation: the least cost of dropping ``excess`` bytes when a
    producer may be taken fractionally (items in order of cost per byte, the last one in
    part). Infinite when all of them are not enough."""
    return _lp_tail(excess, sorted(items, key=_ratio), 0)


def exact_cover(excess: int, items: list[Item], node_limit: int = COVER_NODES) -> float:
    """``min sum C_u x_u`` over ``x`` in {0, 1} with ``sum bytes_u x_u >= excess``: the cheapest
    set of re-runs that frees ``excess`` bytes (infinite when all of them are not enough, 0 when
    nothing needs freeing). A depth-first branch and bound over the items in order of cost per
    byte, taking each before leaving it out, each node pruned by its LP relaxation
    (:func:`lp_cover` over the items left); after ``node_limit`` nodes the root's LP relaxation
    is returned instead, a bound too (never above the exact value)."""
    return cover_search(excess, items, node_limit)[0]


def cover_search(excess: int, items: list[Item], node_limit: int) -> tuple[float, int]:
    """:func:`exact_cover`'s value and the branch-and-bound nodes it visited."""
    if excess <= 0:
        return 0.0, 0
    order = sorted((item for item in items if item[1] > 0), key=_ratio)
    root = _lp_tail(excess, order, 0)
    if math.isinf(root):
        return root, 0
    best = _greedy_cover(excess, order)
    suffix = [0] * (len(order) + 1)
    for i in range(len(order) - 1, -1, -1):
        suffix[i] = suffix[i + 1] + order[i][1]
    stack = [(0, excess, 0.0)]  # (next item, bytes still to free, cost so far)
    nodes = 0
    while stack:
        i, left, spent = stack.pop()
        if left <= 0:
            best = min(best, spent)
            continue
        if i == len(order) or suffix[i] < left:
            continue
        nodes += 1
        if nodes > node_limit:
            return root, nodes
        if spent + _lp_tail(left, order, i) >= best * (1 - 1e-12):
            continue
        cost, size = order[i]
        stack.append((i + 1, left, spent))  # leave item i out: explored after taking it
        stack.append((i + 1, left - size, spent + cost))
    return best, nodes


def _ratio(item: Item) -> float:
    return item[0] / item[1]


def _lp_tail(excess: int, order: list[Item], start: int) -> float:
    """:func:`lp_cover` over ``order[start:]`` (already in order of cost per byte)."""
    total = 0.0
    for cost, size in order[start:]:
        take = min(size, excess)
        total += cost * take / size
        excess -= take
        if excess <= 0:
            return total
    return float("inf")


def _greedy_cover(excess: int, items: list[Item]) -> float:
    """A cover's cost that is no lower than the exact one (an upper bound on :func:`exact_cover`):
    items in order of cost per byte, each taken whole, until ``excess`` bytes are freed."""
    total = 0.0
    for cost, size in sorted(items, key=_ratio):
        if excess <= 0:
            break
        total += cost
        excess -= size
    return total if excess <= 0 else float("inf")
