"""The planned CPU allocator: record, place, replay; unsafe requests fall back, never overlap."""

from __future__ import annotations

import pytest

import torch
from memplan.placement import validate_placement
from memplan.torch.run import allocator
from memplan.torch.run.replay import ReplayedStep, placement_problem

pytestmark = pytest.mark.skipif(
    not allocator.available(), reason="no C++ compiler here: the planned allocator cannot be built"
)


def chain(x: torch.Tensor, keep: list | None = None) -> torch.Tensor:
    y = x * 2
    z = torch.relu(y) + 1
    if keep is not None:
        keep.append(y)  # lives longer than it did when recorded
    del y
    w = z @ z.T
    return w.sum()


def record(fn, *args):
    allocator.begin_record()
    try:
        result = fn(*args)
    finally:
        trace = allocator.end_record()
    return result, trace


def stacked_plan(trace: allocator.AllocationTrace) -> allocator.ReplayPlan:
    """Every freed allocation at an address of its own: valid whatever the lifetimes."""
    offsets, top = {}, 0
    for k, end in enumerate(trace.free_at):
        if end is not None:
            offsets[k], top = top, top + allocator.aligned(trace.sizes[k])
    return allocator.replay_plan(trace, offsets, top)


def test_trace_records_every_allocation_and_what_escaped():
    x = torch.randn(64, 64)
    _, trace = record(chain, x)
    assert trace.num_allocations >= 4
    assert 64 * 64 * 4 in trace.sizes
    freed = [k for k, end in enumerate(trace.free_at) if end is not None]
    assert all(trace.alloc_at[k] < trace.free_at[k] for k in freed)
    assert len(freed) < trace.num_allocations  # the result outlives the call


def test_replay_serves_the_arena_and_gives_the_same_numbers():
    x = torch.randn(128, 128)
    expected, trace = record(chain, x)
    problem, indices = placement_problem(trace)
    from memplan.placement import place

    solved = place(problem, time_limit_seconds=2)
    validate_placement(problem, solved)
    offsets = {k: solved.offsets_bytes[i] for i, k in enumerate(indices)}
    plan = allocator.replay_plan(trace, offsets, solved.arena_bytes)
    arena = torch.empty(plan.arena_bytes, dtype=torch.uint8)
    allocator.begin_replay(plan, arena)
    try:
        got = chain(x)
    finally:
        stats = allocator.end_replay()
    assert torch.equal(got, expected)
    assert stats.served == len(indices) and stats.diverged_at is None and stats.arena_alive_after == 0
    assert solved.arena_bytes == trace.peak_live_bytes()


def test_a_tensor_kept_longer_than_recorded_is_never_overwritten():
    x = torch.randn(128, 128)
    expected, trace = record(chain, x)
    problem, indices = placement_problem(trace)
    from memplan.placement import place

    solved = place(problem, time_limit_seconds=2)
    plan = allocator.replay_plan(trace, {k: solved.offsets_bytes[i] for i, k in enumerate(indices)}, solved.arena_bytes)
    arena = torch.empty(plan.arena_bytes, dtype=torch.uint8)
    keep: list[torch.Tensor] = []
    allocator.begin_replay(plan, arena)
    try:
        got = chain(x, keep)
        snapshot = keep[0].clone()  # whatever came later must not have written over it
    finally:
        stats = allocator.end_replay()
    assert torch.equal(got, expected)
    assert torch.equal(keep[0], x * 2) and torch.equal(snapshot, x * 2)
    assert stats.blocked >= 1 or stats.fallback >= 1
    assert stats.arena_alive_after == 1
    keep.clear()


def test_another_allocation_sequence_diverges_to_the_base_allocator():
    x = torch.randn(64, 64)
    _, trace = record(chain, x)
    plan = stacked_plan(trace)
    arena = torch.empty(plan.arena_bytes, dtype=torch.uint8)
    other = torch.randn(32, 32)
    allocator.begin_replay(plan, arena)
    try:
        got = chain(other)
    finally:
        stats = allocator.end_replay()
    assert torch.equal(got, chain(other))
    assert stats.diverged_at is not None and stats.fallback >= 1


def test_replayed_step_records_until_steady_then_replays():
    x = torch.randn(96, 96)
    step = ReplayedStep(lambda batch: chain(batch).clone())
    results = [step(x) for _ in range(4)]
    assert step.replaying and step.last_stats is not None
    assert step.last_stats.served > 0 and step.last_stats.diverged_at is None
    assert all(torch.equal(r, results[0]) for r in results)
    assert step.placement is not None and step.placement.arena_bytes == step.placement.lower_bound_bytes


def test_a_step_that_diverges_becomes_a_branch_and_replays_from_the_plan():
    """A step that allocates otherwise (a GradScaler step that makes the update after a plan
    recorded on skipped ones) finishes on the base allocator; once two such steps allocate
    alike, it becomes a branch of the plan: the next step of either kind replays from the one
    arena, with the same numbers."""
    x, other = torch.randn(96, 96), torch.randn(40, 40)
    step = ReplayedStep(lambda batch: chain(batch).clone())
    for _ in range(4):
        step(x)
    assert step.plan is not None and len(step.plan.branches) == 1
    for seen in (1, 2):
        unusual = step(other)
        assert step.last_stats.diverged_at is not None
        assert torch.equal(unusual, chain(other).clone())
        assert len(step.plan.branches) == seen and step.placement.branches == seen
    for batch, branch in [(other, 1), (x, 0), (other, 1)]:
        got = step(batch)
        stats = step.last_stats
        assert (stats.diverged_at, stats.branch, stats.blocked, stats.arena_alive_after) == (None, branch, 0, 0)
        assert stats.served == sum(o >= 0 for o in step.plan.branches[branch].offsets)
        assert torch.equal(got, chain(batch).clone())
    assert step.placement.arena_bytes >= step.placement.lower_bound_bytes


def test_an_unseen_kind_past_the_branches_falls_back_and_keeps_the_plan():
    """With the plan's branches all taken, a third kind finishes on the base allocator with the
    same numbers and the plan is kept; two such steps in a row record again."""
    x, other, third = torch.randn(96, 96), torch.randn(40, 40), torch.randn(24, 24)
    step = ReplayedStep(lambda batch: chain(batch).clone())
    step.max_branches = 2
    for batch in [x, x, x, other, other]:
        step(batch)
    plan = step.plan
    assert plan is not None and len(plan.branches) == 2
    got = step(third)
    assert step.last_stats.diverged_at is not None and step.last_stats.fallback >= 1 and step.plan is plan
    assert torch.equal(got, chain(third).clone())
    step(other)
    assert step.last_stats.diverged_at is None and step.plan is plan
    step(third)
    step(third)
    assert not step.replaying  # two in a row: recorded again


def test_or_tools_loads_after_the_allocator_in_this_process_and_in_a_forked_child():
    """The allocator library was loaded RTLD_GLOBAL: its weak C++ template instantiations took
    the place of later libraries' and OR-Tools' native module died loading (SIGSEGV), which
    killed every solve in a forked child once OR-Tools was no longer imported before it."""
    import subprocess
    import sys

    script = (
        "import os, torch\n"
        "from memplan.torch.run import allocator\n"
        "assert allocator.available()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    from ortools.sat.python import cp_model\n"
        "    cp_model.CpSolver().Solve(cp_model.CpModel())\n"
        "    os._exit(0)\n"
        "assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, 'the forked child died'\n"
        "from ortools.sat.python import cp_model\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
