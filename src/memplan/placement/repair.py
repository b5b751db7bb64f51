"""Closing the last bytes to the lower bound: peak-anchored packing and top-band repair.

When the heuristic portfolio leaves the arena above the lower bound ``L`` (the largest total
size live at once, OLLA 5.4), two observations guide a short, exact search:

* At a time of maximum load the live buffers must tile ``[0, L)`` exactly; one hole there
  already lifts the arena above ``L``. :func:`peak_anchored` solves the buffers live in a
  short time window around that time with CP-SAT at capacity ``L``, their lifetimes clipped
  to the window, and places the rest greedily around them (OLLA 4.5 also fixes a part
  first). Clipping only removes conflicts, so the window is a relaxation of the whole
  problem: when CP-SAT proves it INFEASIBLE, no arena of ``L`` exists (:class:`Anchoring`).
* A near-miss is mostly right; only the buffers at the top of the arena are in the way.
  :func:`repair_top_band` unfixes the buffers reaching above ``L - h``, keeps every other
  buffer where it is, and asks CP-SAT to fit the unfixed ones under ``L`` (one step of a
  large neighbourhood search over Sekiyama et al.'s time x address rectangles, eq. 2-6).

:func:`reach_bound` chains both within a time budget; it never returns a larger arena than
the placement it starts from. It applies to interval problems without fixed offsets or
contiguous groups, where every block is one buffer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from memplan.placement.heuristics import Blocks, _lengths, make_blocks, place_in_order
from memplan.placement.problem import Placement, PlacementProblem, arena_bytes, unit_bytes
from memplan.solvers import solve_cp_sat

# Half-widths (in time steps) of the windows solved exactly around the peak, smallest first.
WINDOWS = (1, 2, 4)
# Peak-anchored placements kept per window (the best arenas, distinct offsets).
PER_WINDOW = 2
# Heights of the top band unfixed by one repair step, as fractions of the lower bound.
BANDS = (0.01, 0.03, 0.1, 0.3)
# Seconds given to one CP-SAT call (a window or a band); infeasible bands answer in milliseconds.
STEP_SECONDS = 2.5
# A CP-SAT call is not started with fewer seconds than this left in the budget.
MIN_STEP_SECONDS = 0.05


def applies(problem: PlacementProblem) -> bool:
    """True when :func:`reach_bound` can work on ``problem`` (interval conflicts, free blocks)."""
    intervals = problem.is_interval and problem.lifetimes is not None
    return intervals and not problem.fixed_offsets and not problem.contiguous


@dataclass(frozen=True)
class Anchoring:
    """Placements built around a peak window, and whether that window proves ``L`` unreachable."""

    placements: tuple[Placement, ...]
    bound_unreachable: bool


def load_profile(problem: PlacementProblem) -> np.ndarray:
    """Total padded bytes live at each time step (the estimator's curve, OLLA eq. 4)."""
    assert problem.lifetimes is not None
    lives = np.array(problem.lifetimes, dtype=np.int64).reshape(-1, 2)
    delta = np.zeros(int(lives[:, 1].max(initial=0)) + 1, dtype=np.int64)
    sizes = np.array(problem.padded_sizes_bytes, dtype=np.int64)
    np.add.at(delta, lives[:, 0], sizes)
    np.add.at(delta, lives[:, 1], -sizes)
    return np.cumsum(delta)


def _rectangles(
    model: cp_model.CpModel, lives: Sequence[tuple[int, int]], addresses: Sequence, sizes: Sequence[int]
) -> None:
    """Sekiyama eq. 2-6: the time x address rectangles of live buffers do not overlap."""
    time_iv = [model.new_fixed_size_interval_var(s, e - s, "") for s, e in lives]
    addr_iv = [model.new_fixed_size_interval_var(a, z, "") for a, z in zip(addresses, sizes, strict=True)]
    model.add_no_overlap_2d(time_iv, addr_iv)


def _solve_fit(
    model: cp_model.CpModel, free: list[cp_model.IntVar], seconds: float, workers: int
) -> tuple[cp_model.CpSolver, str]:
    """Feasibility under the capacity with a bottom-left search (lowest start, lowest value)."""
    model.add_decision_strategy(free, cp_model.CHOOSE_LOWEST_MIN, cp_model.SELECT_MIN_VALUE)
    params = {"search_branching": cp_model.FIXED_SEARCH}
    solver, status = solve_cp_sat(model, seconds, workers=workers, parameters=params)
    return solver, status.status


def solve_window(
    problem: PlacementProblem, t_lo: int, t_hi: int, seconds: float, workers: int = 2
) -> tuple[dict[int, int] | None, str]:
    """Fit the buffers live in ``[t_lo, t_hi)``, lifetimes clipped to it, under the lower bound.

    Returns (buffer -> offset in units, CP-SAT status). "infeasible" proves that the whole
    problem cannot reach its lower bound: the clipped window has fewer conflicts than the
    problem, and its arena cannot exceed the problem's.
    """
    assert problem.lifetimes is not None
    unit = unit_bytes(problem)
    cap = problem.lower_bound_bytes // unit
    sizes = [s // unit for s in problem.padded_sizes_bytes]
    rows = [
        (b, max(s, t_lo), min(e, t_hi))
        for b, (s, e) in enumerate(problem.lifetimes)
        if s < t_hi and e > t_lo and sizes[b] > 0
    ]
    model = cp_model.CpModel()
    starts = [model.new_int_var(0, cap - sizes[b], f"A{b}") for b, _, _ in rows]
    _rectangles(model, [(s, e) for _, s, e in rows], starts, [sizes[b] for b, _, _ in rows])
    solver, status = _solve_fit(model, starts, seconds, workers)
    if status not in ("optimal", "feasible"):
        return None, status
    return {b: int(solver.value(x)) for (b, _, _), x in zip(rows, starts, strict=True)}, status


def _greedy_orders(blocks: Blocks) -> list[tuple[str, list[int], bool]]:
    """Cheap orders for the buffers outside the window: by size, size then start, area, lifetime."""
    n = len(blocks.members)
    index, size, length = np.arange(n), blocks.sizes_units, _lengths(blocks)
    starts = blocks.starts if blocks.starts is not None else np.zeros(n, dtype=np.int64)
    orders = {
        "size": np.lexsort((index, -length, -size)),
        "size-then-start": np.lexsort((index, starts, -size)),
        "area": np.lexsort((index, -size, -size * np.maximum(length, 1))),
        "lifetime": np.lexsort((index, -size, -length)),
    }
    return [(name, order.tolist(), best_fit) for name, order in orders.items() for best_fit in (True, False)]


def peak_anchored(
    problem: PlacementProblem,
    half_width: int,
    seconds: float = STEP_SECONDS,
    workers: int = 2,
    deadline: float | None = None,
) -> Anchoring:
    """Fix the window of ``half_width`` steps around the first maximum-load time exactly
    (:func:`solve_window`), then place every other buffer around it greedily, in several orders
    (as many as ``deadline``, a ``time.perf_counter()`` value, leaves time for; at least one)."""
    peak_time = int(np.argmax(load_profile(problem)))
    preset, status = solve_window(problem, peak_time - half_width, peak_time + half_width + 1, seconds, workers)
    if preset is None:
        return Anchoring((), status == "infeasible")
    blocks = make_blocks(problem)
    placements = []
    for name, order, best_fit in _greedy_orders(blocks):
        if placements and deadline is not None and time.perf_counter() >= deadline:
            break
        method = f"peak-anchored-{name}"
        placements.append(
            place_in_order(problem, order, best_fit=best_fit, method=method, preset_units=preset, blocks=blocks)
        )
    return Anchoring(tuple(placements), False)


def repair_top_band(
    problem: PlacementProblem, start: Placement, band_bytes: int, seconds: float = STEP_SECONDS, workers: int = 2
) -> Placement | None:
    """One LNS step: unfix the buffers reaching above ``L - band_bytes``, keep the rest at
    their offsets in ``start``, and fit the unfixed ones under ``L``; ``None`` if CP-SAT does not."""
    assert problem.lifetimes is not None
    t0 = time.perf_counter()
    unit, bound = unit_bytes(problem), problem.lower_bound_bytes
    sizes = np.array(problem.padded_sizes_bytes, dtype=np.int64)
    offsets = np.array(start.offsets_bytes, dtype=np.int64)
    lives = np.array(problem.lifetimes, dtype=np.int64).reshape(-1, 2)
    free = np.flatnonzero((offsets + sizes > bound - band_bytes) & (sizes > 0))
    if len(free) == 0:
        return None
    t_lo, t_hi = lives[free, 0].min(), lives[free, 1].max()
    unfree = np.ones(len(sizes), dtype=bool)
    unfree[free] = False
    fixed = np.flatnonzero(unfree & (sizes > 0) & (lives[:, 0] < t_hi) & (lives[:, 1] > t_lo))
    model = cp_model.CpModel()
    cap = bound // unit
    starts = [model.new_int_var(0, cap - int(sizes[b] // unit), f"A{b}") for b in free]
    rows = np.concatenate([free, fixed])
    addresses = starts + [int(offsets[b] // unit) for b in fixed]
    _rectangles(model, [tuple(map(int, lives[b])) for b in rows], addresses, [int(sizes[b] // unit) for b in rows])
    solver, status = _solve_fit(model, starts, seconds, workers)
    if status not in ("optimal", "feasible"):
        return None
    for b, x in zip(free, starts, strict=True):
        offsets[b] = int(solver.value(x)) * unit
    result = tuple(int(o) for o in offsets)
    arena = arena_bytes(problem, result)
    return Placement(result, arena, f"{start.method}+band-repair", "optimal", time.perf_counter() - t0, 0.0, bound)


def reach_bound(
    problem: PlacementProblem, start: Placement, seconds: float, workers: int = 2
) -> tuple[Placement, bool]:
    """Try to bring ``start`` down to the lower bound within ``seconds``.

    Candidates: ``start``, then the :data:`PER_WINDOW` best peak-anchored placements for each
    of :data:`WINDOWS`. Each band of :data:`BANDS` (narrow first, since narrow bands answer
    fast) is tried on every candidate by :func:`repair_top_band`. Returns the best placement
    found (never larger than ``start``) and whether some window proved the lower bound
    unreachable (then nothing is searched: no placement can reach it).
    """
    deadline = time.perf_counter() + seconds
    candidates, unreachable = _candidates(problem, start, deadline, workers)
    best = min(candidates, key=lambda p: p.arena_bytes)
    if unreachable or best.arena_bytes <= problem.lower_bound_bytes:
        return best, unreachable
    for fraction in BANDS:
        band = int(fraction * problem.lower_bound_bytes)
        for candidate in candidates:
            left = deadline - time.perf_counter()
            if left < MIN_STEP_SECONDS:
                return best, False
            repaired = repair_top_band(problem, candidate, band, min(STEP_SECONDS, left), workers)
            if repaired is not None:
                return repaired, False
    return best, False


def _candidates(
    problem: PlacementProblem, start: Placement, deadline: float, workers: int
) -> tuple[list[Placement], bool]:
    """``start`` and the best distinct peak-anchored placements of each window; True if a
    window proved the lower bound unreachable."""
    candidates, seen = [start], {start.offsets_bytes}
    for half_width in WINDOWS:
        left = deadline - time.perf_counter()
        if left < MIN_STEP_SECONDS:
            break
        anchoring = peak_anchored(problem, half_width, min(STEP_SECONDS, left), workers, deadline)
        if anchoring.bound_unreachable:
            return candidates, True
        fresh = [p for p in sorted(anchoring.placements, key=lambda p: p.arena_bytes) if p.offsets_bytes not in seen]
        for placement in fresh[:PER_WINDOW]:
            seen.add(placement.offsets_bytes)
            candidates.append(placement)
        if any(p.arena_bytes <= problem.lower_bound_bytes for p in candidates):
            break
    return candidates, False
