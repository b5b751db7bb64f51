"""Refusals that read as reasons.

- A module cast or move inside ``forward`` that changes nothing (``.to(same dtype)``, ``.float()``
  on a float32 module, ``.cpu()`` on a CPU module) is captured as the no-op it is: the step
  trains bit for bit like eager. One that changes the parameters is refused in one line that
  names the module and the call (memplan.torch.capture.casts). HF's Switch-Transformers, whose
  router casts its classifier on every call, is the real case.
- Wrappers memplan does not plan (FSDP2, FSDP1, DDP, torch.compile, DTensor parameters) are
  refused by name before capture (memplan.torch.capture.wrappers).
- A step that sets the random generator and draws after it (``torch.utils.checkpoint`` around
  dropout, a ``torch.manual_seed`` in the step), or leaves it set, is refused in one line with
  the generator and the model as they were (memplan.torch.capture.generator); a checkpoint
  around code without random ops trains bit for bit.
- A step whose ops get other Python numbers from one call to the next (a counter the model
  keeps, an annealed temperature) is refused in one line: a plan would freeze the first value.
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Callable, Iterator

import pytest
import torch.distributed as dist

import memplan
import torch
from memplan.errors import (
    CaptureError,
    DataDependentControlFlow,
    DynamicShape,
    ModuleCast,
    UnplannedWrapper,
    UnsupportedOp,
)
from memplan.torch.capture.wrappers import refuse_unplanned_wrappers
from memplan.torch.equivalence import differences, snapshot

STEPS = 5


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The models are tiny: a second intra-op thread only spins on this 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train_both(model: torch.nn.Module, batch: tuple, loss_fn: Callable) -> None:
    """``STEPS`` steps of memplan.compile and of eager from the same state and seeds: losses,
    parameters, optimizer state and random state bit for bit equal after each."""
    eager = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)

    @memplan.compile(model=model, optimizer=opt)
    def step(b):
        loss = loss_fn(model(b[0]), b[1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for k in range(STEPS):
        torch.manual_seed(k)
        loss = step(batch)
        torch.manual_seed(k)
        eager_loss = loss_fn(eager(batch[0]), batch[1])
        eager_loss.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        assert torch.equal(loss, eager_loss.detach()), k
        assert not differences(snapshot(eager, eager_opt), snapshot(model, opt)), k


# ---------------------------------------------------------------- casts inside forward


class Casting(torch.nn.Module):
    """Casts its ``inner`` layer in ``forward`` with each of ``casts``, as HF's router does."""

    def __init__(self, *casts: Callable[[torch.nn.Module], torch.nn.Module]) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 2)
        self.casts = casts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for cast in self.casts:
            self.inner = cast(self.inner)
        return self.head(torch.relu(self.norm(self.inner(x))))


class CastsItself(Casting):
    """The whole model cast and moved from inside its own forward, buffers included."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super(CastsItself, self.float().cpu()).forward(x)


NO_OPS = (
    lambda m: m.to(torch.float32),
    lambda m: m.float(),
    lambda m: m.cpu(),
    lambda m: m.to("cpu"),
    lambda m: m.to(torch.device("cpu"), torch.float32),
    lambda m: m.type(torch.float32),
)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(16, 8), torch.randn(16, 2)


def test_casts_that_change_nothing_are_no_ops_and_train_bit_for_bit_like_eager() -> None:
    torch.manual_seed(0)
    model = CastsItself(*NO_OPS)
    _train_both(model, _batch(), torch.nn.functional.mse_loss)
    assert not {"_apply", "to", "float"} & set(model.inner.__dict__)  # the capture's checks are gone
    infer = memplan.compile_inference(model.eval(), _batch()[0])
    assert torch.equal(infer(_batch()[0]), model(_batch()[0]))


@pytest.mark.parametrize(
    ("cast", "call"),
    [
        (lambda m: m.to(torch.float64), "inner.to(torch.float64)"),
        (lambda m: m.half(), "inner.half()"),
        (lambda m: m.to(dtype=torch.bfloat16), "inner.to(dtype=torch.bfloat16)"),
    ],
)
def test_a_cast_that_changes_the_parameters_is_refused_in_one_line_naming_it(cast, call) -> None:
    torch.manual_seed(0)
    model = Casting(cast)
    before = {n: p for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ModuleCast) as err:
        memplan.compile_step(model, opt, torch.nn.functional.mse_loss, _batch())
    message = str(err.value)
    assert "\n" not in message
    assert f"`{call}` inside the step changes the module's parameters" in message
    assert "cast or move the model before memplan.compile" in message
    # the user's model is as it was: same parameter objects, float32, no capture attributes left
    assert dict(model.named_parameters()) == before
    assert all(p.dtype == torch.float32 and not p.is_meta for p in model.parameters())
    assert not {"_apply", "to", "half"} & set(model.inner.__dict__)


# ---------------------------------------------------------------- HF Switch-Transformers


def _transformers():
    return pytest.importorskip("transformers", reason="Switch-Transformers is HF transformers' own")


def _switch_config(**overrides) -> transformers.SwitchTransformersConfig:  # noqa: F821
    return _transformers().SwitchTransformersConfig(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        num_experts=4,
        expert_capacity=8,
        num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=1,
        dropout_rate=0.0,
        **overrides,
    )


class RoutedProjection(torch.nn.Module):
    """A projection, then Switch-Transformers' own router (which casts its classifier to the
    router dtype on every call and jitters its input with random noise)."""

    def __init__(self, config: transformers.SwitchTransformersConfig) -> None:  # noqa: F821
        super().__init__()
        from transformers.models.switch_transformers.modeling_switch_transformers import SwitchTransformersTop1Router

        self.proj = torch.nn.Linear(config.d_model, config.d_model)
        self.router = SwitchTransformersTop1Router(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expert_index, probs, logits = self.router(self.proj(x))
        return logits.logsumexp(-1) + probs.squeeze(-1) * expert_index.sum(-1)


def test_switch_transformers_router_casts_its_classifier_and_trains_bit_for_bit() -> None:
    config = _switch_config()
    assert config.router_dtype == "float32" and config.router_jitter_noise > 0
    torch.manual_seed(0)
    model = RoutedProjection(config)
    x = torch.randn(2, 8, config.d_model)
    _train_both(model, (x, torch.zeros(2, 8)), torch.nn.functional.mse_loss)


def test_a_bfloat16_router_is_refused_naming_the_cast() -> None:
    torch.manual_seed(0)
    model = RoutedProjection(_switch_config(router_dtype="bfloat16"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(2, 8, 32), torch.zeros(2, 8))
    with pytest.raises(ModuleCast, match=r"`router\.classifier\.to\(torch\.bfloat16\)` inside the step") as err:
        memplan.compile_step(model, opt, torch.nn.functional.mse_loss, batch)
    assert "\n" not in str(err.value)
    assert model.router.classifier.weight.dtype == torch.float32


def test_switch_transformers_is_refused_for_its_data_dependent_routing_not_its_cast() -> None:
    torch.manual_seed(0)
    model = _transformers().SwitchTransformersForConditionalGeneration(_switch_config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = {"input_ids": torch.randint(0, 64, (2, 8)), "labels": torch.randint(0, 64, (2, 8))}

    @memplan.compile(model=model, optimizer=opt)
    def step(b):
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    with pytest.raises(DynamicShape) as err:
        step(batch)
    message = str(err.value)
    assert "\n" not in message and "_apply" not in message and "swap" not in message
    assert "aten.nonzero" in message and "modeling_switch_transformers.py" in message  # the experts' dispatch
    assert "depends on the data" in message


# ---------------------------------------------------------------- wrappers memplan does not plan


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """A 1-rank gloo process group on CPU (the one the wrappers below need to be built)."""
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(8, 8)), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _fsdp2(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model[0])
    return fully_shard(model)


def _fsdp1(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(model, device_id=torch.device("cpu"))


def _replicated_dtensors(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_module

    return distribute_module(model, init_device_mesh("cpu", (1,)))


def _compiled_in_place(model: torch.nn.Module) -> torch.nn.Module:
    model.compile()
    return model


WRAPPERS = {
    "fsdp2": (_fsdp2, r"the model \(FSDPSequential\) is sharded with FSDP2's fully_shard .*memplan\.compile_step\("),
    "fsdp1": (_fsdp1, r"wrapped in FSDP's FullyShardedDataParallel: memplan does not plan FSDP-sharded models"),
    "ddp": (
        torch.nn.parallel.DistributedDataParallel,
        r"wrapped in DistributedDataParallel, .* to memplan\.compile_data_parallel_step",
    ),
    "dtensor": (_replicated_dtensors, r"parameter '0\.0\.weight' is a DTensor"),
    "torch.compile": (torch.compile, r"the model \(OptimizedModule\) is compiled with torch\.compile"),
    "module.compile()": (_compiled_in_place, r"the model \(Sequential\) is compiled with torch\.compile"),
}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_wrappers_memplan_does_not_plan_are_refused_by_name(one_rank, wrapper: str) -> None:
    wrap, reason = WRAPPERS[wrapper]
    model = wrap(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(4, 8), torch.randn(4, 2))
    if wrapper != "fsdp2":  # compile_step plans an FSDP2 model (tests/torch/test_fsdp.py)
        with pytest.raises(UnplannedWrapper, match=reason) as err:
            memplan.compile_step(model, opt, torch.nn.functional.mse_loss, batch)
        assert "\n" not in str(err.value)
    with pytest.raises(UnplannedWrapper, match=reason) as err:  # the decorator refuses at compile time
        memplan.compile(lambda b: None, model=model, optimizer=opt)
    assert "\n" not in str(err.value)


def test_data_parallel_is_refused_over_several_gpus_only() -> None:
    model = _mlp()
    refuse_unplanned_wrappers(torch.nn.DataParallel(model))  # on CPU it calls the module itself
    several = torch.nn.DataParallel(model)
    several.device_ids = [0, 1]  # what DataParallel holds on a 2-GPU machine (this one has none)
    with pytest.raises(UnplannedWrapper, match="DataParallel over 2 GPUs"):
        refuse_unplanned_wrappers(several)


# ---------------------------------------------------------------- the random generator inside the step


class Checkpointed(torch.nn.Module):
    """A block under ``torch.utils.checkpoint`` (non-reentrant, RNG state preserved), with or
    without dropout in it."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)
        self.dropout = dropout

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(torch.relu(h), self.dropout, self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.utils.checkpoint.checkpoint(self.block, self.a(x), use_reentrant=False))


def _refused_untouched(model: torch.nn.Module, step_body: Callable, match: str) -> None:
    """The first call raises ``UnsupportedOp`` matching ``match``, in one line, and leaves the
    model, the optimizer and the random generator as they were."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = copy.deepcopy(model.state_dict())
    step = memplan.compile(lambda b: step_body(model, opt, b), model=model, optimizer=opt)
    batch = _batch()
    torch.manual_seed(3)
    rng = torch.get_rng_state()
    with pytest.raises(UnsupportedOp, match=match) as refused:
        step(batch)
    assert "\n" not in str(refused.value)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and not opt.state


def _plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer, b: tuple) -> torch.Tensor:
    loss = torch.nn.functional.mse_loss(model(b[0]), b[1])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_checkpoint_around_dropout_is_refused_where_a_replay_would_draw_another_mask() -> None:
    """Eager's checkpoint sets the generator back to redraw the forward's mask in the backward;
    the planned step replays ops, not generator calls (it trained on another mask, silently)."""
    _refused_untouched(Checkpointed(0.3), _plain_step, "under torch.utils.checkpoint")


def test_checkpoint_around_code_without_random_ops_trains_bit_for_bit() -> None:
    torch.manual_seed(0)
    _train_both(Checkpointed(0.0), _batch(), torch.nn.functional.mse_loss)


def test_a_seed_inside_the_step_is_refused_before_a_draw_and_after_the_last() -> None:
    def seeded_first(model, opt, b):
        torch.manual_seed(123)
        return _plain_step(model, opt, b)

    def seeded_last(model, opt, b):
        loss = _plain_step(model, opt, b)
        torch.manual_seed(123)
        return loss

    torch.manual_seed(0)
    _refused_untouched(Checkpointed(0.3).requires_grad_(True), seeded_first, "after setting the random generator")
    torch.manual_seed(0)
    _refused_untouched(Checkpointed(0.0), seeded_last, "leaves it elsewhere")


# ---------------------------------------------------------------- Python numbers that change between calls


class Annealed(torch.nn.Module):
    """Scales its hidden layer by a temperature it anneals on every call, in Python."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        temperature = max(0.5, 1.0 - 0.1 * self.calls)
        return self.b(torch.relu(self.a(x)) / temperature)


def test_a_number_the_step_changes_each_call_is_refused_not_frozen() -> None:
    """The first plan would divide by the capture's temperature forever (it trained silently
    otherwise); capture's two runs pass the op 0.9, then 0.8."""
    model = Annealed()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = copy.deepcopy(model.state_dict())
    step = memplan.compile(lambda b: _plain_step(model, opt, b), model=model, optimizer=opt)
    with pytest.raises(CaptureError, match="other Python numbers in two runs") as refused:
        step(_batch())
    assert "\n" not in str(refused.value) and "0.9" in str(refused.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and not opt.state


def test_an_lr_scheduler_memplan_was_not_given_is_refused_before_it_steps() -> None:
    """Capture's runs stepped it twice and no planned step stepped it again: the learning rate
    stayed where capture left it (OneCycleLR at its peak from the first call), silently."""
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def body(b):
        loss = _plain_step(model, opt, b)
        scheduler.step()
        return loss

    with pytest.raises(UnsupportedOp, match=r"StepLR.step\(\) at test_refusals.py:\d+.*scheduler=") as refused:
        memplan.compile(body, model=model, optimizer=opt)(_batch())
    assert "\n" not in str(refused.value)
    assert scheduler.last_epoch == 0 and opt.param_groups[0]["lr"] == 0.1 and not opt.state


def test_a_learning_rate_the_step_sets_from_a_counter_is_refused_a_constant_one_kept() -> None:
    """nanoGPT's ``g["lr"] = get_lr(it)`` inside the step: frozen at its capture value, silently;
    refused now with the values capture's two runs set, and the user's value put back. A step
    that sets the same value every call trains as eager."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    twin = copy.deepcopy(model)
    opt, twin_opt = torch.optim.AdamW(model.parameters(), lr=1.0), torch.optim.AdamW(twin.parameters(), lr=1.0)
    it = [0]

    def warm_up(m, o, b):
        for group in o.param_groups:
            group["lr"] = 0.01 * (it[0] + 1)
        it[0] += 1
        return _plain_step(m, o, b)

    with pytest.raises(UnsupportedOp, match=r"'lr': 0.01 -> 0.02.*between calls") as refused:
        memplan.compile(lambda b: warm_up(model, opt, b), model=model, optimizer=opt)(_batch())
    assert "\n" not in str(refused.value) and opt.param_groups[0]["lr"] == 1.0

    def constant(m, o, b):
        for group in o.param_groups:
            group["lr"] = 0.01
        return _plain_step(m, o, b)

    step = memplan.compile(lambda b: constant(model, opt, b), model=model, optimizer=opt)
    for _ in range(3):
        batch = _batch()
        assert torch.equal(step(batch), constant(twin, twin_opt, batch))
        assert torch.equal(model.weight, twin.weight)


def test_a_sparse_embedding_is_refused_naming_it() -> None:
    """Its sparse gradient failed inside capture ("Cannot access storage of SparseTensorImpl")."""
    model = torch.nn.Sequential(torch.nn.Embedding(100, 8, sparse=True), torch.nn.Flatten(), torch.nn.Linear(40, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def body(x):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    with pytest.raises(UnsupportedOp, match=r"module '0' is an Embedding with sparse=True.*sparse=False") as refused:
        memplan.compile(body, model=model, optimizer=opt)(torch.randint(0, 100, (4, 5)))
    assert "\n" not in str(refused.value)


def test_a_tensor_the_step_keeps_outside_itself_is_refused_naming_where() -> None:
    """``history.append(loss.detach())`` in the step, or a hook that keeps a layer's output: the
    user's list got capture's two fake tensors and no planned step added to it, silently."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history: list[torch.Tensor] = []
    seen: dict[str, torch.Tensor] = {}

    def body(b):
        loss = _plain_step(model, opt, b)
        history.append(loss.detach())
        return loss

    with pytest.raises(UnsupportedOp, match=r"keeps 2 tensor\(s\) it made outside itself \(in a list of 2 items\)"):
        memplan.compile(body, model=model, optimizer=opt)(_batch())
    hook = model[0].register_forward_hook(lambda module, args, out: seen.__setitem__("first", out.detach()))
    with pytest.raises(UnsupportedOp, match=r"outside itself \(in a dict or an object's attribute, key 'first'\)"):
        memplan.compile(lambda b: _plain_step(model, opt, b), model=model, optimizer=opt)(_batch())
    hook.remove()
    step = memplan.compile(lambda b: _plain_step(model, opt, b), model=model, optimizer=opt)
    step(_batch())  # without the hook: planned


def test_a_gradient_left_on_the_batch_is_refused_and_autograd_grad_trains_as_eager() -> None:
    """FGSM with ``x.requires_grad_(); loss.backward(); x.grad``: capture's traced run
    accumulated into the gradient its untraced run left on the fake batch and was refused with
    "reads a tensor _tensor_constant0 ... whose value capture cannot know"; refused now naming
    it, and the form with ``torch.autograd.grad`` trains bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    twin = copy.deepcopy(model)
    opt, twin_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)

    def with_dot_grad(b):
        x, y = b
        x.requires_grad_(True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        x_adv = (x + 0.1 * x.grad.sign()).detach()
        opt.zero_grad()
        return _plain_step(model, opt, (x_adv, y))

    with pytest.raises(UnsupportedOp, match=r"gradient on its batch input \(leaf 0.*torch.autograd.grad") as refused:
        memplan.compile(with_dot_grad, model=model, optimizer=opt)(_batch())
    assert "\n" not in str(refused.value)

    def with_autograd_grad(m, o, b):
        x = b[0].clone().requires_grad_(True)
        (gx,) = torch.autograd.grad(torch.nn.functional.mse_loss(m(x), b[1]), x)
        return _plain_step(m, o, ((x + 0.1 * gx.sign()).detach(), b[1]))

    step = memplan.compile(lambda b: with_autograd_grad(model, opt, b), model=model, optimizer=opt)
    for _ in range(3):
        batch = _batch()
        assert torch.equal(step(batch), with_autograd_grad(twin, twin_opt, batch))
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


def test_a_torch_compiled_function_in_the_step_is_refused_not_run_on_fakes() -> None:
    """``torch.compile(F.cross_entropy)`` called in the step: capture's fake run ran inductor's
    kernels on fakes and the process died (segmentation fault). Now nothing compiles while
    capture runs, and the step is refused in one line naming the call."""
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled_loss = torch.compile(torch.nn.functional.mse_loss)

    def body(b):
        loss = compiled_loss(model(b[0]), b[1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    with pytest.raises(UnsupportedOp, match=r"compiled with torch.compile at test_refusals.py:\d+") as refused:
        memplan.compile(body, model=model, optimizer=opt)(_batch())
    assert "\n" not in str(refused.value) and not opt.state


@pytest.mark.parametrize("validate", [True, False])
def test_torch_distributions_argument_checks_are_named_and_a_vae_trains_without_them(validate: bool) -> None:
    """A VAE's ``Normal(mu, std).rsample()``: the distribution checks its arguments' values in
    Python (on by default), which a planned step cannot; the refusal says how to turn the
    checks off, and with them off the step trains bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    twin = copy.deepcopy(model)
    opt, twin_opt = torch.optim.Adam(model.parameters(), lr=1e-3), torch.optim.Adam(twin.parameters(), lr=1e-3)

    def body(m, o, b):
        mu, log_var = m(b[0]).chunk(2, -1)
        q = torch.distributions.Normal(mu, (0.5 * log_var).exp(), validate_args=validate)
        loss = q.rsample().pow(2).mean() + q.entropy().mean()
        loss.backward()
        o.step()
        o.zero_grad()
        return loss

    step = memplan.compile(lambda b: body(model, opt, b), model=model, optimizer=opt)
    if validate:
        with pytest.raises(DataDependentControlFlow, match=r"validate_args=False.*set_default_validate_args\(False\)"):
            step(_batch())
        return
    for k in range(3):
        batch = _batch()
        torch.manual_seed(k)
        ours = step(batch)
        torch.manual_seed(k)
        assert torch.equal(ours, body(twin, twin_opt, batch)), k
        assert torch.equal(model.weight, twin.weight), k


def test_an_optimizer_over_parameters_outside_the_model_is_refused_naming_them() -> None:
    """A head trained by the optimizer but left out of ``model=``: refused with "reads a tensor
    _tensor_constant0 (4,) ... whose value capture cannot know"."""
    backbone, head = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU()), torch.nn.Linear(16, 2)
    opt = torch.optim.AdamW([*backbone.parameters(), *head.parameters()], lr=1e-2)
    step = memplan.compile(
        lambda b: _plain_step(torch.nn.Sequential(backbone, head), opt, b), model=backbone, optimizer=opt
    )
    with pytest.raises(
        UnsupportedOp, match=r"optimizer 0 \(AdamW\) updates 2 parameter\(s\) that are not in the model"
    ):
        step(_batch())
    assert not opt.state


def test_a_frozen_teacher_outside_the_model_put_in_train_mode_gets_another_capture() -> None:
    """Distillation: the teacher is no module of ``model=``, so its ``training`` flag was not in
    the plan's key; put in train mode between calls (dropout on), the step kept the eval-mode
    plan, silently. Its modes are now checked at each call and a change captures again."""
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 2)).eval()
    teacher.requires_grad_(False)
    student = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    twin = copy.deepcopy(student)
    opt, twin_opt = torch.optim.SGD(student.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)

    def body(m, o, b):
        with torch.no_grad():
            target = teacher(b[0])
        return _plain_step(m, o, (b[0], target))

    step = memplan.compile(lambda b: body(student, opt, b), model=student, optimizer=opt)
    for k, mode in enumerate(["eval", "eval", "train", "train", "eval"]):
        getattr(teacher, mode)()
        batch = _batch()
        torch.manual_seed(k)
        ours = step(batch)
        torch.manual_seed(k)
        assert torch.equal(ours, body(twin, twin_opt, batch)), (k, mode)
        assert torch.equal(student[0].weight, twin[0].weight), (k, mode)


def test_two_runs_are_compared_only_where_they_made_the_same_ops() -> None:
    from memplan.torch.capture.fake import op_scalars
    from memplan.torch.capture.literals import check_scalars_repeat

    mul, add = torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor
    nan = op_scalars((torch.ones(2), float("nan"), torch.tensor(3.0)), {"alpha": 2})
    assert nan == ("nan", 3.0, 2)  # a wrapped number's value; NaN equal to itself
    check_scalars_repeat([(mul, (2,)), (add, nan)], [(mul, (2,)), (add, nan)])
    check_scalars_repeat([(mul, (1,))], [(mul, (1,)), (add, (5,))])  # a cache the first run filled: not compared
    check_scalars_repeat(None, [(mul, (3,))])
    with pytest.raises(CaptureError, match="1, then 2"):
        check_scalars_repeat([(mul, (1,)), (add, (5,))], [(mul, (2,)), (add, (5,))])


def test_an_hf_model_with_gradient_checkpointing_and_dropout_is_refused_naming_the_switch() -> None:
    """HF's ``gradient_checkpointing_enable()`` on GPT-2 (dropout 0.1): it trained unlike eager
    from the first update, silently; now one line says how to turn it off."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).train()
    model.gradient_checkpointing_enable()
    ids = torch.randint(0, 100, (2, 16))

    def step_body(m, opt, b):
        loss = m(input_ids=b[0], labels=b[0]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = memplan.compile(lambda b: step_body(model, opt, b), model=model, optimizer=opt)
    with pytest.raises(UnsupportedOp, match="gradient_checkpointing_disable") as refused:
        step((ids,))
    assert "\n" not in str(refused.value) and not opt.state


class Rebinds(torch.nn.Module):
    """Keeps a running mean in a buffer by assigning it anew in ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)
        self.register_buffer("avg", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        self.avg = 0.9 * self.avg + 0.1 * h.detach().mean(0)
        return self.b(h - self.avg)


def test_a_buffer_assigned_anew_in_forward_is_refused_naming_it() -> None:
    """The plan writes into the tensors the model holds: a buffer rebound each call kept its
    first value while eager's moved on (losses apart from the second step), silently."""
    model = Rebinds()
    _refused_untouched(model, _plain_step, "assigns a new tensor to the buffer 'avg'")
    assert torch.equal(model.avg, torch.zeros(16))
