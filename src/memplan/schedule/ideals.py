"""Exact reordering: depth-first search over ideals under a peak cap, and a cap bisection.

The ops run before any timestep form an *ideal* ``D`` of the graph (closed under
predecessors), and the bytes resident after them depend on ``D`` alone (the estimator's rule,
OLLA 2.2: a tensor is resident from its producer's step to its last reader's step; outputs of
the step to the end; persistent tensors always). Running a ready op ``v`` next costs
``resident(D) + outputs(v)`` at its step. So the orders with a peak at most ``cap`` are the
paths from the empty ideal to the whole graph whose every step stays under ``cap``: a search
over ideals, as in Serenity's dynamic programming over zero-indegree sets (Ahn et al.,
"Ordering Chaos: Memory-Aware Scheduling of Irregularly Wired Neural Networks", MLSys 2020),
with its memory budget as the cap. Exhausting it proves that no order fits the cap.

Two rules keep it small, both exact:

* dead ideals: whether an ideal can be completed under the cap depends on the ideal only, so
  one that failed once is never searched again;
* dominance: a ready op that fits under the cap and frees at least what it allocates is run at
  once, alone. Moving it to the front of any completion lowers (or keeps) the resident bytes at
  every step before its old place and leaves the others as they were.

Other ready ops are tried by how little they add (then by their step's bytes), so the first
dive is a good greedy order. :func:`minimise_peak` bisects the cap between a proven lower bound
and the best order known, as the placement search does with capacities.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from memplan.graph.ir import Category, Graph, OpId
from memplan.graph.liveness import memory_timeline, peak_bytes
from memplan.schedule.problem import gap_met

# Dead ideals are remembered up to this many bits of bitsets in all (beyond, the search goes on
# without remembering more: slower, never wrong).
DEAD_IDEAL_BITS = 2**31


def max_dead_ideals(num_ops: int) -> int:
    return DEAD_IDEAL_BITS // max(num_ops, 64)


class _Stopped(Exception):
    """The node limit or the deadline was reached."""


@dataclass(frozen=True)
class IdealGraph:
    """What the search needs of a graph, as flat lists: per op its successors, predecessor
    count, allocated bytes and the tensors it reads (each once), and per tensor its size and
    reader count; tensors that never die (outputs of the step) have no reader count."""

    num_ops: int
    successors: tuple[tuple[int, ...], ...]
    num_preds: tuple[int, ...]
    alloc_bytes: tuple[int, ...]
    unread_bytes: tuple[int, ...]  # outputs no op reads: freed right after their producer's step
    reads: tuple[tuple[int, ...], ...]  # dying-capable tensors each op reads
    read_sets: tuple[frozenset[int], ...]
    tensor_bytes: tuple[int, ...]
    num_readers: tuple[int, ...]
    base_bytes: int

    def kernel(self) -> Any:
        """The arrays of the compiled search (built once per graph)."""
        if "_kernel" not in self.__dict__:
            from memplan.schedule.native import Kernel

            object.__setattr__(self, "_kernel", Kernel(self))
        return self.__dict__["_kernel"]

    @classmethod
    def of(cls, graph: Graph) -> IdealGraph:
        n = graph.num_ops
        alloc, unread = [0] * n, [0] * n
        reads: list[list[int]] = [[] for _ in range(n)]
        sizes = [0] * graph.num_tensors
        readers = [0] * graph.num_tensors
        for e, t in enumerate(graph.tensors):
            if t.persistent or t.size_bytes == 0:
                continue
            p = graph.producer[e]
            alloc[p] += t.size_bytes
            if t.category is Category.OUTPUT:
                continue
            distinct = set(graph.consumers[e])
            if not distinct:
                unread[p] += t.size_bytes
                continue
            sizes[e], readers[e] = t.size_bytes, len(distinct)
            for c in distinct:
                reads[c].append(e)
        return cls(
            n,
            tuple(tuple(dict.fromkeys(s)) for s in graph.successors),
            tuple(len(set(p)) for p in graph.predecessors),
            tuple(alloc),
            tuple(unread),
            tuple(tuple(r) for r in reads),
            tuple(frozenset(r) for r in reads),
            tuple(sizes),
            tuple(readers),
            graph.persistent_bytes,
        )


class _Search:
    """One search at a fixed cap; state is undone on backtrack."""

    def __init__(self, ig: IdealGraph, cap: int, deadline: float, max_nodes: int, prefix: Sequence[int] = ()) -> None:
        self.ig, self.cap, self.deadline, self.max_nodes = ig, cap, deadline, max_nodes
        self.max_dead = max_dead_ideals(ig.num_ops)
        self.preds_left = list(ig.num_preds)
        self.readers_left = list(ig.num_readers)
        self.ready = {v for v in range(ig.num_ops) if ig.num_preds[v] == 0}
        self.mem = ig.base_bytes
        self.done = 0  # the ideal, as a bitset
        self.order: list[int] = []
        self.dead: set[int] = set()
        self.nodes = 0
        for v in prefix:  # the segments before this one, as they are: not searched, not capped
            self.run(v)
        self.goal = ig.num_ops

    def freed(self, v: int) -> int:
        """Bytes that die at ``v``'s step: inputs it reads last, outputs nobody reads."""
        ig, left = self.ig, self.readers_left
        return ig.unread_bytes[v] + sum(ig.tensor_bytes[e] for e in ig.reads[v] if left[e] == 1)

    def look_ahead(self, v: int) -> int:
        """Where running ``v`` leads: the bytes it adds once every op it makes ready that the
        dominance rule would run at once (views, transposes, frees) has run, in turn, lowest
        number first; minus the most that one op then ready would free. Steers the dive to
        complete what ``v`` starts (a gradient contribution to its accumulation) rather than
        leave both waiting."""
        ig, before = self.ig, self.mem
        trail = [(v, self.run(v))]
        newly = set(ig.successors[v])
        while True:
            runnable = sorted(
                s
                for s in newly & self.ready
                if self.mem + ig.alloc_bytes[s] <= self.cap and ig.alloc_bytes[s] - self.freed(s) <= 0
            )
            if not runnable:
                break
            s = runnable[0]
            trail.append((s, self.run(s)))
            newly.discard(s)
            newly.update(ig.successors[s])
        relief = max((self.freed(s) for s in newly & self.ready), default=0)
        added = self.mem - before
        for u, delta in reversed(trail):
            self.undo(u, delta)
        return added - relief

    def run(self, v: int) -> int:
        ig = self.ig
        delta = ig.alloc_bytes[v] - self.freed(v)
        self.mem += delta
        self.done |= 1 << v
        self.order.append(v)
        self.ready.discard(v)
        for e in ig.reads[v]:
            self.readers_left[e] -= 1
        for s in ig.successors[v]:
            self.preds_left[s] -= 1
            if self.preds_left[s] == 0:
                self.ready.add(s)
        return delta

    def undo(self, v: int, delta: int) -> None:
        ig = self.ig
        for s in ig.successors[v]:
            if self.preds_left[s] == 0:
                self.ready.discard(s)
            self.preds_left[s] += 1
        for e in ig.reads[v]:
            self.readers_left[e] += 1
        self.ready.add(v)
        self.order.pop()
        self.done ^= 1 << v
        self.mem -= delta

    def complete(self) -> bool:
        """True if the current ideal can be completed under the cap (the order is then full)."""
        if len(self.order) == self.goal:
            return True
        if self.done in self.dead:
            return False
        self.nodes += 1
        if self.nodes > self.max_nodes or (self.nodes & 63 == 0 and time.perf_counter() > self.deadline):
            raise _Stopped
        ig, mem, cap = self.ig, self.mem, self.cap
        fitting = [(ig.alloc_bytes[v] - self.freed(v), v) for v in self.ready if mem + ig.alloc_bytes[v] <= cap]
        dominant = [v for delta, v in fitting if delta <= 0]
        if dominant:  # it frees what it takes: run it now, alone (the lowest-numbered such op)
            options = [min(dominant)]
        else:
            scored = sorted((self.look_ahead(v), delta, v) for delta, v in fitting)
            options = [v for *_, v in scored]
        for v in options:
            delta = self.run(v)
            if self.complete():
                return True
            self.undo(v, delta)
        if len(self.dead) < self.max_dead:
            self.dead.add(self.done)
        return False


@dataclass(frozen=True)
class CapResult:
    """An order whose peak is at most the cap (``None`` if none was found), whether the search
    finished (so ``None`` means: provably none), and the nodes it visited."""

    order: tuple[OpId, ...] | None
    proven: bool
    nodes: int


def fit_under(
    graph: Graph,
    cap_bytes: int,
    deadline: float,
    max_nodes: int = 10**9,
    ig: IdealGraph | None = None,
    *,
    prefix: Sequence[int] = (),
    segment_size: int | None = None,
    engine: str = "auto",
) -> CapResult:
    """An order of ``graph`` whose peak (the estimator's) is at most ``cap_bytes``, or a proof
    that there is none, within ``deadline`` (``time.perf_counter()``) and ``max_nodes``.

    With ``prefix`` (the ops of the segments before, in their order) and ``segment_size``, only
    the next ``segment_size`` steps are searched and capped, and the returned order is theirs:
    a segment (no op of another can run inside it, :func:`memplan.schedule.ilp.segments`) is
    searched on its own, which keeps the ideals of the other segments out of the search.
    ``engine``: "native" (the compiled kernel), "python" or "auto" (native when it builds)."""
    ig = ig or IdealGraph.of(graph)
    goal = len(prefix) + segment_size if segment_size is not None else ig.num_ops
    if _use_native(engine):
        outcome, steps, nodes = ig.kernel().search(
            cap_bytes, prefix, goal, max_nodes, max_dead_ideals(ig.num_ops), deadline
        )
    else:
        outcome, steps, nodes = _python_search(ig, cap_bytes, deadline, max_nodes, prefix, goal)
    if outcome == "aborted":
        return CapResult(None, False, nodes)
    if steps is None:
        return CapResult(None, True, nodes)
    order = tuple(OpId(v) for v in steps)
    if segment_size is None:
        assert peak_bytes(graph, order) <= cap_bytes, "the ideal search's memory model disagrees with the estimator"
    return CapResult(order, True, nodes)


ENGINES = ("auto", "native", "python")


def _use_native(engine: str) -> bool:
    if engine not in ENGINES:
        raise ValueError(f"unknown search engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if engine == "python":
        return False
    from memplan.schedule import native

    return engine == "native" or native.available()


def _python_search(
    ig: IdealGraph, cap: int, deadline: float, max_nodes: int, prefix: Sequence[int], goal: int
) -> tuple[str, list[int] | None, int]:
    search = _Search(ig, cap, deadline, max_nodes, prefix)
    search.goal = goal
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 2 * ig.num_ops + 1000))
    try:
        found = search.complete()
    except _Stopped:
        return "aborted", None, search.nodes
    finally:
        sys.setrecursionlimit(limit)
    if not found:
        return "infeasible", None, search.nodes
    return "found", search.order[len(prefix) :], search.nodes


@dataclass(frozen=True)
class Probe:
    cap_bytes: int
    outcome: str  # "found" | "infeasible" | "unknown"
    nodes: int
    seconds: float


@dataclass(frozen=True)
class PeakSearch:
    """The best order found (``None`` if none beat the start), its peak, and the proven lower
    bound: no order of the graph peaks below ``proven_lower_bytes``."""

    order: tuple[OpId, ...] | None
    peak_bytes: int
    proven_lower_bytes: int
    probes: tuple[Probe, ...]


# The first probe (at the lower bound) gets this share of the time; each later one this share
# of what is left.
FIRST_PROBE_SHARE = 0.3
PROBE_SHARE = 0.5


def minimise_peak(
    graph: Graph,
    lower_bytes: int,
    start_order: Sequence[int],
    deadline: float,
    ig: IdealGraph | None = None,
    parts: Sequence[tuple[int, int, Sequence[int]]] | None = None,
    engine: str = "auto",
    *,
    stop_gap: float = 0.0,
    first_share: float = FIRST_PROBE_SHARE,
    max_probes: int | None = None,
) -> PeakSearch:
    """Bisect the cap between ``lower_bytes`` (a proven bound) and the peak of ``start_order``
    minus one: a probe that finds an order moves the top down to its peak minus one, one that
    is exhausted proves its cap infeasible, one that runs out of time moves the searched bottom
    only. The lower bound is probed first (most graphs meet it), then, if it was not met, one
    byte below the best order known (which proves that order optimal when it fails).

    A probe searches only the segments (``parts``: ``(first, last, ops)`` timestep ranges no
    op crosses, :func:`memplan.schedule.ilp.segments`; the whole graph by default) whose peak
    in the best order is above the cap, highest first; one segment that cannot be brought
    under the cap proves that no order can.

    ``stop_gap``: stop once the best order is within that fraction of the proven bound
    (:func:`memplan.schedule.problem.gap_met`), after the probe at the bound (which may prove
    it optimal); ``first_share``: the share of the time the
    probe at the bound gets; ``max_probes``: stop after that many probes."""
    ig = ig or IdealGraph.of(graph)
    parts = list(parts) if parts is not None else [(0, graph.num_ops - 1, range(graph.num_ops))]
    best_order = list(start_order)
    best = peak_bytes(graph, best_order)
    found_any = False
    proven = searched = lower_bytes
    hi = best - 1
    probes: list[Probe] = []
    cap, share, second = lower_bytes, first_share, True
    while searched <= hi:
        t0 = time.perf_counter()
        if t0 >= deadline or len(probes) == max_probes or (probes and stop_gap and gap_met(best, proven, stop_gap)):
            break
        probe_deadline = min(deadline, t0 + share * (deadline - t0))
        outcome, order, nodes = _probe(graph, ig, parts, best_order, cap, probe_deadline, engine)
        if order is not None:
            best_order, best, found_any = order, peak_bytes(graph, order), True
            hi = best - 1
        else:
            searched = cap + 1
            if outcome == "infeasible":
                proven = cap + 1
        probes.append(Probe(cap, outcome, nodes, time.perf_counter() - t0))
        share = PROBE_SHARE
        # Right after the bound, one below the best known: proves it optimal in one probe.
        cap = hi if second and outcome != "found" else (searched + hi) // 2
        second = False
    order_out = tuple(OpId(v) for v in best_order) if found_any else None
    return PeakSearch(order_out, best, min(proven, best), tuple(probes))


def _probe(
    graph: Graph,
    ig: IdealGraph,
    parts: Sequence[tuple[int, int, Sequence[int]]],
    order: list[int],
    cap: int,
    deadline: float,
    engine: str,
) -> tuple[str, list[int] | None, int]:
    """Bring every segment of ``order`` whose peak is above ``cap`` under it, highest first."""
    timeline = memory_timeline(graph, order)
    over = [(first, last) for first, last, _ in parts if max(timeline[first : last + 1]) > cap]
    over.sort(key=lambda fl: -max(timeline[fl[0] : fl[1] + 1]))
    order, nodes = list(order), 0
    for first, last in over:
        size = last - first + 1
        result = fit_under(graph, cap, deadline, ig=ig, prefix=order[:first], segment_size=size, engine=engine)
        nodes += result.nodes
        if result.order is None:
            return ("infeasible" if result.proven else "unknown"), None, nodes
        order[first : last + 1] = result.order
    assert peak_bytes(graph, order) <= cap, "the ideal search's memory model disagrees with the estimator"
    return "found", order, nodes
