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
