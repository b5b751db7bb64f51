"""Run a step with every allocation at a planned offset: profile-guided allocation
(Sekiyama et al. 3-4) on top of the planned order (OLLA).

The step (a :class:`memplan.torch.runtime.StepRunner` running the optimised order) is recorded
(the optimizer state a first step creates left out of its recording,
:mod:`memplan.torch.run.first_state`; with ``place_after=2``, until two consecutive recordings
request the same allocations), the offsets of every allocation the step frees are solved as one
placement problem (lifetimes in event time, ``memplan.placement``), validated, and later steps
are replayed with each allocation served at its offset by the planned CPU allocator
(``memplan.torch.run.allocator``). Kernels write their outputs where they would anyway, so no
output is copied and oneDNN's scratch lands in the arena too.

A replayed step that allocates otherwise than every branch of its plan (a GradScaler step that
makes the update after the plan was recorded on skipped ones) finishes on the ordinary
allocator; the allocator logged it as a recording would, so once two such steps allocate alike
it becomes a new branch and the branches are placed again in one arena
(:mod:`memplan.torch.run.branches`): the next step of that kind replays from the plan too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from memplan.errors import MemplanError
from memplan.isolate import in_child
from memplan.placement import Placement, PlacementProblem, place_from_heuristic, solve_exact, validate_placement
from memplan.torch.run import allocator
from memplan.torch.run.allocator import AllocationTrace, BranchedPlan, NativeReplay, ReplayStats
from memplan.torch.run.arena import SharedArena
from memplan.torch.run.branches import branched_plan, build_trie, trie_problem, validate_branches
from memplan.torch.run.first_state import noting_state_calls, steady_trace
from memplan.torch.run.verify import StepObjects, verify_by_rerun

MAX_RECORDINGS = 4
# A step that allocates otherwise than the plan (a GradScaler step that skips the update, an
# occasional other branch) finishes on the base allocator and, once two such steps allocate
# alike, becomes a branch of the plan, up to this many branches; beyond them the plan is kept
# for the steps after it, and recorded again only when REPLAN_AFTER_DIVERGED steps in a row
# diverge.
MAX_BRANCHES = 4
REPLAN_AFTER_DIVERGED = 2


@dataclass(frozen=True)
class ArenaPlacement:
    """The solved arena of a recorded step."""

    arena_bytes: int
    lower_bound_bytes: int
    method: str
    status: str
    seconds: float
    allocations: int
    planned_allocations: int  # freed within the step, so placed in the arena
    branches: int = 1  # recorded steps placed together (run/branches.py)


def placement_problem(trace: AllocationTrace) -> tuple[PlacementProblem, list[int]]:
    """The trace's freed allocations as a placement problem (OLLA eq. 6 on event time), with
    the allocation index of each buffer."""
    indices = [k for k in range(trace.num_allocations) if trace.free_at[k] is not None]
    problem = PlacementProblem.from_intervals(
        [trace.sizes[k] for k in indices],
        [(trace.alloc_at[k], trace.free_at[k]) for k in indices],
        alignment_bytes=trace.alignment_bytes,
    )
    return problem, indices


class ReplayedStep:
    """Wraps ``run(batch)``: records, plans, then replays every allocation at its offset.

    ``shared`` is the arena, possibly shared with the plans of a step's other shapes
    (:class:`memplan.torch.run.arena.SharedArena`; Sekiyama 4.3): it is released while this
    step records (the recording runs on the ordinary allocator, and the process should not hold
    both) and reserved at the plan's size when it replays. ``last_stats`` says what the latest
    replayed step did; a step whose allocations differ from every branch of the plan is still
    correct (the rest goes to the allocator), and becomes a branch, up to ``max_branches``,
    once two such steps allocate alike; past them, after ``REPLAN_AFTER_DIVERGED`` such steps
    in a row the step is recorded again.
    ``native`` is the planned
    allocator that records and replays: the CPU one by default, the CUDA one
    (:func:`memplan.torch.run.cuda_allocator.native`) for a step on a GPU. Where the native
    allocator asks for it (CUDA: ``verify_first_replay``), the first replayed step of every plan
    is run again on the ordinary allocator and must give the same bits
    (:mod:`memplan.torch.run.verify`); otherwise ``refused`` says why and every later step runs
    on the ordinary allocator (the caller then plans with arena views).
    """

    max_branches = MAX_BRANCHES

    def __init__(
        self,
        run: Callable[[Any], Any],
        *,
        time_limit_seconds: float = 5.0,
        arena: SharedArena | None = None,
        native: NativeReplay | None = None,
        schedulers: Sequence[Any] = (),
        place_after: int = 2,
        keep_observed: bool = False,
    ) -> None:
        self.native = native if native is not None else allocator.cpu()
        # recordings alike before one is placed: 2 waits for a repeat; 1 places the first step
        # recorded without the self-check's dispatch mode (exact either way: a replayed step is
        # checked allocation by allocation, and one that differs finishes on the allocator)
        self.place_after = place_after
        # keep the first (observed) step's trace as a branch of the plan, for a plan cache: a
        # restarted process's first step, observed alike, then replays from it
        self.keep_observed = keep_observed
        self._observed: AllocationTrace | None = None
        # called after each solved placement with the step and its offsets (a plan cache stores them)
        self.on_placed: Callable[[ReplayedStep, dict[int, int]], None] | None = None
        self.first_steps: dict[str, Any] = {}  # the report's account of the first steps (filled in place)
        self.calls = 0
        self._replayed_now = False
        self._preloaded = False  # a plan from a cache, not yet confirmed by an unobserved step
        self._first_plan: BranchedPlan | None = None  # the plan's branches with the observed one first
        self.schedulers = list(schedulers)  # state the verification of a first replay puts back
        self.run = run
        self.time_limit_seconds = time_limit_seconds
        self.shared = arena if arena is not None else SharedArena()
        self.planning_seconds = 0.0  # spent placing recorded steps (capture and graph plan not included)
        self.plan: BranchedPlan | None = None
        self.traces: list[AllocationTrace] = []  # the plan's branches, as recorded
        self._pending: AllocationTrace | None = None  # a diverged step, a branch if the next allocates alike
        self.placement: ArenaPlacement | None = None
        self.last_stats: ReplayStats | None = None
        self.recordings = 0
        self.replays = 0  # steps served from the plan
        self.refused: str | None = None  # why replay was given up (the step then runs on the allocator)
        self._previous: AllocationTrace | None = None
        self._unverified = False  # a new plan whose first replay the native allocator wants verified
        self.diverged_in_a_row = 0
        self.recorded: tuple[Any] | None = None  # a recording step's result, once it ran, until it returns

    def __call__(self, batch: Any) -> Any:
        self.calls += 1
        result = self._step(batch)
        stats = self.last_stats
        whole = self._replayed_now and stats is not None and stats.diverged_at is None
        if whole and "replayed_at_call" not in self.first_steps:  # the first step served from the plan throughout
            self.first_steps["replayed_at_call"] = self.calls
            self.first_steps["visits_before_replay"] = self.calls - 1
        return result

    def _step(self, batch: Any) -> Any:
        self._replayed_now = False
        if self.refused is not None:
            return self.run(batch)
        before, after = getattr(self.run, "before_step", None), getattr(self.run, "after_step", None)
        # outside the recording or replay: the runner's one-off work, its check's state
        if before is not None and before():
            self._program_written()
        result = self._record_or_replay(batch)
        if after is not None:
            after()
        return result

    def _program_written(self) -> None:
        """Called when the runner wrote its program just before a step (a subclass that holds
        the step to a budget gives back the heap that writing freed)."""

    def _record_or_replay(self, batch: Any) -> Any:
        if self.plan is None:
            return self._record(batch)
        if self.last_stats is None and hasattr(self.run, "request_self_check"):
            self.run.request_self_check()  # the first replayed step is checked too
        if not self._unverified:
            return self._replay(batch)
        self._unverified = False
        result, reason = verify_by_rerun(
            StepObjects.of(self.run, self.schedulers), lambda: self._replay(batch), lambda: self._rerun(batch)
        )
        if reason is not None:
            self.refused = f"{reason}: replay given up"
            self.plan = None
            self.shared.release()
        # the rerun's blocks, freed into the allocator's cache, are never asked for again by
        # replayed steps: give them back (on an H100, ResNet-50 at batch 32 held 2.2x eager's
        # reserved bytes without this)
        self.native.release_free_memory()
        return result

    def _rerun(self, batch: Any) -> Any:
        """The verification's run on the ordinary allocator, the arena released first (the next
        replayed step reserves it again): the device never holds the arena and the rerun's
        blocks at once, so what it holds stays within the placed step plus the cache's bound."""
        self.shared.release()
        return self.run(batch)

    def _replay(self, batch: Any) -> Any:
        """One step with every planned allocation at its offset."""
        assert self.plan is not None
        arena = self.shared.reserve(self.arena_block_bytes)
        plan, self._first_plan = self._first_plan or self.plan, None  # the first step follows the observed branch
        self.native.begin_replay(plan, arena.data_ptr(), arena.numel())
        try:
            result = self.run(batch)
        finally:
            stats = self.native.end_replay()
        self.last_stats = stats
        self.replays += 1
        self._replayed_now = True
        if stats.arena_alive_after:
            raise MemplanError(
                f"{stats.arena_alive_after} arena allocation(s) outlived the step, which the recording did not show; "
                "keep no tensor of the step alive across steps, or run with allocator='views'"
            )
        if self._preloaded and not getattr(self.run, "last_step_observed", False):
            self._preloaded = False  # the first unobserved step decides: a cached plan it left is stale
            if stats.diverged_at is not None:
                self.plan, self.traces, self.recordings, self._pending, self._previous = None, [], 0, None, None
                self._observed = None  # the entry's observed branch is as stale
                self.first_steps.pop("placement", None)
                self.first_steps["cache_entry"] = f"stale (the step left it at allocation {stats.diverged_at})"
                return result
        if stats.diverged_at is None or self._branch_off():
            self.diverged_in_a_row = 0
            return result
        self.diverged_in_a_row += 1
        if self.diverged_in_a_row >= REPLAN_AFTER_DIVERGED:  # record again
            self.plan, self._previous, self.traces, self.recordings, self.diverged_in_a_row = None, None, [], 0, 0
            self._pending = None
        return result

    def _branch_off(self) -> bool:
        """The step that just diverged, as the allocator logged it: placed as a new branch of the
        plan when the previous diverged step allocated alike (a kind seen once, such as the
        first update that creates the optimizer's state, would claim memory for nothing), else
        kept to compare with the next. False when the plan has its ``max_branches`` or the step
        was observed by the self-check (its allocations are not the step's)."""
        if len(self.traces) >= self.max_branches or getattr(self.run, "last_step_observed", False):
            return False
        trace = self.native.replayed_trace()
        if self._pending is None or self._pending.sizes != trace.sizes:
            self._pending = trace
            return True
        self._pending = None
        self._place([*self.traces, trace])
        return True

    @property
    def replaying(self) -> bool:
        return self.plan is not None

    @property
    def settled(self) -> bool:
        """Replaying, the latest step served by the plan without leaving it, and no diverged
        step waiting to become a branch: the steps from here are the plan's steady state."""
        stats = self.last_stats
        return self.plan is not None and stats is not None and stats.diverged_at is None and self._pending is None

    @property
    def arena_block_bytes(self) -> int:
        """The arena block the plan needs (0 while recording): its offsets plus the allocator's lead."""
        return 0 if self.plan is None else self.native.arena_block_bytes(self.plan.arena_bytes)

    @property
    def arena(self) -> torch.Tensor:
        """The arena block this step replays into (empty until planned, or while released)."""
        return self.shared.tensor

    def _record(self, batch: Any) -> Any:
        self.shared.release()
        self.native.begin_record()
        try:
            with noting_state_calls(self.run, self.native) as state_calls:
                result = self.run(batch)
            self.recorded = (result,)  # the step ran: its update is applied whatever follows
        finally:
            first = self.native.end_record()
        # the state this step made, later ones find made; None: its first update is not a
        # steady one (SGD with momentum), so the next step is recorded too
        trace = steady_trace(first, state_calls)
        # the step ran on the ordinary allocator: the C library keeps its freed blocks in a heap
        # that the plans' objects fragment, and the process would grow with every new shape
        self.native.release_free_memory()
        self.recordings += 1
        if getattr(self.run, "last_step_observed", False):
            if self.keep_observed and self._observed is None:
                self._observed = first
            self.recorded = None
            return result  # the self-check's dispatch mode changed this step's allocations: record again
        if trace is not first and self.keep_observed and self._observed is None:
            self._observed = first  # a restarted process's first step makes the state again: a branch for it
        if trace is None:
            self.recorded = None
            return result
        steady = self._previous is not None and self._previous.sizes == trace.sizes
        if steady or self.place_after <= 1 or self.recordings >= MAX_RECORDINGS:
            self._plan(trace)  # may raise (a budget refused): ``recorded`` then still holds the result
        self._previous = trace
        self.recorded = None  # not kept past the call: it may be a large output
        return result

    def _plan(self, trace: AllocationTrace) -> None:
        # called right after _record gave the recording's freed blocks back: no second release
        self._place([trace] if self._observed is None else [trace, self._observed], released=True)

    @property
    def observed_branch(self) -> int | None:
        """Which branch of the plan is the first (observed) step's, if it is one."""
        return next((b for b, trace in enumerate(self.traces) if trace is self._observed), None)

    def preload(
        self, traces: Sequence[AllocationTrace], offsets: dict[int, int], arena_bytes: int, first: int | None = None
    ) -> None:
        """Make a placement solved before (a plan cache's) the plan, without solving: the
        offsets are validated in every branch on its own lifetimes (OLLA eq. 6, alignment, inside
        the arena: :func:`validate_branches`), which is what the allocator relies on as it
        replays a branch (moving to another only where they share every event so far); the
        trie-wide check a solver's placement also gets (its lifetimes are supersets of the
        branches') is not needed for that and is skipped (issue 37: 0.4 s of a restarted
        MobileNet-v2's first step). Raises :class:`memplan.placement.InvalidPlacement` (or
        ValueError) if they do not hold. ``first``: the branch of an observed first step, which
        the first replayed step starts on."""
        start = time.perf_counter()
        if any(t.alignment_bytes != self.native.alignment_bytes for t in traces):
            raise ValueError("traces of another alignment")
        trie = build_trie(traces)
        buffers = [i for i, placed in enumerate(trie.placed) if placed]
        if sorted(offsets) != buffers:
            raise ValueError("offsets for other buffers")
        solved = Placement(tuple(offsets[i] for i in buffers), arena_bytes, "cached", "feasible", 0.0, 0.0, 0)
        lower_bound = validate_branches(trie, offsets, solved)
        self._install(trie, offsets, solved, lower_bound, list(traces))
        self._preloaded = True
        if first is not None and 0 < first < len(traces):
            assert self.plan is not None
            self._first_plan = starting_with(self.plan, first)
            self._observed = self.traces[first]  # a branch again if this step is placed anew
        self.planning_seconds += time.perf_counter() - start
        self.first_steps.update(placement="cached", placing_seconds=round(time.perf_counter() - start, 3))

    def _install(
        self, trie: Any, offsets: dict[int, int], solved: Placement, lower_bound: int, traces: list[AllocationTrace]
    ) -> None:
        self.shared.reserve(self.native.arena_block_bytes(solved.arena_bytes))
        self.plan = branched_plan(trie, offsets, solved.arena_bytes)
        self.traces = list(traces)
        self._unverified = self.native.verify_first_replay
        self.placement = ArenaPlacement(
            solved.arena_bytes,
            lower_bound,
            solved.method,
            solved.status,
            solved.seconds,
            sum(t.num_allocations for t in traces),
            sum(trie.placed),
            len(traces),
        )

    def _place(self, traces: list[AllocationTrace], *, released: bool = False) -> None:
        """Place the branches ``traces`` in one arena (one branch: the recorded step), validate
        the offsets in every branch, and make them the plan. ``released``: the caller gave the
        freed blocks back just before (a full ``gc.collect`` and ``malloc_trim`` cost 0.1-0.7 s
        on the zoo; nothing but the placement problem was made since)."""
        start = time.perf_counter()
        trie = build_trie(traces)
        problem, buffers = trie_problem(trie)
        solved = place_recorded(problem, self.time_limit_seconds)
        validate_placement(problem, solved)
        offsets = {i: solved.offsets_bytes[j] for j, i in enumerate(buffers)}
        lower_bound = validate_branches(trie, offsets, solved)
        # the recording steps' freed blocks go back to the OS before the arena is mapped (in
        # this untimed step, not on first touch in the first replayed step)
        self._previous = None
        if not released:
            self.native.release_free_memory()
        self._install(trie, offsets, solved, lower_bound, traces)
        self.planning_seconds += time.perf_counter() - start
        self.first_steps.setdefault("placement", "solved")
        self.first_steps.setdefault("placing_seconds", round(time.perf_counter() - start, 3))
        if self.on_placed is not None:
            self.on_placed(self, offsets)


def place_recorded(problem: PlacementProblem, time_limit_seconds: float) -> Placement:
    """The recorded steps' placement: the heuristics here, where they meet the lower bound;
    else the exact solver from their placement, in a child process (its memory stays out of
    this one, :mod:`memplan.isolate`). See :func:`memplan.placement.place_from_heuristic`."""
    return place_from_heuristic(problem, lambda start: in_child(solve_exact, problem, time_limit_seconds, start=start))


def starting_with(plan: BranchedPlan, first: int) -> BranchedPlan:
    """The same plan with branch ``first`` first (the allocator starts every step on branch 0)."""
    order = [first, *(b for b in range(len(plan.branches)) if b != first)]
    shared = tuple(tuple(plan.shared[a][b] for b in order) for a in order)
    return BranchedPlan(tuple(plan.branches[b] for b in order), shared, plan.arena_bytes)
