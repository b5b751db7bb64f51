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
        self.spanning = np.zeros(problem.num_buffers, dtype=bool)  # single buffers as high as their object

    def put(self, block: int, obj: int, start: int) -> None:
        members = self.blocks.members[block]
        for b, pre in zip(members, self.blocks.prefixes_units[block], strict=True):
            self.offsets[b] = self.bases[obj] + start + pre
            self.object_of[b] = obj
        if len(members) == 1 and self.sizes[members[0]] == self.heights[obj]:
            self.spanning[members[0]] = True

    def open(self, block: int) -> int:
        self.bases.append(sum(self.heights))
        self.heights.append(int(self.blocks.sizes_units[block]))
        return len(self.bases) - 1

    def blocked(self, block: int) -> np.ndarray:
        """Objects where ``block`` is unsafe with a tensor spanning the whole object: no start
        can work there (SOMAS's quick rejection)."""
        blocked = np.zeros(len(self.bases), dtype=bool)
        for b in self.blocks.members[block]:
            if self.sizes[b] > 0:
                nb = self.problem.conflicts.neighbors(b)
                blocked[self.object_of[nb[self.spanning[nb]]]] = True
        return blocked

    def fit(self, block: int, best_fit: bool) -> tuple[int, int] | None:
        """``(object, start)`` for ``block``: the lowest object with a legal start (objects are
        tried bottom-up, each only against its own tensors), at its tightest hole (best fit) or
        lowest start there; ``None`` if no object can take it."""
        size = int(self.blocks.sizes_units[block])
        heights = np.array(self.heights, dtype=np.int64)
        usable = np.flatnonzero((heights >= size) & ~self.blocked(block))
        if len(usable) == 0:
            return None
        lo, hi = self._forbidden(block)
        # legal starts: inside an object, [base, base + height - size], minus the forbidden ones
        free_lo, free_hi = _free_ranges(lo, hi)
        obj_lo = np.array(self.bases, dtype=np.int64)[usable]
        obj_hi = obj_lo + heights[usable] - size + 1
        first = np.searchsorted(obj_hi, free_lo, side="right")  # per free range: first object ending after it
        valid = first < len(usable)
        valid[valid] &= obj_lo[first[valid]] < free_hi[valid]
        if not valid.any():
            return None
        k = int(np.argmax(valid))  # the lowest free range that reaches into an object
        obj = int(first[k])
        seg_lo = np.maximum(free_lo, obj_lo[obj])
        seg_hi = np.minimum(free_hi, obj_hi[obj])
        fits = np.flatnonzero(seg_hi > seg_lo)
        pick = fits[np.argmin(seg_hi[fits] - seg_lo[fits])] if best_fit else fits[0]
        return int(usable[obj]), int(seg_lo[pick])

    def _forbidden(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """Absolute block starts ``[lo, hi)`` that overlap a placed unsafe tensor."""
        los, his = [], []
        for b, pre in zip(self.blocks.members[block], self.blocks.prefixes_units[block], strict=True):
            if self.sizes[b] == 0:
                continue
            nb = self.problem.conflicts.neighbors(b)
            nb = nb[(self.object_of[nb] >= 0) & (self.sizes[nb] > 0)]
            los.append(self.offsets[nb] - pre - self.sizes[b] + 1)
            his.append(self.offsets[nb] + self.sizes[nb] - pre)
        if not los:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return np.concatenate(los), np.concatenate(his)


def _free_ranges(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The complement of the union of ``[lo, hi)`` as sorted half-open ranges."""
    if len(lo) == 0:
        return np.array([np.iinfo(np.int64).min // 2]), np.array([np.iinfo(np.int64).max // 2])
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    reach = np.maximum.accumulate(hi)
    starts = np.concatenate(([np.iinfo(np.int64).min // 2], reach))
    ends = np.concatenate((lo, [np.iinfo(np.int64).max // 2]))
    keep = ends > starts
    return starts[keep], ends[keep]


def many_objects_in_order(
    problem: PlacementProblem, blocks: Blocks, block_order: list[int], best_fit: bool, method: str
) -> Placement:
    """Place ``blocks`` in ``block_order`` into a stack of objects (module docstring)."""
    t0 = time.perf_counter()
    objects = _Objects(problem, blocks)
    for block in block_order:
        if blocks.sizes_units[block] == 0:
            continue  # empty: offset 0 of the arena overlaps nothing
        found = objects.fit(block, best_fit)
        if found is None:
            objects.put(block, objects.open(block), 0)
        else:
            obj, start = found
            objects.put(block, obj, start - objects.bases[obj])
    offsets = tuple(int(o) * blocks.unit_bytes for o in objects.offsets)
    arena = arena_bytes(problem, offsets)
    bound = lower_bound_bytes(problem)
    status = "optimal" if arena <= bound else "feasible"
    gap = 0.0 if arena <= bound else (arena - bound) / arena
    return Placement(offsets, arena, method, status, time.perf_counter() - t0, gap, bound)
