"""SOMAS's offset assignment for parallel steps (Lamprou et al. 2023, section 4).

The problem (Definition 6) is memplan's :class:`~memplan.placement.problem.PlacementProblem`
with a pair conflict relation (the unsafe pairs) and contiguous groups. SOMAS's algorithm:

1. sort the *blocks* (a contiguous group is one block, any other tensor its own) by some
   criterion (greater size first; ties by index or by number of constraints);
2. for the current block, compute the forbidden start offsets: a member at distance ``pre``
   from the block's start must not overlap a placed unsafe tensor, so the block may not start
   in ``[offset(u) - pre - size(m) + 1, offset(u) + size(u) - pre)``;
3. choose a start among the allowed ones (best fit: the tightest hole; or the smallest offset).

* **Single object** (:func:`single_object`): the whole arena is one memory object; steps 2-3
  look at every placed unsafe tensor. Every sort x fit combination is run and the smallest
  arena kept (this is memplan's own block packer, :func:`~memplan.placement.heuristics.place_in_order`).
* **Many objects** (:func:`many_objects`): the arena is a stack of objects, each as high as
  the block that opened it. A block tries the objects bottom-up, looking only at that object's
  tensors, skips an object at once when it is unsafe with a tensor spanning it, and opens a new
  object on top when none can take it. Faster (smaller searches), sometimes a little larger.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from memplan.placement.heuristics import Blocks, make_blocks, place_in_order
from memplan.placement.problem import Placement, PlacementProblem, arena_bytes, lower_bound_bytes

Sort = Callable[[PlacementProblem, Blocks], list[int]]


def _constraints(problem: PlacementProblem, blocks: Blocks) -> np.ndarray:
    return np.array([sum(len(problem.conflicts.neighbors(b)) for b in m) for m in blocks.members], dtype=np.int64)


def _first_index(blocks: Blocks) -> np.ndarray:
    return np.array([min(m) for m in blocks.members], dtype=np.int64)


SORTS: dict[str, Sort] = {
    "size-smaller-index": lambda p, b: np.lexsort((_first_index(b), -b.sizes_units)).tolist(),
    "size-larger-index": lambda p, b: np.lexsort((-_first_index(b), -b.sizes_units)).tolist(),
    "size-more-constraints": lambda p, b: np.lexsort((_first_index(b), -_constraints(p, b), -b.sizes_units)).tolist(),
    "size-fewer-constraints": lambda p, b: np.lexsort((_first_index(b), _constraints(p, b), -b.sizes_units)).tolist(),
}
FITS = {"best": True, "smallest": False}


def _best(results: list[Placement], t0: float) -> Placement:
    best = min(results, key=lambda r: r.arena_bytes)  # first listed wins ties
    return Placement(
        best.offsets_bytes,
        best.arena_bytes,
        best.method,
        best.status,
        time.perf_counter() - t0,
        best.gap,
        best.bound_bytes,
    )


def single_object(problem: PlacementProblem) -> Placement:
    """SOMAS single object: every sort x fit, each block at its best legal start in the whole
    arena; the smallest arena (``method`` says which combination found it)."""
    t0 = time.perf_counter()
    blocks = make_blocks(problem)
    results = [
        place_in_order(
            problem, sort(problem, blocks), best_fit=best_fit, method=f"somas-so({name},{fit})", blocks=blocks
        )
        for name, sort in SORTS.items()
        for fit, best_fit in FITS.items()
    ]
    return _best(results, t0)


def many_objects(problem: PlacementProblem) -> Placement | None:
    """SOMAS many objects: every sort x fit, the smallest arena; ``None`` with fixed offsets
    (objects are stacked from 0, so a fixed offset has no object to go to)."""
    if problem.fixed_offsets:
        return None
    t0 = time.perf_counter()
    blocks = make_blocks(problem)
    results = [
        many_objects_in_order(problem, blocks, sort(problem, blocks), best_fit, f"somas-mo({name},{fit})")
        for name, sort in SORTS.items()
        for fit, best_fit in FITS.items()
    ]
    return _best(results, t0)


class _Objects:
    """The stack of memory objects and the blocks placed in them (all in units)."""

    def __init__(self, problem: PlacementProblem, blocks: Blocks) -> None:
        self.problem = problem
        self.blocks = blocks
        self.sizes = blocks.buffer_sizes_units
        self.offsets = np.zeros(problem.num_buffers, dtype=np.int64)
        self.object_of = np.full(problem.num_buffers, -1, dtype=np.int64)
        self.bases: list[int] = []
        self.heights: list[int] = []
        self.spanning: list[list[int]] = []  # per object: single buffers as high as the object

    def put(self, block: int, obj: int, start: int) -> None:
        members = self.blocks.members[block]
        for b, pre in zip(members, self.blocks.prefixes_units[block], strict=True):
            self.offsets[b] = self.bases[obj] + start + pre
            self.object_of[b] = obj
        if len(members) == 1 and self.sizes[members[0]] == self.heights[obj]:
            self.spanning[obj].append(members[0])

    def open(self, block: int) -> int:
        self.bases.append(sum(self.heights))
        self.heights.append(int(self.blocks.sizes_units[block]))
        self.spanning.append([])
        return len(self.bases) - 1

    def blocked(self, block: int, obj: int) -> bool:
        """Unsafe with a tensor spanning the whole object: no start can work there."""
        conflicts = self.problem.conflicts
        return any(
            conflicts.conflict(b, s)
            for s in self.spanning[obj]
            for b in self.blocks.members[block]
            if self.sizes[b] > 0
        )

    def fit(self, block: int, obj: int, best_fit: bool) -> int | None:
        """The start of ``block`` in ``obj`` (relative to its base), or ``None`` if it fits nowhere."""
        limit = self.heights[obj] - int(self.blocks.sizes_units[block])  # the highest allowed start
        base = self.bases[obj]
        los, his = [], []
        for b, pre in zip(self.blocks.members[block], self.blocks.prefixes_units[block], strict=True):
            if self.sizes[b] == 0:
                continue
            nb = self.problem.conflicts.neighbors(b)
            nb = nb[(self.object_of[nb] == obj) & (self.sizes[nb] > 0)]
            los.append(self.offsets[nb] - base - pre - self.sizes[b] + 1)
            his.append(self.offsets[nb] - base + self.sizes[nb] - pre)
        lo = np.concatenate([*los, [limit + 1]])  # the object's top closes the last hole
        hi = np.concatenate([*his, [limit + 1]])
        order = np.argsort(lo, kind="stable")
        lo, hi = lo[order], hi[order]
        reach = np.maximum.accumulate(hi)
        gap_start = np.maximum(np.concatenate(([0], reach[:-1])), 0)
        gap_length = np.minimum(lo, limit + 1) - gap_start
        ok = np.flatnonzero(gap_length > 0)
        if len(ok) == 0:
            return None
        pick = ok[np.argmin(gap_length[ok])] if best_fit else ok[0]
        return int(gap_start[pick])


def many_objects_in_order(
    problem: PlacementProblem, blocks: Blocks, block_order: list[int], best_fit: bool, method: str
) -> Placement:
    """Place ``blocks`` in ``block_order`` into a stack of objects (module docstring)."""
    t0 = time.perf_counter()
    objects = _Objects(problem, blocks)
    for block in block_order:
        if blocks.sizes_units[block] == 0:
            continue  # empty: offset 0 of the arena overlaps nothing
        for obj in range(len(objects.bases)):
            if blocks.sizes_units[block] > objects.heights[obj] or objects.blocked(block, obj):
                continue
            start = objects.fit(block, obj, best_fit)
            if start is not None:
                objects.put(block, obj, start)
                break
        else:
            objects.put(block, objects.open(block), 0)
    offsets = tuple(int(o) * blocks.unit_bytes for o in objects.offsets)
    arena = arena_bytes(problem, offsets)
    bound = lower_bound_bytes(problem)
    status = "optimal" if arena <= bound else "feasible"
    gap = 0.0 if arena <= bound else (arena - bound) / arena
    return Placement(offsets, arena, method, status, time.perf_counter() - t0, gap, bound)
