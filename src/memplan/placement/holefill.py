"""Exact hole filling along time, for placements whose load meets the capacity.

The canonical search (:mod:`memplan.placement.search`) places buffers in order of offset, all
times at once. Where the load equals the capacity at every time (a perfect packing, as
:func:`memplan.placement.generate.perfect_instance` makes), a wrong choice low down at one time
shows only once the offsets there reach the top, and meanwhile the search tries every
combination higher up at all other times. Sweeping *time* instead keeps that choice close to
its consequence: at each time some buffers start, and at that moment the free address ranges
(the holes left by the live buffers placed so far) are known. With no slack at that time
(load = capacity) the starting buffers must tile the holes exactly: each hole is a stack of
them from its bottom, and the only choice is which buffer goes next in which hole. Those
stacks are tried depth first, time after time (each hole's candidates in one of :data:`ORDERS`,
taking turns with growing node limits), with these rules:

* slack: with ``s`` bytes of slack at a time (capacity minus load), at most ``s`` bytes of
  the holes may stay empty, taken only at the top of a hole (the search's definition);
* exact refills (:attr:`HoleFillOptions.exact_refills`): where the load meets the capacity
  just before and at a time ``e``, the buffers ending at ``e`` free exactly the holes that
  those starting at ``e`` must tile; so a run of buffers ending at ``e``, stacked together and
  bounded by buffers that outlive them (or by 0 and the capacity), must measure a sum of the
  sizes starting at ``e`` (the section inference of this sweep);
* interchangeable buffers (:attr:`HoleFillOptions.interchangeable`): buffers with the same
  size and lifetime are tried in one order only;
* failed states (:attr:`HoleFillOptions.failed_states`): what is left to do at a time depends
  only on the offsets of the buffers live then, so a time reached again with the same live
  offsets as a failed visit fails again (a no-good, remembered for the rest of the run).

Stacking from the bottom of a hole is complete when there is no slack (every hole is
covered exactly) and a heuristic otherwise (empty space lies only at the top of holes).
So this search only ever *finds* placements; it never reports that none exists.

The search can pause and resume (:class:`HoleFilling`): its depth-first recursion is a chain
of generators that yield at the clock checks, so a later :meth:`HoleFilling.run` continues
where the last one stopped, and the placement found does not depend on how the time is sliced.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, fields

from memplan.placement.problem import Placement, PlacementProblem, arena_bytes, unit_bytes
from memplan.placement.search import problem_units

# Nodes between two looks at the clock.
CLOCK_EVERY = 1024
# The subset sums of the sizes starting at each time are bit sets of as many bits as the
# capacity has units; larger capacities are left to the other stages.
MAX_CAPACITY_UNITS = 1 << 16

# The order in which a hole's candidates are tried, bottom up (key of size, end, index): the
# earliest-ending lowest, the latest-ending lowest, the largest lowest. Tried in turn with node
# limits that double every round, like MiniMalloc's preorderings; whichever finishes first wins.
ORDERS: dict[str, Callable[[int, int, int], tuple[int, ...]]] = {
    "short-low": lambda size, end, b: (end, -size, b),
    "long-low": lambda size, end, b: (-end, -size, b),
    "large-low": lambda size, end, b: (-size, end, b),
}


@dataclass(frozen=True)
class HoleFillOptions:
    """The pruning rules of the hole filling; each is sound alone and in any combination:
    switching one off changes the time, never whether a placement is found."""

    exact_refills: bool = True  # a closed run of buffers ending together must be refillable exactly
    interchangeable: bool = True  # buffers of one size and lifetime are tried in one order only
    chained_runs: bool = True  # a run can grow past a neighbour only along a chain of buffers ending there
    failed_states: bool = True  # a time reached again with the same live offsets fails again

    @classmethod
    def flag_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class HoleFill:
    """``offsets_units`` when every buffer was placed under the capacity, else ``None``
    (nothing proven either way); ``nodes`` spent."""

    offsets_units: tuple[int, ...] | None
    nodes: int


def subset_sums(sizes: Iterable[int]) -> int:
    """The sums of all subsets of ``sizes``, as a bit set (bit ``s`` set: ``s`` is one)."""
    bits = 1
    for size in sizes:
        bits |= bits << size
    return bits


class _Stop(Exception):
    """Node limit reached."""


# A step of the search: yields when it pauses (deadline or stop), returns whether it placed.
_Steps = Generator[None, None, bool]


class _Sweep:
    """The depth-first search over (time, hole, buffer) with its undo-able state."""

    def __init__(
        self,
        sizes: Sequence[int],
        lives: Sequence[tuple[int, int]],
        capacity: int,
        pause: Callable[[], bool],
        max_nodes: int,
        order: str = "short-low",
        options: HoleFillOptions = HoleFillOptions(),
        failed: set[tuple[int, int, int]] | None = None,
    ) -> None:
        self.pause, self.options = pause, options
        # No-goods: (time index, number of live buffers, 64-bit hash of their (buffer, offset)
        # pairs) that failed. They hold whatever the node limit, so a later round of the same
        # order starts with them. Two live sets sharing a key (odds about 2**-64) could only
        # hide a placement, never make a wrong one.
        self.failed = set() if failed is None else failed
        self.live_load = self.live_hash = 0
        self.sizes, self.lives, self.capacity = sizes, lives, capacity
        self.nodes_left, self.nodes = max_nodes, 0
        self.offsets = [0] * len(sizes)
        placed = [b for b, s in enumerate(sizes) if s > 0]
        self.times = sorted({lives[b][0] for b in placed})
        starting: dict[int, list[int]] = {t: [] for t in self.times}
        for b in placed:
            starting[lives[b][0]].append(b)
        key = ORDERS[order]
        self.starting = [sorted(starting[t], key=lambda b: key(sizes[b], lives[b][1], b)) for t in self.times]
        self.live: list[int] = []  # placed buffers not yet ended, in no order
        self.starting_load = [sum(sizes[b] for b in group) for group in self.starting]
        self.ends = [end for _, end in lives]
        self.by_top: dict[int, int] = {}  # live placed buffers by their top (unique: they do not overlap)
        self.by_bottom: dict[int, int] = {}
        self.reach, self.tight = self._exact_refills(placed)
        self.chain = self._chains(placed)
        self.now = 0

    def _chains(self, placed: list[int]) -> dict[int, int]:
        """Per time ``s``: the times (a bit set, bit ``t`` for time ``t``) at which a chain of
        buffers ends, the first starting at ``s`` and each next one when the last ends, with
        the load at the capacity at every link (so the space a buffer frees is taken at once
        by the next). Where the load is below the capacity, space may stay empty and be taken
        later by anything: every later time. Bit ``i`` stands for the ``i``-th time."""
        starting: dict[int, list[int]] = {}
        for b in placed:
            starting.setdefault(self.lives[b][0], []).append(self.lives[b][1])
        times = sorted({t for b in placed for t in self.lives[b]})
        self.rank = {t: i for i, t in enumerate(times)}
        chain: dict[int, int] = {}
        for t in reversed(times):
            if t not in self.tight:
                chain[t] = -1 << (self.rank[t] + 1)  # every later time
                continue
            bits = 0
            for end in starting.get(t, []):
                bits |= 1 << self.rank[end] | chain[end]
            chain[t] = bits
        return chain

    def _exact_refills(self, placed: list[int]) -> tuple[dict[int, int], set[int]]:
        """Per start time ``e``: the subset sums of the sizes starting there (a bit set), and
        whether the load meets the capacity both just before ``e`` and at ``e`` (then the
        buffers ending at ``e`` free exactly the holes that those starting at ``e`` fill)."""
        delta: dict[int, int] = {}
        for b in placed:
            start, end = self.lives[b]
            delta[start] = delta.get(start, 0) + self.sizes[b]
            delta[end] = delta.get(end, 0) - self.sizes[b]
        tight, load, before = set(), 0, -1
        for t in sorted(delta):
            load += delta[t]
            if before == self.capacity and load == self.capacity:
                tight.add(t)
            before = load
        return {t: subset_sums(self.sizes[b] for b in self.starting[k]) for k, t in enumerate(self.times)}, tight

    def _run_fits(self, b: int) -> bool:
        """Exact refills: if the buffers ending when ``b`` ends and stacked with it form a run
        bounded by buffers that outlive them (or by 0 and the capacity), the buffers starting
        then must be able to fill that run exactly. A side still open (its neighbour ends
        sooner, or is not placed yet) may let the run grow, unless (``chained_runs``) no chain
        of buffers, each starting when the last ends, leads from there to the run's end."""
        end = self.ends[b]
        if not self.options.exact_refills or end not in self.tight:
            return True
        total = self.sizes[b]
        a = b
        while self.offsets[a] > 0:  # down
            a = self.by_top.get(self.offsets[a], -1)
            if self._may_grow(a, end):
                return True
            if self._bounds(a, end):
                break
            total += self.sizes[a]
        a = b
        while self.offsets[a] + self.sizes[a] < self.capacity:  # up
            a = self.by_bottom.get(self.offsets[a] + self.sizes[a], -1)
            if self._may_grow(a, end):
                return True
            if self._bounds(a, end):
                break
            total += self.sizes[a]
        return bool(self.reach[end] >> total & 1)

    def _bounds(self, a: int, end: int) -> bool:
        """Whether neighbour ``a`` (or what follows it, see :meth:`_may_grow`) ends a run of
        buffers ending at ``end``."""
        return a < 0 or self.ends[a] != end

    def _may_grow(self, a: int, end: int) -> bool:
        """Whether a run ending at ``end`` may grow past neighbour ``a`` (-1: space not filled
        yet at this time): ``a`` ends sooner (or is missing) and, with ``chained_runs``, some
        chain of buffers starting where it ends (or now) reaches ``end``."""
        if a >= 0 and self.ends[a] >= end:
            return False
        if not self.options.chained_runs:
            return True
        since = self.now if a < 0 else self.ends[a]
        return bool(self.chain[since] >> self.rank[end] & 1)

    def run(self) -> _Steps:
        return self._event(0)

    def _tick(self) -> bool:
        """Count a node (raise :class:`_Stop` past the node limit); whether to pause now
        (``pause()``, polled every :data:`CLOCK_EVERY` nodes)."""
        self.nodes += 1
        self.nodes_left -= 1
        if self.nodes_left < 0:
            raise _Stop
        return self.nodes % CLOCK_EVERY == 0 and self.pause()

    def _event(self, k: int) -> _Steps:
        """Place the buffers starting at ``times[k]`` and everything after."""
        if k == len(self.times):
            return True
        if self._tick():
            yield
        before, t = self.now, self.times[k]
        self.now = t
        kept = [b for b in self.live if self.lives[b][1] > t]
        ended = [b for b in self.live if self.lives[b][1] <= t]
        saved, self.live = self.live, kept
        for b in ended:
            self._forget(b)
        todo = self.starting[k]
        slack = self.capacity - self.live_load - self.starting_load[k]
        state = (k, len(kept), self.live_hash) if self.options.failed_states else None
        ok = state not in self.failed and slack >= 0
        ok = ok and (yield from self._fill(k, self._holes(), 0, None, list(todo), slack))
        if not ok and state is not None:
            self.failed.add(state)
        for b in ended:
            self._remember(b)
        self.live, self.now = saved, before
        return ok

    def _remember(self, b: int) -> None:
        self.by_top[self.offsets[b] + self.sizes[b]] = b
        self.by_bottom[self.offsets[b]] = b
        self.live_load += self.sizes[b]
        self.live_hash ^= hash((b, self.offsets[b]))

    def _forget(self, b: int) -> None:
        del self.by_top[self.offsets[b] + self.sizes[b]]
        del self.by_bottom[self.offsets[b]]
        self.live_load -= self.sizes[b]
        self.live_hash ^= hash((b, self.offsets[b]))

    def _fits_around(self, b: int) -> bool:
        """The exact-refill test on the runs of ``b`` and of the buffers just under and over it."""
        under = self.by_top.get(self.offsets[b], -1) if self.offsets[b] > 0 else -1
        over = self.by_bottom.get(self.offsets[b] + self.sizes[b], -1)
        return all(self._run_fits(x) for x in (b, under, over) if x >= 0)

    def _holes(self) -> list[tuple[int, int]]:
        """The free address ranges under the capacity around the live buffers, lowest first."""
        holes, level = [], 0
        for bottom in sorted(self.by_bottom):  # live buffers never overlap
            if bottom > level:
                holes.append((level, bottom))
            level = bottom + self.sizes[self.by_bottom[bottom]]
        if level < self.capacity:
            holes.append((level, self.capacity))
        return holes

    def _fill(
        self, k: int, holes: list[tuple[int, int]], h: int, level: int | None, todo: list[int], slack: int
    ) -> _Steps:
        """Stack ``todo`` into ``holes[h:]`` (hole ``h`` filled up to ``level``), wasting at
        most ``slack``; then go on to the next time."""
        if not todo:
            return (yield from self._event(k + 1))
        if h == len(holes):
            return False
        if self._tick():
            yield
        bottom, top = holes[h]
        at = bottom if level is None else level
        room = top - at
        tried: set[tuple[int, int]] = set()
        for i, b in enumerate(todo):
            key = (self.sizes[b], self.lives[b][1]) if self.options.interchangeable else (b, -1)
            if self.sizes[b] > room or key in tried:
                continue
            tried.add(key)
            self.offsets[b] = at
            self.live.append(b)
            self._remember(b)
            rest = todo[:i] + todo[i + 1 :]
            found = self._fits_around(b) and (yield from self._fill(k, holes, h, at + self.sizes[b], rest, slack))
            self._forget(b)
            self.live.pop()
            if found:
                return True
        # Leave the rest of this hole empty, if the slack allows.
        return room <= slack and (yield from self._fill(k, holes, h + 1, None, todo, slack - room))


class HoleFilling:
    """The hole filling of one problem as a search that pauses and resumes: each
    :meth:`run` goes on from where the last one stopped (no work is repeated), until its
    deadline, ``stop()``, or the end of the search. The candidate ``orders`` (names from
    :data:`ORDERS`) take turns, each to a node limit that doubles every round (the no-goods of
    an order carry over to its next round). ``stop()`` returning True pauses the search
    (polled with the clock); ``max_nodes`` ends it."""

    def __init__(
        self,
        sizes_units: Sequence[int],
        lives: Sequence[tuple[int, int]],
        capacity_units: int,
        *,
        max_nodes: int | None = None,
        orders: Sequence[str] = tuple(ORDERS),
        stop: Callable[[], bool] = lambda: False,
        options: HoleFillOptions = HoleFillOptions(),
    ) -> None:
        self.until = 0.0
        self.stop = stop
        self.outcome: HoleFill | None = None  # set once the search has ended
        self.spent = 0  # nodes of the rounds finished
        self._sweep: _Sweep | None = None  # the round in progress
        self._depth = 8 * len(sizes_units) + 1000  # recursion: a generator per node on the path
        self._steps = self._rounds(sizes_units, lives, capacity_units, max_nodes, orders, options)

    @property
    def nodes(self) -> int:
        """Nodes spent so far."""
        return self.spent + (0 if self._sweep is None else self._sweep.nodes)

    def _pause(self) -> bool:
        return time.perf_counter() > self.until or self.stop()

    def run(self, until: float) -> HoleFill | None:
        """Search on until ``until`` (``time.perf_counter()`` time): the outcome once the
        search has ended (placed, exhausted or out of nodes), ``None`` while it is paused."""
        if self.outcome is None:
            self.until = until
            limit = sys.getrecursionlimit()
            sys.setrecursionlimit(max(limit, self._depth))
            try:
                next(self._steps)
            except StopIteration as end:
                self.outcome = end.value
            finally:
                sys.setrecursionlimit(limit)
        return self.outcome

    def _rounds(
        self,
        sizes: Sequence[int],
        lives: Sequence[tuple[int, int]],
        capacity: int,
        max_nodes: int | None,
        orders: Sequence[str],
        options: HoleFillOptions,
    ) -> Generator[None, None, HoleFill]:
        nodes_left = sys.maxsize if max_nodes is None else max_nodes
        node_limit = len(sizes)
        failed: dict[str, set[tuple[int, int, int]]] = {order: set() for order in orders}
        while True:
            node_limit *= 2
            for order in orders:
                while self._pause():
                    yield
                nodes = min(node_limit, nodes_left)
                sweep = _Sweep(sizes, lives, capacity, self._pause, nodes, order, options, failed[order])
                self._sweep = sweep
                try:
                    found: bool | None = yield from sweep.run()
                except _Stop:
                    found = None
                self._sweep = None
                self.spent, nodes_left = self.spent + sweep.nodes, nodes_left - sweep.nodes
                if found:
                    return HoleFill(tuple(sweep.offsets), self.spent)
                if found is not None or nodes_left <= 0:
                    return HoleFill(None, self.spent)  # exhausted (no slack: nothing fits), or out of nodes


def fill_holes(
    sizes_units: Sequence[int],
    lives: Sequence[tuple[int, int]],
    capacity_units: int,
    deadline: float,
    *,
    max_nodes: int | None = None,
    orders: Sequence[str] = tuple(ORDERS),
    stop: Callable[[], bool] = lambda: False,
    options: HoleFillOptions = HoleFillOptions(),
) -> HoleFill:
    """Offsets (units) for every buffer under ``capacity_units`` by filling holes along time,
    or ``None`` when the search ends (exhausted, out of time or nodes, or ``stop()``) without
    one: :class:`HoleFilling` run once until ``deadline``."""
    search = HoleFilling(
        sizes_units, lives, capacity_units, max_nodes=max_nodes, orders=orders, stop=stop, options=options
    )
    outcome = search.run(deadline)
    return outcome if outcome is not None else HoleFill(None, search.nodes)


def applies(problem: PlacementProblem) -> bool:
    """Interval problems without fixed offsets or contiguous groups, whose lower bound is at
    most :data:`MAX_CAPACITY_UNITS` units."""
    interval = problem.is_interval and problem.lifetimes is not None
    if not interval or problem.fixed_offsets or problem.contiguous:
        return False
    return problem.lower_bound_bytes <= MAX_CAPACITY_UNITS * unit_bytes(problem)


def tight_share(problem: PlacementProblem) -> float:
    """The share of the time (with anything live) during which the load equals the lower bound."""
    assert problem.lifetimes is not None
    delta: dict[int, int] = {}
    for size, (start, end) in zip(problem.padded_sizes_bytes, problem.lifetimes, strict=True):
        delta[start] = delta.get(start, 0) + size
        delta[end] = delta.get(end, 0) - size
    times = sorted(delta)
    load = busy = tight = 0
    for t, nxt in itertools.pairwise(times):
        load += delta[t]
        if load > 0:
            busy += nxt - t
            tight += nxt - t if load == problem.lower_bound_bytes else 0
    return tight / busy if busy else 0.0


class FillingAtBound:
    """:class:`HoleFilling` of ``problem`` at its lower bound, paused and resumed by :meth:`run`."""

    def __init__(
        self, problem: PlacementProblem, *, max_nodes: int | None = None, stop: Callable[[], bool] = lambda: False
    ) -> None:
        assert applies(problem)
        self.problem, self.seconds = problem, 0.0
        self.unit, sizes, lives, _ = problem_units(problem)
        bound = problem.lower_bound_bytes
        # A bound that is not a whole number of units cannot be met exactly: nothing to search.
        self.search = (
            None if bound % self.unit else HoleFilling(sizes, lives, bound // self.unit, max_nodes=max_nodes, stop=stop)
        )

    @property
    def ended(self) -> bool:
        """Whether the search has ended (a further :meth:`run` does nothing)."""
        return self.search is None or self.search.outcome is not None

    def run(self, until: float) -> Placement | None:
        """Search on until ``until``: the placement at the lower bound once found, else ``None``
        (paused, or ended without one)."""
        if self.search is None:
            return None
        t0 = time.perf_counter()
        outcome = self.search.run(until)
        self.seconds += time.perf_counter() - t0
        if outcome is None or outcome.offsets_units is None:
            return None
        offsets = tuple(o * self.unit for o in outcome.offsets_units)
        arena = arena_bytes(self.problem, offsets)
        bound = self.problem.lower_bound_bytes
        return Placement(offsets, arena, "hole-filling", "optimal", self.seconds, 0.0, bound)


def fill_at_bound(
    problem: PlacementProblem,
    deadline: float,
    *,
    max_nodes: int | None = None,
    stop: Callable[[], bool] = lambda: False,
) -> Placement | None:
    """A placement of ``problem`` at its lower bound found by :func:`fill_holes` before
    ``deadline``, or ``None``."""
    return FillingAtBound(problem, max_nodes=max_nodes, stop=stop).run(deadline)
