"""Capture from PyTorch: fidelity against a measured eager run, the zoo, semantics, errors."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

import torch
from memplan.errors import DataDependentControlFlow, DynamicShape, UnknownModel
from memplan.graph import Category, Reachability, peak_bytes, validate_graph
from memplan.torch.capture import RELEASE_KIND, capture_infer_step, capture_train_step
from memplan.torch.measure import measure_infer_step, measure_train_step
from memplan.torch.zoo import build_workload, capture_model, list_models, make_optimizer

FIDELITY_TOLERANCE = 0.02


@pytest.mark.parametrize(
    ("model", "batch", "optimizer"),
    [
        ("mlp", 8, "sgd"),
        ("mlp", 64, "adam"),
        ("vgg16", 2, "sgd"),
        ("vgg16", 16, "adamw"),
        ("gpt2-2l", 1, "adam"),
        ("gpt2-2l", 4, "sgd"),
    ],
)
def test_program_order_peak_matches_measured_eager_peak(model, batch, optimizer):
    w = build_workload(model, batch)
    w.model.train()
    opt = make_optimizer(optimizer, w.model.parameters())
    measured = measure_train_step(w.model, opt, w.loss_fn, (w.inputs, w.target))
    graph = capture_train_step(w.model, opt, w.loss_fn, (w.inputs, w.target)).graph
    estimated = peak_bytes(graph, graph.program_order())
    assert abs(estimated - measured) <= FIDELITY_TOLERANCE * measured, (estimated, measured)


def test_inference_capture_matches_measured_peak():
    w = build_workload("mlp", 32)
    w.model.eval()
    measured = measure_infer_step(w.model, w.inputs)
    graph = capture_infer_step(w.model, w.inputs).graph
    assert graph.meta["mode"] == "infer"
    assert not any(t.category is Category.GRADIENT for t in graph.tensors)
    assert abs(peak_bytes(graph, graph.program_order()) - measured) <= FIDELITY_TOLERANCE * measured


def test_capture_leaves_the_users_model_and_optimizer_untouched():
    w = build_workload("mlp", 4)
    opt = make_optimizer("adam", w.model.parameters())
    before = {k: v.clone() for k, v in w.model.state_dict().items()}
    capture_train_step(w.model, opt, w.loss_fn, (w.inputs, w.target))
    assert not opt.state, "capture must not create state in the user's optimizer"
    for k, v in w.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in w.model.parameters())


@pytest.mark.parametrize("name", list_models())
def test_every_zoo_model_captures_a_valid_training_step(name):
    graph = capture_model(name, 1, "train", "adam").graph
    validate_graph(graph)
    categories = {t.category for t in graph.tensors}
    assert {Category.PARAMETER, Category.OPTIMIZER_STATE, Category.GRADIENT, Category.ACTIVATION} <= categories
    assert sum(t.category is Category.OUTPUT for t in graph.tensors) == 1  # the loss
    assert any(op.kind == RELEASE_KIND for op in graph.ops)


def test_optimizer_updates_come_after_every_read_of_their_parameter():
    graph = capture_model("mlp", 2, "train", "sgd").graph
    reach = Reachability.of(graph)
    for op_id, op in enumerate(graph.ops):
        for t in op.mutates:
            if graph.tensors[t].category is not Category.PARAMETER:
                continue
            for reader in graph.consumers[t]:
                if reader != op_id and reader < op_id:
                    assert reach.is_ancestor(reader, op_id), (graph.ops[reader].name, op.name)


def test_batchnorm_running_stats_are_written_and_views_share_storage():
    graph = capture_model("vgg16", 2, "train", "sgd").graph
    bn = [op for op in graph.ops if "native_batch_norm.default" in op.kind]
    assert bn and all(len(op.mutates) == 2 for op in bn)
    assert all(graph.tensors[t].category is Category.BUFFER for op in bn for t in op.mutates)
    views = [op for op in graph.ops if op.kind in ("aten.t.default", "aten.view.default", "aten.detach.default")]
    assert views and all(graph.tensors[t].size_bytes == 0 for op in views for t in op.outputs)


def test_random_ops_are_chained_in_program_order():
    graph = capture_model("gpt2-2l", 1, "train", "sgd").graph
    random_ops = [i for i, op in enumerate(graph.ops) if "bernoulli" in op.kind or "dropout" in op.kind]
    assert len(random_ops) >= 4
    reach = Reachability.of(graph)
    for a, b in itertools.pairwise(random_ops):
        assert reach.is_ancestor(a, b)


def test_fake_zoo_capture_equals_real_model_capture():
    fake_graph = capture_model("gpt2-2l", 1, "train", "adam").graph
    w = build_workload("gpt2-2l", 1)
    opt = make_optimizer("adam", w.model.parameters())
    real_graph = capture_train_step(w.model, opt, w.loss_fn, (w.inputs, w.target)).graph
    assert fake_graph.persistent_bytes == real_graph.persistent_bytes
    assert peak_bytes(fake_graph, fake_graph.program_order()) == peak_bytes(real_graph, real_graph.program_order())


def test_tied_weights_count_once():
    w = build_workload("gpt2-2l", 1)
    lm = w.model.model
    assert lm.lm_head.weight is lm.transformer.wte.weight
    graph = capture_infer_step(w.model, w.inputs).graph
    params = sum(t.size_bytes for t in graph.tensors if t.category is Category.PARAMETER)
    assert params == sum(p.numel() * p.element_size() for p in w.model.parameters())


class Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * 2 if y.sum() > 0 else y


class Nonzero(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)[torch.nonzero(x[:, 0] > 0).flatten()]


@pytest.mark.parametrize(("module", "error"), [(Branchy, DataDependentControlFlow), (Nonzero, DynamicShape)])
def test_unsupported_steps_fail_with_one_line(module, error):
    model = module()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(error) as info:
        capture_train_step(model, opt, lambda out, y: out.sum(), (torch.randn(3, 4), None))
    assert "\n" not in str(info.value)


def test_unknown_model_is_a_clear_error():
    with pytest.raises(UnknownModel, match="memplan models"):
        capture_model("resnet9000")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memplan.cli", *args], capture_output=True, text=True)


def test_cli_analyze_writes_json(tmp_path):
    out = tmp_path / "r.json"
    result = run_cli("analyze", "mlp", "--batch-size", "4", "--optimizer", "adam", "--json", str(out))
    assert result.returncode == 0, result.stderr
    import json

    data = json.loads(out.read_text())
    for key in ("model", "batch_size", "mode", "num_ops", "num_tensors", "persistent_bytes"):
        assert key in data
    assert data["lower_bound_bytes"] <= data["program_order_peak_bytes"]
    assert isinstance(data["program_order_peak_bytes"], int)


def test_cli_capture_then_analyze_the_json(tmp_path):
    path = tmp_path / "g.json"
    assert run_cli("capture", "mlp", "-o", str(path)).returncode == 0
    result = run_cli("analyze", str(path))
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "args",
    [("analyze", "resnet9000"), ("analyze", "missing.json"), ("analyze", "mlp", "--batch-size", "0")],
)
def test_cli_errors_are_one_line_and_nonzero(args):
    result = run_cli(*args)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert result.stderr.strip()
