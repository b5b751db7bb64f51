"""Results written over dying inputs in the captured program (memplan.torch.capture.inplace)."""

from __future__ import annotations

import copy
import math
from collections import Counter

import pytest
from torch.fx.experimental.proxy_tensor import make_fx

import memplan
import torch
from memplan.remat.problem import RematProblem, memory_floor
from memplan.torch.capture import capture_train_step
from memplan.torch.capture.inplace import write_into_dying_inputs
from memplan.torch.run.remat import RematRunner
from memplan.torch.tensors import storage_key
from torch import nn

aten = torch.ops.aten


def _traced(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    phases = {n.name: "forward" for n in gm.graph.nodes if n.op == "call_function"}
    return gm, phases


def _rewritten(fn, *args):
    gm, phases = _traced(fn, *args)
    return gm, dict(write_into_dying_inputs(gm, phases, set()))


def _by_target(gm):
    return {n.name: str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def test_a_chain_of_elementwise_temporaries_is_written_in_place_and_computes_the_same():
    def fn(x):
        return (torch.sigmoid(x * 2) + 1).tanh().sum()

    gm, written = _rewritten(fn, torch.randn(4, 8))
    # mul makes a temporary; sigmoid, add and tanh each write over the one before
    assert written == {"sigmoid": 0, "add": 0, "tanh": 0}
    assert _by_target(gm)["tanh"] == "aten.tanh.out"
    vals = {n.name: n.meta["val"] for n in gm.graph.nodes if n.op == "call_function"}
    assert len({storage_key(vals[n]) for n in ("mul", "sigmoid", "add", "tanh")}) == 1
    x = torch.randn(4, 8)
    assert torch.equal(gm(x), fn(x))


def test_an_input_read_again_later_is_not_written_over():
    def fn(x):
        y = x * 2
        return (torch.sigmoid(y) + y).sum()  # y is read after the sigmoid

    gm, written = _rewritten(fn, torch.randn(4, 8))
    assert "sigmoid" not in written
    assert written == {"add": 0}  # the add may write over the sigmoid's result, dying there
    x = torch.randn(4, 8)
    assert torch.equal(gm(x), fn(x))


def test_a_view_of_the_input_read_elsewhere_keeps_it():
    def fn(x):
        y = x * 2
        v = y.view(-1)
        return torch.sigmoid(y).sum() + v.sum()

    _, written = _rewritten(fn, torch.randn(4, 8))
    assert "sigmoid" not in written


def test_inputs_and_results_the_step_does_not_own_are_never_written():
    def fn(x):
        return torch.sigmoid(x), torch.tanh(x * 3)

    _, written = _rewritten(fn, torch.randn(4, 8))
    assert written == {}  # x is the caller's; the results are returned


def test_a_rowwise_kernel_off_the_cpu_is_left_alone():
    def fn(x):
        return torch.log_softmax(x * 2, dim=-1).sum()

    gm, phases = _traced(fn, torch.randn(4, 8))
    for node in gm.graph.nodes:  # the same program with its values on another device
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and node.name == "_log_softmax":
            node.meta["val"] = torch.empty_like(val, device="meta")
    assert "_log_softmax" not in dict(write_into_dying_inputs(gm, phases, set()))


class TinyLM(nn.Module):
    """An LM head over a small vocabulary: the loss's backward is the step's largest moment."""

    def __init__(self, vocab: int = 3000, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids):
        return self.head(self.mlp(self.embed(ids)))


def _lm_loss(logits, target):
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _lm_batch():
    torch.manual_seed(0)
    return torch.randint(0, 3000, (4, 64)), torch.randint(0, 3000, (4, 64))


def test_the_loss_backward_writes_over_its_gradient_and_lowers_the_floor(monkeypatch):
    import memplan.torch.capture.fused as fused

    monkeypatch.setattr(fused, "fuse_loss_backward", lambda *args: [])  # the pair as it was traced
    model, batch = TinyLM(), _lm_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    capture = capture_train_step(model, opt, _lm_loss, batch)
    written = dict(capture.written_into)
    assert "_log_softmax_backward_data" in written and "_log_softmax" in written
    graph = capture.graph
    op = graph.ops[graph.op_index["_log_softmax_backward_data"]]
    assert [graph.tensors[t].size_bytes for t in op.outputs] == [0, 0]  # its result is an alias of the input
    logits_bytes = 4 * 64 * 3000 * 4
    floor = memory_floor(RematProblem(graph, 10**12))
    assert floor.bytes < graph.persistent_bytes + 3 * logits_bytes


@pytest.mark.parametrize("budget", [None, 0.98])
def test_a_planned_lm_step_with_writes_over_dying_inputs_equals_eager(budget):
    torch.manual_seed(0)
    model, batch = TinyLM(), _lm_batch()
    reference = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference))
    step = memplan.compile_step(model, opt, _lm_loss, batch, allocator="views", memory_budget=budget)
    _assert_trains_as_eager(step, model, reference, ref_opt, _lm_loss, batch)


def _assert_trains_as_eager(step, model, reference, ref_opt, loss_fn, batch, steps: int = 3):
    """``steps`` steps of ``step`` and of eager PyTorch on ``reference``: the same loss bits
    each step, the same parameters after."""
    for _ in range(steps):
        loss = step(batch)
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = loss_fn(reference(batch[0]), batch[1])
        ref_loss.backward()
        ref_opt.step()
        assert torch.equal(loss, ref_loss)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


class NewGELU(nn.Module):
    """HF GPT-2's ``gelu_new`` as Python ops: the capture writes ``mul``, ``add``, ``mul`` and
    ``tanh`` one after the other over the ``pow`` result (an in-place chain)."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class GeluNet(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), NewGELU(), nn.Linear(4 * width, width)) for _ in range(depth)
        )

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def test_a_remat_plan_reapplies_the_inplace_chain_and_equals_eager():
    """Under half the checkpoint-all peak the plan must drop the GELU values the backward reads
    (``tanh``'s, written into ``pow``'s storage) and re-make them: ``pow`` re-runs and the
    chain's links after it, in order (memplan.remat.problem.inplace_chain). Bit for bit eager's."""
    torch.manual_seed(0)
    rerun = _rerun_kinds_train_as_eager(GeluNet(), (torch.randn(256, 64), torch.randn(256, 64)), 0.5)
    assert rerun["aten.tanh.out"] >= 1 and rerun["aten.pow.Tensor_Scalar"] >= 1, rerun


def _rerun_kinds_train_as_eager(model: nn.Module, batch: tuple, budget: float) -> Counter:
    """The op kinds the remat plan under ``budget`` re-runs, once its step trained as eager's (AdamW, MSE)."""
    reference = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference))
    loss_fn = nn.functional.mse_loss
    step = memplan.compile_step(
        model, opt, loss_fn, batch, allocator="views", memory_budget=budget, time_limit_seconds=3
    )
    runner = step.runners[next(iter(step.runners))]
    assert isinstance(runner, RematRunner)
    _assert_trains_as_eager(step, model, reference, ref_opt, loss_fn, batch)
    runs = Counter(i for kind, i in runner.steps if kind == "run")
    return Counter(runner.graph.ops[i].kind for i, count in runs.items() if count > 1)


class AttentionOut(nn.Module):
    """``x + tanh(x) @ w`` per block on 4-d tensors, as GPT-2's attention ends: ``matmul`` is a
    ``bmm`` and an ``_unsafe_view`` of its output, and the capture writes the residual sum over
    that output through the view (the ``add.out``)."""

    def __init__(self, width: int = 16, heads: int = 4, depth: int = 4) -> None:
        super().__init__()
        self.mix = nn.ParameterList(nn.Parameter(torch.randn(heads, width, width) / width**0.5) for _ in range(depth))

    def forward(self, x):
        for w in self.mix:
            x = x + torch.matmul(torch.tanh(x), w)
        return x


def test_a_view_taken_for_an_inplace_write_is_made_again_when_its_producer_reruns():
    """Under 75% of the checkpoint-all peak the plan re-runs the ``bmm`` whose output the
    residual ``add.out`` overwrites through a view (memplan.remat.problem.chain_previews):
    the view is made again before the write is re-applied, bit for bit eager's."""
    torch.manual_seed(0)
    batch = (torch.randn(32, 4, 32, 16), torch.randn(32, 4, 32, 16))
    rerun = _rerun_kinds_train_as_eager(AttentionOut(), batch, 0.75)
    assert rerun["aten.bmm.default"] >= 1 and rerun["aten.add.out"] >= 1, rerun
