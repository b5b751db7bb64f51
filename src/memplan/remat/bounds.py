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
excess: a knapsack cover whose LP relaxation is solved exactly by taking the producers in
order of cost per byte, the last one fractionally. The bound is the plain step's cost plus
the largest cover over ``v`` (one re-run can serve several ``v``, so the covers do not add).

It is the stage cuts of :mod:`memplan.remat.moccasin` without their recursion through what a
re-run reads, and without a solver: weaker where re-runs need re-runs, but known before any
search starts. Its scope: plans whose first runs keep program order (every plan of
Checkmate's MILP, the CP model without ``defer``, the baselines), any number of re-runs.
"""

from __future__ import annotations

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
    for v, (starting, ending) in enumerate(_droppable_events(problem)):
        for u, size in ending:
            live[u] -= size
        for u, size in starting:
            live[u] = live.get(u, 0) + size
        own = _own_droppable(problem, v)
        excess = floors[v] + sum(live.values()) - sum(own.values()) - budget
        if excess <= 0:
            continue
        extra = _cheapest_cover(excess, {u: live[u] - own.get(u, 0) for u in live}, cost)
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


def _cheapest_cover(excess: int, sizes: dict[int, int], cost: tuple[float, ...]) -> float:
    """The least cost of dropping ``excess`` bytes, fractionally (the knapsack cover's LP):
    producers in order of cost per byte. Infinite when all of them are not enough."""
    total = 0.0
    for u in sorted((u for u in sizes if sizes[u] > 0), key=lambda u: cost[u] / sizes[u]):
        take = min(sizes[u], excess)
        total += cost[u] * take / sizes[u]
        excess -= take
        if excess <= 0:
            return total
    return float("inf")
