"""Every torch.optim optimizer and variant trains bit for bit like eager, or is refused at
compile time; and the runtime's self-check catches a step that does not (issue: foreach SGD
trained differently without a word)."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest

import memplan
import torch
from memplan.api import optimize
from memplan.errors import SelfCheckFailed
from memplan.torch.capture import capture_train_step
from memplan.torch.equivalence import bitwise_equal, differences, snapshot
from memplan.torch.optimizer_matrix import MatrixNet, OptimizerCase, make_optimizer, optimizer_cases, run_case
from memplan.torch.run.interpreter import Plan, StepRunner
from memplan.torch.run.selfcheck import SelfCheck

CASES = optimizer_cases()
REFUSED = {"LBFGS", "SparseAdam"}
# `make test` runs every optimizer in its for-loop, foreach and fused forms, warm state and the
# refused ones; the other variants (option combinations) run with `make test-all` and in
# bench/optimizers.py, which checks all of them after every step.
QUICK_VARIANTS = ("plain", "foreach", "fused")


def _quick(case: OptimizerCase) -> bool:
    return case.variant in QUICK_VARIANTS or case.warm or case.optimizer in REFUSED


def _params(cases: list[OptimizerCase], quick=_quick) -> list:
    return [c if quick(c) else pytest.param(c, marks=pytest.mark.slow, id=c.label) for c in cases]


@pytest.mark.parametrize("case", _params(CASES), ids=[c.label for c in CASES])
def test_every_optimizer_variant_trains_like_eager_or_is_refused_at_compile_time(case):
    result = run_case(case, steps=3, time_limit_seconds=0.5)
    if case.optimizer in REFUSED:
        assert result.outcome == "refused" and result.steps == 0, result
        assert case.optimizer in result.detail and "\n" not in result.detail
    else:
        assert result.outcome == "equal", result


VIEWS_CASES = [c for c in CASES if c.optimizer not in REFUSED and c.variant in ("foreach", "fused", "plain")]
QUICK_VIEWS = ("SGD[plain]", "Adam[plain]", "AdamW[plain]", "Adam[foreach]", "AdamW[fused]")


@pytest.mark.parametrize(
    "case",
    # views is the fallback mode: one optimizer per form in `make test`, all with `make test-all`
    _params(VIEWS_CASES, quick=lambda c: c.label in QUICK_VIEWS),
    ids=[c.label for c in VIEWS_CASES],
)
def test_arena_views_runtime_also_trains_like_eager(case):
    assert run_case(case, steps=3, allocator="views", time_limit_seconds=0.5).outcome == "equal"


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_reported_foreach_sgd_rows_are_now_equal(momentum):
    """The issue's MLP (64-128-10), batch 16, SGD(lr=0.1, foreach=True): losses and parameters
    equal eager's at every step (they drifted from step 1 on)."""

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))

    planned, eager = mlp(), mlp()
    opt_p = torch.optim.SGD(planned.parameters(), lr=0.1, momentum=momentum, foreach=True)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=momentum, foreach=True)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    loss_fn = torch.nn.functional.cross_entropy
    step = memplan.compile_step(planned, opt_p, loss_fn, (x, y), time_limit_seconds=0.5)
    for _ in range(3):
        loss = step((x, y))
        ref = loss_fn(eager(x), y)
        ref.backward()
        opt_e.step()
        opt_e.zero_grad(set_to_none=True)
        assert torch.equal(loss, ref.detach())
    assert differences(snapshot(eager, opt_e), snapshot(planned, opt_p)) == []


# ---------------------------------------------------------------------------- the self-check


def _setup(optimizer="SGD", options=None):
    case = OptimizerCase(
        optimizer, "test", {"foreach": True, "momentum": 0.9} if options is None else options, {"lr": 0.01}
    )
    torch.manual_seed(0)
    model = MatrixNet()
    opt = make_optimizer(case, model)
    batch = (torch.randn(8, 16), torch.randint(0, 8, (8,)))
    return model, opt, batch


class SkipsOneParameter(StepRunner):
    """A broken runtime: every update group leaves ``fc2.weight`` out."""

    def _update(self, ins, env):
        keep = [i for i, name in enumerate(ins.param_names) if name != "fc2.weight"]
        ins = dataclasses.replace(
            ins,
            param_names=tuple(ins.param_names[i] for i in keep),
            grad_nodes=tuple(ins.grad_nodes[i] for i in keep),
            split=True,
        )
        if ins.param_names:
            super()._update(ins, env)


@pytest.mark.parametrize("options", [{"foreach": True, "momentum": 0.9}, {"foreach": False}])
def test_self_check_names_the_parameter_a_broken_update_skipped(options):
    model, opt, batch = _setup("SGD", options)
    capture, plan = optimize(model, opt, torch.nn.functional.cross_entropy, batch, time_limit_seconds=0.5)
    runner = SkipsOneParameter(capture, Plan(tuple(plan.order)), model, opt)
    with pytest.raises(
        SelfCheckFailed, match=re.escape("parameter 'fc2.weight' received a gradient but the step did not update")
    ):
        runner(batch)


def _self_check(model, opt, batch) -> SelfCheck:
    return SelfCheck(capture_train_step(model, opt, torch.nn.functional.cross_entropy, batch), model, opt)


def _watched_eager_step(model, opt, batch, *, extra=None, skip_zero_grad=False, steps=1):
    with _self_check(model, opt, batch).watch():
        loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        for _ in range(steps):
            opt.step()
        if extra is not None:
            extra()
        if not skip_zero_grad:
            opt.zero_grad(set_to_none=True)


EAGER_CHECKED = [c for c in CASES if c.optimizer not in REFUSED and not c.warm][::3]


@pytest.mark.parametrize("case", EAGER_CHECKED, ids=[c.label for c in EAGER_CHECKED])
def test_eager_step_passes_the_self_check(case):
    """The self-check's account of a step is eager's: an eager step under it passes, twice
    (the second time with the state the first one created)."""
    torch.manual_seed(0)
    model = MatrixNet()
    opt = make_optimizer(case, model)
    batch = (torch.randn(8, 16), torch.randint(0, 8, (8,)))
    for _ in range(2):
        _watched_eager_step(model, opt, batch)


def test_self_check_catches_an_extra_random_draw():
    model, opt, batch = _setup()
    with pytest.raises(SelfCheckFailed, match="random op"):
        _watched_eager_step(model, opt, batch, extra=lambda: torch.rand(3))


def test_self_check_catches_a_step_counted_twice():
    model, opt, batch = _setup("Adam", {"foreach": True})
    with pytest.raises(SelfCheckFailed, match="step count"):
        _watched_eager_step(model, opt, batch, steps=2)


def test_self_check_catches_gradients_left_behind():
    model, opt, batch = _setup()
    with pytest.raises(SelfCheckFailed, match=re.escape("kept a .grad")):
        _watched_eager_step(model, opt, batch, skip_zero_grad=True)


def test_self_check_catches_a_missing_running_stat_update():
    model, opt, batch = _setup()
    check = _self_check(model, opt, batch)
    with pytest.raises(SelfCheckFailed, match=re.escape("buffer 'bn.running_mean' was not updated")), check.watch():
        model.bn.eval()  # no running-statistics update
        torch.nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_self_check_catches_a_parameter_written_without_a_gradient():
    model, opt, batch = _setup()
    with pytest.raises(SelfCheckFailed, match=re.escape("parameter 'unused.weight' was written")):
        _watched_eager_step(model, opt, batch, extra=lambda: model.unused.weight.data.add_(1.0))


def test_refused_optimizers_say_why_in_one_line():
    model = MatrixNet()
    batch = (torch.randn(8, 16), torch.randint(0, 8, (8,)))
    with pytest.raises(memplan.errors.UnsupportedOp, match="LBFGS is not supported: it needs a closure"):
        memplan.compile_step(model, torch.optim.LBFGS(model.parameters()), torch.nn.functional.cross_entropy, batch)


def test_a_parameter_the_optimizer_does_not_own_is_refused():
    """Eager would accumulate its .grad across steps (zero_grad only clears the optimizer's)."""
    model = MatrixNet()
    opt = torch.optim.SGD(model.fc1.parameters(), lr=0.1)
    batch = (torch.randn(8, 16), torch.randint(0, 8, (8,)))
    with pytest.raises(
        memplan.errors.UnsupportedOp, match=re.escape("'bn.weight' requires grad but no optimizer owns it")
    ):
        memplan.compile_step(model, opt, torch.nn.functional.cross_entropy, batch)


def test_an_optimizer_with_step_hooks_runs_one_step_per_training_step():
    """A hook must fire once per step, as in eager: the updates are one group at the end."""
    model, opt, batch = _setup("Adam", {})
    calls = []
    opt.register_step_post_hook(lambda *_: calls.append(1))
    eager = copy.deepcopy(model)
    eager_opt = make_optimizer(OptimizerCase("Adam", "test", {}, {"lr": 0.01}), eager)
    step = memplan.compile_step(model, opt, torch.nn.functional.cross_entropy, batch, time_limit_seconds=0.5)
    for k in range(3):
        torch.manual_seed(k)
        step(batch)
        torch.manual_seed(k)
        torch.nn.functional.cross_entropy(eager(batch[0]), batch[1]).backward()
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)
    assert len(calls) == 3
    assert differences(snapshot(eager, eager_opt), snapshot(model, opt)) == []


def test_bitwise_equal_tells_nan_payloads_and_signed_zeros_apart():
    assert bitwise_equal(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    assert not bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not bitwise_equal(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))
