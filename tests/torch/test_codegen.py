"""The generated executor (memplan.torch.run.codegen) against the interpreter it replaces: the
same bits after every step, the same run statistics, on models with and without BatchNorm,
in both allocator modes, with foreach / fused optimizers and the step-function features."""

from __future__ import annotations

import pytest

import memplan
import memplan.api  # OR-Tools loaded before the planned allocator (they crash the other way round)
import torch
from memplan.errors import MemplanError
from memplan.torch.equivalence import differences, snapshot
from memplan.torch.loops import FEATURES, Batch, LoopModel, _setup, gpt2, mlp
from memplan.torch.run.allocator import available as allocator_available
from memplan.torch.run.interpreter import StepRunner

MLP = mlp(width=64, batch=8)
TINY_GPT2 = gpt2(hidden=32, layers=2, batch=4, seq=16, vocab=128)
ALLOCATORS = [
    "views",
    pytest.param(
        "replay",
        marks=pytest.mark.skipif(not allocator_available(), reason="no C++ compiler: no planned allocator"),
    ),
]


class _ConvBN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
            torch.nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
        )
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _cnn() -> LoopModel:
    def make_batch(seed: int) -> Batch:
        g = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(4, 3, 16, 16, generator=g), "labels": torch.randint(0, 5, (4,), generator=g)}

    def loss(model: torch.nn.Module):
        return lambda b: torch.nn.functional.cross_entropy(model(b["x"]), b["labels"])

    return LoopModel("conv + BatchNorm", _ConvBN, make_batch, loss, "body.0.")


CNN = _cnn()


def _both_executors(spec: LoopModel, feature_name: str, allocator: str, steps: int = 5) -> list:
    """Run the feature's step with each executor from the same state; fail at the first step
    whose loss, parameters, gradients, buffers, optimizer / scaler / scheduler state or RNG
    differ in any bit. Returns the two compiled steps."""
    feature = FEATURES[feature_name]
    sides = [_setup(spec, feature, 0) for _ in range(2)]
    compiled = [
        memplan.compile(
            feature.step(s),
            model=s.model,
            optimizer=s.optimizer,
            scaler=s.scaler,
            scheduler=s.scheduler or (),
            time_limit_seconds=0.5,
            allocator=allocator,
            executor=executor,
        )
        for s, executor in zip(sides, ("generated", "interpreted"), strict=True)
    ]
    for k in range(steps):
        batch = spec.batch(k)
        if feature.nested:
            batch = {"inputs": {key: v for key, v in batch.items() if key != "labels"}, "labels": batch["labels"]}
        losses = []
        for step in compiled:
            torch.manual_seed(1000 + k)
            losses.append(step(batch))
        found = differences(*(snapshot(s.model, s.optimizer, *s.objects()) for s in sides))
        assert not found, f"step {k}: {found[:3]}"
        assert torch.equal(losses[0].nan_to_num(), losses[1].nan_to_num()), f"step {k}: loss"
    return compiled


def _runner(step) -> StepRunner:
    runner = next(iter(step.runners.values()))
    return getattr(runner, "run", runner)


# test_loops.py runs every feature with the generated executor (the default) against eager on
# three models; here each feature group is compared with the interpreter once (suite time)
@pytest.mark.parametrize("allocator", ALLOCATORS)
@pytest.mark.parametrize("spec", [MLP, CNN, TINY_GPT2], ids=["mlp", "cnn-bn", "gpt2"])
@pytest.mark.parametrize("feature", ["foreach optimizer"])
def test_generated_and_interpreted_steps_give_the_same_bits(spec, feature, allocator):
    generated, interpreted = _both_executors(spec, feature, allocator)
    runner = _runner(generated)
    assert runner.executor == "generated" and runner._generated is not None
    assert _runner(interpreted)._generated is None
    # the interpreter's per-op closures exist only where it runs (they would stay resident)
    assert runner._fetching is None and _runner(interpreted)._fetching is not None
    assert all(getattr(ins, "fetch", None) is None for ins in runner.instructions)
    # the same ops wrote the same bytes in the same places
    assert runner.stats == _runner(interpreted).stats


@pytest.mark.parametrize("allocator", ["replay"])
@pytest.mark.parametrize(
    "feature",
    [
        "fused optimizer",
        "gradient accumulation (2 micro-batches)",
        "float16 + GradScaler (skipped steps)",
        "nested batch",
    ],
)
def test_every_loop_feature_gives_the_same_bits_generated_and_interpreted(feature, allocator):
    _both_executors(MLP, feature, allocator, steps=4)


def test_the_generated_step_is_plain_calls_and_frees():
    step = _both_executors(MLP, "dict batch, loss from the output", "views", steps=1)[0]
    lines = _runner(step).generated_step().source.splitlines()
    assert lines[0] == "def step(env, runner):"
    body = [line for line in lines[1:] if "= env[" not in line]  # the inputs and constants, bound once
    assert any(line.strip().startswith("del ") for line in body)
    assert any("runner._update_with(" in line for line in body)
    assert not any("env" in line for line in body)


def test_an_unknown_executor_is_refused():
    s = _setup(MLP, FEATURES["dict batch, loss from the output"], 0)
    step = memplan.compile(
        FEATURES["dict batch, loss from the output"].step(s),
        model=s.model,
        optimizer=s.optimizer,
        time_limit_seconds=0.5,
        allocator="views",
        executor="jit",
    )
    with pytest.raises(MemplanError, match="executor must be one of"):
        step(MLP.batch(0))


def _update_calls(runner: StepRunner) -> int:
    return sum("runner._update_with(" in line for line in runner.generated_step().source.splitlines())


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_consecutive_updates_run_as_one_optimizer_step(allocator):
    """Updates with no op between them are one ``optimizer.step()`` in the generated step (the
    planned allocator serves its addresses; with arena views each update follows its own traced
    ops): the same bits as the interpreter's call per update, over two param groups with
    different hyper-parameters."""
    generated, interpreted = _both_executors(CNN, "several param groups", allocator, steps=4)
    runner = _runner(generated)
    updates = sum(type(ins).__name__ == "_Update" for ins in runner.instructions)
    assert updates == sum(type(ins).__name__ == "_Update" for ins in _runner(interpreted).instructions)
    if allocator == "replay":
        assert _update_calls(runner) < updates  # the batch-norm's weight and bias are ready at one op
    else:
        assert _update_calls(runner) == updates
