"""The planned CUDA allocator's policies (issue 34), tested without a GPU.

The library (csrc/cuda_planned_allocator.cpp over replay_core.h) runs as on a GPU, with host
memory standing in for the device (:class:`HostDevice`: host functions as cudaMalloc/cudaFree,
512-aligned blocks, the most bytes ever held, every free of a pointer it does not hold). Each
policy stated in the library's header is checked against that device, not against the
allocator's own counters:

- near size: a cached block of ``s`` bytes serves a request rounded to ``r`` only when
  ``r <= s <= r + r / 8``, on the same stream; a larger block is never handed to a small request;
- cache bound: what the device holds never exceeds the most bytes handed out so far plus the
  bound (``max_memory_reserved <= max_memory_allocated + bound``), and it never holds the arena
  and the verification's rerun at once;
- the verification's blocks go back to the device, and steady replayed steps never call it;
- under a budget, the bound is the budget's headroom above the placed step, so the device holds
  at most the budget;
- a step that departs from its plan (a size never recorded, another stream, a block kept past its
  planned free) finishes on the cache, still bounded, every block given back once.
"""

from __future__ import annotations

import ctypes
import random
from collections.abc import Iterator
from typing import Any

import pytest

import torch
from memplan.errors import MemplanError
from memplan.torch.run import cuda_allocator
from memplan.torch.run.allocator import CUDA_ALIGNMENT_BYTES, aligned
from memplan.torch.run.budget import BudgetedReplay, BudgetPlan
from memplan.torch.run.replay import ReplayedStep
from tests.torch.test_cuda_allocator import (
    OTHER_STREAM,
    STREAM,
    HostDevice,
    a_step,
    free,
    host_device,
    load_library,
    malloc,
    planned,
)

BOUND = 16 * 1024


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    return load_library()


@pytest.fixture
def host(lib: ctypes.CDLL) -> Iterator[HostDevice]:
    with host_device(lib) as device:
        yield device


def rounded(n: int) -> int:
    return aligned(max(n, 1), CUDA_ALIGNMENT_BYTES)


def native_with(lib, bound: int = BOUND, slack: tuple[int, int] = (1, 8)) -> cuda_allocator.CudaReplay:
    native = cuda_allocator.CudaReplay(lib, cache_bound_bytes=bound, slack=slack)
    native.reset_peaks()
    return native


def test_a_cached_block_serves_a_request_within_its_slack_only(lib, host):
    native = native_with(lib, bound=-1)
    big = malloc(lib, 9 * 512)  # 4608 bytes
    free(lib, big, 9 * 512)
    near = malloc(lib, 4000)  # rounded to 4096: a 4608-byte block is within 1/8 of it
    assert near == big and host.mallocs == 1
    stats = native.memory_stats()
    assert stats.near_hits == 1 and stats.in_use == 4608  # the whole block is in use
    free(lib, near, 4000)
    small = malloc(lib, 2048)  # 4608 > 2048 + 256: the large block is not wasted on it
    assert small != big and host.mallocs == 2
    other = malloc(lib, 4096, OTHER_STREAM)  # never across streams
    assert other != big and host.mallocs == 3
    exact = malloc(lib, 8 * 512)
    free(lib, exact, 8 * 512)
    assert malloc(lib, 4096 - 100) == exact  # the smallest block that serves it: the exact one
    for pointer, size, stream in ((small, 2048, STREAM), (other, 4096, OTHER_STREAM), (exact, 4096, STREAM)):
        free(lib, pointer, size, stream)


def test_with_no_slack_only_the_same_size_is_reused(lib, host):
    native_with(lib, bound=-1, slack=(0, 1))
    big = malloc(lib, 9 * 512)
    free(lib, big, 9 * 512)
    p = malloc(lib, 4096)
    assert p != big and host.mallocs == 2
    free(lib, p, 4096)


def _churn(lib, seed: int = 0, rounds: int = 300) -> None:
    """Requests of ever new sizes (none within another's slack), most freed soon: a cache that
    keeps every freed block grows without end."""
    rng = random.Random(seed)
    live: list[tuple[int, int]] = []
    for k in range(rounds):
        size = 512 * (k % 97 + 1) * 3
        live.append((malloc(lib, size), size))
        if len(live) > 4 or rng.random() < 0.3:
            pointer, n = live.pop(rng.randrange(len(live)))
            free(lib, pointer, n)
    for pointer, n in live:
        free(lib, pointer, n)


def test_the_device_never_holds_more_than_the_most_in_use_plus_the_bound(lib, host):
    native = native_with(lib, bound=-1)
    _churn(lib)
    unbounded = native.memory_stats()
    assert host.peak > unbounded.peak_in_use + BOUND  # the bound below has something to hold
    native.release_free_memory()
    host.peak = 0
    native = native_with(lib, bound=BOUND)
    _churn(lib)
    stats = native.memory_stats()
    assert host.peak == stats.peak_held  # the counters tell the device's truth
    assert host.peak <= stats.peak_in_use + BOUND
    assert stats.evicted > 0 and stats.cache_bound == BOUND


def test_a_second_free_never_reaches_the_device(lib, host):
    native = native_with(lib)
    p = malloc(lib, 1000)
    free(lib, p, 1000)
    free(lib, p, 1000)  # a second free: counted, never passed to cudaFree
    assert native.memory_stats().unknown_frees >= 1
    native.release_free_memory()
    assert host.bad_frees == [] and host.frees == 1
    host.expected_unknown_frees = 1  # the fixture's teardown checks that no other free was unknown


def _record_until_steady(native, lib) -> Any:
    """Two recordings of :func:`a_step` (as ReplayedStep records until two agree), the result
    (d, 40000 bytes) dropped by the caller after each step; their blocks go back after each."""
    trace = None
    for _ in range(2):
        native.begin_record()
        pointers = a_step(lib)
        trace = native.end_record()
        free(lib, pointers[3], 40_000)
        native.release_free_memory()
    return trace


def test_reserved_stays_within_arena_and_bound_through_record_verify_and_replay(lib, host):
    native = native_with(lib)
    params = malloc(lib, 100_000)  # persistent: parameters, optimizer state
    trace = _record_until_steady(native, lib)
    plan = planned(trace)
    block = native.arena_block_bytes(plan.arena_bytes)
    arena = malloc(lib, block)  # the arena is a block of the cache, as SharedArena's tensor is
    # the verification: the replayed step, then the same step on the cache with the arena released
    native.begin_replay(plan, arena, block)
    d = a_step(lib)[3]
    assert native.end_replay().served == 3
    free(lib, d, 40_000)
    free(lib, arena, block)
    native.release_free_memory()
    free(lib, a_step(lib)[3], 40_000)
    native.release_free_memory()  # the verification's blocks go back
    assert host.held() == rounded(100_000)
    arena = malloc(lib, block)
    persistent, outside = rounded(100_000), rounded(40_000)
    ordinary_peak = persistent + max(rounded(1000) + rounded(3000), rounded(3000) + rounded(513) + outside)
    # every step so far: what the device held is within the most handed out plus the bound
    stats = native.memory_stats()
    assert host.peak == stats.peak_held <= stats.peak_in_use + BOUND
    assert host.peak <= max(persistent + block + outside, ordinary_peak) + BOUND
    host.peak, mallocs = host.held(), host.mallocs
    for _ in range(3):
        native.begin_replay(plan, arena, block)
        d = a_step(lib)[3]
        stats = native.end_replay()
        assert (stats.served, stats.fallback, stats.diverged_at) == (3, 1, None)
        free(lib, d, 40_000)
    assert host.mallocs == mallocs + 1  # the result's block, once; then reused from the cache
    assert host.peak <= persistent + block + outside
    free(lib, arena, block)
    free(lib, params, 100_000)


@pytest.mark.parametrize("departure", ["size never recorded", "another stream", "kept past its free"])
def test_a_step_that_departs_from_its_plan_stays_bounded(lib, host, departure):
    native = native_with(lib)
    trace = _record_until_steady(native, lib)
    plan = planned(trace)
    block = native.arena_block_bytes(plan.arena_bytes)
    arena = malloc(lib, block)
    native.reset_peaks()
    host.peak = host.held()
    native.begin_replay(plan, arena, block)
    if departure == "kept past its free":
        sizes = (1000, 3000, 513, 40_000)
        ptrs = [malloc(lib, n) for n in sizes]  # a is not freed before c: c must not take a's bytes
        for p, n in zip(ptrs[:3], sizes[:3], strict=True):
            free(lib, p, n)
        d, stream = ptrs[3], STREAM
    elif departure == "another stream":
        d, stream = a_step(lib, stream=OTHER_STREAM)[3], OTHER_STREAM
    else:
        d, stream = a_step(lib, sizes=(1000, 3000, 2048, 40_000))[3], STREAM
    stats = native.end_replay()
    assert stats.fallback >= 2 and stats.arena_alive_after == 0
    assert (stats.blocked == 1) if departure == "kept past its free" else (stats.diverged_at is not None)
    free(lib, d, 40_000, stream)
    memory = native.memory_stats()
    assert host.peak == memory.peak_held <= memory.peak_in_use + BOUND
    # the departed allocations all fit below the most in use: the plan's arena plus at most the step itself
    assert memory.peak_in_use <= block + sum(rounded(n) for n in trace.sizes) + rounded(2048)
    free(lib, arena, block)
    native.release_free_memory()
    assert host.bad_frees == []


# ----------------------------------------------------------------------------- through ReplayedStep


class HostArena:
    """SharedArena's interface over the stand-in device: the arena is a block of the cache."""

    def __init__(self, lib) -> None:
        self.lib, self.address, self.nbytes, self.allocations = lib, 0, 0, 0

    def reserve(self, nbytes: int) -> HostArena:
        if nbytes > self.nbytes:
            self.release()
            self.address, self.nbytes = malloc(self.lib, nbytes), nbytes
            self.allocations += 1
        return self

    def release(self) -> None:
        if self.nbytes:
            free(self.lib, self.address, self.nbytes)
            self.address = self.nbytes = 0
            self.lib.mp_cuda_empty_cache()  # as SharedArena.release does on CUDA

    def data_ptr(self) -> int:
        return self.address

    def numel(self) -> int:
        return self.nbytes

    @property
    def tensor(self) -> HostArena:
        return self


FLOATS = 256


class HostStep:
    """A training step whose temporaries live on the stand-in device: it computes through them
    (a wrong placement, two live blocks sharing bytes, changes its numbers) and updates a real
    parameter; its result block (d) is kept, as a loss is, until the next step replaces it."""

    def __init__(self, lib) -> None:
        torch.manual_seed(0)
        self.lib = lib
        self.model = torch.nn.Linear(FLOATS, 1, bias=False)
        self.kept: int | None = None
        self.keep_one_past_the_step = False
        self.left: list[int] = []  # blocks kept past the step (freed by the test)

    def _floats(self, pointer: int, n: int) -> torch.Tensor:
        return torch.frombuffer((ctypes.c_float * n).from_address(pointer), dtype=torch.float32)

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        lib, w = self.lib, self.model.weight
        a = malloc(lib, 4 * FLOATS)
        self._floats(a, FLOATS).copy_(w.detach()[0] * batch)
        b = malloc(lib, 8 * FLOATS)
        self._floats(b, 2 * FLOATS).copy_(torch.cat([self._floats(a, FLOATS) * 2, self._floats(a, FLOATS) + 1]))
        free(lib, a, 4 * FLOATS)
        c = malloc(lib, 4 * FLOATS + 100)
        self._floats(c, FLOATS).copy_(self._floats(b, 2 * FLOATS)[:FLOATS] - 0.5)
        d = malloc(lib, 4 * FLOATS)
        self._floats(d, FLOATS).copy_(self._floats(c, FLOATS) * self._floats(b, 2 * FLOATS)[FLOATS:])
        free(lib, b, 8 * FLOATS)
        if self.keep_one_past_the_step:
            self.left.append(c)
        else:
            free(lib, c, 4 * FLOATS + 100)
        with torch.no_grad():
            w[0] -= 0.01 * self._floats(d, FLOATS)
        if self.kept is not None:
            free(lib, self.kept, 4 * FLOATS)
        self.kept = d
        return self._floats(d, FLOATS).sum().detach().clone()

    def drop(self) -> None:
        if self.kept is not None:
            free(self.lib, self.kept, 4 * FLOATS)
            self.kept = None


def _eager_weights(steps: int) -> torch.Tensor:
    """The same steps on plain host tensors: the oracle for the parameter."""
    torch.manual_seed(0)
    w = torch.nn.Linear(FLOATS, 1, bias=False).weight.detach().clone()
    for k in range(steps):
        x = w[0] * _batch(k)
        b = torch.cat([x * 2, x + 1])
        w[0] -= 0.01 * ((b[:FLOATS] - 0.5) * b[FLOATS:])
    return w


def _batch(k: int) -> torch.Tensor:
    return torch.linspace(-1, 1, FLOATS) * (k + 1)


def test_through_replayed_step_the_verifications_blocks_go_back_and_replays_never_call_the_device(lib, host):
    native = native_with(lib)
    assert native.verify_first_replay
    run = HostStep(lib)
    arena = HostArena(lib)
    step = ReplayedStep(run, time_limit_seconds=2, arena=arena, native=native)
    for k in range(2):  # two recordings (the second is placed)
        step(_batch(k))
    recording_peak, placed = host.peak, arena.nbytes + 2 * rounded(4 * FLOATS)  # the arena, two results
    host.peak = host.held()
    step(_batch(2))  # the verified first replay: replayed, then rerun on the cache
    # the arena is given back before the rerun: never the arena and the rerun's blocks at once
    assert host.peak <= max(recording_peak, placed)
    assert step.refused is None and step.replays == 1 and step.last_stats.served == 3
    assert native.memory_stats().cached == 0  # the verification's blocks went back to the device
    assert host.held() == rounded(4 * FLOATS)  # the kept result only (the next replay reserves the arena)
    mallocs = host.mallocs
    host.peak = host.held()
    for k in range(3, 7):
        step(_batch(k))
        assert step.last_stats.diverged_at is None and step.last_stats.served == 3
    # the arena once, one block for the results (alternating with the kept one); nothing else
    assert host.mallocs == mallocs + 2
    assert host.peak <= placed
    assert torch.equal(run.model.weight.detach(), _eager_weights(7))
    run.drop()
    arena.release()


def test_through_replayed_step_a_block_kept_past_the_step_is_refused_in_one_line(lib, host):
    run = HostStep(lib)
    arena = HostArena(lib)
    step = ReplayedStep(run, time_limit_seconds=2, arena=arena, native=native_with(lib))
    for k in range(3):
        step(_batch(k))
    run.keep_one_past_the_step = True
    with pytest.raises(MemplanError, match="outlived the step") as refused:
        step(_batch(3))
    assert "\n" not in str(refused.value) and "allocator='views'" in str(refused.value)
    for c in run.left:
        free(lib, c, 4 * FLOATS + 100)
    run.drop()
    arena.release()


def test_a_budgeted_step_holds_the_device_to_its_budget(lib, host):
    """BudgetedReplay with the planned CUDA allocator: the placed step (persistent bytes, the
    arena, the results kept outside it) is checked against the budget, and the cache's bound
    is what the budget leaves above it, or above what is in use if more (here the persistent
    bytes the graph counts are 3000 short of the device's, as 512-byte rounding makes them): the
    device then holds at most the budget, every step from the verified replay on (the
    recordings before the plan are bounded as any step is)."""
    native = native_with(lib, bound=cuda_allocator.CACHE_BOUND_BYTES)
    persistent = rounded(64_000)
    params = malloc(lib, 64_000)
    run = HostStep(lib)
    arena = HostArena(lib)
    budget = persistent + 4096 + 2 * rounded(4 * FLOATS) + 1536
    decided = BudgetPlan(None, {"budget_bytes": budget, "planned_peak_bytes": 0}, budget)
    step = BudgetedReplay(decided, lambda schedule: run, persistent - 3000, decided.report, arena=arena, native=native)
    for k in range(2):  # the recordings; the second is placed
        step(_batch(k))
    placed = decided.report["placed_peak_bytes"]
    assert placed <= budget
    bound = decided.report["cache_bound_bytes"]
    assert bound == budget - placed - 3000 == native.memory_stats().cache_bound
    host.peak = host.held()
    for k in range(2, 8):  # the verified replay (the arena released for its rerun), then replays
        step(_batch(k))
    assert step.replays == 6 and step.refused is None
    assert host.peak <= budget
    assert torch.equal(run.model.weight.detach(), _eager_weights(8))
    run.drop()
    arena.release()
    free(lib, params, 64_000)
