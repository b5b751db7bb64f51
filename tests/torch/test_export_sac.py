"""memplan's remat decision as a selective-activation-checkpointing policy in a plain eager
loop: same numbers as eager, less memory, close to the plan's peak."""

from __future__ import annotations

import copy

import pytest

import torch
from memplan.remat import rematerialize, sequence_peak_bytes
from memplan.remat.baselines import checkpoint_all
from memplan.remat.problem import RematProblem
from memplan.torch.capture import capture_train_step
from memplan.torch.export.sac import PolicyMismatch, SACPolicy, align_calls, repeated_layers
from memplan.torch.measure import allocator_peak_bytes, optimizer_state_tensors, resident_bytes


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
        self.norm, self.drop = torch.nn.LayerNorm(width), torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class Net(torch.nn.Module):
    def __init__(self, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def workload(seed: int = 0):
    torch.manual_seed(seed)
    model = Net()
    batch = (torch.randn(512, 64), torch.randint(0, 10, (512,)))
    return model, batch


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def plan(model, batch, fraction: float, strategy: str = "linearized-greedy"):
    capture = capture_train_step(model, sgd(model), torch.nn.functional.cross_entropy, batch, write_into_dying=False)
    top = checkpoint_all(RematProblem(capture.graph, 10**18)).peak_bytes
    schedule = rematerialize(capture.graph, int(fraction * top), strategy, 5.0)
    return capture, schedule


def train_step(model, optimizer, batch) -> torch.Tensor:
    loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def test_sac_trains_like_eager_with_less_memory_close_to_the_plan() -> None:
    model, batch = workload()
    capture, schedule = plan(model, batch, 0.8)
    policy = SACPolicy.from_schedule(capture, schedule)
    eager_model, sac_model = model, copy.deepcopy(model)
    optimizers = {"eager": sgd(eager_model), "sac": sgd(sac_model)}
    assert policy.apply(sac_model, batch[0]) == ["blocks.0", "blocks.1", "blocks.2"]
    peaks = {}
    for k in range(3):
        losses = {}
        for side, m in (("eager", eager_model), ("sac", sac_model)):
            torch.manual_seed(100 + k)
            policy.reset_stats()
            if k == 2:
                losses[side], peak = allocator_peak_bytes(train_step, m, optimizers[side], batch)
                state = optimizer_state_tensors(optimizers[side])
                peaks[side] = peak + resident_bytes(list(m.parameters()), state, batch)
            else:
                losses[side] = train_step(m, optimizers[side], batch)
        assert torch.equal(losses["eager"], losses["sac"])
        for a, b in zip(eager_model.parameters(), sac_model.parameters(), strict=True):
            assert torch.equal(a, b)
    assert not policy.stats.unaligned  # every call in a checkpointed region was matched to the capture
    assert policy.stats.saved > 0 and policy.stats.recomputed > 0
    planned = sequence_peak_bytes(capture.graph, schedule.steps)
    assert peaks["sac"] < peaks["eager"]
    assert abs(peaks["sac"] / planned - 1) < 0.05, (peaks, planned)  # the target, on a small model


def test_decisions_follow_the_plan_and_what_sac_can_cache() -> None:
    model, batch = workload()
    capture, schedule = plan(model, batch, 0.8)
    policy = SACPolicy.from_schedule(capture, schedule)
    by_node = {d.node: d for d in policy.decisions}
    graph = capture.graph
    runs = {}
    for kind, i in schedule.steps:
        if kind == "run":
            runs[i] = runs.get(i, 0) + 1
    for v, phase in enumerate(capture.op_phase):
        if phase != "forward":
            continue
        d = by_node[capture.node_of_op[v]]
        if "bernoulli" in d.op or "dropout" in d.op:
            assert not d.save  # replayed from checkpoint's generator state
        if runs[v] > 1:
            assert not d.save
        if d.save:
            fresh = [t for t in graph.ops[v].outputs if graph.tensors[t].size_bytes]
            assert any(capture.op_phase[c] == "backward" for t in fresh for c in graph.consumers[t])
    assert policy.num_saved > 0


def test_policy_file_round_trip_and_clear_errors(tmp_path) -> None:
    model, batch = workload()
    capture, schedule = plan(model, batch, 0.8)
    policy = SACPolicy.from_schedule(capture, schedule, model="net")
    path = tmp_path / "policy.json"
    policy.save(path)
    loaded = SACPolicy.load(path)
    assert loaded.decisions == policy.decisions and loaded.meta["model"] == "net"
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(PolicyMismatch, match="not a memplan SAC policy"):
        SACPolicy.load(tmp_path / "bad.json")
    with pytest.raises(PolicyMismatch, match="no submodule"):
        loaded.apply(model, batch[0], regions=["nope"])
    with pytest.raises(PolicyMismatch, match="ModuleList"):
        repeated_layers(torch.nn.Linear(2, 2))
    with pytest.raises(PolicyMismatch, match="attach"):
        loaded.policy_fn(None, torch.ops.aten.mm.default)


def test_alignment_skips_what_only_one_side_has() -> None:
    model, batch = workload()
    capture, schedule = plan(model, batch, 0.8)
    decisions = SACPolicy.from_schedule(capture, schedule).decisions
    calls = [d.op for d in decisions]
    calls[3:3] = ["aten.eq.Scalar", "aten.all.default"]  # a Python-side check eager makes, capture does not
    del calls[10]
    mapping = align_calls(calls, decisions)
    assert mapping[3] is None and mapping[4] is None
    assert sum(m is not None for m in mapping) == len(decisions) - 1
    assert all(decisions[m].op == calls[i] for i, m in enumerate(mapping) if m is not None)
