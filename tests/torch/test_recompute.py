"""Copies recomputed in the backward (memplan.torch.capture.recompute): lower peak, same bits."""

from __future__ import annotations

import copy

import pytest

import memplan
import torch
from memplan.graph.liveness import peak_bytes
from memplan.torch.capture import capture_train_step
from memplan.torch.compare import compare_with_eager
from memplan.torch.run.allocator import available as allocator_available
from memplan.torch.zoo import build_workload, make_optimizer
from torch import nn


def _program_peak(capture) -> int:
    return peak_bytes(capture.graph, list(range(len(capture.graph.ops))))


def _capture(model, batch, recompute):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return capture_train_step(model, opt, _mse, batch, recompute_copies=recompute)


def _mse(out, target):
    return nn.functional.mse_loss(out, target)


class SkipCat(nn.Module):
    """A U-Net level: the skip connection is kept for its own backward and concatenated."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.enc = nn.Conv2d(channels, channels, 3, padding=1)
        self.up = nn.Conv2d(channels, channels, 3, padding=1)
        self.dec = nn.Conv2d(2 * channels, channels, 3, padding=1)
        wide = 4 * channels  # saved for the head's backward: the peak is where the backward starts
        self.head = nn.Sequential(nn.ReLU(), nn.Conv2d(channels, wide, 1), nn.ReLU(), nn.Conv2d(wide, channels, 1))

    def forward(self, x):
        skip = torch.relu(self.enc(x))
        return self.head(self.dec(torch.cat([skip, self.up(skip)], dim=1)))


class CatOfTemporaries(nn.Module):
    """Both halves of the cat die at it: recomputing it would only keep them instead."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.a = nn.Conv2d(channels, channels, 1)
        self.b = nn.Conv2d(channels, channels, 1)
        self.dec = nn.Conv2d(2 * channels, channels, 3, padding=1)

    def forward(self, x):
        return self.dec(torch.cat([self.a(x) * 2, self.b(x) * 3], dim=1))


class CatThenWrite(SkipCat):
    """An input of the cat is written in place after it: a recomputed cat would read new values."""

    def forward(self, x):
        skip = torch.relu(self.enc(x))
        upsampled = self.up(skip)
        joined = torch.cat([skip, upsampled], dim=1)
        upsampled.mul_(2)
        return self.head(self.dec(joined)) + upsampled


def _batch(channels: int = 8):
    torch.manual_seed(0)
    return torch.randn(2, channels, 16, 16), torch.randn(2, channels, 16, 16)


def test_a_kept_skip_cat_is_recomputed_and_lowers_the_peak():
    model, batch = SkipCat(), _batch()
    kept, recomputed = _capture(model, batch, False), _capture(model, batch, True)
    assert kept.recomputed == [] and recomputed.recomputed == ["cat"]
    assert len(recomputed.graph.ops) == len(kept.graph.ops) + 1
    assert _program_peak(recomputed) < _program_peak(kept)


def test_a_cat_of_dying_inputs_is_not_recomputed():
    assert _capture(CatOfTemporaries(), _batch(), True).recomputed == []


def test_a_cat_whose_input_is_written_later_is_not_recomputed():
    assert _capture(CatThenWrite(), _batch(), True).recomputed == []


@pytest.mark.parametrize("model_type", [SkipCat, CatThenWrite])
def test_steps_with_recomputed_copies_equal_eager_exactly(model_type):
    torch.manual_seed(0)
    model, batch = model_type(), _batch()
    reference = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, reference))
    step = memplan.compile_step(model, opt, _mse, batch)
    for _ in range(3):
        loss = step(batch)
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = _mse(reference(batch[0]), batch[1])
        ref_loss.backward()
        ref_opt.step()
        assert torch.equal(loss, ref_loss)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "allocator",
    [
        # views: the fallback mode, whose out= path the recomputed copies share; `make test-all`
        pytest.param("views", marks=pytest.mark.slow),
        pytest.param(
            "replay",
            marks=pytest.mark.skipif(not allocator_available(), reason="no C++ compiler: no planned allocator"),
        ),
    ],
)
def test_unet_recomputes_its_cats_and_trains_like_eager(allocator):
    report = compare_with_eager("unet", 2, steps=2, optimizer_name="adam", time_limit_seconds=2, allocator=allocator)
    assert report["max_abs_diff"] == 0.0
    assert report["plan"]["recomputed_copies"], report["plan"]
    if allocator == "replay":  # views leave the outputs of ops without an out= kernel to the allocator
        assert report["memplan"]["peak_bytes"] < report["eager"]["peak_bytes"], report


def test_recompute_can_be_turned_off():
    w = build_workload("unet", 1)
    opt = make_optimizer("sgd", w.model.parameters())
    step = memplan.compile_step(w.model, opt, w.loss_fn, (w.inputs, w.target), recompute_copies=False)
    assert step.report["recomputed_copies"] == []
