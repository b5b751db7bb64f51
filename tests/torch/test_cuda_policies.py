"""The planned CUDA allocator's policies (issue 34), tested without a GPU.

The library (csrc/cuda_planned_allocator.cpp over replay_core.h) runs as on a GPU, with host
memory standing in for the device (:class:`HostDevice`: host functions as cudaMalloc/cudaFree,
512-aligned blocks, the most bytes ever held, every free of a pointer it does not hold). Each
policy stated in the library's header is checked against that device, not against the
allocator's own counters:

- near size: a cached block of ``s`` bytes serves a request rounded to ``r`` only when
  ``r <= s <= r + r / 8``, on the same stream; a larger block is never handed to a small request;
- cache bound: what the device holds never exceeds the most bytes handed out so far plus the
  bound plus its growth (``max_memory_reserved <= max_memory_allocated + bound + growth``), the
  growth never above its ceiling, and it never holds the arena and the verification's rerun at once;
- growth: a step on arena views whose requests repeat (replay given up, issue 34) stops calling
  the device after a few steps, where the bound alone gives back and takes again most of its
  blocks every step (the thrash an H100 showed on vit-base);
- the verification's blocks go back to the device, and steady replayed steps never call it;
- under a budget, the device holds at most the budget from the first step (cached blocks given
  back at once), and the placed step counts what the device holds in use besides it;
- a step that departs from its plan (a size never recorded, another stream, a block kept past its
  planned free) finishes on the cache, still bounded, every block given back once.
"""

from __future__ import annotations

import ctypes
import random
from collections import deque
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


def native_with(
    lib, bound: int = BOUND, slack: tuple[int, int] = (1, 8), growth_ceiling: int = cuda_allocator.GROWTH_CEILING
) -> cuda_allocator.CudaReplay:
    native = cuda_allocator.CudaReplay(lib, cache_bound_bytes=bound, slack=slack, growth_ceiling=growth_ceiling)
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


@pytest.mark.parametrize("ceiling", [0, 64 * 1024, cuda_allocator.GROWTH_CEILING])
def test_the_device_never_holds_more_than_the_most_in_use_plus_the_bound_and_its_growth(lib, host, ceiling):
    native = native_with(lib, bound=-1)
    _churn(lib)
    unbounded = native.memory_stats()
    assert host.peak > unbounded.peak_in_use + BOUND  # the bound below has something to hold
    native.release_free_memory()
    host.peak = 0
    native = native_with(lib, bound=BOUND, growth_ceiling=ceiling)
    _churn(lib)
    stats = native.memory_stats()
    assert host.peak == stats.peak_held  # the counters tell the device's truth
    assert host.peak <= stats.peak_in_use + BOUND + stats.growth
    assert stats.evicted > 0 and stats.cache_bound == BOUND
    if ceiling == 0:  # no growth: the bound alone
        assert stats.growth == 0 and host.peak <= stats.peak_in_use + BOUND
    else:  # the churn's sizes come back: blocks the bound gave back are asked for again
        assert stats.regrets > 0 and 0 < stats.growth <= (ceiling if ceiling > 0 else stats.high_in_use)


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


def _budgeted(lib, native, budget: int, persistent_counted: int) -> tuple[BudgetedReplay, HostStep, HostArena]:
    run, arena = HostStep(lib), HostArena(lib)
    decided = BudgetPlan(None, {"budget_bytes": budget, "planned_peak_bytes": 0}, budget)
    step = BudgetedReplay(decided, lambda schedule: run, persistent_counted, decided.report, arena=arena, native=native)
    return step, run, arena


def _cache_an_eager_step(lib, sizes=(8192, 8192, 16384)) -> None:
    """Blocks freed into the cache before the budgeted step, as an eager forward leaves them."""
    pointers = [malloc(lib, n) for n in sizes]
    for p, n in zip(pointers, sizes, strict=True):
        free(lib, p, n)


@pytest.mark.parametrize("workspace", [0, 4096])
def test_a_budgeted_step_holds_the_device_to_its_budget_from_the_first_step(lib, host, workspace):
    """BudgetedReplay with the planned CUDA allocator: the device holds at most the budget from
    the first call on (blocks an earlier eager step left in the cache go back when the step is
    made, the recordings and the verified replay are held too), and the placed step (persistent
    bytes, the arena, the results kept outside it) counts what the device holds in use besides
    the step: here 3000 bytes of 512-byte rounding the graph's count misses and, with
    ``workspace``, a block a library keeps (cuBLAS' workspace: 32 MiB on an H100, the excess an
    H100 measured on mobilenet-v2 b32 at memory_budget=0.5). The cache's bound is what the budget
    leaves above the placed step; steady steps make no device call."""
    native = native_with(lib, bound=cuda_allocator.CACHE_BOUND_BYTES)
    persistent = rounded(64_000)
    params = malloc(lib, 64_000)
    library_block = malloc(lib, workspace) if workspace else None
    _cache_an_eager_step(lib)
    budget = persistent + workspace + 4096 + 2 * rounded(4 * FLOATS) + 1536
    assert host.held() > budget  # the cached blocks alone would take the device over it
    step, run, arena = _budgeted(lib, native, budget, persistent - 3000)
    assert host.held() <= budget and native.memory_stats().held_cap == budget
    host.peak = host.held()
    for k in range(2):  # the recordings; the second is placed
        step(_batch(k))
    placed = step.report["placed_peak_bytes"]
    outside = rounded(4 * FLOATS)  # the result kept past the step
    assert placed == persistent + workspace + arena.nbytes + outside <= budget
    bound = step.report["cache_bound_bytes"]
    assert bound == budget - placed == native.memory_stats().cache_bound
    for k in range(2, 4):  # the verified replay (the arena released for its rerun), then a replay
        step(_batch(k))
    mallocs = host.mallocs
    for k in range(4, 8):
        step(_batch(k))
    assert host.mallocs == mallocs  # steady steps: no device call
    assert step.replays == 6 and step.refused is None
    assert host.peak <= budget
    assert torch.equal(run.model.weight.detach(), _eager_weights(8))
    run.drop()
    arena.release()
    free(lib, params, 64_000)
    if library_block is not None:
        free(lib, library_block, workspace)


def test_a_budget_below_what_the_device_holds_is_never_replayed_over(lib, host):
    """A block the graph does not count (a library's workspace) takes the placed step over the
    budget: the step is re-planned with the excess (here no solver stands behind the plan, so the
    re-plan is refused), never replayed over it."""
    native = native_with(lib, bound=cuda_allocator.CACHE_BOUND_BYTES)
    params, workspace = malloc(lib, 64_000), malloc(lib, 8192)
    budget = 64_000 + 4096 + 2 * rounded(4 * FLOATS) + 1536  # enough for the step as the graph counts it
    step, run, arena = _budgeted(lib, native, budget, 64_000)
    step(_batch(0))
    with pytest.raises(MemplanError, match="tightened"):
        step(_batch(1))
    placed = step.report["placement_rounds"][-1]["placed_peak_bytes"]
    assert placed > budget and placed - 8192 <= budget and step.replays == 0
    run.drop()
    arena.release()
    free(lib, params, 64_000)
    free(lib, workspace, 8192)


def test_holding_a_budget_gives_cached_blocks_back_at_once(lib, host):
    """hold_cache_within, as BudgetedReplay calls it once the step is placed: afterwards the
    device holds at most the budget (the cached blocks of earlier steps went back), without
    waiting for a request that a steady step never makes."""
    native = native_with(lib, bound=cuda_allocator.CACHE_BOUND_BYTES)
    kept = malloc(lib, 20_000)
    _cache_an_eager_step(lib)
    budget = rounded(20_000) + 10_000
    assert host.held() > budget
    frees = host.frees
    bound = native.hold_cache_within(budget, rounded(20_000))
    assert bound == budget - rounded(20_000) and host.held() <= budget and host.frees > frees
    free(lib, kept, 20_000)


# ----------------------------------------------------------------------------- arena views

VIEW_SIZES = tuple(512 * (3 + 5 * i) for i in range(24))  # 1.5 KiB to 59 KiB: most within no other's slack
ARENA_BYTES = 2 * 2**20


class HostViewsStep:
    """A step with arena views on the planned allocator (replay given up, issue 34: the allocator
    stays installed): its planned tensors are views of one arena block kept across steps; the
    rest (kernel outputs and scratch the plan does not place) are requests to the cache, of the
    sizes :data:`VIEW_SIZES`, up to four live at once; its result is kept until the next step.
    Each block is filled with its own byte and checked before its free: a block handed out twice
    while live, or given back while in use, changes them."""

    def __init__(self, lib) -> None:
        self.lib = lib
        self.arena = malloc(lib, ARENA_BYTES)
        self.kept: int | None = None

    def __call__(self) -> None:
        live: deque[tuple[int, int, int]] = deque()
        for k, n in enumerate(VIEW_SIZES):
            pointer = malloc(self.lib, n)
            ctypes.memset(pointer, k + 1, n)
            live.append((pointer, n, k + 1))
            if len(live) > 3:
                self._free(*live.popleft())
        result = malloc(self.lib, 1024)
        while live:
            self._free(*live.popleft())
        if self.kept is not None:
            free(self.lib, self.kept, 1024)
        self.kept = result

    def _free(self, pointer: int, n: int, fill: int) -> None:
        assert ctypes.string_at(pointer, n) == bytes([fill]) * n, "a live block was overwritten"
        free(self.lib, pointer, n)

    def close(self) -> None:
        free(self.lib, self.kept, 1024)
        free(self.lib, self.arena, ARENA_BYTES)


def _device_calls_per_step(lib, host: HostDevice, steps: int = 6) -> list[int]:
    step, calls = HostViewsStep(lib), []
    for _ in range(steps):
        before = host.mallocs + host.frees
        step()
        calls.append(host.mallocs + host.frees - before)
    step.close()
    return calls


def test_views_steps_that_repeat_their_requests_stop_calling_the_device(lib, host):
    """Issue 34's thrash (vit-base b32 on an H100, arena views on the planned allocator: 335
    cudaMalloc and 335 cudaFree per step, 3.3x eager's time), reproduced with a bound smaller than
    what one step frees and asks for again: with the bound alone (no growth) every step gives back
    and takes again most of its blocks; with the growth, each block the bound gave back and a
    later step asked for again grows it, and from the fourth step no device call is made. What the
    device holds stays within the arena, the kept result and the step's blocks, plus the bound."""
    native = native_with(lib, growth_ceiling=0)
    thrashing = _device_calls_per_step(lib, host)
    assert min(thrashing) >= len(VIEW_SIZES) and native.memory_stats().growth == 0
    native.release_free_memory()
    host.peak = 0
    native = native_with(lib)
    settled = _device_calls_per_step(lib, host)
    assert settled[3:] == [0, 0, 0]
    stats = native.memory_stats()
    assert 0 < stats.growth <= stats.high_in_use and host.peak <= stats.peak_in_use + BOUND + stats.growth
    assert host.peak <= ARENA_BYTES + 2 * 1024 + sum(rounded(n) for n in VIEW_SIZES) + BOUND


@pytest.mark.parametrize("headroom", [1 << 20, 320 * 1024])
def test_views_steps_under_a_budget_hold_the_device_to_it(lib, host, headroom):
    """Arena views under a budget (BudgetedReplay gave up replay): the cap holds the device to the
    budget whatever the bound's growth; with room for the step's blocks the steps settle at no
    device call, with less (but more than the step has in use at once) they call it but never hold
    more."""
    native = native_with(lib, bound=cuda_allocator.CACHE_BOUND_BYTES)
    budget = ARENA_BYTES + headroom
    native.hold_cache_within(budget, ARENA_BYTES)
    calls = _device_calls_per_step(lib, host)
    assert host.peak <= budget
    if headroom > sum(rounded(n) for n in VIEW_SIZES):
        assert calls[2:] == [0, 0, 0, 0]
    else:
        assert min(calls) > 0
