"""Exact windows rolled outward from the peak, at capacity = lower bound ``L``.

:func:`memplan.placement.repair.peak_anchored` packs a short window around the time of
maximum load exactly and then places every other buffer greedily; on spiky profiles (an
unrolled RNN's backward pass, whose every step lifts the load close to ``L`` again) the
greedy part misses ``L`` at a later spike. :func:`roll_from_peak` keeps going instead:

1. Pack the buffers live in ``[p - w, p + w]`` around the peak ``p`` exactly (as
   :func:`memplan.placement.repair.solve_window` does). By Helly's property of intervals, two
   buffers that both meet the window and are ever live together are live together inside
   it, so this packing is exact for those buffers, not a relaxation.
2. The buffers left are wholly after the window or wholly before it; the two sides never
   conflict and are rolled out separately. On one side, place the rest greedily around the
   packed part and accept every buffer that starts (ends, going back in time) before the
   first buffer the greedy had to put above ``L``: they are all under ``L``.
3. At that failure time ``f`` solve the next step exactly: the unplaced buffers starting
   before ``f + d`` are fitted under ``L`` by CP-SAT, the placed buffers they may meet kept
   where they are. If that fails, backtrack: also unfix the placed buffers that start in
   ``[f - k, f + d)`` for growing ``k`` (long-lived buffers placed earlier stay: unfixing
   them makes the step as hard as the whole problem). Then go back to 2; every round moves
   the front by at least ``d`` steps.

Every packing kept is under ``L``, so a complete roll is a placement of arena ``L``
(validated by the caller). The search is incomplete: it gives up a side when no backtrack
depth fits, or at the deadline.

Each exact step is one single-worker CP-SAT solve (the bottom-left fixed search, which is what
finds these packings) cut off by a deterministic limit, :data:`STEP_DETERMINISTIC`, not by the
wall clock: a step's verdict, and so the roll's path, do not depend on the machine's load; only
the roll's deadline does.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
from ortools.sat import sat_parameters_pb2
from ortools.sat.python import cp_model

from memplan.placement.heuristics import make_blocks, place_in_order
from memplan.placement.problem import Placement, PlacementProblem, arena_bytes, unit_bytes
from memplan.placement.repair import load_profile
from memplan.solvers import solve_cp_sat

# Half-widths of the first window (time steps), tried in turn, and the steps one exact
# extension adds. The rolls are incomplete and differ in where they get stuck.
HALF_WIDTHS = (4, 8, 2, 16)
STEP = 8
# Backtrack depths (time steps before the failure whose placed buffers are unfixed), in turn.
BACKTRACK = (0, 8, 32, 128, 512)
# CP-SAT's deterministic time for one step (OR-Tools 9.15 counts about 0.04 for 0.7 s of one
# core on these no-overlap models): the steps of the rolls that complete on the generated tight
# packings need at most 0.012; a step past the limit counts as failed (the roll backtracks).
STEP_DETERMINISTIC = 0.03
MIN_STEP_SECONDS = 0.05
# Presolve merges the per-time no-overlap cliques for seconds on thousands of rectangles;
# windows are small and fixed-search, so skip that merge.
# (Older OR-Tools lack that parameter; then the merge runs.)
_PARAMETERS: dict[str, object] = {
    "search_branching": cp_model.FIXED_SEARCH,
    "max_deterministic_time": STEP_DETERMINISTIC,
}
if "merge_no_overlap_work_limit" in sat_parameters_pb2.SatParameters.DESCRIPTOR.fields_by_name:
    _PARAMETERS["merge_no_overlap_work_limit"] = 0.0


class _Roll:
    """A partial placement under ``L`` (in units) rolled outward in time."""

    def __init__(self, problem: PlacementProblem, deadline: float) -> None:
        assert problem.lifetimes is not None
        self.problem = problem
        self.deadline = deadline
        self.unit = unit_bytes(problem)
        self.cap = problem.lower_bound_bytes // self.unit
        self.sizes = np.array(problem.padded_sizes_bytes, dtype=np.int64) // self.unit
        lives = np.array(problem.lifetimes, dtype=np.int64).reshape(-1, 2)
        self.starts, self.ends = lives[:, 0], lives[:, 1]
        self.offsets = np.zeros(problem.num_buffers, dtype=np.int64)
        self.placed = self.sizes == 0  # empty buffers sit at 0 and never conflict
        self.blocks = make_blocks(problem)
        self.cp_calls = 0
        self.last_status = "unknown"

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def set(self, values: dict[int, int]) -> None:
        for b, x in values.items():
            self.offsets[b] = x
            self.placed[b] = True

    def greedy(self, todo: np.ndarray) -> np.ndarray:
        """Offsets (units) of a greedy completion of ``todo`` around the placed buffers: largest
        first, equal sizes by start, each at its lowest legal offset (other buffers stay at 0)."""
        preset = {int(b): int(self.offsets[b]) for b in np.flatnonzero(self.placed)}
        rest = np.flatnonzero(todo)
        order = rest[np.lexsort((rest, self.starts[rest], -self.sizes[rest]))]
        placement = place_in_order(
            self.problem, order.tolist(), best_fit=False, method="roll", preset_units=preset, blocks=self.blocks
        )
        return np.array(placement.offsets_bytes, dtype=np.int64) // self.unit

    def fit(self, free: np.ndarray, clip: tuple[int, int] | None = None) -> bool:
        """Fit the ``free`` buffers under ``L`` around the other placed buffers; True if done.
        With ``clip`` = (lo, hi), lifetimes are cut to ``[lo, hi)`` (exact when every buffer
        involved meets that window: Helly)."""
        seconds = self.left()
        if seconds < MIN_STEP_SECONDS:
            return False
        free = free & (self.sizes > 0)
        fr = np.flatnonzero(free)
        if len(fr) == 0:
            return True
        # The placed buffers live at some time a free one is live: sweep the free lifetimes.
        origin = int(self.starts.min())
        cover = np.zeros(int(self.ends.max()) - origin + 2, dtype=np.int64)
        np.add.at(cover, self.starts[fr] - origin, 1)
        np.add.at(cover, self.ends[fr] - origin, -1)
        seen = np.concatenate(([0], np.cumsum(np.cumsum(cover) > 0)))
        touches = seen[self.ends - origin] - seen[self.starts - origin] > 0
        fixed = np.flatnonzero(self.placed & ~free & (self.sizes > 0) & touches)
        model = cp_model.CpModel()
        xs = [model.new_int_var(0, self.cap - int(self.sizes[b]), f"A{b}") for b in fr]
        rows = np.concatenate([fr, fixed])
        lo, hi = clip if clip is not None else (int(self.starts.min()), int(self.ends.max()))
        t0s, t1s = np.maximum(self.starts[rows], lo), np.minimum(self.ends[rows], hi)
        time_iv = [model.new_fixed_size_interval_var(int(a), int(z - a), "") for a, z in zip(t0s, t1s, strict=True)]
        addr_iv = [model.new_fixed_size_interval_var(x, int(self.sizes[b]), "") for x, b in zip(xs, fr, strict=True)]
        addr_iv += [model.new_fixed_size_interval_var(int(self.offsets[b]), int(self.sizes[b]), "") for b in fixed]
        model.add_no_overlap_2d(time_iv, addr_iv)
        model.add_decision_strategy(xs, cp_model.CHOOSE_LOWEST_MIN, cp_model.SELECT_MIN_VALUE)
        solver, status = solve_cp_sat(model, seconds, workers=1, parameters=dict(_PARAMETERS))
        self.cp_calls += 1
        self.last_status = status.status
        if status.status not in ("optimal", "feasible"):
            return False
        self.set({int(b): int(solver.value(x)) for b, x in zip(fr, xs, strict=True)})
        return True

    def roll(self, side: np.ndarray, movable: np.ndarray, forward: bool) -> bool:
        """Place every buffer of ``side`` under ``L``, backtracking over placed ``movable``
        buffers; False if the search gives up."""
        # Going back in time is going forward on the negated time axis.
        first = self.starts if forward else -self.ends
        while True:
            todo = side & ~self.placed
            if not todo.any():
                return True
            if self.left() < MIN_STEP_SECONDS:
                return False
            greedy = self.greedy(todo)
            over = todo & (greedy + self.sizes > self.cap)
            if not over.any():
                self.set({int(b): int(greedy[b]) for b in np.flatnonzero(todo)})
                return True
            front = int(first[over].min())
            self.set({int(b): int(greedy[b]) for b in np.flatnonzero(todo & (first < front))})
            step = side & ~self.placed & (first < front + STEP)
            tried: set[int] = set()
            for depth in BACKTRACK:
                free = step | (self.placed & movable & (first >= front - depth) & (first < front + STEP))
                count = int(free.sum())
                if count in tried:
                    continue  # the same buffers as a shallower depth
                tried.add(count)
                if self.fit(free):
                    break
            else:
                return False


def roll_from_peak(
    problem: PlacementProblem, seconds: float, half_widths: tuple[int, ...] = HALF_WIDTHS
) -> tuple[Placement | None, bool]:
    """Roll exact windows outward from the peak at capacity = lower bound within ``seconds``,
    from a first window of each of ``half_widths`` in turn until one roll completes. A roll
    ends when it completes or gives up (no backtrack depth fits), after a bounded number of
    deterministic steps, and each width may use all the time left: under load the first width
    (every roll that completes in bench/results/placement_hard.md starts with it) is not cut
    off for the others. On large perfect packings a failing roll can use the whole budget.

    Returns (a placement of arena ``L`` or ``None``, whether a first window proved ``L``
    unreachable). Needs interval conflicts without fixed offsets or contiguous groups
    (:func:`memplan.placement.repair.applies`).
    """
    t0 = time.perf_counter()
    deadline = t0 + seconds
    for half_width in half_widths:
        if deadline - time.perf_counter() < MIN_STEP_SECONDS:
            break
        placement, unreachable = _roll_once(problem, half_width, deadline)
        if placement is not None or unreachable:
            if placement is not None:
                placement = replace(placement, seconds=time.perf_counter() - t0)
            return placement, unreachable
    return None, False


def _roll_once(problem: PlacementProblem, half_width: int, deadline: float) -> tuple[Placement | None, bool]:
    t0 = time.perf_counter()
    peak = int(np.argmax(load_profile(problem)))
    lo, hi = peak - half_width, peak + half_width + 1
    roll = _Roll(problem, deadline)
    window = (roll.starts < hi) & (roll.ends > lo)
    if not roll.fit(window, clip=(lo, hi)):
        return None, roll.last_status == "infeasible"
    after = ~roll.placed & (roll.starts >= hi)
    before = ~roll.placed & (roll.ends <= lo)
    if not (roll.roll(after, after | window, forward=True) and roll.roll(before, before | window, forward=False)):
        return None, False
    offsets = tuple(int(o) * roll.unit for o in roll.offsets)
    arena = arena_bytes(problem, offsets)
    if arena > problem.lower_bound_bytes:
        return None, False
    method = f"rolled-windows(w={half_width},{roll.cp_calls} cp-sat)"
    return Placement(offsets, arena, method, "optimal", time.perf_counter() - t0, 0.0, problem.lower_bound_bytes), False
