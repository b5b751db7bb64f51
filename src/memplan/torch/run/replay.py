"""Run a step with every allocation at a planned offset: profile-guided allocation
(Sekiyama et al. 3-4) on top of the planned order (OLLA).

The step (a :class:`memplan.torch.runtime.StepRunner` running the optimised order) is recorded
until two consecutive recordings request the same allocations (the first steps create the
optimizer's state lazily), the offsets of every allocation the step frees are solved as one
placement problem (lifetimes in event time, ``memplan.placement``), validated, and later steps
are replayed with each allocation served at its offset by the planned CPU allocator
(``memplan.torch.run.allocator``). Kernels write their outputs where they would anyway, so no
output is copied and oneDNN's scratch lands in the arena too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from memplan.errors import MemplanError
from memplan.placement import PlacementProblem, place, validate_placement
from memplan.torch.rss import release_free_memory
from memplan.torch.run import allocator
from memplan.torch.run.allocator import AllocationTrace, ReplayPlan, ReplayStats
from memplan.torch.run.arena import SharedArena

MAX_RECORDINGS = 4
# A step that allocates otherwise than the plan (a GradScaler step that skips the update, an
# occasional other branch) finishes on the base allocator; the plan is kept for the steps after
# it, and recorded again only when this many steps in a row diverge.
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


def placement_problem(trace: AllocationTrace) -> tuple[PlacementProblem, list[int]]:
    """The trace's freed allocations as a placement problem (OLLA eq. 6 on event time), with
    the allocation index of each buffer."""
    indices = [k for k in range(trace.num_allocations) if trace.free_at[k] is not None]
    problem = PlacementProblem.from_intervals(
        [trace.sizes[k] for k in indices],
        [(trace.alloc_at[k], trace.free_at[k]) for k in indices],
        alignment_bytes=allocator.ALIGNMENT_BYTES,
    )
    return problem, indices


class ReplayedStep:
    """Wraps ``run(batch)``: records, plans, then replays every allocation at its offset.

    ``shared`` is the arena, possibly shared with the plans of a step's other shapes
    (:class:`memplan.torch.run.arena.SharedArena`; Sekiyama 4.3): it is released while this
    step records (the recording runs on the ordinary allocator, and the process should not hold
    both) and reserved at the plan's size when it replays. ``last_stats`` says what the latest
    replayed step did; a step whose allocations differ from the recording is still correct (the
    rest goes to the allocator); after ``REPLAN_AFTER_DIVERGED`` such steps in a row the step is
    recorded again.
    """

    def __init__(
        self, run: Callable[[Any], Any], *, time_limit_seconds: float = 5.0, arena: SharedArena | None = None
    ) -> None:
        allocator.load()
        self.run = run
        self.time_limit_seconds = time_limit_seconds
        self.shared = arena if arena is not None else SharedArena()
        self.planning_seconds = 0.0  # spent placing recorded steps (capture and graph plan not included)
        self.plan: ReplayPlan | None = None
        self.placement: ArenaPlacement | None = None
        self.last_stats: ReplayStats | None = None
        self.recordings = 0
        self._previous: AllocationTrace | None = None
        self.diverged_in_a_row = 0

    def __call__(self, batch: Any) -> Any:
        if self.plan is None:
            return self._record(batch)
        if self.last_stats is None and hasattr(self.run, "request_self_check"):
            self.run.request_self_check()  # the first replayed step is checked too
        allocator.begin_replay(self.plan, self.shared.reserve(self.plan.arena_bytes))
        try:
            result = self.run(batch)
        finally:
            stats = allocator.end_replay()
        self.last_stats = stats
        if stats.arena_alive_after:
            raise MemplanError(
                f"{stats.arena_alive_after} arena allocation(s) outlived the step, which the recording did not show; "
                "keep no tensor of the step alive across steps, or run with allocator='views'"
            )
        self.diverged_in_a_row = self.diverged_in_a_row + 1 if stats.diverged_at is not None else 0
        if self.diverged_in_a_row >= REPLAN_AFTER_DIVERGED:
            self.plan, self._previous, self.recordings, self.diverged_in_a_row = None, None, 0, 0  # record again
        return result

    @property
    def replaying(self) -> bool:
        return self.plan is not None

    @property
    def arena(self) -> torch.Tensor:
        """The arena block this step replays into (empty until planned, or while released)."""
        return self.shared.tensor

    def _record(self, batch: Any) -> Any:
        self.shared.release()
        allocator.begin_record()
        try:
            result = self.run(batch)
        finally:
            trace = allocator.end_record()
        # the step ran on the ordinary allocator: the C library keeps its freed blocks in a heap
        # that the plans' objects fragment, and the process would grow with every new shape
        release_free_memory()
        self.recordings += 1
        if getattr(self.run, "last_step_observed", False):
            return result  # the self-check's dispatch mode changed this step's allocations: record again
        steady = self._previous is not None and self._previous.sizes == trace.sizes
        if steady or self.recordings >= MAX_RECORDINGS:
            self._plan(trace)
        self._previous = trace
        return result

    def _plan(self, trace: AllocationTrace) -> None:
        start = time.perf_counter()
        problem, indices = placement_problem(trace)
        solved = place(problem, time_limit_seconds=self.time_limit_seconds)
        validate_placement(problem, solved)
        offsets = {k: solved.offsets_bytes[i] for i, k in enumerate(indices)}
        # the recording steps' freed blocks go back to the OS before the arena is mapped (in
        # this untimed step, not on first touch in the first replayed step)
        self._previous = None
        release_free_memory()
        self.shared.reserve(solved.arena_bytes)
        self.planning_seconds += time.perf_counter() - start
        self.plan = allocator.replay_plan(trace, offsets, solved.arena_bytes)
        self.placement = ArenaPlacement(
            solved.arena_bytes,
            problem.lower_bound_bytes,
            solved.method,
            solved.status,
            solved.seconds,
            trace.num_allocations,
            len(indices),
        )
