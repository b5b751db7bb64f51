"""``torch.compile(model, backend=memplan_backend(...))``: memplan's remat decision in
AOTAutograd's partitioner. Trains bit for bit like eager and like ``aot_eager``; saves fewer
activations for the backward, so the step's peak is lower."""

from __future__ import annotations

import copy

import pytest

import torch
from memplan.torch.export.backend import forward_nodes, memplan_backend
from memplan.torch.measure import allocator_peak_bytes


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128)) for _ in range(2)
        )
        self.drop = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + self.drop(layer(x))
        return self.head(x)


def step(model, optimizer, x, y) -> torch.Tensor:
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_memplan_backend_trains_like_eager_and_aot_eager_with_a_lower_peak() -> None:
    torch.manual_seed(0)
    eager = Net()
    models = {"eager": eager, "memplan": copy.deepcopy(eager), "aot_eager": copy.deepcopy(eager)}
    backend = memplan_backend(budget=0.8, strategy="linearized-greedy")
    run = {
        "eager": models["eager"],
        "memplan": torch.compile(models["memplan"], backend=backend),
        "aot_eager": torch.compile(models["aot_eager"], backend="aot_eager"),
    }
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for k, m in models.items()}
    x, y = torch.randn(512, 128), torch.randint(0, 10, (512,))
    peaks = {}
    for k in range(3):
        losses = {}
        for name, model in run.items():
            torch.manual_seed(k)  # dropout draws the same numbers on every side
            if k == 2:
                losses[name], peaks[name] = allocator_peak_bytes(step, model, optimizers[name], x, y)
            else:
                losses[name] = step(model, optimizers[name], x, y)
        for name in ("memplan", "aot_eager"):
            assert torch.equal(losses[name], losses["eager"])
            for a, b in zip(models[name].parameters(), models["eager"].parameters(), strict=True):
                assert torch.equal(a, b)
    report = backend.last_report
    assert report is not None and report.feasible and report.recomputed_nodes
    assert report.planned_peak_bytes <= report.budget_bytes
    assert peaks["memplan"] < peaks["aot_eager"]


def test_an_infeasible_budget_recomputes_nothing_and_says_so() -> None:
    torch.manual_seed(0)
    model = Net()
    backend = memplan_backend(budget=1e-6, strategy="linearized-greedy")
    compiled = torch.compile(model, backend=backend)
    step(compiled, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 128), torch.randint(0, 10, (8,)))
    assert backend.last_report is not None and not backend.last_report.feasible
    assert not backend.last_report.recomputed_nodes


def test_forward_nodes_do_not_depend_on_tangents() -> None:
    graph = torch.fx.Graph()
    primal, tangent = graph.placeholder("primals_1"), graph.placeholder("tangents_1")
    fwd = graph.call_function(torch.ops.aten.relu.default, (primal,))
    bwd = graph.call_function(torch.ops.aten.mul.Tensor, (fwd, tangent))
    graph.output((fwd, bwd))
    assert forward_nodes(torch.fx.GraphModule({}, graph)) == {fwd.name}
