"""Fast placement heuristics and a portfolio that keeps the smallest arena.

* :func:`greedy_by_size`: TFLite's / XLA's "greedy by size": largest buffer first, each put
  in the tightest gap left by the conflicting buffers already placed (best fit), or above
  them all. Works for any conflict relation, fixed offsets and contiguous groups (a group is
  placed as one block; each member avoids its own conflicts, as SOMAS's offset assignment).
* :func:`best_fit_skyline`: Sekiyama et al. 3.2 and Figure 1: keep the "offset lines" (a
  skyline over time); take the lowest line (leftmost on ties), put on it the unplaced buffer
  with the longest lifetime that fits under the line; if none fits, lift the line up to its
  lower neighbour and merge them. Needs lifetimes.
* :func:`pyramid_offsets`: OLLA 4.5, Function 5: a chain of nested lifetimes, longest first,
  stacked at increasing addresses; the rest is then placed greedily.

All of them count in units of :func:`memplan.placement.problem.unit_bytes`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from memplan.placement.problem import (
    Placement,
    PlacementProblem,
    arena_bytes,
    group_prefixes,
    lower_bound_bytes,
    unit_bytes,
)


@dataclass(frozen=True)
class Blocks:
    """Buffers gathered into blocks: a contiguous group is one block, any other buffer its own."""

    members: tuple[tuple[int, ...], ...]
    prefixes_units: tuple[tuple[int, ...], ...]
    sizes_units: np.ndarray  # per block
    buffer_sizes_units: np.ndarray  # per buffer
    fixed_start_units: dict[int, int]  # block -> start
    starts: np.ndarray | None  # per block lifetime hull, when lifetimes are known
    ends: np.ndarray | None
    unit_bytes: int


def make_blocks(problem: PlacementProblem) -> Blocks:
    unit = unit_bytes(problem)
    sizes = np.array(problem.padded_sizes_bytes, dtype=np.int64) // unit
    grouped = set(problem.group_of)
    members = [tuple(g) for g in problem.contiguous] + [(b,) for b in range(problem.num_buffers) if b not in grouped]
    prefixes = [tuple(p // unit for p in group_prefixes(problem, m)) for m in members]
    fixed = {}
    for k, (m, p) in enumerate(zip(members, prefixes, strict=True)):
        for b, pre in zip(m, p, strict=True):
            if b in problem.fixed_offsets:
                fixed[k] = problem.fixed_offsets[b] // unit - pre
    starts = ends = None
    if problem.lifetimes is not None:
        starts = np.array([min(problem.lifetimes[b][0] for b in m) for m in members], dtype=np.int64)
        ends = np.array([max(problem.lifetimes[b][1] for b in m) for m in members], dtype=np.int64)
    block_sizes = np.array([sum(int(sizes[b]) for b in m) for m in members], dtype=np.int64)
    return Blocks(tuple(members), tuple(prefixes), block_sizes, sizes, fixed, starts, ends, unit)


class _Packer:
    """Places blocks one at a time at the lowest (first fit) or tightest (best fit) legal start."""

    def __init__(self, problem: PlacementProblem, blocks: Blocks) -> None:
        self.problem = problem
        self.blocks = blocks
        n = problem.num_buffers
        self.offsets = np.full(n, -1, dtype=np.int64)
        self.placed = np.zeros(n, dtype=bool)
        self.sizes = blocks.buffer_sizes_units
        self.interval = problem.is_interval and problem.lifetimes is not None
        if self.interval:
            lives = np.array(problem.lifetimes, dtype=np.int64).reshape(-1, 2)
            self.starts, self.ends = lives[:, 0], lives[:, 1]

    def put(self, block: int, start: int) -> None:
        for b, pre in zip(self.blocks.members[block], self.blocks.prefixes_units[block], strict=True):
            self.offsets[b] = start + pre
            self.placed[b] = True

    def _placed_conflicts(self, b: int) -> np.ndarray:
        if self.interval:
            mask = self.placed & (self.starts < self.ends[b]) & (self.starts[b] < self.ends)
            return np.flatnonzero(mask)
        nb = self.problem.conflicts.neighbors(b)
        return nb[self.placed[nb]]

    def forbidden(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """Block starts ``[lo, hi)`` that would make a member overlap a placed conflicting buffer."""
        los, his = [], []
        for b, pre in zip(self.blocks.members[block], self.blocks.prefixes_units[block], strict=True):
            if self.sizes[b] == 0:
                continue
            nb = self._placed_conflicts(b)
            nb = nb[self.sizes[nb] > 0]
            los.append(self.offsets[nb] - pre - self.sizes[b] + 1)
            his.append(self.offsets[nb] + self.sizes[nb] - pre)
        if not los:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(los), np.concatenate(his)

    def choose(self, block: int, best_fit: bool) -> int:
        lo, hi = self.forbidden(block)
        if len(lo) == 0:
            return 0
        order = np.argsort(lo, kind="stable")
        lo, hi = lo[order], hi[order]
        reach = np.maximum.accumulate(hi)
        region_start = np.maximum(np.concatenate(([0], reach[:-1])), 0)
        length = lo - region_start
        ok = np.flatnonzero(length > 0)
        if len(ok) == 0:
            return int(max(reach[-1], 0))
        if not best_fit:
            return int(region_start[ok[0]])
        return int(region_start[ok[np.argmin(length[ok])]])


def _finish(problem: PlacementProblem, blocks: Blocks, offsets_units: np.ndarray, method: str, t0: float) -> Placement:
    offsets = tuple(int(o) * blocks.unit_bytes for o in offsets_units)
    arena = arena_bytes(problem, offsets)
    bound = lower_bound_bytes(problem)
    gap = 0.0 if arena <= bound else (arena - bound) / arena
    status = "optimal" if arena <= bound else "feasible"
    return Placement(offsets, arena, method, status, time.perf_counter() - t0, gap, bound)


def place_in_order(
    problem: PlacementProblem,
    block_order: Sequence[int],
    *,
    best_fit: bool,
    method: str,
    preset_units: dict[int, int] | None = None,
    blocks: Blocks | None = None,
) -> Placement:
    """Place the blocks in ``block_order`` one by one; fixed blocks (and ``preset_units``) first."""
    t0 = time.perf_counter()
    blocks = blocks or make_blocks(problem)
    packer = _Packer(problem, blocks)
    preset = {**(preset_units or {}), **blocks.fixed_start_units}
    for block, start in preset.items():
        packer.put(block, start)
    for block in block_order:
        if block not in preset:
            packer.put(block, packer.choose(block, best_fit))
    return _finish(problem, blocks, packer.offsets, method, t0)


def _lengths(blocks: Blocks) -> np.ndarray:
    if blocks.starts is None or blocks.ends is None:
        return np.zeros(len(blocks.members), dtype=np.int64)
    return blocks.ends - blocks.starts


def greedy_by_size(problem: PlacementProblem, best_fit: bool = True, blocks: Blocks | None = None) -> Placement:
    """TFLite / XLA greedy by size: largest first (longer lifetime, then index, breaks ties)."""
    blocks = blocks or make_blocks(problem)
    order = np.lexsort((np.arange(len(blocks.members)), -_lengths(blocks), -blocks.sizes_units))
    name = "greedy-by-size" if best_fit else "greedy-by-size-first-fit"
    return place_in_order(problem, order.tolist(), best_fit=best_fit, method=name, blocks=blocks)


def greedy_by_size_then_start(
    problem: PlacementProblem, size_classes: bool = False, blocks: Blocks | None = None
) -> Placement:
    """Largest first, equal sizes by start time, each at its lowest legal offset.

    Among buffers of one size, first fit in start order is an optimal interval-graph
    colouring, so equal-sized temporaries (an unrolled RNN's gate buffers) tile perfectly.
    With ``size_classes`` sizes are compared by power of two only, so near-equal sizes tile too.
    """
    blocks = blocks or make_blocks(problem)
    key = np.floor(np.log2(np.maximum(blocks.sizes_units, 1))) if size_classes else blocks.sizes_units
    starts = blocks.starts if blocks.starts is not None else np.zeros(len(blocks.members), dtype=np.int64)
    order = np.lexsort((np.arange(len(blocks.members)), -blocks.sizes_units, starts, -key))
    name = "greedy-by-size-class-then-start" if size_classes else "greedy-by-size-then-start"
    return place_in_order(problem, order.tolist(), best_fit=False, method=name, blocks=blocks)


def greedy_by_lifetime(problem: PlacementProblem, blocks: Blocks | None = None) -> Placement:
    """Longest lifetime first (Sekiyama's priority), then largest, each at its lowest legal offset."""
    blocks = blocks or make_blocks(problem)
    order = np.lexsort((np.arange(len(blocks.members)), -blocks.sizes_units, -_lengths(blocks)))
    return place_in_order(problem, order.tolist(), best_fit=False, method="greedy-by-lifetime", blocks=blocks)


def greedy_by_area(problem: PlacementProblem, blocks: Blocks | None = None) -> Placement:
    """Largest size x lifetime first, best fit: a compromise between the two orders above."""
    blocks = blocks or make_blocks(problem)
    area = blocks.sizes_units * np.maximum(_lengths(blocks), 1)
    order = np.lexsort((np.arange(len(blocks.members)), -blocks.sizes_units, -area))
    return place_in_order(problem, order.tolist(), best_fit=True, method="greedy-by-area", blocks=blocks)


def greedy_by_conflict_weight(problem: PlacementProblem, blocks: Blocks | None = None) -> Placement:
    """For general conflicts: most constrained first (size times the bytes it conflicts with)."""
    blocks = blocks or make_blocks(problem)
    sizes = blocks.buffer_sizes_units
    weight = np.array(
        [sum(int(sizes[problem.conflicts.neighbors(b)].sum()) for b in m) for m in blocks.members], dtype=np.int64
    )
    order = np.lexsort((np.arange(len(blocks.members)), -blocks.sizes_units, -(weight + 1) * blocks.sizes_units))
    return place_in_order(problem, order.tolist(), best_fit=True, method="greedy-by-conflicts", blocks=blocks)


def best_fit_skyline(
    problem: PlacementProblem, blocks: Blocks | None = None, by_size: bool = False
) -> Placement | None:
    """Sekiyama et al. 3.2 (Figure 1); ``None`` when it does not apply (no lifetimes or fixed offsets).

    On each offset line the longest-lived fitting block goes first (the paper's rule), or the
    largest with ``by_size``.

    A contiguous group is one block spanning the hull of its members' lifetimes.
    """
    blocks = blocks or make_blocks(problem)
    if blocks.starts is None or blocks.ends is None or not problem.is_interval or blocks.fixed_start_units:
        return None
    t0 = time.perf_counter()
    starts, ends, sizes = blocks.starts, blocks.ends, blocks.sizes_units
    priority = np.empty(len(sizes), dtype=np.int64)
    keys = (-(ends - starts), -sizes) if by_size else (-sizes, -(ends - starts))  # np.lexsort: last key first
    priority[np.lexsort((np.arange(len(sizes)), *keys))] = np.arange(len(sizes))
    free = np.ones(len(sizes), dtype=bool)
    sky = _Skyline(int(starts.min(initial=0)), int(ends.max(initial=1)))
    block_start = np.zeros(len(sizes), dtype=np.int64)
    never = np.iinfo(np.int64).max
    while free.any():
        k = sky.lowest()
        t_lo, t_hi, height = sky.t0[k], sky.t1[k], sky.h[k]
        fits = free & (starts >= t_lo) & (ends <= t_hi)
        pick = int(np.argmin(np.where(fits, priority, never)))
        if not fits[pick]:
            sky.lift(k)
            continue
        block_start[pick] = height
        free[pick] = False
        sky.raise_span(k, int(starts[pick]), int(ends[pick]), height + int(sizes[pick]))
    offsets = np.zeros(problem.num_buffers, dtype=np.int64)
    for k, (m, p) in enumerate(zip(blocks.members, blocks.prefixes_units, strict=True)):
        for b, pre in zip(m, p, strict=True):
            offsets[b] = block_start[k] + pre
    return _finish(problem, blocks, offsets, "best-fit-skyline-by-size" if by_size else "best-fit-skyline", t0)


class _Skyline:
    """Sekiyama's offset lines: segments ``[t0, t1)`` at height ``h`` covering the time axis."""

    def __init__(self, t_min: int, t_max: int) -> None:
        self.t0, self.t1, self.h = [t_min], [t_max], [0]

    def lowest(self) -> int:
        """The lowest line, leftmost on ties."""
        return min(range(len(self.h)), key=self.h.__getitem__)

    def lift(self, k: int) -> None:
        """Raise line ``k`` to its lowest neighbour and merge with it (both if equal)."""
        neighbours = [self.h[j] for j in (k - 1, k + 1) if 0 <= j < len(self.h)]
        if not neighbours:
            raise AssertionError("the single offset line always fits every remaining block")
        self.h[k] = min(neighbours)
        self._merge_around(k)

    def raise_span(self, k: int, start: int, end: int, height: int) -> None:
        t_lo, t_hi, h = self.t0[k], self.t1[k], self.h[k]
        pieces = [(t_lo, start, h), (start, end, height), (end, t_hi, h)]
        pieces = [p for p in pieces if p[0] < p[1]]
        self.t0[k : k + 1] = [p[0] for p in pieces]
        self.t1[k : k + 1] = [p[1] for p in pieces]
        self.h[k : k + 1] = [p[2] for p in pieces]
        self._merge_around(k + (1 if start > t_lo else 0))

    def _merge_around(self, k: int) -> None:
        if k + 1 < len(self.h) and self.h[k + 1] == self.h[k]:
            self._join(k)
        if k > 0 and self.h[k - 1] == self.h[k]:
            self._join(k - 1)

    def _join(self, k: int) -> None:
        self.t1[k] = self.t1[k + 1]
        del self.t0[k + 1], self.t1[k + 1], self.h[k + 1]


def pyramid_offsets(problem: PlacementProblem, blocks: Blocks | None = None) -> dict[int, int]:
    """OLLA Function 5 (section 4.5): block -> start (units) for a pyramid of nested lifetimes.

    Repeatedly take the longest-lived unplaced single buffer whose lifetime nests in the
    previous one's and stack it on top. With a fixed order, ASAP/ALAP spans are lifetimes.
    Returns ``{}`` when there are no lifetimes or there are fixed offsets to respect.
    """
    blocks = blocks or make_blocks(problem)
    if blocks.starts is None or blocks.ends is None or blocks.fixed_start_units:
        return {}
    singles = [k for k, m in enumerate(blocks.members) if len(m) == 1 and blocks.sizes_units[k] > 0]
    lengths = _lengths(blocks)
    singles.sort(key=lambda k: (-int(lengths[k]), k))
    min_start, max_end, base = -np.inf, np.inf, 0
    chosen: dict[int, int] = {}
    for k in singles:  # longest first, so the first that nests is the one Function 5 picks
        if blocks.starts[k] >= min_start and blocks.ends[k] <= max_end:
            chosen[k] = base
            base += int(blocks.sizes_units[k])
            min_start, max_end = blocks.starts[k], blocks.ends[k]
    return chosen


def pyramid_greedy(problem: PlacementProblem, blocks: Blocks | None = None) -> Placement | None:
    """OLLA's pre-placement, then greedy by size for the remaining buffers."""
    blocks = blocks or make_blocks(problem)
    preset = pyramid_offsets(problem, blocks)
    if not preset:
        return None
    order = np.lexsort((np.arange(len(blocks.members)), -_lengths(blocks), -blocks.sizes_units))
    return place_in_order(
        problem, order.tolist(), best_fit=True, method="pyramid+greedy", preset_units=preset, blocks=blocks
    )


HEURISTICS: tuple[tuple[str, Callable[[PlacementProblem, Blocks], Placement | None]], ...] = (
    ("best-fit-skyline", lambda p, b: best_fit_skyline(p, b)),
    ("best-fit-skyline-by-size", lambda p, b: best_fit_skyline(p, b, by_size=True)),
    ("greedy-by-size", lambda p, b: greedy_by_size(p, True, b)),
    ("greedy-by-size-then-start", lambda p, b: greedy_by_size_then_start(p, False, b)),
    ("greedy-by-size-class-then-start", lambda p, b: greedy_by_size_then_start(p, True, b)),
    ("greedy-by-lifetime", lambda p, b: greedy_by_lifetime(p, b)),
    ("greedy-by-area", lambda p, b: greedy_by_area(p, b)),
    ("greedy-by-size-first-fit", lambda p, b: greedy_by_size(p, False, b)),
    ("pyramid+greedy", lambda p, b: pyramid_greedy(p, b)),
    ("greedy-by-conflicts", lambda p, b: None if p.is_interval else greedy_by_conflict_weight(p, b)),
)


def portfolio(problem: PlacementProblem, stop_at_bound: bool = True) -> Placement:
    """Run every applicable heuristic and keep the smallest arena (first listed wins ties);
    stop early once one reaches the lower bound, since nothing can beat it."""
    t0 = time.perf_counter()
    blocks = make_blocks(problem)
    best: Placement | None = None
    for _name, run in HEURISTICS:
        result = run(problem, blocks)
        if result is not None and (best is None or result.arena_bytes < best.arena_bytes):
            best = result
        if stop_at_bound and best is not None and best.status == "optimal":
            break
    assert best is not None  # greedy-by-size always applies
    return Placement(
        best.offsets_bytes,
        best.arena_bytes,
        best.method,
        best.status,
        time.perf_counter() - t0,
        best.gap,
        best.bound_bytes,
    )
