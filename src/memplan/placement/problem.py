"""The placement problem (dynamic storage allocation) and its solution, kept apart.

A :class:`PlacementProblem` states *what* must be placed: buffer sizes, an offset alignment,
and a CONFLICT relation (the pairs of buffers that may be live together, so must not
overlap in the arena). Sekiyama et al. 3.1 call these the "possible colliding pairs" E;
OLLA 3.3 derives them from liveness (eq. 6); SOMAS (Lamprou et al.) derives them from
multi-stream safety, where they are not intervals. So the problem does not assume
intervals: :class:`IntervalConflicts` is one kind of relation, :class:`PairConflicts`
another. Optional extras: lifetimes (for interval heuristics and plots), fixed offsets,
contiguous groups (SOMAS: members placed back to back in the given order) and a capacity.

A :class:`Placement` is the answer: offsets, arena size, method, status, time and gap.

Sizes are rounded up to the alignment, as every real allocator does; the arena and the
lower bound are measured in those padded bytes, so an arena equal to the lower bound means
zero fragmentation (OLLA 5.4).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from memplan.errors import MemplanError
from memplan.graph.ir import Graph
from memplan.graph.liveness import lifetimes as graph_lifetimes
from memplan.graph.liveness import padded


class PlacementError(MemplanError, ValueError):
    """A placement problem is malformed."""


class ConflictRelation(ABC):
    """Which pairs of buffers may be live at the same time (so must not share addresses)."""

    num_buffers: int

    @abstractmethod
    def conflict(self, i: int, j: int) -> bool:
        """True if buffers ``i`` and ``j`` (``i != j``) may be live together."""

    @abstractmethod
    def neighbors(self, i: int) -> np.ndarray:
        """The buffers that conflict with ``i``, as an int array."""

    def pairs(self) -> Iterator[tuple[int, int]]:
        """Every conflicting pair ``(i, j)`` with ``i < j``."""
        for i in range(self.num_buffers):
            for j in self.neighbors(i):
                if j > i:
                    yield i, int(j)


class IntervalConflicts(ConflictRelation):
    """Buffers conflict iff their half-open lifetimes ``[start, end)`` intersect."""

    def __init__(self, lifetimes: Sequence[tuple[int, int]]) -> None:
        self.lifetimes = tuple((int(s), int(e)) for s, e in lifetimes)
        self.num_buffers = len(self.lifetimes)
        arr = np.array(self.lifetimes, dtype=np.int64).reshape(-1, 2)
        self.starts = arr[:, 0]
        self.ends = arr[:, 1]

    def conflict(self, i: int, j: int) -> bool:
        return i != j and self.starts[i] < self.ends[j] and self.starts[j] < self.ends[i]

    def neighbors(self, i: int) -> np.ndarray:
        mask = (self.starts < self.ends[i]) & (self.starts[i] < self.ends)
        mask[i] = False
        return np.flatnonzero(mask)


class PairConflicts(ConflictRelation):
    """An explicit conflict relation: any set of unordered pairs (SOMAS's unsafe pairs)."""

    def __init__(self, num_buffers: int, pairs: Sequence[tuple[int, int]]) -> None:
        self.num_buffers = int(num_buffers)
        adjacency: list[set[int]] = [set() for _ in range(self.num_buffers)]
        for i, j in pairs:
            if not (0 <= i < self.num_buffers and 0 <= j < self.num_buffers):
                raise PlacementError(f"conflict pair ({i}, {j}) names a buffer outside 0..{self.num_buffers - 1}")
            if i != j:
                adjacency[i].add(int(j))
                adjacency[j].add(int(i))
        self._adjacency = tuple(np.array(sorted(a), dtype=np.int64) for a in adjacency)
        self._sets = tuple(frozenset(a) for a in adjacency)

    def conflict(self, i: int, j: int) -> bool:
        return j in self._sets[i]

    def neighbors(self, i: int) -> np.ndarray:
        return self._adjacency[i]


@dataclass(frozen=True)
class PlacementProblem:
    """Place buffers of ``sizes_bytes`` at aligned offsets; conflicting buffers must not overlap.

    ``fixed_offsets`` maps a buffer to an offset it must take; ``contiguous`` lists groups of
    buffers that must lie back to back in the given order (SOMAS), each member starting where
    the previous one's padded size ends; ``capacity_bytes`` caps the arena. ``cliques`` lists
    sets of buffers known to conflict pairwise (e.g. those live together at one moment of one
    execution of a multi-stream step): each one's total size is a lower bound on the arena.
    """

    sizes_bytes: tuple[int, ...]
    conflicts: ConflictRelation
    alignment_bytes: int = 1
    names: tuple[str, ...] = ()
    lifetimes: tuple[tuple[int, int], ...] | None = None
    fixed_offsets: Mapping[int, int] = field(default_factory=dict)
    contiguous: tuple[tuple[int, ...], ...] = ()
    capacity_bytes: int | None = None
    cliques: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes_bytes", tuple(int(s) for s in self.sizes_bytes))
        if not self.names:
            object.__setattr__(self, "names", tuple(str(i) for i in range(len(self.sizes_bytes))))
        object.__setattr__(self, "fixed_offsets", dict(self.fixed_offsets))
        object.__setattr__(self, "contiguous", tuple(tuple(int(b) for b in g) for g in self.contiguous))
        object.__setattr__(self, "cliques", tuple(tuple(int(b) for b in c) for c in self.cliques))
        _check_problem(self)

    @classmethod
    def from_intervals(
        cls, sizes_bytes: Sequence[int], lifetimes: Sequence[tuple[int, int]], **kwargs: object
    ) -> PlacementProblem:
        """A problem whose conflicts are lifetime overlaps (Sekiyama eq. E, OLLA eq. 6)."""
        lives = tuple((int(s), int(e)) for s, e in lifetimes)
        return cls(tuple(sizes_bytes), IntervalConflicts(lives), lifetimes=lives, **kwargs)  # type: ignore[arg-type]

    @property
    def num_buffers(self) -> int:
        return len(self.sizes_bytes)

    @property
    def is_interval(self) -> bool:
        """True when conflicts are exactly lifetime overlaps (interval heuristics apply)."""
        return isinstance(self.conflicts, IntervalConflicts)

    @cached_property
    def padded_sizes_bytes(self) -> tuple[int, ...]:
        """Sizes rounded up to the alignment: what each buffer really occupies."""
        return tuple(padded(s, self.alignment_bytes) for s in self.sizes_bytes)

    @cached_property
    def lower_bound_bytes(self) -> int:
        """Cached :func:`lower_bound_bytes`."""
        return _lower_bound(self)

    @cached_property
    def group_of(self) -> dict[int, int]:
        """Buffer -> index of the contiguous group it belongs to."""
        return {b: g for g, members in enumerate(self.contiguous) for b in members}


def _check_problem(problem: PlacementProblem) -> None:
    n = problem.num_buffers
    if problem.alignment_bytes < 1:
        raise PlacementError(f"alignment must be at least 1 byte, got {problem.alignment_bytes}")
    if problem.conflicts.num_buffers != n:
        raise PlacementError(f"conflict relation covers {problem.conflicts.num_buffers} buffers, problem has {n}")
    if len(problem.names) != n or len(set(problem.names)) != n:
        raise PlacementError(f"need {n} distinct buffer names, got {len(set(problem.names))}")
    for name, size in zip(problem.names, problem.sizes_bytes, strict=True):
        if size < 0:
            raise PlacementError(f"buffer {name!r} has negative size {size}")
    if problem.lifetimes is not None:
        _check_lifetimes(problem)
    if problem.capacity_bytes is not None and problem.capacity_bytes < 0:
        raise PlacementError(f"capacity must be non-negative, got {problem.capacity_bytes}")
    _check_fixed(problem)
    _check_groups(problem)
    _check_cliques(problem)


def _check_lifetimes(problem: PlacementProblem) -> None:
    assert problem.lifetimes is not None
    if len(problem.lifetimes) != problem.num_buffers:
        raise PlacementError(f"{len(problem.lifetimes)} lifetimes for {problem.num_buffers} buffers")
    for name, (start, end) in zip(problem.names, problem.lifetimes, strict=True):
        if start >= end:
            raise PlacementError(f"buffer {name!r} has empty lifetime [{start}, {end}) (lower must be < upper)")


def _check_fixed(problem: PlacementProblem) -> None:
    for b, offset in problem.fixed_offsets.items():
        if not 0 <= b < problem.num_buffers:
            raise PlacementError(f"fixed offset for unknown buffer {b}")
        if offset < 0 or offset % problem.alignment_bytes:
            raise PlacementError(
                f"fixed offset {offset} of buffer {problem.names[b]!r} is negative or not a multiple of the "
                f"alignment {problem.alignment_bytes}"
            )


def _check_groups(problem: PlacementProblem) -> None:
    seen: set[int] = set()
    for members in problem.contiguous:
        for b in members:
            if not 0 <= b < problem.num_buffers:
                raise PlacementError(f"contiguous group names unknown buffer {b}")
            if b in seen:
                raise PlacementError(f"buffer {problem.names[b]!r} is in more than one contiguous group or twice")
            seen.add(b)
        starts = {
            problem.fixed_offsets[b] - p
            for b, p in zip(members, group_prefixes(problem, members), strict=True)
            if b in problem.fixed_offsets
        }
        if len(starts) > 1:
            raise PlacementError(f"fixed offsets in contiguous group {[problem.names[b] for b in members]} disagree")


def _check_cliques(problem: PlacementProblem) -> None:
    """A clique that is not one would make the lower bound, and every "optimal", wrong."""
    for members in problem.cliques:
        for b in members:
            if not 0 <= b < problem.num_buffers:
                raise PlacementError(f"clique names unknown buffer {b}")
        for k, i in enumerate(members):
            conflicting = set(problem.conflicts.neighbors(i).tolist())
            for j in members[k + 1 :]:
                if j not in conflicting:
                    raise PlacementError(
                        f"buffers {problem.names[i]!r} and {problem.names[j]!r} of a clique do not conflict"
                    )


def group_prefixes(problem: PlacementProblem, members: Sequence[int]) -> list[int]:
    """Offset of each member from the group's start: the sum of the padded sizes before it."""
    prefixes, total = [], 0
    for b in members:
        prefixes.append(total)
        total += problem.padded_sizes_bytes[b]
    return prefixes


@dataclass(frozen=True)
class Placement:
    """A solution: ``offsets_bytes[i]`` is buffer ``i``'s offset in an arena of ``arena_bytes``.

    ``status``: "optimal" (arena proven minimal), "feasible" (valid, not proven minimal),
    "infeasible" (proven: nothing fits the capacity; offsets are the best found, over it) or
    "unknown" (nothing within the capacity found in time; offsets as for "infeasible").
    ``gap`` = (arena - best proven bound) / arena.
    """

    offsets_bytes: tuple[int, ...]
    arena_bytes: int
    method: str
    status: str
    seconds: float
    gap: float
    bound_bytes: int

    @property
    def fits(self) -> bool:
        return self.status in ("optimal", "feasible")


def arena_bytes(problem: PlacementProblem, offsets_bytes: Sequence[int]) -> int:
    """The arena a set of offsets needs: the highest end of a padded buffer (OLLA eq. 8)."""
    return max((o + s for o, s in zip(offsets_bytes, problem.padded_sizes_bytes, strict=True)), default=0)


def lower_bound_bytes(problem: PlacementProblem) -> int:
    """A valid lower bound on the arena (cached on the problem); see :func:`_lower_bound`."""
    return problem.lower_bound_bytes


def _lower_bound(problem: PlacementProblem) -> int:
    """A valid lower bound on the arena: the largest total padded size live at once.

    For interval conflicts that is the peak of a sweep over time, which is the max-weight
    clique of the interval graph and equals the estimator's peak (OLLA 5.4's RS). For general
    conflicts any clique is a valid bound, so we take the heaviest of greedy cliques and of the
    problem's known ``cliques``. Fixed offsets and contiguous groups add their own bounds.
    """
    sizes = problem.padded_sizes_bytes
    bound = max(sizes, default=0)
    if problem.lifetimes is not None and problem.is_interval:
        bound = max(bound, _sweep_peak(problem.lifetimes, sizes))
    else:
        bound = max(bound, _greedy_clique_bytes(problem))
    for b, offset in problem.fixed_offsets.items():
        bound = max(bound, offset + sizes[b])
    for members in problem.contiguous:
        bound = max(bound, sum(sizes[b] for b in members))
    for members in problem.cliques:
        bound = max(bound, sum(sizes[b] for b in set(members)))
    return bound


def _sweep_peak(lives: Sequence[tuple[int, int]], sizes: Sequence[int]) -> int:
    events: dict[int, int] = {}
    for (start, end), size in zip(lives, sizes, strict=True):
        events[start] = events.get(start, 0) + size
        events[end] = events.get(end, 0) - size
    peak = live = 0
    for t in sorted(events):
        live += events[t]
        peak = max(peak, live)
    return peak


def _greedy_clique_bytes(problem: PlacementProblem, max_seeds: int = 64) -> int:
    """Grow a clique from each of the heaviest buffers, adding the heaviest compatible one."""
    sizes = np.array(problem.padded_sizes_bytes, dtype=np.int64)
    best = 0
    for seed in np.argsort(-sizes, kind="stable")[:max_seeds]:
        candidates = set(int(j) for j in problem.conflicts.neighbors(int(seed)))
        weight = int(sizes[seed])
        while candidates:
            pick = max(candidates, key=lambda j: sizes[j])
            weight += int(sizes[pick])
            candidates &= set(int(j) for j in problem.conflicts.neighbors(pick))
        best = max(best, weight)
    return best


def fragmentation(arena: int, lower_bound: int) -> float:
    """OLLA 5.4: (arena - lower bound) / arena; 0 for an empty arena."""
    return 0.0 if arena <= 0 else (arena - lower_bound) / arena


def problem_from_graph(
    graph: Graph, order: Sequence[int], alignment: int = 1, exclude: Collection[int] = frozenset()
) -> PlacementProblem:
    """The arena problem of ``graph`` run in ``order``: every non-persistent tensor with bytes,
    with the lifetimes of :func:`memplan.graph.liveness.lifetimes`. Persistent tensors belong
    to the model and 0-byte tensors need no memory, so neither is placed; nor is any tensor in
    ``exclude`` (left to the allocator by the runtime)."""
    kept = [
        life
        for life in graph_lifetimes(graph, order)
        if not graph.tensors[life.tensor].persistent
        and graph.tensors[life.tensor].size_bytes > 0
        and life.tensor not in exclude
    ]
    return PlacementProblem.from_intervals(
        [graph.tensors[life.tensor].size_bytes for life in kept],
        [(life.start, life.end) for life in kept],
        names=tuple(graph.tensors[life.tensor].name for life in kept),
        alignment_bytes=alignment,
    )


def unit_bytes(problem: PlacementProblem) -> int:
    """The largest unit every padded size and every fixed offset are multiples of.

    Pushing every buffer down until it rests on another one (or on 0, or on a fixed one)
    keeps a placement valid and no larger, and leaves every offset a sum of sizes; so some
    optimal placement uses multiples of this unit only, and solvers can count in units.
    """
    unit = 0
    for s in problem.padded_sizes_bytes:
        unit = math.gcd(unit, s)
    for o in problem.fixed_offsets.values():
        unit = math.gcd(unit, o)
    return unit or problem.alignment_bytes
