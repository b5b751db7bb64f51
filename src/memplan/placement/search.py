"""Exact placement by depth-first search over canonical solutions (MiniMalloc, Moffitt 2023).

Interval problems only (conflicts = lifetime overlaps). Sizes and offsets are counted in units of
:func:`memplan.placement.problem.unit_bytes`, so alignment is respected by construction.

A placement is *canonical* when every buffer sits at the lowest offset its already placed
neighbours allow (0, or the top of one of them), and the buffers were placed in order of
non-decreasing offset. Pushing every buffer of any valid placement down as far as it goes and
sorting by offset gives a canonical one no larger, so searching canonical placements only is
complete (MiniMalloc section 4.1). On top of it the search prunes by:

* sections (MiniMalloc 4.2): the time axis cut at every lifetime end into maximal sets of
  buffers live together; a section whose *floor* (the top of the last buffer placed in it, or
  the lowest offset any of its unplaced buffers can take) plus the bytes still unplaced in it
  exceeds the capacity fails the branch (inference). MiniMalloc raises the second floor
  incrementally, in the sections of the buffers just lifted; here it is evaluated at every
  check, which is never weaker and, with a witness per section, cheaper;
* dominance (4.3): placing a buffer at or above the top some unplaced buffer would reach at its
  lowest offset leaves a gap that buffer could fill; such placements are skipped;
* decomposition (4.4): once placed buffers cut every lifetime crossing between two sections,
  the two sides are independent problems, solved one after the other.

Every rule is one field of :class:`SearchOptions`; each can be switched off, and the answer
(feasible or not at a capacity) must not change, only the time.
"""

from __future__ import annotations

import ctypes
import itertools
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np

from memplan.placement.problem import Placement, PlacementProblem, arena_bytes, unit_bytes


@dataclass(frozen=True)
class SearchOptions:
    """The pruning rules of the search (MiniMalloc's solver flags). Each is sound alone and in
    any combination: switching one off changes the time, never the answer."""

    canonical_only: bool = True  # place buffers in non-decreasing (offset, preorder) order only
    section_inference: bool = True  # fail when a section's floor plus its unplaced bytes exceeds the capacity
    dynamic_ordering: bool = True  # try unplaced buffers lowest possible offset first
    check_dominance: bool = True  # skip a placement that leaves room below it for another buffer
    unallocated_floor: bool = True  # a section's floor is at least its unplaced buffers' lowest offsets
    static_preordering: bool = True  # sort buffers by the preordering heuristic before searching
    dynamic_decomposition: bool = True  # split into independent parts when no lifetime crosses a cut
    monotonic_floor: bool = True  # every section's floor is at least the offset just placed
    hatless_pruning: bool = True  # a buffer with no unplaced neighbour needs no alternative tried
    # Static preorderings, tried in turn with growing node limits (MiniMalloc's round robin):
    # W = lifetime width, A = area, T = the largest section total the buffer is in, Z = size.
    preorderings: tuple[str, ...] = ("WAT", "TAW", "TWA")

    @classmethod
    def flag_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.type in (bool, "bool"))


class Cancel:
    """A flag another thread sets to stop a running search (read by the compiled kernel too)."""

    def __init__(self) -> None:
        self.flag = ctypes.c_int(0)

    def set(self) -> None:
        self.flag.value = 1

    def is_set(self) -> bool:
        return bool(self.flag.value)


@dataclass(frozen=True)
class Sweep:
    """The sections and independent partitions of an interval problem (MiniMalloc's sweeper).

    ``sections[s]`` lists the buffers live in section ``s``; buffer ``b`` is in sections
    ``first[b] <= s < last[b]``; ``partitions`` are groups of buffers whose lifetimes chain
    together, with their section ranges; ``overlaps[b]`` lists the buffers live with ``b``.
    """

    sections: tuple[tuple[int, ...], ...]
    first: tuple[int, ...]
    last: tuple[int, ...]
    partitions: tuple[tuple[tuple[int, ...], int, int], ...]
    overlaps: tuple[tuple[int, ...], ...]

    def cuts(self) -> list[int]:
        """``cuts[s]``: how many buffers span both section ``s`` and ``s + 1``."""
        cuts = [0] * max(len(self.sections) - 1, 0)
        for lo, hi in zip(self.first, self.last, strict=True):
            for s in range(lo, hi - 1):
                cuts[s] += 1
        return cuts


def sweep(lifetimes: Sequence[tuple[int, int]], buffers: Sequence[int]) -> Sweep:
    """Sections: at each lifetime end after time advanced, the set of buffers then live
    (every maximal clique of the interval graph is one, and only those that end somewhere)."""
    n = len(lifetimes)
    points = sorted(
        [(lifetimes[b][0], 1, b) for b in buffers] + [(lifetimes[b][1], 0, b) for b in buffers]
    )  # ends (0) before starts (1) at one time: half-open lifetimes do not meet there
    first, last = [0] * n, [0] * n
    sections: list[tuple[int, ...]] = []
    partitions: list[tuple[tuple[int, ...], int, int]] = []
    overlaps: list[list[int]] = [[] for _ in range(n)]
    live: dict[int, None] = {}
    members: list[int] = []
    last_time, part_start, pending = None, 0, False
    for t, is_start, b in points:
        if is_start:
            if not live:
                members, part_start = [], len(sections)
            for other in live:
                overlaps[other].append(b)
                overlaps[b].append(other)
            live[b] = None
            members.append(b)
            first[b] = len(sections)
            pending = True
            last_time = t
        else:
            if pending:  # something started since the last section: a new maximal set
                sections.append(tuple(live))
                pending = False
            del live[b]
            last[b] = len(sections)
            if not live:
                partitions.append((tuple(members), part_start, len(sections)))
    del last_time
    return Sweep(
        tuple(sections),
        tuple(first),
        tuple(last),
        tuple(partitions),
        tuple(tuple(sorted(o)) for o in overlaps),
    )


# --------------------------------------------------------------------------- preordering


def preorder(
    heuristic: str,
    members: Sequence[int],
    sizes: Sequence[int],
    lives: Sequence[tuple[int, int]],
    totals: Mapping[int, int],
) -> list[int]:
    """``members`` sorted by MiniMalloc's static preordering keys, each descending, in the
    order the letters give: A area, W lifetime width, T largest section total, Z size; index
    breaks ties."""

    def key(b: int) -> tuple[int, ...]:
        values = {"A": sizes[b] * (lives[b][1] - lives[b][0]), "W": lives[b][1] - lives[b][0], "T": totals[b]}
        values["Z"] = sizes[b]
        return (*(-values[c] for c in heuristic), b)

    return sorted(members, key=key)


# --------------------------------------------------------------------------- the search


class Aborted(Exception):
    """The node limit or the deadline was reached."""


NO_OFFSET = -1


class ReferenceSearch:
    """MiniMalloc's depth-first search, in plain Python: the specification that the compiled
    kernel (``csrc/canonical_search.c``) follows step for step (same nodes, same answer).

    One feasibility search at ``capacity`` (units); state is undone on backtrack.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        lives: Sequence[tuple[int, int]],
        fixed: Sequence[int],
        data: Sweep,
        capacity: int,
        options: SearchOptions,
        deadline: float,
        cancel: Cancel | None = None,
    ) -> None:
        self.sizes = list(sizes)
        self.cancel = cancel
        self.lives = lives
        self.fixed = list(fixed)
        self.data = data
        self.capacity = capacity
        self.options = options
        self.deadline = deadline
        n = len(sizes)
        self.offsets = [NO_OFFSET] * n
        self.solution = [0] * n
        self.min_offsets = [max(f, 0) for f in self.fixed]
        self.floor = [0] * len(data.sections)
        self.total = [sum(self.sizes[b] for b in section) for section in data.sections]
        self.cuts = data.cuts()
        self.heuristic = ""
        self.nodes_left = 0
        self.nodes = 0
        self.backtracks = 0

    # -- entry points

    def solve(self, heuristic: str, node_limit: int) -> bool:
        """True if every partition fits; False if some provably does not; raises
        :class:`Aborted` at the node limit (negative: none) or the deadline."""
        self.heuristic = heuristic
        self.nodes_left = node_limit if node_limit >= 0 else sys.maxsize
        return all(self.sub_solve(members, lo, hi) for members, lo, hi in self.data.partitions)

    def sub_solve(self, members: Sequence[int], lo: int, hi: int) -> bool:
        """Preorder ``members`` (with the section totals as they are now) and search them."""
        if self.options.static_preordering:
            first, last, total = self.data.first, self.data.last, self.total
            totals = {b: max(total[first[b] : last[b]]) for b in members}
            order = preorder(self.heuristic, members, self.sizes, self.lives, totals)
        else:
            order = list(members)
        return self.search(members, order, lo, hi, 0, 0)

    # -- one node

    def search(
        self, members: Sequence[int], order: list[int], lo: int, hi: int, min_offset: int, min_rank: int
    ) -> bool:
        self.nodes_left -= 1
        if self.nodes_left < 0:
            raise Aborted
        self.nodes += 1
        if self.nodes & 255 == 0 and (
            time.perf_counter() > self.deadline or (self.cancel is not None and self.cancel.is_set())
        ):
            raise Aborted
        offsets, min_offsets, sizes, opts = self.offsets, self.min_offsets, self.sizes, self.options
        unplaced = [(min_offsets[b], rank, b) for rank, b in enumerate(order) if offsets[b] == NO_OFFSET]
        if not unplaced:
            for b in members:
                self.solution[b] = offsets[b]
            return True
        if opts.dynamic_ordering:
            unplaced.sort()
        min_height = min(m + sizes[b] for m, _, b in unplaced)
        for offset, rank, b in unplaced:
            if opts.canonical_only and (offset < min_offset or (offset == min_offset and rank < min_rank)):
                continue
            if opts.check_dominance and offset >= min_height:
                continue
            if self.fixed[b] >= 0 and offset > self.fixed[b]:
                continue
            offsets[b] = offset
            offset_changes, hatless, broken = self._raise_neighbours(b, offset)
            section_changes = self._update_sections(b, offset)
            found = False
            if not broken and self._check(lo, hi, offset):
                if opts.dynamic_decomposition:
                    found = self._decompose(members, order, lo, hi, offset, rank, b)
                else:
                    found = self.search(members, order, lo, hi, offset, rank)
            self._restore(b, offset_changes, section_changes)
            if found:
                return True
            if hatless and opts.hatless_pruning:
                break
        self.backtracks += 1
        return False

    def _raise_neighbours(self, b: int, offset: int) -> tuple[list[tuple[int, int]], bool, bool]:
        """Lift every unplaced neighbour's lowest offset to the top of ``b``. Returns the undo
        log, whether ``b`` has no unplaced neighbour ("hatless"), and whether a fixed neighbour
        was pushed past its offset."""
        top = offset + self.sizes[b]
        offsets, min_offsets, fixed = self.offsets, self.min_offsets, self.fixed
        changes: list[tuple[int, int]] = []
        hatless, broken = True, False
        for other in self.data.overlaps[b]:
            if offsets[other] != NO_OFFSET:
                continue
            hatless = False
            if min_offsets[other] >= top:
                continue
            changes.append((other, min_offsets[other]))
            min_offsets[other] = top
            if fixed[other] >= 0 and top > fixed[other]:
                broken = True
        return changes, hatless, broken

    def _update_sections(self, b: int, offset: int) -> list[tuple[int, int]]:
        """Sections of ``b``: floor to its top (every buffer placed later in them lies above
        it), its bytes no longer unplaced."""
        floor, total = self.floor, self.total
        changes: list[tuple[int, int]] = []
        top, size = offset + self.sizes[b], self.sizes[b]
        for s in range(self.data.first[b], self.data.last[b]):
            changes.append((s, floor[s]))
            floor[s] = top
            total[s] -= size
        return changes

    def _restore(self, b: int, offset_changes: list[tuple[int, int]], section_changes: list[tuple[int, int]]) -> None:
        floor, total, size = self.floor, self.total, self.sizes[b]
        for s, value in reversed(section_changes):
            floor[s] = value
        for s in range(self.data.first[b], self.data.last[b]):
            total[s] += size
        for other, value in reversed(offset_changes):
            self.min_offsets[other] = value
        self.offsets[b] = NO_OFFSET

    def _check(self, lo: int, hi: int, offset: int) -> bool:
        """No section of the partition overflows: its floor (at least ``offset`` with the
        monotonic floor; at least the lowest offset any of its unplaced buffers can take with
        the unallocated floor) plus its unplaced bytes (with section inference) fit."""
        cap, floor, total, opts = self.capacity, self.floor, self.total, self.options
        offsets, min_offsets, sections = self.offsets, self.min_offsets, self.data.sections
        for s in range(lo, hi):
            f = floor[s]
            if opts.monotonic_floor and f < offset:
                f = offset
            rest = total[s] if opts.section_inference else 0
            if f + rest > cap:
                return False
            if opts.unallocated_floor:
                # Overflow iff every unplaced buffer of the section lies above cap - rest.
                live = [min_offsets[o] for o in sections[s] if offsets[o] == NO_OFFSET]
                if live and min(live) + rest > cap:
                    return False
        return True

    def _decompose(
        self, members: Sequence[int], order: list[int], lo: int, hi: int, offset: int, rank: int, b: int
    ) -> bool:
        """With ``b`` placed, no unplaced lifetime may cross some boundaries between the sections
        it spanned: solve each independent stretch on its own (MiniMalloc 4.4)."""
        self.solution[b] = offset
        first, last = self.data.first[b], self.data.last[b]
        cuts = self.cuts
        points = [lo]
        for s in range(first, last - 1):
            cuts[s] -= 1
            if cuts[s] == 0:
                points.append(s + 1)
        try:
            if len(points) == 1:
                return self.search(members, order, lo, hi, offset, rank)
            points.append(hi)
            for a, z in itertools.pairwise(points):
                part = [
                    o
                    for o in members
                    if self.offsets[o] == NO_OFFSET and not (self.data.last[o] <= a or z <= self.data.first[o])
                ]
                if part and not self.sub_solve(part, a, z):
                    return False
            return True
        finally:
            for s in range(first, last - 1):
                cuts[s] += 1


@dataclass(frozen=True)
class SearchResult:
    """``offsets_units`` when a placement within the capacity was found; ``proven`` True when
    the search ran to completion (so ``None`` offsets mean: provably nothing fits)."""

    offsets_units: tuple[int, ...] | None
    proven: bool
    nodes: int
    backtracks: int


def fit(
    sizes_units: Sequence[int],
    lives: Sequence[tuple[int, int]],
    capacity_units: int,
    deadline: float,
    options: SearchOptions = SearchOptions(),
    fixed_units: Sequence[int] | None = None,
    engine: str = "auto",
    cancel: Cancel | None = None,
    *,
    max_nodes: int | None = None,
    data: Sweep | None = None,
) -> SearchResult:
    """Find offsets (units) that fit every buffer under ``capacity_units``, or prove none exist,
    before ``deadline`` (a ``time.perf_counter()`` value) and within ``max_nodes`` nodes.

    ``fixed_units[b]`` is buffer ``b``'s required offset or -1. With several preorderings they
    are tried in turn, each to a node limit that doubles every round (MiniMalloc's round robin),
    until one finishes; a finished search is a proof either way. ``engine``: "native" (the
    compiled kernel), "python" (:class:`ReferenceSearch`) or "auto" (native when it builds).
    ``cancel`` stops the search from another thread (the result is then unproven). ``data``
    is the problem's :func:`sweep`, when the caller has it already.
    """
    n = len(sizes_units)
    fixed = list(fixed_units) if fixed_units is not None else [NO_OFFSET] * n
    buffers = [b for b, s in enumerate(sizes_units) if s > 0]
    too_big = any(s > capacity_units or f + s > capacity_units for s, f in zip(sizes_units, fixed, strict=True))
    if capacity_units < 0 or too_big:
        return SearchResult(None, True, 0, 0)
    data = data or sweep(lives, buffers)
    run = _runner(engine, sizes_units, lives, fixed, data, capacity_units, options, deadline, cancel)
    heuristics = options.preorderings if options.static_preordering else options.preorderings[:1]
    node_limit = -1 if len(heuristics) == 1 else max(len(buffers), 1)
    nodes_left = sys.maxsize if max_nodes is None else max_nodes
    nodes = backtracks = 0
    while nodes_left > 0:
        if node_limit >= 0:
            node_limit *= 2
        for heuristic in heuristics:
            limit = nodes_left if node_limit < 0 else min(node_limit, nodes_left)
            outcome, offsets, spent, back = run(heuristic, limit if limit < sys.maxsize else -1)
            nodes, backtracks, nodes_left = nodes + spent, backtracks + back, nodes_left - spent
            if outcome == "aborted":
                if time.perf_counter() > deadline or (cancel is not None and cancel.is_set()) or nodes_left <= 0:
                    return SearchResult(None, False, nodes, backtracks)
                continue
            if outcome == "infeasible":
                return SearchResult(None, True, nodes, backtracks)
            placed = tuple(offsets[b] if sizes_units[b] > 0 else max(fixed[b], 0) for b in range(n))
            return SearchResult(placed, True, nodes, backtracks)
    return SearchResult(None, False, nodes, backtracks)


def _runner(
    engine: str,
    sizes: Sequence[int],
    lives: Sequence[tuple[int, int]],
    fixed: Sequence[int],
    data: Sweep,
    capacity: int,
    options: SearchOptions,
    deadline: float,
    cancel: Cancel | None,
) -> Runner:
    if engine not in ENGINES:
        raise ValueError(f"unknown search engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if engine != "python":
        from memplan.placement import native

        if engine == "native" or native.available():
            return native.runner(sizes, lives, fixed, data, capacity, options, deadline, cancel)
    return _python_runner(sizes, lives, fixed, data, capacity, options, deadline, cancel)


ENGINES = ("auto", "native", "python")


Runner = Callable[[str, int], tuple[str, list[int], int, int]]


def _python_runner(
    sizes: Sequence[int],
    lives: Sequence[tuple[int, int]],
    fixed: Sequence[int],
    data: Sweep,
    capacity: int,
    options: SearchOptions,
    deadline: float,
    cancel: Cancel | None,
) -> Runner:
    def run(heuristic: str, node_limit: int) -> tuple[str, list[int], int, int]:
        search = ReferenceSearch(sizes, lives, fixed, data, capacity, options, deadline, cancel)
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 4 * len(sizes) + 1000))
        try:
            ok = search.solve(heuristic, node_limit)
        except Aborted:
            return "aborted", [], search.nodes, search.backtracks
        finally:
            sys.setrecursionlimit(limit)
        return ("found" if ok else "infeasible"), search.solution, search.nodes, search.backtracks

    return run


def problem_units(problem: PlacementProblem) -> tuple[int, list[int], list[tuple[int, int]], list[int]]:
    """(unit, padded sizes in units, lifetimes, fixed offsets in units or -1) of an interval problem."""
    assert problem.lifetimes is not None
    unit = unit_bytes(problem)
    fixed = [NO_OFFSET] * problem.num_buffers
    for b, offset in problem.fixed_offsets.items():
        fixed[b] = offset // unit
    return unit, [s // unit for s in problem.padded_sizes_bytes], list(problem.lifetimes), fixed


@dataclass(frozen=True)
class Probe:
    """One feasibility search: the capacity tried, what came of it, and its cost."""

    capacity_units: int
    outcome: str  # "found" | "infeasible" | "unknown"
    arena_units: int | None
    nodes: int
    seconds: float


@dataclass(frozen=True)
class Minimised:
    """The smallest arena the search reached within its budget.

    ``offsets_units`` is the best placement found at or under the upper limit (``None`` when none
    was); every capacity below ``proven_lower_units`` was proven infeasible (or is below the lower
    bound), so the arena is optimal when they meet.
    """

    offsets_units: tuple[int, ...] | None
    arena_units: int | None
    proven_lower_units: int
    probes: tuple[Probe, ...]


# Share of the search budget given to the first probe (at the lower bound, or at the capacity).
FIRST_PROBE_SHARE = 0.7
# Each later probe may use up to this share of what is left, and at first this many nodes per
# buffer: far above the optimum a probe that does not succeed quickly is lost in a bad subtree.
# When the bisection has run out of capacities to try, it starts over with four times the nodes.
PROBE_SHARE = 0.5
PROBE_NODES_PER_BUFFER = 64


def minimise(
    sizes_units: Sequence[int],
    lives: Sequence[tuple[int, int]],
    lower_units: int,
    upper_units: int,
    deadline: float,
    *,
    fixed_units: Sequence[int] | None = None,
    first: int | None = None,
    options: SearchOptions = SearchOptions(),
    engine: str = "auto",
    cancel: Cancel | None = None,
) -> Minimised:
    """The smallest capacity in ``[lower_units, upper_units]`` that fits, by bisection over
    :func:`fit` probes (MiniMalloc's capacity search), starting with a probe at ``first``
    (default: the lower bound, where most instances meet their optimum).

    A probe that finds a placement lowers the upper end to that placement's arena minus one; one
    that proves infeasibility raises the proven lower end; one that runs out of nodes or time
    raises the searched lower end only. The first probe gets :data:`FIRST_PROBE_SHARE` of the
    time (all of it when it is the only capacity to try), later ones :data:`PROBE_SHARE` of what
    is left and a node budget that grows each time the bisection starts over.
    """
    best: tuple[int, ...] | None = None
    best_arena: int | None = None
    proven = searched = lower_units
    hi = upper_units
    probes: list[Probe] = []
    data = sweep(lives, [b for b, s in enumerate(sizes_units) if s > 0])
    node_budget = PROBE_NODES_PER_BUFFER * max(len(sizes_units), 16)
    capacity: int | None = lower_units if first is None else first
    share, max_nodes = (FIRST_PROBE_SHARE if capacity < upper_units else 1.0), None
    while capacity is not None:
        t0 = time.perf_counter()
        if t0 >= deadline or (cancel is not None and cancel.is_set()):
            break
        probe_deadline = min(deadline, t0 + share * (deadline - t0))
        result = fit(
            sizes_units, lives, capacity, probe_deadline, options, fixed_units, engine, cancel,
            max_nodes=max_nodes, data=data,
        )  # fmt: skip
        if result.offsets_units is not None:
            best = result.offsets_units
            best_arena = max((o + s for o, s in zip(best, sizes_units, strict=True)), default=0)
            hi = best_arena - 1
            outcome = "found"
        else:
            searched = max(searched, capacity + 1)
            if result.proven:
                proven = max(proven, capacity + 1)
            outcome = "infeasible" if result.proven else "unknown"
        arena = best_arena if outcome == "found" else None
        probes.append(Probe(capacity, outcome, arena, result.nodes, time.perf_counter() - t0))
        share, max_nodes = PROBE_SHARE, node_budget
        if searched > hi >= proven:
            searched, node_budget = proven, 4 * node_budget  # unknowns left: try them harder
            max_nodes = node_budget
        capacity = (searched + hi) // 2 if searched <= hi else None
    return Minimised(best, best_arena, proven, tuple(probes))


# ----------------------------------------------------------------------------- on a problem

# Larger problems are left to the other stages (the search's memory and stack grow with the
# buffers, and its set-up with the pairs of buffers live together).
MAX_BUFFERS = 20_000
MAX_OVERLAPPING_PAIRS = 4_000_000


def overlapping_pairs(lives: Sequence[tuple[int, int]]) -> int:
    """How many pairs of half-open lifetimes intersect (a sweep, without listing them)."""
    if not lives:
        return 0
    arr = np.array(lives, dtype=np.int64).reshape(-1, 2)
    starts, ends = np.sort(arr[:, 0]), np.sort(arr[:, 1])
    began_before_end = np.searchsorted(starts, arr[:, 1], side="left")
    ended_by_start = np.searchsorted(ends, arr[:, 0], side="right")
    return int((began_before_end - ended_by_start - 1).sum()) // 2


def applies(problem: PlacementProblem) -> bool:
    """True for problems the search handles: lifetime conflicts, no contiguous groups, and not
    too large (:data:`MAX_BUFFERS`, :data:`MAX_OVERLAPPING_PAIRS`)."""
    return (
        problem.is_interval
        and problem.lifetimes is not None
        and not problem.contiguous
        and problem.num_buffers <= MAX_BUFFERS
        and overlapping_pairs(problem.lifetimes) <= MAX_OVERLAPPING_PAIRS
    )


@dataclass(frozen=True)
class SearchOutcome:
    """What :func:`search_placement` reached: a placement smaller than the start (or within the
    capacity the start missed), if any; and a proven lower bound on every arena (bytes)."""

    placement: Placement | None
    proven_lower_bytes: int
    probes: tuple[Probe, ...]


def search_placement(
    problem: PlacementProblem,
    start: Placement,
    deadline: float,
    *,
    options: SearchOptions = SearchOptions(),
    engine: str = "auto",
    cancel: Cancel | None = None,
) -> SearchOutcome:
    """Look for a smaller arena than ``start``'s by the canonical search, until ``deadline``.

    Without a capacity (or when ``start`` fits it) capacities from the lower bound up to just
    below ``start``'s arena are bisected, the lower bound first; when ``start`` misses the
    capacity, the capacity is probed first. Counting in units of :func:`unit_bytes` loses
    nothing: some optimal placement has every offset a sum of padded sizes.
    """
    assert applies(problem)
    t0 = time.perf_counter()
    unit, sizes, lives, fixed = problem_units(problem)
    lower = -(-problem.lower_bound_bytes // unit)
    cap = problem.capacity_bytes
    if cap is None or start.arena_bytes <= cap:
        upper, first = -(-start.arena_bytes // unit) - 1, lower
    else:
        upper = first = cap // unit
    found = minimise(
        sizes, lives, lower, upper, deadline, fixed_units=fixed, first=first, options=options, engine=engine,
        cancel=cancel,
    )  # fmt: skip
    placement = None
    if found.offsets_units is not None:
        offsets = tuple(o * unit for o in found.offsets_units)
        arena = arena_bytes(problem, offsets)
        bound = max(problem.lower_bound_bytes, found.proven_lower_units * unit)
        status = "optimal" if arena <= bound else "feasible"
        gap = 0.0 if arena <= bound else (arena - bound) / arena
        placement = Placement(offsets, arena, "canonical-search", status, time.perf_counter() - t0, gap, bound)
    return SearchOutcome(placement, found.proven_lower_units * unit, found.probes)
