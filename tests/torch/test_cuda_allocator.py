"""The planned CUDA allocator (memplan.torch.run.cuda_allocator).

Without a GPU: the library builds with the system compiler and needs no CUDA symbol; its
record/replay state machine (replay_core.h, shared with the CPU allocator) is driven through
its CUDAPluggableAllocator entry points with host memory standing in for the device (a host
buffer as the arena, host functions as cudaMalloc/cudaFree); nothing of it is loaded when CUDA
is absent. With a GPU (``-m gpu``): bit for bit against eager, and memory below eager's.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import torch
from memplan.api import CompiledStep
from memplan.placement import place, validate_placement
from memplan.torch.run import allocator, cuda_allocator
from memplan.torch.run.allocator import (
    CUDA_ALIGNMENT_BYTES,
    AllocatorUnavailable,
    NativeReplay,
    alignment_for,
    replay_plan,
)
from memplan.torch.run.replay import placement_problem

ROOT = Path(__file__).resolve().parents[2]
DEVICE = 0
STREAM = 0x7000  # an opaque stream handle, as PyTorch passes cudaStream_t
OTHER_STREAM = 0x9000
_RAW_MALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t)
_RAW_FREE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class HostDevice:
    """Host memory in place of cudaMalloc/cudaFree, with a capacity (a failed malloc returns 2,
    cudaErrorMemoryAllocation), a count of calls, the most bytes it ever held, and every free of a
    pointer it does not hold (a second free; cudaFree would fail or corrupt the device heap).
    Blocks are 512-byte aligned, as cudaMalloc's are (it gives 256 at least)."""

    def __init__(self, capacity: int = 1 << 30) -> None:
        self.capacity = capacity
        self.blocks: dict[int, ctypes.Array] = {}
        self.sizes: dict[int, int] = {}
        self.mallocs = 0
        self.frees = 0
        self.peak = 0
        self.bad_frees: list[int] = []
        self.expected_unknown_frees = 0  # second frees a test makes on purpose
        self.malloc_fn = _RAW_MALLOC(self._malloc)  # kept alive with the object
        self.free_fn = _RAW_FREE(self._free)

    def held(self) -> int:
        return sum(self.sizes.values())

    def _malloc(self, out, size: int) -> int:
        self.mallocs += 1
        if self.held() + size > self.capacity:
            return 2
        block = ctypes.create_string_buffer(size + CUDA_ALIGNMENT_BYTES)
        base = ctypes.addressof(block)
        address = base + (-base % CUDA_ALIGNMENT_BYTES)
        self.blocks[address] = block
        self.sizes[address] = size
        self.peak = max(self.peak, self.held())
        out[0] = address
        return 0

    def _free(self, address: int) -> int:
        self.frees += 1
        if address not in self.blocks:
            self.bad_frees.append(address)
            return 1  # cudaErrorInvalidValue
        del self.blocks[address]
        del self.sizes[address]
        return 0


def load_library() -> ctypes.CDLL:
    """The CUDA allocator's library, built here (no CUDA needed) and loaded for ctypes."""
    try:
        path = cuda_allocator.build()
    except AllocatorUnavailable as error:
        pytest.fail(f"the CUDA allocator library must build with the system compiler: {error}")
    library = ctypes.CDLL(str(path))
    cuda_allocator.declare_cuda_api(library)
    return library


@contextlib.contextmanager
def host_device(library: ctypes.CDLL) -> Iterator[HostDevice]:
    """A fresh host device as the library's device; afterwards every block was freed, goes back
    to it, and none was given back twice."""
    device = HostDevice()
    library.mp_cuda_set_raw(_address(device.malloc_fn), _address(device.free_fn), DEVICE)
    native = cuda_allocator.CudaReplay(library)  # the default cache policies
    unknown_before = native.memory_stats().unknown_frees
    yield device
    native = cuda_allocator.CudaReplay(library)
    assert native.memory_stats().in_use == 0, "a test leaked a block"
    native.release_free_memory()
    assert device.blocks == {}
    assert device.bad_frees == [], "a block was given back to the device twice"
    unknown = native.memory_stats().unknown_frees - unknown_before
    assert unknown == device.expected_unknown_frees, "a pointer was freed twice"


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    return load_library()


@pytest.fixture
def host(lib: ctypes.CDLL) -> Iterator[HostDevice]:
    """A fresh host device per test (:func:`host_device`)."""
    with host_device(lib) as device:
        yield device


def _address(function) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


def malloc(lib, size: int, stream: int = STREAM) -> int:
    return lib.mp_cuda_malloc(size, DEVICE, stream)


def free(lib, pointer: int, size: int, stream: int = STREAM) -> None:
    lib.mp_cuda_free(pointer, size, DEVICE, stream)


def a_step(lib, sizes=(1000, 3000, 513, 40_000), stream: int = STREAM) -> list[int]:
    """A step's pattern: a, b live; a freed; c, d; everything but d freed (d is the result)."""
    a = malloc(lib, sizes[0], stream)
    b = malloc(lib, sizes[1], stream)
    free(lib, a, sizes[0], stream)
    c = malloc(lib, sizes[2], stream)
    d = malloc(lib, sizes[3], stream)
    free(lib, b, sizes[1], stream)
    free(lib, c, sizes[2], stream)
    return [a, b, c, d]


def recorded(lib) -> cuda_allocator.CudaReplay:
    native = cuda_allocator.CudaReplay(lib)
    native.begin_record()
    pointers = a_step(lib)
    trace = native.end_record()
    free(lib, pointers[3], 40_000)
    return native, trace


def planned(trace):
    problem, indices = placement_problem(trace)
    solved = place(problem, time_limit_seconds=2)
    validate_placement(problem, solved)
    return replay_plan(trace, {k: solved.offsets_bytes[i] for i, k in enumerate(indices)}, solved.arena_bytes)


class HostArena:
    """A host block whose address is a multiple of 512, as cudaMalloc's blocks are."""

    def __init__(self, nbytes: int) -> None:
        self.raw = ctypes.create_string_buffer(nbytes + CUDA_ALIGNMENT_BYTES)
        base = ctypes.addressof(self.raw)
        self.address = base + (-base % CUDA_ALIGNMENT_BYTES)
        self.nbytes = nbytes


def replaying(lib):
    """Record :func:`a_step`, place it, and start replaying it into a fresh host arena."""
    native, trace = recorded(lib)
    plan = planned(trace)
    arena = HostArena(native.arena_block_bytes(plan.arena_bytes))
    native.begin_replay(plan, arena.address, arena.nbytes)
    return native, trace, plan, arena


def test_each_device_has_its_allocators_alignment():
    assert alignment_for("cuda") == alignment_for(torch.device("cuda", 1)) == CUDA_ALIGNMENT_BYTES == 512
    assert alignment_for("cpu") == 64


def test_builds_without_cuda_headers_or_symbols(lib):
    path = cuda_allocator.build()
    nm = shutil.which("nm")
    assert nm is not None, "binutils' nm is needed to list the library's undefined symbols"
    undefined = subprocess.run([nm, "-D", "--undefined-only", str(path)], capture_output=True, text=True).stdout
    assert "cuda" not in undefined.lower() and "c10" not in undefined
    assert lib.mp_cuda_malloc and lib.mp_cuda_free  # the CUDAPluggableAllocator entry points


def test_records_sizes_streams_and_lifetimes(lib, host):
    _, trace = recorded(lib)
    assert trace.sizes == (1000, 3000, 513, 40_000)
    assert trace.streams == (STREAM,) * 4
    assert trace.alloc_at == (0, 1, 3, 4)
    assert trace.free_at == (2, 5, 6, None)  # d outlived the step: never goes to the arena
    assert trace.alignment_bytes == CUDA_ALIGNMENT_BYTES
    # recording ran on the base allocator: c (513 -> 1024 bytes) took a's freed block
    assert host.mallocs == 3


def test_replay_serves_planned_offsets_512_aligned_inside_the_arena(lib, host):
    native, trace, plan, arena = replaying(lib)
    assert all(o % CUDA_ALIGNMENT_BYTES == 0 for o in plan.offsets if o >= 0)
    pointers = a_step(lib)
    stats = native.end_replay()
    assert native.arena_lead_bytes == CUDA_ALIGNMENT_BYTES
    for k, pointer in enumerate(pointers):
        if plan.offsets[k] >= 0:
            assert pointer == arena.address + native.arena_lead_bytes + plan.offsets[k]
            assert pointer + trace.sizes[k] <= arena.address + arena.nbytes
            assert (pointer - arena.address) % CUDA_ALIGNMENT_BYTES == 0
        else:
            assert not arena.address <= pointer < arena.address + arena.nbytes
    # CUDAPluggableAllocator keeps allocations by address: none may share the arena block's
    assert min(plan.offsets[k] for k in range(len(pointers)) if plan.offsets[k] >= 0) == 0
    assert arena.address not in pointers
    assert (stats.served, stats.fallback, stats.blocked, stats.diverged_at, stats.arena_alive_after) == (
        3,
        1,
        0,
        None,
        0,
    )
    free(lib, pointers[3], 40_000)
    # a and c never live together: the plan may share their bytes; a and b never may
    a, b = plan.offsets[0], plan.offsets[1]
    assert a + 1024 <= b or b + 3072 <= a


def test_a_size_never_recorded_diverges_to_the_base_allocator(lib, host):
    native, _, _, arena = replaying(lib)
    pointers = a_step(lib, sizes=(1000, 3000, 2048, 40_000))
    stats = native.end_replay()
    assert stats.diverged_at == 2 and stats.served == 2 and stats.fallback == 2
    assert not arena.address <= pointers[2] < arena.address + arena.nbytes
    free(lib, pointers[3], 40_000)


def test_another_stream_diverges(lib, host):
    native, _, _, _ = replaying(lib)
    pointers = a_step(lib, stream=OTHER_STREAM)
    stats = native.end_replay()
    assert stats.diverged_at == 0 and stats.served == 0 and stats.fallback == 4
    free(lib, pointers[3], 40_000, OTHER_STREAM)


def test_a_block_kept_past_its_planned_free_is_never_overwritten(lib, host):
    native, _, plan, _ = replaying(lib)
    assert plan.offsets[0] == plan.offsets[2]  # the smallest arena shares a's bytes with c's
    a = malloc(lib, 1000)
    b = malloc(lib, 3000)
    c = malloc(lib, 513)  # a was planned to be free by now: c must not take a shared offset
    d = malloc(lib, 40_000)
    live = [(a, 1000), (b, 3000), (c, 513), (d, 40_000)]
    for i, (p, n) in enumerate(live):
        for q, m in live[i + 1 :]:
            assert p + n <= q or q + m <= p, "two live blocks overlap"
    for p, n in live:
        free(lib, p, n)
    stats = native.end_replay()
    assert stats.diverged_at is None and stats.arena_alive_after == 0
    assert stats.blocked == 1 and stats.served == 2


def test_replay_is_refused_while_an_arena_block_is_alive(lib, host):
    native, _, plan, arena = replaying(lib)
    a = malloc(lib, 1000)
    stats = native.end_replay()
    assert stats.arena_alive_after == 1
    with pytest.raises(Exception, match="still alive"):
        native.begin_replay(plan, arena.address, arena.nbytes)
    free(lib, a, 1000)
    native.begin_replay(plan, arena.address, arena.nbytes)
    native.end_replay()


def test_a_plan_larger_than_the_arena_is_refused(lib, host):
    native, trace = recorded(lib)
    plan = planned(trace)
    arena = HostArena(plan.arena_bytes)
    with pytest.raises(Exception, match="the plan needs"):
        native.begin_replay(plan, arena.address, plan.arena_bytes - 512)


def test_outside_a_step_blocks_are_cached_per_stream_and_size(lib, host):
    native = cuda_allocator.CudaReplay(lib)
    native.reset_peaks()
    p = malloc(lib, 1000)
    free(lib, p, 1000)
    assert malloc(lib, 1000) == p and host.mallocs == 1  # same stream, same rounded size: reused
    q = malloc(lib, 1000, OTHER_STREAM)
    assert q != p and host.mallocs == 2  # never across streams
    stats = native.memory_stats()
    assert stats.held == 2 * 1024 and stats.in_use == 2 * 1024 and stats.peak_held == 2048
    free(lib, p, 1000)
    free(lib, q, 1000, OTHER_STREAM)
    native.release_free_memory()
    assert host.blocks == {} and native.memory_stats().held == 0


def test_out_of_memory_empties_the_cache_and_retries_once(lib, host):
    host.capacity = 4096
    p = malloc(lib, 3000)
    free(lib, p, 3000)  # cached: 3072 bytes held
    q = malloc(lib, 2000)  # 3072 + 2048 > 4096: the cache is emptied, then it fits
    assert q and host.frees == 1
    assert malloc(lib, 5000) is None  # no retry can make room: null, as cudaMalloc's failure
    free(lib, q, 2000)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour on a machine without CUDA")
def test_nothing_cuda_is_loaded_without_cuda(tmp_path):
    script = """
import json, torch
from memplan.api import compile_step
from memplan.torch.run import allocator, cuda_allocator
from memplan.torch.run.allocator import AllocatorUnavailable
try:
    cuda_allocator.install()
    refused = ""
except AllocatorUnavailable as error:
    refused = str(error)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
batch = (torch.randn(4, 8), torch.randint(0, 2, (4,)))
step = compile_step(model, opt, torch.nn.functional.cross_entropy, batch, time_limit_seconds=2)
step(batch)
maps = open("/proc/self/maps").read()
print(json.dumps({
    "refused": refused,
    "choice": cuda_allocator.runtime_choice("auto"),
    "report": step.report.get("allocator_reason"),
    "alignment": step.report.get("alignment_bytes"),
    "loaded": "cuda_planned_allocator" in maps,
    "initialized": torch.cuda.is_initialized(),
    "installed": cuda_allocator.installed(),
}))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["refused"] == "CUDA is not available: the planned CUDA allocator is not loaded"
    assert seen["choice"][0] == "views" and "CUDA is not available" in seen["choice"][1]
    assert seen["report"] == "the planned CPU allocator records and replays the step"
    assert seen["alignment"] == 64
    assert not seen["loaded"] and not seen["initialized"] and not seen["installed"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour on a machine without CUDA")
def test_cuda_bench_says_so_in_one_line_without_cuda():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run_cuda.py")], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 1
    assert done.stdout.strip().splitlines() == [
        "no CUDA device here (torch.cuda.is_available() is false): nothing measured"
    ]


NO_GPU = "needs a CUDA device (none here): run with -m gpu where one is lent"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_cuda_replay_is_bit_exact_and_below_eager_allocated(tmp_path):
    """Each side in its own process (the planned allocator must be installed before the first
    CUDA tensor): the same model, seed and batches; the planned step replays, its parameters
    equal eager's bit for bit after every step, and what it reserved stays below what eager
    allocated."""
    sys.path.insert(0, str(ROOT))
    from bench.run_cuda import run_side

    eager = run_side("eager", "mlp", batch=8, steps=6, out=tmp_path)
    planned_side = run_side("memplan", "mlp", batch=8, steps=6, out=tmp_path)
    assert planned_side["allocator"] == "replay", planned_side["allocator_reason"]
    assert planned_side["replayed_steps"] >= 2 and planned_side["diverged"] == 0
    for a, b in zip(eager["checksums"], planned_side["checksums"], strict=True):
        assert a == b
    eager_params = torch.load(eager["params"])
    planned_params = torch.load(planned_side["params"])
    assert all(torch.equal(eager_params[k], planned_params[k]) for k in eager_params)
    assert planned_side["max_memory_reserved"] < eager["max_memory_allocated"]


class VerifiedCpu(NativeReplay):
    """The planned CPU allocator asking, as the CUDA one does, for its first replay of every plan
    to be verified; ``corrupt`` makes every replayed step write a parameter behind the step's
    back, as a replay that went wrong on real hardware would."""

    verify_first_replay = True

    def __init__(self, corrupt: torch.Tensor | None = None) -> None:
        super().__init__(allocator.load(), allocator.CPU_ALIGNMENT_BYTES)
        self.corrupt = corrupt
        self.calls: list[str] = []

    def begin_replay(self, *args):
        self.calls.append("replay")
        super().begin_replay(*args)

    def release_free_memory(self) -> None:
        self.calls.append("release")
        super().release_free_memory()

    def end_replay(self):
        stats = super().end_replay()
        if self.corrupt is not None:
            with torch.no_grad():
                self.corrupt.view(-1)[0] += 1.0
        return stats


def _train_both(corrupt: bool, steps: int = 6):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9, foreach=False)
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    loss_fn = torch.nn.functional.cross_entropy
    step = CompiledStep.of_loss(model, opt, loss_fn, time_limit_seconds=2, allocator="replay")
    step._native = VerifiedCpu(next(model.parameters()) if corrupt else None)  # before the first plan
    for _ in range(steps):
        loss = step(batch)
        twin_loss = loss_fn(twin(batch[0]), batch[1])
        twin_loss.backward()
        twin_opt.step()
        twin_opt.zero_grad(set_to_none=True)
        assert torch.equal(loss, twin_loss.detach())
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(a, b), "a step trained differently from eager"
    return step


@pytest.mark.skipif(not allocator.available(), reason="the planned CPU allocator needs a C++ compiler")
def test_a_verified_replay_keeps_replaying():
    step = _train_both(corrupt=False)
    runner = next(iter(step.runners.values()))
    assert isinstance(runner.native, VerifiedCpu)
    assert step.allocator == "replay" and runner.refused is None and runner.replays >= 2
    # the verifying rerun's freed blocks go back: replayed steps never ask for them again
    first = runner.native.calls.index("replay")
    assert "release" in runner.native.calls[first:]


@pytest.mark.skipif(not allocator.available(), reason="the planned CPU allocator needs a C++ compiler")
def test_a_replay_that_differs_is_refused_and_the_step_falls_back_to_views():
    step = _train_both(corrupt=True)
    assert step.allocator == "views"
    assert step.allocator_reason.startswith("the replayed step differed from the same step on PyTorch's allocator")
    assert step.report["allocator"] == "views" and "differed" in step.report["allocator_reason"]
