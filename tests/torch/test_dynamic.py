"""One plan for a range of shapes (issue 37): a shape that runs the same ops as a kept plan's on
no larger tensors reuses that plan's order and placement (views) or recorded offsets (replay),
proven valid for it first; every step stays bit-identical to eager's; a shape whose program
differs, or that is larger, is planned as before."""

from __future__ import annotations

import copy

import pytest

import memplan
import torch
from memplan.errors import MemplanError
from memplan.torch.run.allocator import AllocationTrace
from memplan.torch.run.allocator import available as allocator_available
from memplan.torch.run.shapes import (
    ShapeReplay,
    bucket_length,
    check_dynamic,
    largest_batch,
    pad_to_bucket,
    reused_offsets,
)
from memplan.torch.zoo import make_optimizer
from torch import nn

# the replay variants (each new shape records once more) run with `make test-all`
ALLOCATORS = [
    "views",
    pytest.param(
        "replay",
        marks=[pytest.mark.slow, pytest.mark.skipif(not allocator_available(), reason="no C++ compiler")],
    ),
]


class Tokens(nn.Module):
    """A tiny sequence model whose tensors grow with the sequence length (dim 1)."""

    def __init__(self, branchy: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.mix = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 16))
        self.head = nn.Linear(16, 50)
        self.branchy = branchy

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.mix(h)
        if self.branchy and ids.shape[1] > 6:  # the program depends on the length
            h = torch.tanh(h)
        return self.head(h)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _batch(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (2, length), generator=g), torch.randint(0, 50, (2, length), generator=g)


def _run(allocator: str, lengths: list[int], *, branchy: bool = False, dynamic: dict | None = None):
    """Train memplan and eager side by side; assert every step's loss and parameters are equal."""
    torch.manual_seed(0)
    model = Tokens(branchy)
    reference = copy.deepcopy(model)
    opt, ref_opt = make_optimizer("adamw", model.parameters()), make_optimizer("adamw", reference.parameters())
    step = memplan.compile_step(
        model, opt, _loss, _batch(lengths[0], 0), allocator=allocator, time_limit_seconds=2, dynamic=dynamic
    )
    for i, length in enumerate(lengths):
        batch = _batch(length, i)
        torch.manual_seed(i)
        loss = step(batch)
        torch.manual_seed(i)
        ref_loss = _loss(reference(batch[0]), batch[1])
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        assert torch.equal(loss, ref_loss.detach()), (i, length)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))
    return step


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_shorter_lengths_reuse_the_longest_plan_bit_identical(allocator):
    step = _run(allocator, [12, 12, 5, 8, 5, 8])
    assert step.plans_made == 1 and step.plans_reused == 2
    assert [r["plan"] for r in step.shape_log[1:]] == ["reused the plan of 2x12 2x12"] * 2
    # the arena is sized once (replay releases it while a new shape records, and maps it again at that size)
    assert step.arena.largest_bytes == step.arena.nbytes
    assert step.arena.allocations == 1 or allocator == "replay"
    reused = [p for p in step.plans.values() if "reused_from" in p.report]
    assert len(reused) == 2
    if allocator == "replay":  # the recorded allocations are served at the longest step's offsets
        runners = list(step.runners.values())
        assert all(isinstance(r, ShapeReplay) and r.replaying for r in runners)
        assert sum(r.reused_from is not None for r in runners) == 2
        assert all(r.placement.method == "reused" for r in runners if r.reused_from is not None)


@pytest.mark.slow
@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_a_longer_length_is_planned_again_and_the_arena_grows_once(allocator):
    step = _run(allocator, [5, 5, 12, 12, 8, 8, 5])
    assert step.plans_made == 2 and step.plans_reused == 1
    assert "slot holds" in step.shape_log[1]["plan"]  # 12 did not fit the plan of 5
    assert step.shape_log[2]["plan"] == "reused the plan of 2x12 2x12"


def test_declared_largest_length_is_planned_first_one_plan_for_all():
    step = _run("views", [5, 12, 7], dynamic={1: 16})
    assert step.plans_made == 1 and step.plans_reused == 3
    assert all(r["plan"] == "reused the plan of 2x16 2x16" for r in step.shape_log)


@pytest.mark.slow
def test_a_program_that_depends_on_the_length_is_planned_per_shape():
    step = _run("views", [12, 5, 5, 12], branchy=True)
    assert step.plans_made == 2 and step.plans_reused == 0
    assert "ops and" in step.shape_log[1]["plan"] or "op " in step.shape_log[1]["plan"]


def _trace(sizes, alloc_at, free_at):
    return AllocationTrace(tuple(sizes), tuple(alloc_at), tuple(free_at))


def test_reused_offsets_hold_only_for_the_same_events_and_no_larger_sizes():
    kept = _trace([256, 512, 128], [0, 1, 3], [2, 4, 5])
    offsets = (0, 256, 0)  # 0 and 1 live together; 2 after 0 was freed
    smaller = _trace([192, 448, 128], [0, 1, 3], [2, 4, 5])
    assert reused_offsets(kept, offsets, smaller, 768) == {0: 0, 1: 256, 2: 0}
    assert reused_offsets(kept, offsets, _trace([320, 448, 128], [0, 1, 3], [2, 4, 5]), 768) is None  # larger
    assert reused_offsets(kept, offsets, _trace([192, 448, 128], [0, 2, 3], [1, 4, 5]), 768) is None  # other events
    kept_result = _trace([256, 512, 128], [0, 1, 3], [2, 4, None])  # the last one outlives the step: not placed
    assert reused_offsets(kept_result, (0, 256, -1), _trace([192, 448, 64], [0, 1, 3], [2, 4, None]), 768) == {
        0: 0,
        1: 256,
    }
    assert reused_offsets(kept_result, (0, 256, -1), smaller, 768) is None  # freed here, kept there
    with pytest.raises(Exception, match=r"overlap|outside"):  # a kept plan that was wrong is caught by the validator
        reused_offsets(kept, (0, 128, 0), smaller, 768)


def test_declaration_helpers_and_buckets():
    assert check_dynamic({1: 512}) == {1: 512}
    for bad in ({}, {1: 0}, {"seq": 4}, [1, 512]):
        with pytest.raises(MemplanError, match="dynamic"):
            check_dynamic(bad)
    grown = largest_batch({"ids": torch.tensor([[1, 2, 3]]), "flag": True}, {1: 5})
    assert grown["ids"].tolist() == [[1, 2, 3, 3, 3]] and grown["flag"] is True
    assert largest_batch((torch.zeros(2, 7),), {1: 5}) is None  # already above the declared size
    assert bucket_length(70, (64, 128, 256)) == 128 and bucket_length(64, (64, 128)) == 64
    with pytest.raises(MemplanError, match="bucket"):
        bucket_length(300, (64, 128, 256))
    padded = pad_to_bucket(torch.ones(2, 70, dtype=torch.long), (64, 128), value=-100)
    assert padded.shape == (2, 128) and (padded[:, 70:] == -100).all() and (padded[:, :70] == 1).all()
