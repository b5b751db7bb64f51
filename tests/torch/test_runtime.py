"""The runtime: a planned step trains exactly like eager PyTorch, and its memory is the plan's."""

from __future__ import annotations

import collections
import copy

import pytest

import memplan
import torch
from memplan.errors import MemplanError
from memplan.torch.compare import compare_with_eager
from memplan.torch.run.allocator import available as allocator_available
from memplan.torch.zoo import build_workload, make_optimizer

CASES = [("mlp", 8, "adam"), ("vgg16", 4, "sgd"), ("gpt2-2l", 1, "adamw"), ("resnet50", 2, "sgd")]
# views is the fallback mode: its two big models run with `make test-all`
VIEWS_CASES = [c if c[0] in ("mlp", "vgg16") else pytest.param(*c, marks=pytest.mark.slow) for c in CASES]


@pytest.mark.parametrize(("model", "batch", "optimizer"), VIEWS_CASES)
def test_arena_views_train_exactly_like_eager(model, batch, optimizer):
    report = compare_with_eager(
        model, batch, steps=3, optimizer_name=optimizer, time_limit_seconds=2, allocator="views"
    )
    assert report["max_abs_diff"] == 0.0
    m, plan = report["memplan"], report["plan"]
    # the plan: persistent + arena + what the allocator holds (ops without an out= kernel), and the
    # most one op holds outside both while it runs (oneDNN's copy of a convolution weight)
    assert plan["planned_peak_bytes"] == plan["persistent_bytes"] + plan["arena_bytes"] + plan["allocator_peak_bytes"]
    assert m["planned_peak_bytes"] == plan["planned_peak_bytes"] + m["max_scratch_bytes"]
    assert m["fallback_bytes"] == plan["allocator_tensor_bytes"]
    assert m["peak_bytes"] <= m["planned_peak_bytes"] * 1.05, report
    assert m["peak_bytes"] < report["eager"]["peak_bytes"], report


@pytest.mark.skipif(not allocator_available(), reason="no C++ compiler here: the planned allocator cannot be built")
@pytest.mark.parametrize(
    ("model", "batch", "optimizer"),
    # GPT-2 (2 layers) with the planned allocator also runs in test_loops and test_architectures;
    # ResNet-50 (a minute on 2 cores) runs with `make test-all`, the CNN path is covered by VGG-16
    [c if c[0] in ("mlp", "vgg16") else pytest.param(*c, marks=pytest.mark.slow) for c in CASES],
)
def test_planned_allocator_trains_exactly_like_eager(model, batch, optimizer):
    report = compare_with_eager(
        model, batch, steps=3, optimizer_name=optimizer, time_limit_seconds=2, allocator="replay"
    )
    assert report["allocator"] == "replay"
    assert report["max_abs_diff"] == 0.0
    m = report["memplan"]
    assert m["diverged_at"] is None and m["blocked_allocations"] == 0, report
    # every allocation the step frees is served from the arena: only the returned loss is not
    assert m["fallback_bytes"] <= 1024, report
    assert m["arena_bytes"] == m["arena_lower_bound_bytes"], report
    assert m["peak_bytes"] <= m["planned_peak_bytes"] * 1.05, report
    assert m["peak_bytes"] < report["eager"]["peak_bytes"], report


def test_inference_plan_equals_eager():
    report = compare_with_eager("mlp", 16, steps=2, mode="infer")
    assert report["max_abs_diff"] == 0.0


def test_compile_step_api_trains_and_keeps_models_usable():
    w = build_workload("mlp", 4)
    reference = copy.deepcopy(w.model)
    opt = make_optimizer("sgd", w.model.parameters())
    ref_opt = make_optimizer("sgd", reference.parameters())
    step = memplan.compile_step(w.model, opt, w.loss_fn, (w.inputs, w.target))
    for _ in range(2):
        torch.manual_seed(1)
        loss = step((w.inputs, w.target))
        torch.manual_seed(1)
        ref_loss = w.loss_fn(reference(w.inputs), w.target)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        assert torch.equal(loss, ref_loss.detach())
    assert set(opt.state_dict()["state"]) == set(ref_opt.state_dict()["state"])
    assert all(p.grad is None for p in w.model.parameters())
    w.model.eval()
    with torch.no_grad():
        assert torch.equal(w.model(w.inputs), reference.eval()(w.inputs))
    assert step.report["arena_bytes"] > 0


def test_another_batch_shape_gets_its_own_plan():
    w = build_workload("mlp", 4)
    opt = make_optimizer("sgd", w.model.parameters())
    step = memplan.compile_step(w.model, opt, w.loss_fn, (w.inputs, w.target))
    step((w.inputs[:2], w.target[:2]))
    assert len(step.runners) == 2


def test_a_runner_refuses_a_batch_of_another_shape():
    w = build_workload("mlp", 4)
    opt = make_optimizer("sgd", w.model.parameters())
    step = memplan.compile_step(w.model, opt, w.loss_fn, (w.inputs, w.target))
    runner = next(iter(step.runners.values()))
    with pytest.raises(MemplanError, match="make a plan for this shape"):
        runner((w.inputs[:2], w.target[:2]))


@pytest.mark.parametrize("padding_idx", [-1, 0, 7])
def test_arena_embedding_backward_is_bitwise_the_cpu_kernel(padding_idx):
    from memplan.torch.run.interpreter import ARENA_KERNELS

    torch.manual_seed(padding_idx + 5)
    grad, indices = torch.randn(4, 300, 32), torch.randint(0, 50, (4, 300))
    expected = torch.ops.aten.embedding_dense_backward.default(grad, indices, 50, padding_idx, False)
    out = torch.full((50, 32), float("nan"))
    kernel = ARENA_KERNELS["aten::embedding_dense_backward"]
    assert kernel.applies((grad, indices, 50, padding_idx, False))
    assert not kernel.applies((grad, indices, 50, padding_idx, True))
    # another device's kernel sums in another order: there the op runs as it is
    assert not kernel.applies((grad.to("meta"), indices.to("meta"), 50, padding_idx, False))
    kernel.write(out, grad, indices, 50, padding_idx, False)
    assert torch.equal(out, expected)


ROWWISE_CASES = [((8, 4, 16, 16), 1), ((32, 1000), 1), ((2, 12, 64, 64), -1), ((3, 5, 7), 0), ((3, 50257), -1)]


@pytest.mark.parametrize(("shape", "dim"), ROWWISE_CASES)
def test_rowwise_kernels_written_over_their_input_give_the_same_bits(shape, dim):
    """Writes over dying inputs (INPLACE_ROWWISE, capture/inplace.py) rely on these kernels reading
    each element before writing it: out= over either input must equal the functional kernel (a
    GPT-2 vocabulary's row included)."""
    from memplan.torch.capture.inplace import INPLACE_ROWWISE

    aten = torch.ops.aten
    torch.manual_seed(0)
    x, grad = torch.randn(shape) * 3, torch.randn(shape)
    checked = set()
    for name, op, args in [
        ("aten::_softmax", aten._softmax, (x, dim, False)),
        ("aten::_log_softmax", aten._log_softmax, (x, dim, False)),
        ("aten::_softmax_backward_data", aten._softmax_backward_data, (grad, torch.softmax(x, dim), dim, x.dtype)),
        ("aten::_log_softmax_backward_data", aten._log_softmax_backward_data, (grad, x.log_softmax(dim), dim, x.dtype)),
    ]:
        expected = op.default(*args)
        out_name = next(a.name for a in op.out._schema.arguments if a.is_out)
        for i, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                aliased = list(args)
                aliased[i] = arg.clone()
                got = op.out(*aliased, **{out_name: aliased[i]})
                assert torch.equal(got, expected), (name, i)
        checked.add(name)
    assert checked == INPLACE_ROWWISE


@pytest.mark.parametrize(
    ("dtype", "to", "transposed"),
    [
        (torch.float32, torch.float16, False),
        (torch.float16, torch.float32, True),
        (torch.float32, torch.bfloat16, True),
    ],
)
def test_arena_to_copy_is_bitwise_aten_to_copy(dtype, to, transposed):
    """``_to_copy`` (autocast's casts, float16 gradients to float32) written into its arena view."""
    from memplan.torch.run.interpreter import ARENA_KERNELS

    torch.manual_seed(3)
    x = (torch.randn(37, 53) * 1e3).to(dtype)
    x = x.T if transposed else x
    expected = torch.ops.aten._to_copy.default(x, dtype=to)
    out = torch.empty_strided(expected.shape, expected.stride(), dtype=to).fill_(float("nan"))
    kernel = ARENA_KERNELS["aten::_to_copy"]
    assert kernel.applies((x,), {"dtype": to, "layout": torch.strided, "device": torch.device("cpu")})
    assert not kernel.applies((x,), {"dtype": to, "pin_memory": True})
    assert not kernel.applies((x,), {"device": torch.device("meta")})
    kernel.write(out, x, dtype=to)
    assert torch.equal(out, expected) and out.stride() == expected.stride()


def test_allocator_peak_counts_from_the_level_at_the_start():
    """The profiler's counter keeps the tensors earlier profiled calls left alive: the measure
    must not grow with them."""
    from memplan.torch.measure import allocator_peak_bytes

    kept: list[torch.Tensor] = []
    peaks = [allocator_peak_bytes(lambda: kept.append(torch.ones(2**20, dtype=torch.uint8)))[1] for _ in range(3)]
    assert peaks == [2**20] * 3
    assert allocator_peak_bytes(kept.clear)[1] == 0


def _seen_by_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[tuple[float, list[int]]]:
    from memplan.torch.capture.regions import only_params

    by_id = {id(p): k for k, p in enumerate(_ALL)}
    with only_params(optimizer, params):
        return [(g["lr"], [by_id[id(p)] for p in g["params"]]) for g in optimizer.param_groups]


_ALL = [torch.nn.Parameter(torch.zeros(k + 1)) for k in range(6)]


def test_only_params_sees_the_groups_as_they_are_now():
    """``only_params`` (one early update's ``optimizer.step()``): the given parameters in their
    groups' order with their groups' hyper-parameters, every group restored afterwards; its
    index of positions follows the groups when the user edits them between steps."""
    optimizer = torch.optim.SGD([{"params": _ALL[:3]}, {"params": _ALL[3:4], "lr": 0.5}], lr=0.1)
    groups = [dict(g) for g in optimizer.param_groups]
    assert _seen_by_step(optimizer, [_ALL[3], _ALL[2], _ALL[0], _ALL[2]]) == [(0.1, [0, 2]), (0.5, [3])]
    assert [dict(g) for g in optimizer.param_groups] == groups  # restored, lists and all
    assert _seen_by_step(optimizer, [_ALL[5]]) == []  # held by no group: left out
    optimizer.param_groups[0]["params"] = [_ALL[2], _ALL[1]]  # edited: positions moved, one gone
    optimizer.add_param_group({"params": [_ALL[0], _ALL[5]], "lr": 0.25})
    assert _seen_by_step(optimizer, [_ALL[5], _ALL[1], _ALL[0], _ALL[2]]) == [(0.1, [2, 1]), (0.25, [0, 5])]
    assert _seen_by_step(optimizer, [_ALL[4]]) == []


Result = collections.namedtuple("Result", "loss out")
RETURNS = {
    "tensor": lambda loss, out: loss,
    "tuple": lambda loss, out: (loss, out),
    "dict": lambda loss, out: {"loss": loss, "out": out},
    "named tuple": lambda loss, out: Result(loss, out),
    "nested with a number": lambda loss, out: (loss, {"o": [out, 3]}),
    "nothing": lambda loss, out: None,
}


@pytest.mark.parametrize(("shape", "executor"), [*((s, "generated") for s in RETURNS), ("dict", "interpreted")])
def test_the_step_returns_what_the_users_step_returned(shape: str, executor: str) -> None:
    """The traced program returns its leaves flat; the compiled step gives them back in the
    user's structure (a tuple, a dict, a named tuple), as eager's call does (it returned a list)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    twin = copy.deepcopy(model)
    opt, twin_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)

    def body(m: torch.nn.Module, o: torch.optim.Optimizer, x: torch.Tensor):
        out = m(x)
        loss = out.pow(2).mean()
        loss.backward()
        o.step()
        o.zero_grad()
        return RETURNS[shape](loss, out)

    step = memplan.compile(lambda x: body(model, opt, x), model=model, optimizer=opt, executor=executor)
    for _ in range(3):
        x = torch.randn(8, 4)
        ours, theirs = step(x), body(twin, twin_opt, x)
        assert type(ours) is type(theirs)
        ours_leaves, ours_spec = torch.utils._pytree.tree_flatten(ours)
        theirs_leaves, theirs_spec = torch.utils._pytree.tree_flatten(theirs)
        assert ours_spec == theirs_spec
        for a, b in zip(ours_leaves, theirs_leaves, strict=True):
            assert torch.equal(a, b.detach()) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize("executor", ["generated", "interpreted"])
def test_an_ema_and_a_counter_the_step_updates_follow_eager_from_the_first_call(executor: str) -> None:
    """Tensors the step writes that are not the model's or the optimizer's (an EMA of the
    parameters, a step counter): capture's fake runs wrote them for real (the first call
    counted 3 steps), and the EMA's read of the updated parameters failed with a NameError."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    twin = copy.deepcopy(model)
    ema, twin_ema = copy.deepcopy(model), copy.deepcopy(model)
    count, twin_count = torch.zeros(()), torch.zeros(())
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.1)

    def body(m, o, e, c, x):
        loss = m(x).pow(2).mean()
        loss.backward()
        o.step()
        o.zero_grad(set_to_none=True)
        with torch.no_grad():
            c.add_(1)
            for pe, p in zip(e.parameters(), m.parameters(), strict=True):
                pe.mul_(0.9).add_(p, alpha=0.1)
        return loss

    step = memplan.compile(lambda x: body(model, opt, ema, count, x), model=model, optimizer=opt, executor=executor)
    for k in range(4):
        x = torch.randn(8, 4)
        assert torch.equal(step(x), body(twin, twin_opt, twin_ema, twin_count, x))
        assert count.item() == twin_count.item() == k + 1
        ours, theirs = [*model.parameters(), *ema.parameters()], [*twin.parameters(), *twin_ema.parameters()]
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b), k


def _gan() -> tuple[torch.nn.Module, torch.nn.Module, tuple, tuple]:
    """A generator and a discriminator in one ModuleDict, its twin, and an Adam for each part of each."""
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    disc = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 1))
    model = torch.nn.ModuleDict({"G": gen, "D": disc})
    twin = copy.deepcopy(model)

    def optimizers(m: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return (torch.optim.Adam(m["G"].parameters(), lr=1e-3), torch.optim.Adam(m["D"].parameters(), lr=1e-3))

    return model, twin, optimizers(model), optimizers(twin)


@pytest.mark.parametrize(("executor", "allocator"), [("generated", "views"), ("interpreted", "replay")])
def test_a_gan_step_with_two_backwards_and_two_optimizers_follows_eager(executor: str, allocator: str) -> None:
    """A GAN step: the discriminator's backward and update, then the generator's backward
    through the discriminator, which gives the discriminator's parameters a second gradient
    that is thrown away. The first gradient's storage was not kept from the in-place rewrite
    (only each parameter's last gradient was), so it moved and the step was refused with
    "could not find the gradient of 'D.0.weight'"."""
    model, twin, (og, od), (twin_og, twin_od) = _gan()
    bce = torch.nn.functional.binary_cross_entropy_with_logits

    def body(m, og, od, real, z):
        fake = m["G"](z)
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        d_loss = bce(m["D"](real), ones) + bce(m["D"](fake.detach()), zeros)
        d_loss.backward()
        od.step()
        od.zero_grad(set_to_none=True)
        g_loss = bce(m["D"](fake), ones)
        g_loss.backward()
        og.step()
        og.zero_grad(set_to_none=True)
        od.zero_grad(set_to_none=True)
        return d_loss, g_loss

    step = memplan.compile(
        lambda b: body(model, og, od, *b), model=model, optimizer=[og, od], executor=executor, allocator=allocator
    )
    for k in range(4):
        real, z = torch.randn(16, 8), torch.randn(16, 4)
        ours, theirs = step((real, z)), body(twin, twin_og, twin_od, real, z)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), k
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(a, b), k


@pytest.mark.parametrize("executor", ["generated", "interpreted"])
def test_a_step_that_clears_the_gradients_first_trains_as_eager(executor: str) -> None:
    """The tutorials' order, ``zero_grad()`` first (here PyTorch's DCGAN example: the
    discriminator's update runs while the generator still holds the gradients of the previous
    call, cleared later by ``netG.zero_grad()``): eager keeps the gradients from one call to
    the next and the next call clears them before any backward reads them, so the planned
    step frees them at its end (``.grad`` is None between calls) and trains bit for bit.
    Refused before ("the step leaves a gradient"); a step that never clears them still is."""
    model, twin, (og, od), (twin_og, twin_od) = _gan()
    bce = torch.nn.functional.binary_cross_entropy_with_logits

    def body(m, og, od, real, z):
        m["D"].zero_grad()
        label = torch.ones(real.shape[0], 1)
        err_real = bce(m["D"](real), label)
        err_real.backward()
        fake = m["G"](z)
        err_fake = bce(m["D"](fake.detach()), torch.zeros_like(label))
        err_fake.backward()
        od.step()
        m["G"].zero_grad()
        err_g = bce(m["D"](fake), label)
        err_g.backward()
        og.step()
        return err_real + err_fake, err_g

    step = memplan.compile(lambda b: body(model, og, od, *b), model=model, optimizer=[og, od], executor=executor)
    for k in range(4):
        real, z = torch.randn(16, 8), torch.randn(16, 4)
        ours, theirs = step((real, z)), body(twin, twin_og, twin_od, real, z)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), k
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(a, b), k
        assert all(p.grad is None for p in model.parameters())

    plain = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)

    def never_cleared(x):
        loss = plain(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    with pytest.raises(MemplanError, match="that its next call accumulates into") as refused:
        memplan.compile(never_cleared, model=plain, optimizer=opt)(torch.randn(8, 4))
    assert "\n" not in str(refused.value) and plain.weight.grad is None


def test_gradients_the_step_assigns_itself_train_as_eager() -> None:
    """Per-sample gradients (``torch.func.vmap(torch.func.grad(...))``), clipped and averaged by
    hand and assigned to ``.grad`` (no backward, so no gradient hook fires): the self-check
    stopped the first planned step ("parameter '0.weight' was written by the step, which
    eager's step would not do"), as capture had not counted them as gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    opt, twin_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)

    def body(m, o, b):
        params = {k: v.detach() for k, v in m.named_parameters()}

        def loss(p, x, y):
            return torch.nn.functional.cross_entropy(torch.func.functional_call(m, p, (x[None],)), y[None])

        per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, b[0], b[1])
        with torch.no_grad():
            for k, v in m.named_parameters():
                v.grad = per_sample[k].clamp(-1, 1).mean(0)
        o.step()
        o.zero_grad()
        return per_sample["0.weight"].norm()

    step = memplan.compile(lambda b: body(model, opt, b), model=model, optimizer=opt)
    for k in range(3):
        batch = (torch.randn(16, 8), torch.randint(0, 4, (16,)))
        assert torch.equal(step(batch), body(twin, twin_opt, batch)), k
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True)), k


class _CountingMomentum(torch.optim.Optimizer):
    """A custom optimizer with its step count in a Python attribute (its bias correction reads it)."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})
        self.t = 0

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    if not state:
                        state["m"] = torch.zeros_like(p)
                    state["m"].mul_(0.9).add_(p.grad, alpha=0.1)
                    p.add_(state["m"] / (1 - 0.9**self.t), alpha=-group["lr"])


def test_a_custom_optimizer_counting_its_steps_in_python_follows_eager() -> None:
    """Capture's two fake runs called its step for real on the Python side: the first planned
    call ran its third step (t = 3, a wrong bias correction) and every later one too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    twin = copy.deepcopy(model)
    opt, twin_opt = _CountingMomentum(model.parameters()), _CountingMomentum(twin.parameters())

    def body(m, o, x):
        loss = m(x).pow(2).mean()
        loss.backward()
        o.step()
        o.zero_grad()
        return loss

    step = memplan.compile(lambda x: body(model, opt, x), model=model, optimizer=opt)
    for k in range(3):
        x = torch.randn(8, 8)
        assert torch.equal(step(x), body(twin, twin_opt, x)), k
        assert opt.t == twin_opt.t == k + 1
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True)), k


def _counting_step(loss_of, opt: torch.optim.Optimizer, count: torch.Tensor):
    """A training step on ``loss_of(batch)`` that also counts its calls in ``count``, a tensor."""

    def body(x: torch.Tensor) -> torch.Tensor:
        loss = loss_of(x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            count.add_(1)
        return loss

    return body


def test_a_counter_the_step_updates_counts_each_call_once_under_a_budget() -> None:
    """The budget path runs the step's ops twice more on the first call to measure each
    kernel's workspace; a tensor the step writes besides the training state is put back after
    (the first call counted 3)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    count = torch.zeros(())
    body = _counting_step(lambda x: model(x).pow(2).mean(), opt, count)
    step = memplan.compile(body, model=model, optimizer=opt, memory_budget=0.97)
    for k in range(3):
        step(torch.randn(64, 64))
        assert count.item() == k + 1
    assert step.report["budget"]["method"] in ("reorder", "remat")


def test_a_counter_the_step_updates_counts_each_call_once_with_dynamic_lengths() -> None:
    """``dynamic=`` traces the step once more with the length as a symbol, on fakes: that run
    wrote the counter for real too (the second call counted 4)."""
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50)
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    count = torch.zeros(())
    cross_entropy = torch.nn.functional.cross_entropy
    body = _counting_step(lambda x: cross_entropy(head(emb(x)).flatten(0, 1), x.flatten()), opt, count)
    step = memplan.compile(body, model=model, optimizer=opt, dynamic={1: 32})
    for k, length in enumerate((32, 20, 28)):
        step(torch.randint(0, 50, (2, length)))
        assert count.item() == k + 1
    assert all("reused" in entry["plan"] for entry in step.shape_log[1:])


def test_an_ema_the_step_updates_under_a_budget_follows_eager(monkeypatch) -> None:
    """The workspace runs leave the EMA's parameters alone: each is read by a second node of
    the same target (``_param_constant6_1``), which a put-back once looked up by node name; the
    runs do not write them at all now (no copy of the EMA outside the budget to put back)."""
    from memplan.torch.run import budget as budget_module

    measure, versions = budget_module.measure_op_workspace, []

    def watched(capture, model_, optimizer, batch_, steps=None):
        before = [p._version for p in ema.parameters()]
        result = measure(capture, model_, optimizer, batch_, steps=steps)
        versions.append((before, [p._version for p in ema.parameters()]))
        return result

    monkeypatch.setattr(budget_module, "measure_op_workspace", watched)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2)
    )
    twin, ema, twin_ema = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    opt, twin_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)

    def body(m, o, e, x):
        loss = m(x).pow(2).mean()
        loss.backward()
        o.step()
        o.zero_grad(set_to_none=True)
        with torch.no_grad():
            for pe, p in zip(e.parameters(), m.parameters(), strict=True):
                pe.mul_(0.9).add_(p, alpha=0.1)
        return loss

    step = memplan.compile(lambda x: body(model, opt, ema, x), model=model, optimizer=opt, memory_budget=0.97)
    for k in range(3):
        x = torch.randn(64, 64)
        assert torch.equal(step(x), body(twin, twin_opt, twin_ema, x))
        for a, b in zip(ema.parameters(), twin_ema.parameters(), strict=True):
            assert torch.equal(a, b), k
    assert versions and all(before == after for before, after in versions), versions
