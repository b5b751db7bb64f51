"""The loss's backward fused and written over the log-probabilities (memplan.torch.capture.fused):
the same bits as ``nll_loss_backward`` then ``_log_softmax_backward_data``, one vocabulary-sized
buffer less at the floor, and planned steps that train exactly as eager."""

from __future__ import annotations

import copy
import itertools

import pytest

import memplan
import memplan.torch.capture.fused as fused
import torch
from memplan.remat.problem import RematProblem, memory_floor
from memplan.torch.capture import capture_train_step
from tests.torch.test_inplace import TinyLM
from torch import nn

aten = torch.ops.aten


def _pair(grad_loss, logp, target, weight, reduction, total_weight):
    grad = aten.nll_loss_backward(grad_loss, logp, target, weight, reduction, -100, total_weight)
    return aten._log_softmax_backward_data(grad, logp, 1, torch.float32)


@pytest.mark.parametrize(
    ("rows", "vocab", "reduction", "weighted"),
    list(itertools.product((1, 37), (7, 1000, 3001), (0, 1, 2), (False, True))),
)
def test_the_fused_op_equals_the_pair_bit_for_bit(monkeypatch, rows, vocab, reduction, weighted):
    monkeypatch.setattr(fused, "CHUNK_BYTES", 5 * vocab * 4)  # chunks of 5 rows, the last shorter
    g = torch.Generator().manual_seed(rows * vocab + reduction)
    logp = torch.log_softmax(3 * torch.randn(rows, vocab, generator=g), 1)
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[::3] = -100  # ignored rows
    weight = torch.rand(vocab, generator=g) if weighted else None
    _, total_weight = aten.nll_loss_forward(logp, target, weight, reduction, -100)
    grad_loss = torch.randn((rows,) if reduction == 0 else (), generator=g)
    expected = _pair(grad_loss, logp, target, weight, reduction, total_weight)
    out = logp.clone()
    got = fused.FUSED(grad_loss, out, target, weight, reduction, -100, total_weight, 1, torch.float32, out=out)
    assert got is out
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))  # signed zeros and NaNs too


def _loss(logits, target):
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=0)


def _batch(length: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 3000, (4, length), generator=g), torch.randint(0, 3000, (4, length), generator=g)


def test_the_capture_fuses_the_lm_loss_backward_and_lowers_the_floor(monkeypatch):
    logits_bytes = 4 * 64 * 3000 * 4
    floors = {}
    for fuse in (True, False):
        if not fuse:
            monkeypatch.setattr(fused, "fuse_loss_backward", lambda *args: [])
        model = TinyLM()
        capture = capture_train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _loss, _batch())
        kinds = [op.kind for op in capture.graph.ops]
        assert ("memplan_loss.nll_log_softmax_backward.out" in kinds) == fuse
        assert ("aten.nll_loss_backward.default" in kinds) != fuse
        assert bool(capture.fused_loss) == fuse
        floors[fuse] = memory_floor(RematProblem(capture.graph, 10**12)).bytes
    # the zero-filled gradient is never whole (the floor moves to the head's backward: a little less)
    assert floors[True] < floors[False] - logits_bytes // 2


def _train_side_by_side(step, model, reference, batches):
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for batch in batches:
        loss = step(batch)
        ref_loss = _loss(reference(batch[0]), batch[1])
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        assert torch.equal(loss, ref_loss.detach())
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))


def _captures(monkeypatch) -> list:
    """Every capture the compiled steps make from now on."""
    import memplan.api as api

    made, capture_for = [], api.capture_for
    monkeypatch.setattr(
        api, "capture_for", lambda *args, **kwargs: made.append(capture_for(*args, **kwargs)) or made[-1]
    )
    return made


@pytest.mark.parametrize("budget", [None, 0.98])
def test_a_planned_lm_step_with_the_fused_loss_trains_as_eager(monkeypatch, budget):
    captures = _captures(monkeypatch)
    torch.manual_seed(0)
    model = TinyLM()
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = memplan.compile_step(model, opt, _loss, _batch(), memory_budget=budget, time_limit_seconds=5)
    _train_side_by_side(step, model, reference, [_batch(seed=k) for k in range(3)])
    assert captures and all(c.fused_loss for c in captures)


def test_a_dynamic_length_plan_keeps_the_fused_loss_and_trains_as_eager():
    torch.manual_seed(0)
    model = TinyLM()
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = memplan.compile_step(model, opt, _loss, _batch(32), allocator="views", dynamic={1: 48})
    _train_side_by_side(step, model, reference, [_batch(n, seed=n) for n in (32, 17, 48, 25)])
    assert step.plans_made == 1
