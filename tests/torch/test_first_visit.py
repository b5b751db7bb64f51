"""The first planned step is recorded and the second replays (issue 37): the first step's
self-check does without a dispatch mode (the random ops and unmarked writes noted as the runtime
calls them, version counters, bytes, the generator's states), so its allocations are the step's
own, and the optimizer state it makes is left out of the recording. The self-check still
catches what it caught; the steps stay eager's bit for bit."""

from __future__ import annotations

import re

import pytest

import memplan
import torch
from memplan.api import optimize
from memplan.errors import SelfCheckFailed
from memplan.torch.equivalence import differences, snapshot
from memplan.torch.optimizer_matrix import MatrixNet, make_optimizer, optimizer_cases
from memplan.torch.run import allocator
from memplan.torch.run.allocator import AllocationTrace
from memplan.torch.run.first_state import StateCalls, first_update_allocates_as_later, steady_trace
from memplan.torch.run.interpreter import Plan, StepRunner
from memplan.torch.run.replay import ReplayedStep
from memplan.torch.tensors import HIDDEN_WRITES, is_random
from tests.torch.test_optimizer_matrix import SkipsOneParameter
from torch import nn

FEATURES = 16


class PlainNet(nn.Module):
    """No dropout, no BatchNorm (a decoder's habits): a frozen layer, attention without dropout,
    and a layer the optimizer owns that gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(FEATURES, FEATURES).requires_grad_(False)
        self.fc1 = nn.Linear(FEATURES, 32)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 8)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.nn.functional.gelu(self.fc1(self.frozen(x) + x)))
        q = h.view(h.shape[0], 2, 4, 4)  # batch, heads, tokens, head size
        h = h + torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.0).reshape(h.shape)
        return self.fc2(h)


def _setup(net: type[nn.Module] = PlainNet, optimizer: str = "AdamW", **options):
    torch.manual_seed(0)
    model = net()
    opt = getattr(torch.optim, optimizer)(model.parameters(), lr=1e-2, **options)
    batch = (torch.randn(8, FEATURES), torch.randint(0, 8, (8,)))
    return model, opt, batch


def _eager(steps: int, *setup, **options) -> tuple[list[torch.Tensor], object]:
    model, opt, batch = _setup(*setup, **options)
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses, snapshot(model, opt)


@pytest.mark.parametrize(
    ("net", "optimizer", "options", "recorded"),
    [
        (PlainNet, "AdamW", {}, 1),
        (PlainNet, "SGD", {}, 1),
        (PlainNet, "SGD", {"momentum": 0.9}, 2),  # its first update clones the gradient
        (PlainNet, "AdamW", {"fused": True}, 2),  # fused kernels move no version counter: observed
        (MatrixNet, "AdamW", {}, 1),  # dropout, BatchNorm's running statistics
    ],
    ids=["adamw", "sgd", "sgd-momentum", "adamw-fused", "dropout-batchnorm"],
)
def test_the_first_step_is_recorded_and_the_second_replays_bit_for_bit(net, optimizer, options, recorded):
    model, opt, batch = _setup(net, optimizer, **options)
    compiled = memplan.compile_step(model, opt, torch.nn.functional.cross_entropy, batch, allocator="replay")
    torch.manual_seed(1)
    losses = [compiled(batch).detach() for _ in range(3)]
    (runner,) = compiled.runners.values()
    assert isinstance(runner, ReplayedStep)
    first = compiled.report["first_steps"]
    assert first["visits_before_replay"] == recorded and first["replayed_at_call"] == recorded + 1
    assert runner.replays == 3 - recorded and runner.last_stats.diverged_at is None
    eager_losses, eager_state = _eager(3, net, optimizer, **options)
    assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses, strict=True))
    assert differences(snapshot(model, opt), eager_state) == []


def _runner(kind: type[StepRunner] = StepRunner, net: type[nn.Module] = PlainNet) -> tuple[StepRunner, tuple]:
    model, opt, batch = _setup(net)
    capture, plan = optimize(model, opt, torch.nn.functional.cross_entropy, batch, time_limit_seconds=0.5)
    return kind(capture, Plan(tuple(plan.order)), model, opt), batch


def test_the_unobserved_check_leaves_the_allocations_alone():
    """The same program recorded with and without the first step's check allocates alike
    (the first step also makes AdamW's state, which it keeps: compared without it)."""
    runner, batch = _runner()
    native = allocator.cpu()
    traces = []
    for _ in range(3):
        runner.before_step()
        native.begin_record()
        try:
            runner(batch)
        finally:
            traces.append(native.end_record())
        runner.after_step()
        assert not runner.last_step_observed
    kept = [sum(f is None for f in t.free_at) for t in traces]
    assert kept[0] > kept[1] == kept[2] and traces[1].sizes == traces[2].sizes
    freed = [[t.sizes[k] for k in range(t.num_allocations) if t.free_at[k] is not None] for t in traces]
    assert freed[0] == freed[1]


class DrawsOnceMore(StepRunner):
    """A broken runtime: every update also draws random numbers."""

    def _update(self, ins, env):
        torch.rand(3)
        super()._update(ins, env)


class WritesAnUnusedWeight(StepRunner):
    """A broken runtime: it writes a parameter that gets no gradient, through ``.data``
    (whose version counter is its own: only the bytes show it)."""

    def _update(self, ins, env):
        self.model.unused.weight.data.add_(1.0)
        super()._update(ins, env)


class DrawsTwice(StepRunner):
    """A broken runtime: it runs every random op of the program twice (dropout draws again)."""

    def _watched(self, fn, op, *args, **kwargs):
        if is_random(op):
            fn(*args, **kwargs)
        return super()._watched(fn, op, *args, **kwargs)


class KeepsRunningStats(StepRunner):
    """A broken runtime: BatchNorm updates copies of its running statistics, not the buffers."""

    def _watched(self, fn, op, *args, **kwargs):
        if op._schema.name in HIDDEN_WRITES:
            args = (*args[:3], args[3].clone(), args[4].clone(), *args[5:])
        return super()._watched(fn, op, *args, **kwargs)


@pytest.mark.parametrize(
    ("broken", "net", "message"),
    [
        (DrawsOnceMore, PlainNet, "the step drew random numbers"),
        (DrawsTwice, MatrixNet, "the step drew random numbers before its first random op outside the ops"),
        (WritesAnUnusedWeight, PlainNet, "parameter 'unused.weight' was written by the step"),
        (SkipsOneParameter, PlainNet, "parameter 'fc2.weight' received a gradient but the step did not update it"),
        (KeepsRunningStats, MatrixNet, "buffer 'bn.running_mean' was not updated"),
    ],
    ids=["draws-in-an-update", "draws-twice", "writes-unused", "skips-update", "keeps-running-stats"],
)
def test_the_unobserved_check_still_catches_a_broken_step(broken, net, message):
    runner, batch = _runner(broken, net)
    runner.before_step()
    with pytest.raises(SelfCheckFailed, match=re.escape(message)):
        runner(batch)
        runner.after_step()
    assert not runner.last_step_observed  # no dispatch mode ran


def test_a_trace_without_the_state_it_made_is_renumbered():
    # allocations: 0 freed at 2, 1 kept (state), 2 freed at 5, 3 kept (the result)
    trace = AllocationTrace((8, 16, 32, 64), (0, 1, 3, 4), (2, None, 5, None))
    steady = steady_trace(trace, StateCalls([(1, 2)]))
    assert steady.sizes == (8, 32, 64)
    assert steady.alloc_at == (0, 2, 3) and steady.free_at == (1, 4, None)
    assert steady_trace(trace, StateCalls([(0, 1)])) is trace  # a freed allocation is the step's own: kept
    assert steady_trace(trace, StateCalls([(1, 2)], steady=False)) is None
    with pytest.raises(ValueError):
        trace.without({0})


def test_the_optimizers_trusted_with_a_steady_first_update_have_one_here():
    """Every optimizer of the matrix that :func:`first_update_allocates_as_later` trusts frees
    the same allocations in its first eager step as in its second (this torch's code)."""
    native = allocator.cpu()
    trusted = 0
    for case in optimizer_cases():
        if case.warm or case.optimizer in ("LBFGS", "SparseAdam"):
            continue
        torch.manual_seed(0)
        model = MatrixNet()
        opt = make_optimizer(case, model)
        if not first_update_allocates_as_later(opt):
            continue
        trusted += 1
        traces = []
        for _ in range(2):
            native.begin_record()
            try:
                loss = torch.nn.functional.cross_entropy(model(torch.randn(8, FEATURES)), torch.zeros(8).long())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            finally:
                traces.append(native.end_record())
        freed = [[t.sizes[k] for k in range(t.num_allocations) if t.free_at[k] is not None] for t in traces]
        assert freed[0] == freed[1], case.label
    assert trusted >= 50
    assert not first_update_allocates_as_later(torch.optim.SGD(MatrixNet().parameters(), lr=0.1, momentum=0.9))


def test_a_restart_replays_its_first_step_from_the_cache_bit_for_bit(tmp_path):
    """The cold process's first step, recorded unobserved with the state it made, is kept as a
    branch of the cached plan: the restarted process's first step (it makes the state again)
    replays from it."""
    runs = []
    for _ in range(2):
        model, opt, batch = _setup()
        compiled = memplan.compile_step(
            model, opt, torch.nn.functional.cross_entropy, batch, allocator="replay", plan_cache=tmp_path
        )
        torch.manual_seed(1)
        losses = [compiled(batch).detach() for _ in range(3)]
        runs.append((compiled.report["first_steps"], losses, snapshot(model, opt)))
    (cold, *_), (restarted, *_) = runs
    assert cold["plan"] == "planned" and cold["visits_before_replay"] == 1
    assert restarted["plan"] == "cached" and restarted["placement"] == "cached"
    assert restarted["visits_before_replay"] == 0 and "cache_entry" not in restarted
    eager_losses, eager_state = _eager(3)
    for _, losses, state in runs:
        assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses, strict=True))
        assert differences(state, eager_state) == []


class NoisySGD(torch.optim.SGD):
    """An optimizer that draws: noise added to every parameter it updates."""

    @torch.no_grad()
    def step(self, closure=None):
        super().step()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(torch.randn_like(p), alpha=1e-3)


def test_an_optimizer_that_draws_keeps_the_dispatch_mode_check_and_trains_bit_for_bit():
    """Its draws run inside the user's optimizer, not through the runtime's watched calls, so
    its first step is observed by the dispatch mode (and recorded again)."""
    results = []
    for planned in (False, True):
        model, _, batch = _setup()
        opt = NoisySGD(model.parameters(), lr=0.1)
        if planned:
            step = memplan.compile_step(model, opt, torch.nn.functional.cross_entropy, batch, allocator="replay")
        else:

            def step(b, model=model, opt=opt):
                loss = torch.nn.functional.cross_entropy(model(b[0]), b[1])
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss

        torch.manual_seed(1)
        results.append(([step(batch).detach() for _ in range(3)], snapshot(model, opt)))
    (eager_losses, eager_state), (losses, state) = results
    assert step.report["first_steps"]["visits_before_replay"] == 2
    assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses, strict=True))
    assert differences(state, eager_state) == []
