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
from memplan.torch.run.codegen import generate
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
    # the interpreter's bits, with ops through their proven Python bindings (issue 34); the
    # executor before it (every op through OpOverload._op) writes the same statistics
    assert "_bind" in runner.generated_step().source
    boxed = generate(runner, direct=False)
    assert "_bind" not in boxed.source and boxed.static_stats == runner.generated_step().static_stats


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


def _traced_ops(fn, *args) -> list:
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn, tracing_mode="fake")(*args)
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def _real(value, tensors):
    return tensors[value.name] if isinstance(value, torch.fx.Node) else value


def test_an_op_is_called_through_its_python_binding_only_where_that_makes_the_same_call():
    """Issue 34: a proven binding (``torch.convolution``, ``Tensor.add_``) makes the op's own
    call (same op, same arguments: the same bits as ``OpOverload._op``); an op whose binding
    would dispatch another overload (``torch.div(x, 2.0)`` is ``div.Tensor``, not ``div.Scalar``)
    or that has none (``threshold_backward``) keeps ``_op``."""
    from memplan.torch.run.codegen import _direct_binding

    aten = torch.ops.aten

    def step(x, w, b):
        y = aten.convolution.default(x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        r = aten.relu.default(y)
        g = aten.threshold_backward.default(r, y, 0)
        s = aten.div.Scalar(g, 2.0)
        t = aten.add.Tensor(s, r, alpha=2)
        return aten.add_.Tensor(t, 1.5), aten.mean.dim(t, [2, 3], True)

    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(2, 3, 8, 8, generator=g), torch.randn(4, 3, 3, 3, generator=g), torch.randn(4, generator=g))
    nodes = _traced_ops(step, *inputs)
    bound = {n.target: _direct_binding(n.target, n, {}) for n in nodes}
    assert bound[torch.ops.aten.convolution.default] is torch._C._VariableFunctions.convolution
    assert bound[torch.ops.aten.div.Scalar] is None and bound[torch.ops.aten.threshold_backward.default] is None
    assert bound[torch.ops.aten.add_.Tensor] is torch._C.TensorBase.add_
    assert sum(b is not None for b in bound.values()) >= 4
    values = {}
    placeholders = [n for n in next(iter(nodes)).graph.nodes if n.op == "placeholder"]
    values.update({p.name: x for p, x in zip(placeholders, inputs, strict=True)})
    for node in nodes:  # each op run both ways on the same inputs: the same bits
        args = [_real(a, values) for a in node.args]
        kwargs = {k: _real(v, values) for k, v in node.kwargs.items()}
        via_op = node.target._op(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
        if bound[node.target] is not None:
            via_binding = bound[node.target](*[a.clone() if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
            assert torch.equal(via_binding, via_op), node.target
        values[node.name] = node.target._op(*args, **kwargs)


def test_the_update_matcher_finds_the_tensors_pytree_finds_in_the_same_order():
    from memplan.torch.run.interpreter import _tensors_in
    from memplan.torch.tensors import tensor_leaves

    a, b, c, d = (torch.zeros(i + 1) for i in range(4))
    value = ((a, 1.0, [b, None, (c,)]), {"out": d, "alpha": 2})
    found: list = []
    _tensors_in(value, found)
    assert [id(t) for t in found] == [id(t) for t in tensor_leaves(value)] == [id(a), id(b), id(c), id(d)]


class _Noisy(torch.nn.Module):
    """Random factories in the forward, as ViTMAE's masking draws ``torch.rand(batch, patches)``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(4, 8)
        keep = torch.argsort(noise, dim=1)[:, :5]
        return (torch.gather(self.w * x, 1, keep) * torch.randn(4, 5)).sum()


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_random_factories_draw_what_eager_draws_from_the_first_call(allocator: str) -> None:
    """The generated code's binding proofs once ran ``aten.rand`` for real on the CPU (a factory
    has no tensor argument to make meta): the first call drew three times, trained on the third
    draw and left the generator two draws ahead, silently. Every call now matches eager's bits
    and leaves the generator where eager leaves it."""
    torch.manual_seed(0)
    model, x = _Noisy(), torch.randn(4, 8)
    twin = _Noisy()
    twin.load_state_dict(model.state_dict())
    opt, twin_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)

    @memplan.compile(model=model, optimizer=opt, allocator=allocator)
    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = model(batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for call in range(3):
        torch.manual_seed(10 + call)
        ours, ours_state = step(x), torch.get_rng_state()
        torch.manual_seed(10 + call)
        loss = twin(x)
        loss.backward()
        twin_opt.step()
        twin_opt.zero_grad(set_to_none=True)
        assert torch.equal(ours, loss), call
        assert torch.equal(ours_state, torch.get_rng_state()), call
        assert torch.equal(model.w, twin.w), call


def test_a_factorys_binding_proof_runs_no_kernel() -> None:
    """The proof of ``aten.rand``'s binding runs on the meta device: the generator stays put
    (``torch.rand`` fills in the dtype, so the op keeps its boxed call)."""
    from memplan.torch.run.codegen import _direct_binding

    def step(x):
        return torch.ops.aten.mul.Tensor(x, torch.ops.aten.rand.default([4, 8], device=torch.device("cpu")))

    nodes = _traced_ops(step, torch.randn(4, 8))
    rand = next(n for n in nodes if n.target is torch.ops.aten.rand.default)
    before = torch.get_rng_state()
    assert _direct_binding(rand.target, rand, {}) is None
    assert torch.equal(before, torch.get_rng_state())
