"""The step-function form (memplan.compile): the loops people write train bit for bit like the
same function run eagerly, the user's objects come back untouched from capture, and what cannot
be planned is refused in one line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import memplan
import torch
from memplan.errors import CaptureError, DataDependentControlFlow
from memplan.torch.loops import FEATURES, Setup, _setup, bert, gpt2, mlp, run_feature

ROOT = Path(__file__).resolve().parents[2]
MLP = mlp(width=64, batch=8)
TINY_GPT2 = gpt2(hidden=32, layers=2, batch=4, seq=16, vocab=128)
TINY_BERT = bert(hidden=32, layers=2, batch=4, seq=16, vocab=128)


@pytest.mark.parametrize("feature", list(FEATURES))
def test_every_loop_feature_trains_like_eager_on_an_mlp(feature):
    result = run_feature(MLP, FEATURES[feature], steps=3, time_limit_seconds=0.5)
    assert result.works, result
    assert result.max_abs_diff == 0.0


HF_CASES = [
    (TINY_GPT2, "dict batch, loss from the output"),
    (TINY_GPT2, "gradient accumulation (2 micro-batches)"),
    (TINY_GPT2, "float16 + GradScaler (skipped steps)"),
    (TINY_BERT, "nested batch"),
    (TINY_BERT, "clip_grad_norm_"),
    (TINY_BERT, "autocast bfloat16"),
]


@pytest.mark.parametrize(("spec", "feature"), HF_CASES, ids=[f"{s.name}-{f}" for s, f in HF_CASES])
def test_hf_models_with_their_loss_in_the_output(spec, feature):
    result = run_feature(spec, FEATURES[feature], steps=3, time_limit_seconds=0.5)
    assert result.works and result.max_abs_diff == 0.0, result


def test_the_scaler_feature_really_skips_steps_and_memplan_skips_the_same():
    feature = FEATURES["float16 + GradScaler (skipped steps)"]
    setup = _setup(MLP, feature, seed=0)
    step = memplan.compile(
        feature.step(setup), model=setup.model, optimizer=setup.optimizer, scaler=setup.scaler, time_limit_seconds=0.5
    )
    scales = []
    for k in range(4):
        step(MLP.batch(k))
        scales.append(setup.scaler.get_scale())
    assert scales[0] < 2.0**20, "the first step overflows float16 and backs off"
    steps_taken = {float(s["step"]) for s in setup.optimizer.state.values()}
    assert steps_taken and max(steps_taken) < 4, "skipped steps do not update"


def _alternating_scaler_setup() -> Setup:
    """The fp16 + GradScaler step with a scale that float16 holds: it skips exactly the
    steps whose batch overflows (inputs scaled far past float16's range)."""
    setup = _setup(MLP, FEATURES["float16 + GradScaler (skipped steps)"], seed=0)
    setup.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    return setup


def _overflowing(batch: dict) -> dict:
    return {**batch, "x": batch["x"] * 1e5}


def test_a_scaler_loop_alternating_skips_and_updates_replays_both_kinds_from_one_plan():
    """The plan is recorded on skipped steps (as BERT's fp16 row of bench/results/loops.md):
    the updating kind diverges until two updates allocated alike (the first one creates AdamW's
    state), then becomes a branch, and from then on every step of either kind replays from the
    plan, bit for bit like eager, holding outside the arena no more than the branch leaves to the
    ordinary allocator."""
    from memplan.torch.equivalence import differences, snapshot
    from memplan.torch.loops import _seeded
    from memplan.torch.measure import allocator_peak_bytes

    feature = FEATURES["float16 + GradScaler (skipped steps)"]
    eager, planned = _alternating_scaler_setup(), _alternating_scaler_setup()
    eager_step = feature.step(eager)
    planned_step = memplan.compile(
        feature.step(planned),
        model=planned.model,
        optimizer=planned.optimizer,
        scaler=planned.scaler,
        time_limit_seconds=0.5,
    )
    skip, update = _overflowing(MLP.batch(0)), MLP.batch(1)
    replayed = {}  # kind -> branches it replayed on
    for k, (kind, batch) in enumerate([("skip", skip)] * 3 + [("update", update), ("skip", skip)] * 5):
        runner = planned_step.runner_for(batch)
        scale = planned.scaler.get_scale()
        eager_loss = _seeded(eager_step, batch, k)
        planned_loss, outside = allocator_peak_bytes(_seeded, planned_step, batch, k)
        assert (planned.scaler.get_scale() < scale) == (kind == "skip"), "the batch decides the kind"
        assert (
            differences(
                snapshot(eager.model, eager.optimizer, eager.scaler),
                snapshot(planned.model, planned.optimizer, planned.scaler),
            )
            == []
        )
        assert torch.equal(eager_loss.nan_to_num(), planned_loss.nan_to_num())
        if k == 2:
            assert runner.replaying and len(runner.plan.branches) == 1
            recorded_on_skips = runner.recordings
        stats = runner.last_stats
        if k >= 8:  # the branches are in: every step replays from the plan
            assert stats is not None and stats.diverged_at is None and stats.blocked == 0, stats
            branch = runner.plan.branches[stats.branch]
            assert outside <= sum(size for size, o in zip(branch.sizes, branch.offsets, strict=True) if o < 0)
            replayed.setdefault(kind, set()).add(stats.branch)
    assert replayed["skip"] and replayed["update"] and not replayed["skip"] & replayed["update"]
    assert runner.replays >= 6 and runner.recordings == recorded_on_skips, "no step recorded after the skips"


def _mlp_setup() -> Setup:
    return _setup(MLP, FEATURES["dict batch, loss from the output"], seed=0)


def test_capture_gives_the_users_objects_back_untouched():
    s = _setup(MLP, FEATURES["float16 + GradScaler (skipped steps)"], seed=0)
    params = {n: p for n, p in s.model.named_parameters()}
    buffers = {n: b for n, b in s.model.named_buffers()}
    group_params = [list(g["params"]) for g in s.optimizer.param_groups]
    values = {n: p.detach().clone() for n, p in params.items()}
    capture, _ = memplan.plan_step(
        FEATURES["float16 + GradScaler (skipped steps)"].step(s),
        MLP.batch(0),
        model=s.model,
        optimizers=[s.optimizer],
        scaler=s.scaler,
        time_limit_seconds=0.5,
    )
    assert {n: p for n, p in s.model.named_parameters()} == params
    assert all(a is b for a, b in zip(buffers.values(), dict(s.model.named_buffers()).values(), strict=True))
    assert [list(g["params"]) for g in s.optimizer.param_groups] == group_params
    assert all(torch.equal(values[n], p) for n, p in s.model.named_parameters())
    assert all(p.grad is None for p in s.model.parameters())
    assert not s.optimizer.state, "capture never creates the user's optimizer state"
    assert s.scaler.get_scale() == 2.0**20
    assert [r.kind for r in capture.regions] == [
        "scaler.unscale_",
        "scaler.step",
        "scaler.update",
        "optimizer.zero_grad",
    ]


def test_compile_is_a_decorator_and_plans_once_per_batch_shape():
    s = _mlp_setup()

    @memplan.compile(model=s.model, optimizer=s.optimizer, time_limit_seconds=0.5)
    def train_step(batch):
        loss = s.loss(batch)
        loss.backward()
        s.optimizer.step()
        s.optimizer.zero_grad()
        return loss

    train_step(MLP.batch(0))
    train_step(MLP.batch(1))
    assert len(train_step.plans) == 1
    smaller = {k: v[:4] for k, v in MLP.batch(2).items()}
    train_step(smaller)
    assert len(train_step.plans) == 2


def test_a_step_that_keeps_its_gradients_is_refused():
    s = _mlp_setup()

    def accumulate_forever(batch):
        s.loss(batch).backward()
        s.optimizer.step()

    step = memplan.compile(accumulate_forever, model=s.model, optimizer=s.optimizer)
    with pytest.raises(CaptureError, match=re.escape("that its next call accumulates into")):
        step(MLP.batch(0))
    assert all(p.grad is None for p in s.model.parameters())


def test_a_step_that_never_steps_is_refused():
    s = _mlp_setup()

    def no_update(batch):
        s.loss(batch).backward()
        s.model.zero_grad()

    with pytest.raises(CaptureError, match=re.escape("never calls optimizer.step()")):
        memplan.compile(no_update, model=s.model, optimizer=s.optimizer)(MLP.batch(0))


def test_a_step_that_reads_a_value_is_refused_in_one_line():
    s = _mlp_setup()

    def logs_its_loss(batch):
        loss = s.loss(batch)
        if loss.item() > 100:
            raise RuntimeError("diverged")
        loss.backward()
        s.optimizer.step()
        s.optimizer.zero_grad()

    with pytest.raises(DataDependentControlFlow) as info:
        memplan.compile(logs_its_loss, model=s.model, optimizer=s.optimizer)(MLP.batch(0))
    assert "\n" not in str(info.value)
    assert "loss.item() outside the step" in str(info.value) and "test_loops.py" in str(info.value)


@pytest.mark.parametrize(
    "script",
    ["compile_step.py", "step_function.py", pytest.param("muon_adamw_budget.py", marks=pytest.mark.slow)],
)
def test_examples_run(script):
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script)], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]  # its steps' lines say which differed
    assert "DIFFERS" not in done.stdout


@pytest.mark.parametrize(
    "feature",
    ["gradient accumulation (2 micro-batches)", "float16 + GradScaler (skipped steps)", "foreach optimizer"],
)
def test_the_planned_step_peaks_below_eager(feature):
    """The bench's own measure (allocator count plus arena, steady steps, same random draws):
    these rows were above eager or tied with it (the GradScaler row until scaler.step updated
    parameter by parameter after unscale_, the foreach row until its step was traced and run
    parameter by parameter; each gradient is released after its update)."""
    result = run_feature(MLP, FEATURES[feature], steps=3, measure=True, time_limit_seconds=0.5)
    assert result.works and result.max_abs_diff == 0.0, result
    assert 0 < result.planned_peak_bytes < result.eager_peak_bytes, result


def _scaler_groups(step_fn, setup: Setup, kind: str = "scaler.step") -> list:
    from memplan.api import plan_step
    from memplan.torch.run.updates import update_groups

    capture, _ = plan_step(
        step_fn, MLP.batch(0), model=setup.model, optimizers=[setup.optimizer], scaler=setup.scaler, reorder=False
    )
    return [g for g in update_groups(capture) if capture.regions[g.region].kind == kind]


def test_a_foreach_step_on_the_cpu_is_traced_and_run_parameter_by_parameter():
    feature = FEATURES["foreach optimizer"]
    setup = _setup(MLP, feature, seed=0)
    groups = _scaler_groups(feature.step(setup), setup, "optimizer.step")
    assert len(groups) == len(list(setup.model.parameters())) and all(len(g.params) == 1 for g in groups)


def test_scaler_step_after_unscale_updates_each_parameter_on_its_own():
    feature = FEATURES["float16 + GradScaler (skipped steps)"]
    setup = _setup(MLP, feature, seed=0)
    groups = _scaler_groups(feature.step(setup), setup)
    trainable = [n for n, p in setup.model.named_parameters() if p.requires_grad]
    assert sorted(p for g in groups for p in g.params) == sorted(trainable)
    assert len(groups) == len(trainable) and all(g.split for g in groups)


def _scaler_without_unscale(s: Setup):
    def step(batch):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = s.loss(batch)
        s.scaler.scale(loss).backward()
        s.scaler.step(s.optimizer)  # unscales by itself: it needs every gradient at once
        s.scaler.update()
        s.optimizer.zero_grad()
        return loss

    return step


def test_a_scaler_step_that_unscales_by_itself_stays_one_call_and_trains_like_eager():
    from memplan.torch.loops import Feature

    feature = Feature("scaler.step without unscale_", _scaler_without_unscale, scaler=True)
    setup = _setup(MLP, feature, seed=0)
    groups = _scaler_groups(feature.step(setup), setup)
    assert len(groups) == 1 and len(groups[0].params) == len(list(setup.model.parameters()))
    result = run_feature(MLP, feature, steps=4, time_limit_seconds=0.5)
    assert result.works and result.max_abs_diff == 0.0, result
