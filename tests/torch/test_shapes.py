"""Variable batch shapes (Sekiyama et al. 4.3): one arena for every shape, a bounded number of
plans evicted least recently used, numerics equal to eager's at every shape; and the RSS helpers."""

from __future__ import annotations

import copy

import pytest

import memplan
import torch
from memplan.errors import MemplanError
from memplan.torch.rss import peak_rss_bytes, release_free_memory, reset_peak_rss, rss_bytes
from memplan.torch.run.allocator import available as allocator_available
from memplan.torch.run.arena import LruCache, SharedArena
from memplan.torch.zoo import Workload, make_optimizer
from torch import nn

ALLOCATORS = [
    "views",
    pytest.param(
        "replay",
        marks=pytest.mark.skipif(not allocator_available(), reason="no C++ compiler: the planned allocator is absent"),
    ),
]


def _small_workload() -> Workload:
    """A small MLP (dropout included, so the seeds matter): plans in well under a second."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 10))
    return Workload(model, torch.randn(8, 32), torch.randint(0, 10, (8,)), nn.functional.cross_entropy)


def _eager_step(model, opt, loss_fn, inputs, target):
    loss = loss_fn(model(inputs), target)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _batches(w, sizes):
    return [(w.inputs[:n], w.target[:n]) for n in sizes]


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_every_shape_shares_one_arena_bit_identical_to_eager(allocator):
    w = _small_workload()
    reference = copy.deepcopy(w.model)
    opt, ref_opt = make_optimizer("adam", w.model.parameters()), make_optimizer("adam", reference.parameters())
    step = memplan.compile_step(
        w.model, opt, w.loss_fn, (w.inputs[:2], w.target[:2]), allocator=allocator, time_limit_seconds=2
    )
    blocks = set()
    for inputs, target in _batches(w, [2, 8, 4, 8, 2, 4, 4, 8, 8, 2, 2]):
        torch.manual_seed(3)
        loss = step((inputs, target))
        torch.manual_seed(3)
        ref_loss = _eager_step(reference, ref_opt, w.loss_fn, inputs, target)
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(p, q) for p, q in zip(w.model.parameters(), reference.parameters(), strict=True))
        blocks.add(step.arena.tensor.data_ptr())
        # one block, as large as the largest kept plan needs and no larger; none while a step
        # that recorded without placing has left it released (replay.py: never both at once)
        needed = max(
            (r.plan.arena_bytes if r.plan is not None else 0) if hasattr(r, "replaying") else r.plan.arena_bytes
            for r in step.runners.values()
        )
        current = step.runner_for((inputs, target))
        recorded = hasattr(current, "replaying") and not current.replaying
        assert step.arena.nbytes == (0 if recorded else needed)
    # 2 is planned, 8 (larger) planned again, 4 reuses 8's plan, proven valid for it (issue 37)
    assert step.plans_made == 2 and step.plans_reused == 1 and len(step.runners) == 3
    largest = max(p.arena_bytes for p in step.plans.values())
    if allocator == "views":
        assert step.arena.nbytes == largest
        assert all(r.arena is step.arena.tensor for r in step.runners.values())
    else:
        assert step.arena.nbytes == max(r.placement.arena_bytes for r in step.runners.values())
        assert all(r.arena is step.arena.tensor for r in step.runners.values())
    # no block per shape: once the largest shape was planned, the arena was never reallocated again
    assert step.arena.allocations <= 4, step.arena.allocations
    assert step.planning_seconds > 0


# the replay variant (17 s: each new shape records) runs with `make test-all`
@pytest.mark.parametrize(
    "allocator",
    [
        "views",
        pytest.param(
            "replay",
            marks=[
                pytest.mark.slow,
                pytest.mark.skipif(not allocator_available(), reason="no C++ compiler"),
            ],
        ),
    ],
)
def test_least_recently_used_plans_are_evicted_within_the_bound(allocator):
    w = _small_workload()
    reference = copy.deepcopy(w.model)
    opt, ref_opt = make_optimizer("sgd", w.model.parameters()), make_optimizer("sgd", reference.parameters())
    step = memplan.compile_step(
        w.model, opt, w.loss_fn, (w.inputs[:8], w.target[:8]), allocator=allocator, max_plans=2, time_limit_seconds=2
    )
    for inputs, target in _batches(w, [8, 8, 8, 2, 2, 2, 3, 3, 3, 2, 2, 8, 8, 8]):
        assert len(step.runners) <= 2
        torch.manual_seed(5)  # dropout
        loss = step((inputs, target))
        torch.manual_seed(5)
        assert torch.equal(loss, _eager_step(reference, ref_opt, w.loss_fn, inputs, target))
    # 8 was evicted by 3 (2 was used after 8), then captured again; 3 then evicted by 8. Only 8
    # was solved: 2, 3 and 8 again reuse its plan (issue 37)
    assert step.plans_made == 1 and step.plans_reused == 3 and step.evictions == 2
    kept_batch_sizes = {key[0][1][0][0][0] for key in step.runners}
    assert kept_batch_sizes == {2, 8}
    # evicted arenas are gone: only the largest kept plan's arena is held
    assert step.arena.nbytes <= max(
        (getattr(r, "placement", None) or p).arena_bytes
        for r, p in zip(step.runners.values(), step.plans.values(), strict=True)
    )


def test_shared_arena_grows_by_reallocation_and_shrinks_to_fit():
    arena = SharedArena()
    first = arena.reserve(1024)
    assert arena.nbytes == 1024 and arena.reserve(512) is first  # large enough: the same block
    del first
    arena.reserve(4096)
    assert arena.nbytes == 4096 and arena.allocations == 2
    arena.fit(2048)
    assert arena.nbytes == 2048
    arena.release()
    assert arena.nbytes == 0
    assert arena.reserve(100).numel() == 2048  # regrown at what the kept plans need, not per request
    with pytest.raises(MemplanError):
        arena.reserve(-1)


def test_lru_cache_bound_and_order():
    cache: LruCache[int] = LruCache(2)
    assert cache.put("a", 1) == [] and cache.put("b", 2) == []
    assert cache.get("a") == 1  # a is now the most recent
    assert cache.put("c", 3) == [2]  # b evicted
    assert list(cache) == ["a", "c"] and cache.evictions == 1
    with pytest.raises(MemplanError, match="max_plans"):
        LruCache(0)


def test_rss_helpers_read_sane_values():
    reset_peak_rss()
    before = rss_bytes()
    assert 10 * 2**20 < before < 64 * 2**30  # a Python process with torch: tens of MiB to a few GiB
    assert peak_rss_bytes() >= before * 0.9
    block = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched
    assert peak_rss_bytes() >= before + 60 * 2**20
    del block
    release_free_memory()
    assert rss_bytes() < before + 32 * 2**20  # the block went back to the OS
    reset_peak_rss()
    assert peak_rss_bytes() < before + 32 * 2**20  # the high-water mark was reset


def test_mode_key_is_every_modules_flag_and_every_parameters_requires_grad():
    """A plan is kept per mode (``mode_key``): the key follows each module's ``training`` and each
    parameter's ``requires_grad``, shared modules and tied parameters counted once, as
    ``model.modules()`` / ``model.parameters()`` give them."""
    from memplan.api import mode_key

    shared = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(shared, torch.nn.Sequential(torch.nn.Dropout(), shared), torch.nn.Linear(4, 4))
    model[2].weight = shared.weight  # tied

    def expected() -> tuple:
        return tuple(m.training for m in model.modules()), tuple(p.requires_grad for p in model.parameters())

    keys = {mode_key(model)}
    assert mode_key(model) == expected()
    model[1][0].eval()
    assert mode_key(model) == expected()
    keys.add(mode_key(model))
    model[2].bias.requires_grad_(False)
    assert mode_key(model) == expected()
    keys.add(mode_key(model))
    assert len(keys) == 3
