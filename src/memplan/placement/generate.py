"""Adversarial placement instances: a perfect packing that greedy-by-size packs badly.

A ``num_steps x height`` rectangle (time x address) is cut at random, guillotine style,
into ``num_buffers`` rectangles; each becomes a buffer whose lifetime is its time extent and
whose size is its height. The cut itself is a placement with no gap at any time, so the
lower bound (the height) is achievable: the optimum is known. Greedy by size, which puts
the largest buffers low wherever they fit, ends up far above it on such instances; an
instance is kept only if greedy by size lands at least ``min_excess`` above the bound.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from memplan.errors import MemplanError
from memplan.placement.heuristics import greedy_by_size
from memplan.placement.problem import PlacementProblem


class GenerationError(MemplanError, ValueError):
    """No instance with the requested properties was found."""


@dataclass(frozen=True)
class Instance:
    """A problem with a known zero-fragmentation placement ``optimal_offsets_bytes``."""

    problem: PlacementProblem
    optimal_offsets_bytes: tuple[int, ...]
    optimal_arena_bytes: int


def guillotine_rectangles(
    rng: random.Random, num_rects: int, num_steps: int, height_units: int
) -> list[tuple[int, int, int, int]]:
    """Cut ``[0, num_steps) x [0, height_units)`` into ``num_rects`` rectangles (t0, t1, y0, y1)."""
    rects = [(0, num_steps, 0, height_units)]
    while len(rects) < num_rects:
        weights = [(t1 - t0) * (y1 - y0) for t0, t1, y0, y1 in rects]
        i = rng.choices(range(len(rects)), weights=weights)[0]
        t0, t1, y0, y1 = rects[i]
        can_t, can_y = t1 - t0 >= 2, y1 - y0 >= 2
        if not (can_t or can_y):
            continue
        if can_t and (not can_y or rng.random() < 0.5):
            cut = rng.randint(t0 + 1, t1 - 1)
            rects[i : i + 1] = [(t0, cut, y0, y1), (cut, t1, y0, y1)]
        else:
            cut = rng.randint(y0 + 1, y1 - 1)
            rects[i : i + 1] = [(t0, t1, y0, cut), (t0, t1, cut, y1)]
    return rects


def adversarial_instance(
    seed: int,
    num_buffers: int,
    *,
    num_steps: int = 1000,
    height_units: int = 1024,
    unit_bytes: int = 256,
    min_excess: float = 0.30,
    max_tries: int = 50,
) -> Instance:
    """A perfect-packing instance of ``num_buffers`` buffers on which greedy by size needs an
    arena at least ``(1 + min_excess)`` times the lower bound (tries seeds ``seed, seed+1, ...``)."""
    if num_buffers < 1 or num_buffers > num_steps * height_units:
        raise GenerationError(f"cannot cut {num_buffers} buffers out of {num_steps} x {height_units}")
    for attempt in range(max_tries):
        rng = random.Random(seed * 1_000_003 + attempt)
        rects = guillotine_rectangles(rng, num_buffers, num_steps, height_units)
        problem = PlacementProblem.from_intervals(
            [(y1 - y0) * unit_bytes for _, _, y0, y1 in rects],
            [(t0, t1) for t0, t1, _, _ in rects],
            names=tuple(f"b{i}" for i in range(len(rects))),
        )
        arena = height_units * unit_bytes
        if greedy_by_size(problem).arena_bytes >= (1 + min_excess) * arena:
            return Instance(problem, tuple(y0 * unit_bytes for _, _, y0, _ in rects), arena)
    raise GenerationError(f"no instance with greedy by size {min_excess:.0%} above the bound in {max_tries} tries")


def tight_rectangles(
    rng: random.Random,
    num_rects: int,
    height_units: int,
    *,
    mean_size_units: int = 8,
    short_steps: tuple[int, int] = (1, 6),
    long_steps: tuple[int, int] = (10, 60),
    long_share: float = 0.3,
    hole_share: float = 0.0,
    size_spread: float = 1.25,
) -> list[tuple[int, int, int, int]]:
    """A packing of ``num_rects`` rectangles (t0, t1, y0, y1) under ``height_units`` that fills
    it completely at time 0 (and at every time when ``hole_share`` is 0).

    A sweep over time: whenever rectangles end, the address ranges they free are merged with the
    free ranges they touch (so new buffers straddle old boundaries: the cut is not a guillotine
    one) and refilled at once by new rectangles of similar sizes (``mean_size_units`` +- 25%), the
    lower ones short lived and the upper ones long lived (``long_share`` of them drawn from
    ``long_steps``, the rest from ``short_steps``). With probability ``hole_share`` the top piece
    of a refill is left empty, so the load dips below the height there.
    """
    rects: list[tuple[int, int, int, int]] = []
    live: list[int] = []  # indices into rects
    free: list[tuple[int, int]] = []  # empty address ranges, sorted

    def fill(t: int, y0: int, y1: int) -> None:
        y = y0
        pieces = []
        while y < y1:
            size = max(1, round(mean_size_units * size_spread ** rng.uniform(-1.0, 1.0)))
            if y1 - (y + size) < max(1, mean_size_units // 2):
                size = y1 - y  # the last piece takes the rest
            pieces.append((y, y + size))
            y += size
        if len(pieces) > 1 and rng.random() < hole_share:
            free.append(pieces.pop())
        lengths = sorted(
            rng.randint(*long_steps) if rng.random() < long_share else rng.randint(*short_steps) for _ in pieces
        )
        for (a, b), length in zip(pieces, lengths, strict=True):
            live.append(len(rects))
            rects.append((t, t + length, a, b))

    fill(0, 0, height_units)
    while len(rects) < num_rects and live:
        t = min(rects[i][1] for i in live)
        ending = [(rects[i][2], rects[i][3]) for i in live if rects[i][1] == t]
        live[:] = [i for i in live if rects[i][1] != t]
        merged: list[list[int]] = []
        for a, b in sorted(free + ending):
            if merged and merged[-1][1] == a:
                merged[-1][1] = b
            else:
                merged.append([a, b])
        free.clear()
        for a, b in merged:
            if len(rects) >= num_rects:
                break
            fill(t, a, b)
    return rects[:num_rects]


def tight_instance(
    seed: int,
    num_buffers: int,
    *,
    height_units: int = 128,
    unit_bytes: int = 512,
    mean_size_units: int = 8,
    hole_share: float = 0.0,
    size_spread: float = 1.25,
    long_steps: tuple[int, int] = (10, 60),
) -> Instance:
    """A hard instance: a tight packing from :func:`tight_rectangles` (optimum = lower bound =
    ``height_units * unit_bytes``, full at every time step until the load first drops), sizes
    in multiples of ``unit_bytes`` (512 B, as CUDA's caching allocator rounds). Many buffers of
    similar sizes cross the same sections and long-lived ones lie on short-lived ones; the load
    sits exactly at the bound on most sections, so every section must tile perfectly."""
    rng = random.Random(seed)
    rects = tight_rectangles(
        rng,
        num_buffers,
        height_units,
        mean_size_units=mean_size_units,
        hole_share=hole_share,
        size_spread=size_spread,
        long_steps=long_steps,
    )
    return shuffled_instance(rng, rects, height_units, unit_bytes)


def shuffled_instance(
    rng: random.Random, rects: list[tuple[int, int, int, int]], height_units: int, unit_bytes: int
) -> Instance:
    """The packing ``rects`` (t0, t1, y0, y1) as a problem with sizes and offsets in multiples of
    ``unit_bytes``, its buffers in random order (no hint in the order)."""
    order = sorted(range(len(rects)), key=lambda i: rng.random())
    problem = PlacementProblem.from_intervals(
        [(rects[i][3] - rects[i][2]) * unit_bytes for i in order],
        [(rects[i][0], rects[i][1]) for i in order],
        names=tuple(f"b{k}" for k in range(len(rects))),
        alignment_bytes=unit_bytes,
    )
    offsets = tuple(rects[i][2] * unit_bytes for i in order)
    return Instance(problem, offsets, height_units * unit_bytes)


def similar_sizes(rng: random.Random, count: int, mean_units: int, spread: float) -> tuple[int, ...]:
    """``count`` distinct sizes within a factor ``spread`` of ``mean_units``, none a multiple of
    another (so no size tiles another's slot, and the unit is 1 whenever two are coprime)."""
    lo, hi = max(2, round(mean_units / spread)), max(3, round(mean_units * spread))
    if hi - lo + 1 < count:
        raise GenerationError(f"{count} distinct sizes do not fit in [{lo}, {hi}] units: widen the spread")
    chosen: list[int] = []
    for size in rng.sample(range(lo, hi + 1), hi - lo + 1):
        if all(size % c and c % size for c in chosen):
            chosen.append(size)
            if len(chosen) == count:
                return tuple(sorted(chosen))
    raise GenerationError(f"no {count} sizes in [{lo}, {hi}] units divide none of the others: widen the spread")


def perfect_rectangles(
    rng: random.Random,
    num_rects: int,
    height_units: int,
    sizes: tuple[int, ...],
    *,
    short_steps: tuple[int, int] = (1, 6),
    long_steps: tuple[int, int] = (20, 200),
    long_share: float = 0.3,
    stacking: str = "short-low",
) -> list[tuple[int, int, int, int]]:
    """A packing of at least ``num_rects`` rectangles (t0, t1, y0, y1) that fills
    ``[0, horizon) x [0, height_units)`` exactly: no gap at any time.

    The sweep of :func:`tight_rectangles` with every refill complete: whenever rectangles end,
    the freed address ranges are merged with each other (new buffers straddle old boundaries)
    and refilled at once with sizes drawn from ``sizes``, the last piece of a range taking the
    rest; in each refill the shortest lifetimes go lowest (``stacking="short-low"``), so
    long-lived buffers lie on top of short-lived ones, or the longest (``"long-low"``), or
    lifetimes fall in random order (``"mixed"``). The sweep stops once ``num_rects`` rectangles
    have started; every lifetime is cut at the next end after that (the horizon), before which
    nothing has ended unrefilled.
    """
    rects: list[tuple[int, int, int, int]] = []
    smallest = min(sizes)

    def fill(t: int, y0: int, y1: int) -> None:
        pieces, y = [], y0
        while y < y1:
            size = rng.choice(sizes)
            if y1 - (y + size) < smallest:
                size = y1 - y  # the last piece takes the rest
            pieces.append((y, y + size))
            y += size
        lengths = [rng.randint(*long_steps) if rng.random() < long_share else rng.randint(*short_steps) for _ in pieces]
        if stacking != "mixed":
            lengths.sort(reverse=stacking == "long-low")
        rects.extend((t, t + length, a, b) for (a, b), length in zip(pieces, lengths, strict=True))

    fill(0, 0, height_units)
    t = 0
    while len(rects) < num_rects:
        t = min(t1 for _, t1, _, _ in rects if t1 > t)
        ending = sorted((y0, y1) for _, t1, y0, y1 in rects if t1 == t)
        merged: list[list[int]] = []
        for a, b in ending:
            if merged and merged[-1][1] == a:
                merged[-1][1] = b
            else:
                merged.append([a, b])
        for a, b in merged:
            fill(t, a, b)
    horizon = min(t1 for _, t1, _, _ in rects if t1 > t)  # the next end: full until then
    return [(t0, min(t1, horizon), y0, y1) for t0, t1, y0, y1 in rects]


STACKINGS = ("short-low", "long-low", "mixed")


def perfect_instance(
    seed: int,
    num_buffers: int,
    *,
    height_units: int = 1024,
    unit_bytes: int = 1024,
    mean_size_units: int = 40,
    size_spread: float = 1.3,
    num_sizes: int = 0,
    long_steps: tuple[int, int] = (20, 200),
    long_share: float = 0.3,
    stacking: str = "short-low",
) -> Instance:
    """A harder instance than :func:`tight_instance` (issue 13): a perfect packing of a
    ``horizon x height_units`` rectangle by :func:`perfect_rectangles`, so the load equals the
    capacity ``height_units * unit_bytes`` at every time and the optimum is the lower bound.

    Sizes are similar (within ``size_spread`` of ``mean_size_units``) and, at the default
    ``height_units = 1024`` (MiniMalloc's 1 MiB in KiB), fine-grained: not multiples of each
    other. ``num_sizes > 0`` draws them from that many distinct sizes (:func:`similar_sizes`),
    giving many equal sizes crossing the same sections; 0 allows every size in the range.
    Long-lived buffers (``long_share`` of them, ``long_steps`` long) lie on short-lived ones
    (``stacking``: see :func:`perfect_rectangles`).
    Every section must tile the capacity exactly. Buffers come in random order; their number is
    ``num_buffers`` or a few more (the last refill is kept whole)."""
    rng = random.Random(seed)
    if num_sizes > 0:
        sizes = similar_sizes(rng, num_sizes, mean_size_units, size_spread)
    else:
        lo, hi = max(1, round(mean_size_units / size_spread)), max(1, round(mean_size_units * size_spread))
        sizes = tuple(range(lo, hi + 1))
    if stacking not in STACKINGS:
        raise GenerationError(f"unknown stacking {stacking!r}; choose one of {', '.join(STACKINGS)}")
    rects = perfect_rectangles(
        rng, num_buffers, height_units, sizes, long_steps=long_steps, long_share=long_share, stacking=stacking
    )
    return shuffled_instance(rng, rects, height_units, unit_bytes)
