"""What a traced step reads besides its batch: constants, literals, non-tensor batch leaves.

Each kind is bound so that the planned step reads what eager reads, step after step (live
parameters, buffers and tensor attributes; literals kept by value after capture checked that
they repeat), and what cannot be known is refused in one line.
"""

from __future__ import annotations

import copy

import pytest

import memplan
import torch
from memplan.errors import CaptureError, DataDependentControlFlow, DynamicShape, MemplanError, UnsupportedOp
from memplan.torch.capture.fake import new_fake_mode
from memplan.torch.equivalence import differences, snapshot


def _train_both(model: torch.nn.Module, batch, loss_fn, steps: int = 3, between=None) -> None:
    """Train ``model`` planned and a copy eagerly from the same state and seeds; after every
    step everything must be bit-identical. ``between(model, k)`` runs on both models before
    step ``k`` (a change the user makes between steps)."""
    eager = copy.deepcopy(model)
    planned_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    step = memplan.compile_step(model, planned_opt, loss_fn, batch, time_limit_seconds=1)
    for k in range(steps):
        if between is not None:
            between(model, k)
            between(eager, k)
        torch.manual_seed(k)
        inputs, target = batch
        eager_loss = loss_fn(eager(**inputs) if isinstance(inputs, dict) else eager(inputs), target)
        eager_loss.backward()
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)
        torch.manual_seed(k)
        planned_loss = step(batch)
        assert torch.equal(planned_loss, eager_loss.detach()), k
        assert differences(snapshot(eager, eager_opt), snapshot(model, planned_opt)) == [], k


class OutputWithLoss(torch.nn.Module):
    """Returns an object with ``.loss``, computed from labels in its keyword inputs (as HF)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor, scale: float | None = None):
        logits = self.fc(x) * (1.0 if scale is None else scale)
        return type("Out", (), {"loss": torch.nn.functional.cross_entropy(logits, labels)})()


def test_a_none_target_and_dict_batch_with_the_loss_from_the_output():
    torch.manual_seed(0)
    batch = ({"x": torch.randn(4, 8), "labels": torch.randint(0, 4, (4,))}, None)
    _train_both(OutputWithLoss(), batch, lambda out, target: out.loss)


def test_a_non_tensor_batch_leaf_gets_its_own_plan():
    torch.manual_seed(0)
    model = OutputWithLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, labels = torch.randn(4, 8), torch.randint(0, 4, (4,))
    step = memplan.compile_step(model, opt, lambda out, t: out.loss, ({"x": x, "labels": labels, "scale": 2.0}, None))
    step(({"x": x, "labels": labels, "scale": 2.0}, None))
    eager = copy.deepcopy(model)
    loss = step(({"x": x, "labels": labels, "scale": 3.0}, None))
    assert len(step.plans) == 2  # the traced step fixed scale=2.0: another value is another plan
    assert torch.equal(loss, eager(x, labels, 3.0).loss.detach())


def test_a_batch_leaf_that_differs_from_the_traced_value_is_refused_by_the_runner():
    model = OutputWithLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, labels = torch.randn(4, 8), torch.randint(0, 4, (4,))
    step = memplan.compile_step(model, opt, lambda out, t: out.loss, ({"x": x, "labels": labels, "scale": 2.0}, None))
    runner = next(iter(step.runners.values()))
    with pytest.raises(MemplanError, match=r"traced with 2\.0") as err:
        runner(({"x": x, "labels": labels, "scale": 3.0}, None))
    assert "\n" not in str(err.value)


def test_eval_mode_and_freezing_between_steps_get_their_own_plans():
    """Dropout off after ``model.eval()``, no update for a frozen layer: as eager."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.drop, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(self.drop(self.fc1(x).relu()))

    def change(model: Net, k: int) -> None:
        if k == 1:
            model.eval()
        if k == 2:
            model.train()
            model.fc1.requires_grad_(False)

    torch.manual_seed(0)
    _train_both(Net(), (torch.randn(4, 8), torch.randn(4, 8)), _sum_loss, steps=4, between=change)


class WithConstants(torch.nn.Module):
    """Reads a literal, a plain tensor attribute (not a buffer) and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.offset = torch.linspace(-1, 1, 8)  # a plain attribute: not in state_dict
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * self.scale + self.offset
        return h * torch.tensor([2.0]) + torch.tensor(0.25)  # literals


def _sum_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def test_literals_attributes_and_buffers_train_like_eager():
    torch.manual_seed(0)
    _train_both(WithConstants(), (torch.randn(4, 8), torch.randn(4, 8)), _sum_loss)


def test_each_constant_is_bound_by_where_it_comes_from():
    from memplan.torch.run.constants import bind_constants

    model = WithConstants()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = memplan.compile_step(model, opt, _sum_loss, (torch.randn(4, 8), torch.randn(4, 8)), allocator="views")
    capture = next(iter(step.runners.values())).capture
    kinds = sorted({b.kind for b in bind_constants(capture, model, torch.device("cpu"))})
    assert kinds == ["attribute", "buffer", "literal", "param"]


def test_attributes_and_buffers_changed_between_steps_are_read_anew():
    """Written in place, or replaced by another tensor: the plan reads what eager reads."""

    def change(model: WithConstants, k: int) -> None:
        if k == 1:
            model.offset.mul_(3.0)  # in place
            model.scale.add_(1.0)
        if k == 2:
            model.offset = torch.linspace(2, 3, 8)  # rebound
            model.register_buffer("scale", torch.full((8,), -0.5))  # reassigned

    torch.manual_seed(0)
    _train_both(WithConstants(), (torch.randn(4, 8), torch.randn(4, 8)), _sum_loss, between=change)


def test_an_attribute_rebound_to_another_shape_is_refused_in_one_line():
    torch.manual_seed(0)
    model = WithConstants()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(4, 8), torch.randn(4, 8))
    step = memplan.compile_step(model, opt, _sum_loss, batch)
    model.offset = torch.zeros(1, 8)
    with pytest.raises(UnsupportedOp, match="offset") as err:
        step(batch)
    assert "\n" not in str(err.value)


class CountingLiteral(torch.nn.Module):
    """Makes a literal from a Python counter: a different value at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x) * torch.tensor(float(self.calls))


def test_a_literal_that_changes_from_step_to_step_is_refused():
    model = CountingLiteral()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CaptureError, match="differ between two runs") as err:
        memplan.compile_step(model, opt, _sum_loss, (torch.randn(4, 8), torch.randn(4, 8)))
    assert "\n" not in str(err.value)
    assert model.calls == 0  # capture ran on a fake copy


class LazyCache(torch.nn.Module):
    """Computes a tensor from the data on its first call and keeps it: eager's first step
    computes it, the traced (steady-state) step would read a value capture never saw."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.cache = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            self.cache = x.detach().mean(0) * 2
        return self.fc(x) + self.cache


def test_a_tensor_of_unknown_value_left_by_an_earlier_call_is_refused_in_one_line():
    model = LazyCache()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UnsupportedOp, match="cache an earlier call left") as err:
        memplan.compile_step(model, opt, _sum_loss, (torch.randn(4, 8), torch.randn(4, 8)))
    assert "\n" not in str(err.value)


class WeightNormed(torch.nn.Module):
    """A parametrized module (weight norm, as wav2vec2's positional convolution)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).relu()


def test_a_parametrized_module_trains_like_eager():
    torch.manual_seed(0)
    _train_both(WeightNormed(), (torch.randn(4, 8), torch.randn(4, 8)), _sum_loss)


@pytest.mark.parametrize(
    ("a_shape", "b_shape", "offs"),
    [((6, 4), (3, 4, 8), [2, 4, 6]), ((3, 6, 4), (3, 4, 8), None), ((4, 6), (6, 8), [2, 4, 6])],
)
def test_grouped_mm_fakes_match_the_cpu_kernel_in_float32(a_shape, b_shape, offs):
    """HF's mixture-of-experts layers call ``_grouped_mm`` in float32 on CPU, whose meta
    function accepts bfloat16 only: capture's fake kernel gives the CPU kernel's result."""
    a, b = torch.randn(a_shape), torch.randn(b_shape)
    if len(a_shape) == 2 and len(b_shape) == 2:  # 2D x 2D: the kernel wants 16-byte strides
        a = torch.randn(a_shape[1], a_shape[0]).t()
    offsets = None if offs is None else torch.tensor(offs, dtype=torch.int32)
    real = torch._grouped_mm(a, b, offs=offsets)
    mode = new_fake_mode()
    with mode:
        fake = torch._grouped_mm(
            mode.from_tensor(a), mode.from_tensor(b), offs=mode.from_tensor(offsets) if offs else None
        )
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)


def test_capture_errors_name_the_line_of_the_model_that_caused_them():
    class Boolean(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            return h[h > 0].sum() * torch.ones(4, 8)

    class Branch(Boolean):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            return h if h.sum() > 0 else -h

    batch = (torch.randn(4, 8), torch.randn(4, 8))
    for model, error in ((Boolean(), DynamicShape), (Branch(), DataDependentControlFlow)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(error, match=r"test_constants\.py:\d+") as err:
            memplan.compile_step(model, opt, _sum_loss, batch)
        assert "\n" not in str(err.value)
