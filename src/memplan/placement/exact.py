"""Exact placement with CP-SAT: OLLA eq. 6-8 and 15 (Sekiyama et al. eq. 1-6), warm-started.

Variables (in units of :func:`unit_bytes`): one start ``A_k`` per block (a contiguous group
is one block whose members sit at fixed distances from its start) and ``peak``. Constraints:
every buffer ends at or below ``peak`` (eq. 8); conflicting buffers do not overlap, either
through ``AddNoOverlap2D`` over time x address rectangles when conflicts are lifetime
overlaps, or through one disjunction per conflicting pair otherwise (eq. 6, 7a, 7b). The
objective is ``min peak`` (eq. 15), bounded above by the best heuristic arena (or the
capacity) and below by :func:`lower_bound_bytes`.

As in OLLA 4.5 (Function 5) a first solve fixes a pyramid of nested long-lived buffers,
which shrinks the model; a second solve without it can prove optimality or infeasibility.
Both are hinted with the best placement so far, and the result is never worse than it.

The portfolio, in order, stopping as soon as the arena meets a proven bound: the heuristics
(:func:`memplan.placement.heuristics.portfolio`); on interval problems the canonical search
(:func:`memplan.placement.search.search_placement`, MiniMalloc's exact search), which bisects
capacities from the lower bound with :data:`SEARCH_SHARE` of the time and can prove that a
capacity is infeasible; then, still on interval problems and while the lower bound is not
refuted, :func:`memplan.placement.rolling.roll_from_peak` with :data:`ROLL_SHARE` of the time
left (exact windows rolled outward from the peak at capacity = lower bound), interleaved with
the hole filling along time (:mod:`memplan.placement.holefill`, on problems whose load meets
the bound most of the time: a first slice before the windows, resumed where it stopped after
them, :data:`HOLEFILL_SHARE` of the time in all), and
:func:`memplan.placement.repair.reach_bound` up to :data:`REPAIR_SHARE` of it (peak-anchored
packing and top-band repair); last, CP-SAT. Contiguous groups and general conflict relations
(SOMAS) skip the search and the windows. Every stage is budgeted by
the wall clock from the call's start (portfolio and model building included): a stage gets
the time really left, and one with too little left is skipped, so ``time_limit_seconds`` is
honoured to within a CP-SAT model load.
"""

from __future__ import annotations

import inspect
import threading
import time
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from memplan.placement import native
from memplan.placement.heuristics import Blocks, make_blocks, portfolio, pyramid_offsets
from memplan.placement.holefill import FillingAtBound, tight_share
from memplan.placement.holefill import applies as holefill_applies
from memplan.placement.problem import Placement, PlacementProblem, arena_bytes
from memplan.placement.repair import applies as repair_applies
from memplan.placement.repair import reach_bound
from memplan.placement.rolling import roll_from_peak
from memplan.placement.search import Cancel, SearchOutcome, search_placement
from memplan.placement.search import applies as search_applies
from memplan.solvers import SolveStatus, solve_cp_sat, stopping

# Share of the time limit given first to the canonical search (memplan.placement.search); then
# of the time it left, to memplan.placement.rolling and (counted from the same point) to
# memplan.placement.repair, before the CP-SAT solves.
SEARCH_SHARE = 0.7
ROLL_SHARE = 0.4
REPAIR_SHARE = 0.7
# Hole filling along time gets this share of the time left when the stages start, on problems
# whose load equals the lower bound at least this share of the time: it is complete where there
# is no slack, and its branching grows with the slack. It runs first for at most
# HOLEFILL_FIRST_SECONDS, then pauses for the rolled windows (which settle their instances in
# seconds, or give up) and resumes where it stopped with the rest of its share.
HOLEFILL_SHARE = 0.5
HOLEFILL_MIN_TIGHT = 0.85
HOLEFILL_FIRST_SECONDS = 1.0
# A CP-SAT stage is skipped when fewer seconds than this are left: loading a model of
# thousands of rectangles alone takes a good part of a second.
MIN_STAGE_SECONDS = 0.25
# The pyramid solve runs only with this much time left.
PYRAMID_MIN_SECONDS = 1.0


@dataclass
class _Model:
    model: cp_model.CpModel
    starts: list[cp_model.IntVar]
    peak: cp_model.IntVar


def _build(
    problem: PlacementProblem, blocks: Blocks, upper_units: int, lower_units: int, preset: dict[int, int]
) -> _Model:
    model = cp_model.CpModel()
    peak = model.new_int_var(lower_units, upper_units, "peak")
    starts = []
    for k, size in enumerate(blocks.sizes_units):
        fixed = blocks.fixed_start_units.get(k, preset.get(k))
        if fixed is not None:
            x = model.new_constant(int(fixed))
        else:
            x = model.new_int_var(0, max(0, upper_units - int(size)), f"A{k}")
        model.add(x + int(size) <= peak)  # eq. 8
        starts.append(x)
    if problem.is_interval and problem.lifetimes is not None:
        _no_overlap_2d(model, problem, blocks, starts, peak)
    else:
        _pairwise(model, problem, blocks, starts)
    # Bottom-left search: lowest possible start first, at its lowest value, as constructive
    # packing heuristics (and minimalloc's canonical solutions) do.
    model.add_decision_strategy(starts, cp_model.CHOOSE_LOWEST_MIN, cp_model.SELECT_MIN_VALUE)
    model.minimize(peak)  # eq. 15
    return _Model(model, starts, peak)


def _member_rows(blocks: Blocks) -> list[tuple[int, int, int]]:
    """(buffer, block, offset in block) for every member with a non-zero size."""
    return [
        (b, k, pre)
        for k, (members, prefixes) in enumerate(zip(blocks.members, blocks.prefixes_units, strict=True))
        for b, pre in zip(members, prefixes, strict=True)
        if blocks.buffer_sizes_units[b] > 0
    ]


def _no_overlap_2d(
    model: cp_model.CpModel, problem: PlacementProblem, blocks: Blocks, starts: list, peak: cp_model.IntVar
) -> None:
    assert problem.lifetimes is not None
    time_iv, addr_iv, demands = [], [], []
    for b, k, pre in _member_rows(blocks):
        t0, t1 = problem.lifetimes[b]
        size = int(blocks.buffer_sizes_units[b])
        time_iv.append(model.new_fixed_size_interval_var(t0, t1 - t0, f"T{b}"))
        addr_iv.append(model.new_fixed_size_interval_var(starts[k] + pre, size, f"Y{b}"))
        demands.append(size)
    model.add_no_overlap_2d(time_iv, addr_iv)
    model.add_cumulative(time_iv, demands, peak)  # implied; gives the solver the sweep bound


def _pairwise(model: cp_model.CpModel, problem: PlacementProblem, blocks: Blocks, starts: list) -> None:
    rows = {b: (k, pre) for b, k, pre in _member_rows(blocks)}
    sizes = blocks.buffer_sizes_units
    for i, j in problem.conflicts.pairs():
        if i not in rows or j not in rows or rows[i][0] == rows[j][0]:
            continue  # empty buffers never overlap; members of one block are laid out disjoint
        (ki, pi), (kj, pj) = rows[i], rows[j]
        below = model.new_bool_var(f"a{i}_{j}")  # eq. 7a/7b: i below j, or j below i
        model.add(starts[ki] + pi + int(sizes[i]) <= starts[kj] + pj).only_enforce_if(below)
        model.add(starts[kj] + pj + int(sizes[j]) <= starts[ki] + pi).only_enforce_if(~below)


def _hint(m: _Model, blocks: Blocks, placement: Placement, preset: dict[int, int]) -> None:
    offsets = np.array(placement.offsets_bytes, dtype=np.int64) // blocks.unit_bytes
    for k, members in enumerate(blocks.members):
        if k in preset or k in blocks.fixed_start_units:
            continue
        m.model.add_hint(m.starts[k], int(offsets[members[0]] - blocks.prefixes_units[k][0]))
    m.model.add_hint(m.peak, -(-placement.arena_bytes // blocks.unit_bytes))


def _offsets_from(solver: cp_model.CpSolver, m: _Model, blocks: Blocks, n: int) -> tuple[int, ...]:
    offsets = [0] * n
    for k, (members, prefixes) in enumerate(zip(blocks.members, blocks.prefixes_units, strict=True)):
        start = int(solver.value(m.starts[k]))
        for b, pre in zip(members, prefixes, strict=True):
            offsets[b] = (start + pre) * blocks.unit_bytes
    return tuple(offsets)


def _solve(
    problem: PlacementProblem,
    blocks: Blocks,
    best: Placement,
    upper_units: int,
    preset: dict[int, int],
    seconds: float,
    workers: int,
) -> tuple[tuple[int, ...] | None, SolveStatus]:
    """One CP-SAT solve of eq. 6-8 and 15 with the blocks of ``preset`` fixed, hinted with ``best``."""
    lower_units = -(-problem.lower_bound_bytes // blocks.unit_bytes)
    m = _build(problem, blocks, upper_units, min(lower_units, upper_units), preset)
    hinted = best.arena_bytes <= upper_units * blocks.unit_bytes  # a hint over the capacity misleads
    if hinted:
        _hint(m, blocks, best, preset)
    # Bottom-left fixed search finds packings within a capacity; from a good hint, the
    # default portfolio (with its neighbourhood search) improves it better.
    solver, status = _solve_cp_sat(m.model, seconds, workers, fixed_search=not hinted)
    if status.status in ("optimal", "feasible"):
        return _offsets_from(solver, m, blocks, problem.num_buffers), status
    return None, status


# FIXED_SEARCH follows the bottom-left strategy exactly, which is what finds zero-fragmentation
# packings of hundreds of buffers in seconds (the automatic search does not, in minutes);
# solve_cp_sat passes solver parameters on once it accepts a ``parameters`` mapping.
_PASSES_PARAMETERS = "parameters" in inspect.signature(solve_cp_sat).parameters


def _solve_cp_sat(
    model: cp_model.CpModel, seconds: float, workers: int, fixed_search: bool
) -> tuple[cp_model.CpSolver, SolveStatus]:
    if _PASSES_PARAMETERS and fixed_search:
        extra = {"search_branching": cp_model.FIXED_SEARCH}
        return solve_cp_sat(model, seconds, workers=workers, parameters=extra)  # type: ignore[call-arg]
    return solve_cp_sat(model, seconds, workers=workers)


def solve_exact(
    problem: PlacementProblem,
    time_limit_seconds: float = 10.0,
    *,
    workers: int = 2,
    pyramid: bool = True,
    repair: bool = True,
    start: Placement | None = None,
    search: bool = True,
    hole_filling: bool = True,
) -> Placement:
    """Minimise the arena (within ``problem.capacity_bytes`` if set) in ``time_limit_seconds``.

    Starts from ``start`` or the heuristic portfolio and never returns a larger arena. On
    interval problems the canonical search (:mod:`memplan.placement.search`) runs alongside
    the other stages when there are two workers and the compiled search builds (one core
    each; whichever settles the answer first calls off the other), else first, with
    :data:`SEARCH_SHARE` of the time. The status is "optimal" when the arena meets the lower
    bound or a proven one; with a capacity the placement misses, "infeasible" when the search
    or CP-SAT proves nothing fits and "unknown" when nothing was found in time (the best
    placement found is still returned). ``repair=False`` skips the exact windows
    (:func:`memplan.placement.rolling.roll_from_peak`, :func:`memplan.placement.repair.reach_bound`),
    ``search=False`` the canonical search (CP-SAT alone), ``hole_filling=False`` the hole
    filling along time (:mod:`memplan.placement.holefill`), tried before and after the rolled
    windows on problems whose load meets the bound most of the time.
    """
    t0 = time.perf_counter()
    deadline = t0 + time_limit_seconds
    best = start or portfolio(problem)
    bound = problem.lower_bound_bytes
    cap = problem.capacity_bytes
    if cap is not None and bound > cap:
        return _restamp(best, best.method, "infeasible", t0, bound)  # more is live at once than fits
    if best.arena_bytes <= bound:
        return _restamp(best, best.method, "optimal", t0, bound)
    stages = _Stages(problem, t0, deadline, workers, pyramid, repair, hole_filling)
    if not (search and search_applies(problem)):
        return stages.run(best, bound)
    if workers >= 2 and native.available():
        return _search_alongside(problem, best, bound, stages)
    outcome = search_placement(problem, best, t0 + SEARCH_SHARE * time_limit_seconds)
    if outcome.placement is not None and outcome.placement.arena_bytes < best.arena_bytes:
        best = outcome.placement
    bound = max(bound, outcome.proven_lower_bytes)
    if (cap is not None and bound > cap) or best.arena_bytes <= bound:
        return _combine(problem, [best], bound, False, t0)  # settled: optimal, or proven not to fit
    return stages.run(best, bound)


def _search_alongside(problem: PlacementProblem, best: Placement, bound: int, stages: _Stages) -> Placement:
    """The canonical search in a second thread (the compiled kernel releases the GIL) while
    this one runs the other stages with one CP-SAT worker fewer; the first to settle the
    answer (an arena at a proven bound, or a proof that nothing fits) stops the other."""
    cancel, settled = Cancel(), threading.Event()
    box: dict[str, object] = {}
    cap = problem.capacity_bytes

    def run_search() -> None:
        try:
            outcome = search_placement(problem, best, stages.deadline, cancel=cancel)
            box["outcome"] = outcome
            found = outcome.placement
            proven = max(bound, outcome.proven_lower_bytes)
            if (found is not None and found.arena_bytes <= proven) or (cap is not None and proven > cap):
                settled.set()
        except BaseException as err:  # handed to the caller's thread below
            box["error"] = err

    worker = threading.Thread(target=run_search, name="memplan-canonical-search", daemon=True)
    worker.start()
    try:
        with stopping(settled):
            staged = stages.run(best, bound, workers=max(1, stages.workers - 1), stop=settled)
    finally:
        cancel.set()
        worker.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    outcome = box["outcome"]
    assert isinstance(outcome, SearchOutcome)
    candidates = [staged] + ([outcome.placement] if outcome.placement is not None else [])
    proven = max(staged.bound_bytes, outcome.proven_lower_bytes)
    return _combine(problem, candidates, proven, staged.status == "infeasible", stages.t0)


def _combine(
    problem: PlacementProblem, candidates: list[Placement], bound: int, proven_infeasible: bool, t0: float
) -> Placement:
    """The smallest arena among ``candidates``, with the status the proven ``bound`` gives it."""
    best = min(candidates, key=lambda p: p.arena_bytes)
    cap = problem.capacity_bytes
    if cap is None or best.arena_bytes <= cap:
        status = "optimal" if best.arena_bytes <= bound else "feasible"
    else:
        status = "infeasible" if proven_infeasible or bound > cap else "unknown"
    return _restamp(best, best.method, status, t0, bound)


@dataclass
class _Stages:
    """The exact windows and the CP-SAT solves, within the call's deadline."""

    problem: PlacementProblem
    t0: float
    deadline: float
    workers: int
    pyramid: bool
    repair: bool
    hole_filling: bool

    def _hole_filling(self, bound: int, stop: threading.Event | None) -> FillingAtBound | None:
        """Hole filling along time (:mod:`memplan.placement.holefill`) at the lower bound, when
        the load meets the bound at least :data:`HOLEFILL_MIN_TIGHT` of the time."""
        problem = self.problem
        if not (self.hole_filling and holefill_applies(problem) and bound <= problem.lower_bound_bytes):
            return None
        if tight_share(problem) < HOLEFILL_MIN_TIGHT:
            return None
        return FillingAtBound(problem, stop=lambda: _is_set(stop))

    def _fill_and_roll(
        self, bound: int, repaired: bool, stop: threading.Event | None
    ) -> tuple[Placement | None, bool, float]:
        """Hole filling for at most :data:`HOLEFILL_FIRST_SECONDS`, the rolled windows (with
        ``repaired``), then the hole filling resumed for the rest of its share: a placement at
        the lower bound or ``None``, whether a peak window proved the bound unreachable, and
        the seconds left for the repair."""
        deadline = self.deadline
        filling = self._hole_filling(bound, stop)
        share = HOLEFILL_SHARE * _left(deadline) if filling is not None else 0.0
        filled = _fill_on(filling, min(share, HOLEFILL_FIRST_SECONDS))
        if filled is not None:
            return filled, False, 0.0
        # The repair's share counts the time after the whole share of the hole filling.
        rest = max(0.0, _left(deadline) - _share_left(filling, share))
        rolled_for, unreachable = 0.0, False
        if repaired:
            # The windows return once they place or give up: they get their share of all the
            # time left, as without hole filling (under load they need it).
            rolling = time.perf_counter()
            rolled, unreachable = roll_from_peak(self.problem, ROLL_SHARE * _left(deadline))
            if rolled is not None:
                return rolled, False, 0.0
            rolled_for = time.perf_counter() - rolling
        if not unreachable and not _is_set(stop):  # else the lower bound is refuted, or settled
            filled = _fill_on(filling, min(_share_left(filling, share), _left(deadline)))
        # The repair gets at least what it would after windows cut off at their share of ``rest``.
        return filled, unreachable, REPAIR_SHARE * rest - min(rolled_for, ROLL_SHARE * rest)

    def run(
        self, best: Placement, bound: int, *, workers: int | None = None, stop: threading.Event | None = None
    ) -> Placement:
        """From ``best`` and a proven ``bound``: hole filling interleaved with the rolled windows
        and repair (while the lower bound is not refuted), then CP-SAT (pyramid first).
        ``stop``, once set, skips what is left."""
        problem, t0, deadline = self.problem, self.t0, self.deadline
        workers = workers or self.workers
        # The windows aim at the lower bound only: pointless once it is refuted.
        repaired = self.repair and repair_applies(problem) and bound <= problem.lower_bound_bytes
        found, unreachable, budget = self._fill_and_roll(bound, repaired, stop)
        if found is not None:
            return _restamp(found, found.method, "optimal", t0, bound)
        blocks = make_blocks(problem)
        unit = blocks.unit_bytes
        if repaired:
            if not unreachable and not _is_set(stop):
                best, unreachable = reach_bound(problem, best, max(0.0, min(budget, _left(deadline))), workers)
            if best.arena_bytes <= bound:
                return _restamp(best, best.method, "optimal", t0, bound)
            bound += unit if unreachable else 0  # a peak window proved that the bound cannot be met
        cap_units = None if problem.capacity_bytes is None else problem.capacity_bytes // unit
        upper_units = -(-best.arena_bytes // unit)
        upper_units = upper_units if cap_units is None else min(upper_units, cap_units)
        method = best.method
        # The pyramid helps minimise (OLLA 4.5) but can exclude every placement within a tight
        # capacity, so it is only tried when the heuristic already fits. After the repair, whose
        # peak windows fix a part first more tightly, it is skipped: on thousands of buffers its
        # constant rectangles make CP-SAT load the model for seconds past the time limit.
        over_capacity = cap_units is not None and best.arena_bytes > cap_units * unit
        preset = pyramid_offsets(problem, blocks) if self.pyramid and not over_capacity and not repaired else {}
        if preset and _left(deadline) >= PYRAMID_MIN_SECONDS and not _is_set(stop):
            offsets, _ = _solve(problem, blocks, best, upper_units, preset, 0.3 * _left(deadline), workers)
            best, method = _better(problem, best, offsets, method, "cp-sat+pyramid")
            if best.arena_bytes <= bound:
                return _restamp(best, method, "optimal", t0, bound)
        if _left(deadline) < MIN_STAGE_SECONDS or _is_set(stop):
            return _restamp(best, method, _status(problem, best, _NOT_RUN, bound), t0, bound)
        upper_units = min(upper_units, -(-best.arena_bytes // unit))
        offsets, status = _solve(problem, blocks, best, upper_units, {}, _left(deadline), workers)
        best, method = _better(problem, best, offsets, method, "cp-sat")
        if status.bound is not None:
            bound = max(bound, round(status.bound) * unit)
        return _restamp(best, method, _status(problem, best, status, bound), t0, bound)


def _fill_on(filling: FillingAtBound | None, seconds: float) -> Placement | None:
    """Resume ``filling`` (if any) for ``seconds``: its placement at the lower bound, or ``None``."""
    if filling is None or filling.ended or seconds <= 0:
        return None
    return filling.run(time.perf_counter() + seconds)


def _share_left(filling: FillingAtBound | None, share: float) -> float:
    """Seconds of its ``share`` the hole filling has not used yet (none once it has ended)."""
    return 0.0 if filling is None or filling.ended else max(0.0, share - filling.seconds)


def _is_set(stop: threading.Event | None) -> bool:
    return stop is not None and stop.is_set()


_NOT_RUN = SolveStatus("unknown", None, None, None, 0.0)


def _left(deadline: float) -> float:
    """Seconds left until ``deadline`` (never negative)."""
    return max(0.0, deadline - time.perf_counter())


def _better(
    problem: PlacementProblem, best: Placement, offsets: tuple[int, ...] | None, method: str, new_method: str
) -> tuple[Placement, str]:
    if offsets is None:
        return best, method
    arena = arena_bytes(problem, offsets)
    if arena >= best.arena_bytes:
        return best, method
    return Placement(offsets, arena, new_method, "feasible", 0.0, 0.0, best.bound_bytes), new_method


def _status(problem: PlacementProblem, best: Placement, status: SolveStatus, bound: int) -> str:
    fits = problem.capacity_bytes is None or best.arena_bytes <= problem.capacity_bytes
    if fits:
        return "optimal" if best.arena_bytes <= bound or status.status == "optimal" else "feasible"
    return "infeasible" if status.status == "infeasible" else "unknown"


def _restamp(best: Placement, method: str, status: str, t0: float, bound: int) -> Placement:
    arena = best.arena_bytes
    gap = 0.0 if status == "optimal" or arena <= 0 else max(0.0, (arena - bound) / arena)
    return Placement(best.offsets_bytes, arena, method, status, time.perf_counter() - t0, gap, bound)
