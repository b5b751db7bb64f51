"""Remat with the optimizer's updates moved early, on real captures (issue 33): each update group
the runtime runs as one call (:func:`memplan.torch.run.interpreter.optimizer_update_groups`) stays
contiguous in :func:`memplan.remat.stage_order.early_update_order`, moved into the backward; a remat
plan whose stages keep that order keeps every group whole and trains bit for bit like eager."""

from __future__ import annotations

import copy

import pytest

import torch
from memplan.graph.liveness import peak_bytes
from memplan.remat.baselines import checkpoint_all
from memplan.remat.portfolio import solve_remat_in_order
from memplan.remat.problem import RematProblem, memory_floor
from memplan.remat.stage_order import broken_group, call_groups, early_update_order
from memplan.torch.capture import capture_train_step
from memplan.torch.run.budget import held_graph
from memplan.torch.run.interpreter import optimizer_update_groups
from memplan.torch.run.remat import RematRunner, first_run_order
from tests.torch.test_budget_joint import eager_step, optimizer_for, small_net


@pytest.mark.parametrize("optimizer", ["adamw", pytest.param("sgd", marks=pytest.mark.slow)])
def test_the_early_order_keeps_the_runtimes_update_groups_whole_and_trains_like_eager(optimizer: str) -> None:
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(8, 3, 24, 24, generator=g), torch.randint(0, 10, (8,), generator=g))
    model = small_net()
    eager, planned = model, copy.deepcopy(model)
    eager_opt, planned_opt = optimizer_for(optimizer, eager), optimizer_for(optimizer, planned)
    capture = capture_train_step(planned, planned_opt, torch.nn.functional.cross_entropy, batch)
    graph, groups = held_graph(capture), optimizer_update_groups(capture)
    program = list(range(len(graph.ops)))
    early = early_update_order(graph, program, groups)
    assert early != program and early_update_order(graph, early, groups) == early
    backward_end = max(v for v in program if not any(v in g for g in groups) and graph.ops[v].kind.startswith("aten"))
    assert min(early.index(g[0]) for g in groups) < early.index(backward_end)  # an update runs inside the backward
    for group in groups:
        where = sorted(early.index(v) for v in group)
        assert where == list(range(where[0], where[0] + len(group)))
    reference = checkpoint_all(RematProblem(graph, 10**18)).peak_bytes
    floor = memory_floor(RematProblem(graph, reference)).bytes
    assert peak_bytes(graph, early) <= reference
    plan = solve_remat_in_order(graph, early, (floor + reference) // 2, 2.0, groups=groups)
    assert plan.feasible and broken_group(plan.steps, groups) is None
    assert first_run_order(plan.steps) == tuple(early) or plan.compute_cost > plan.plain_cost
    runner = RematRunner(capture, plan.steps, planned, planned_opt)
    for k in range(2):
        torch.manual_seed(k)
        expected = eager_step(eager, eager_opt, batch)
        torch.manual_seed(k)
        assert torch.equal(expected, runner(batch))
        state = [
            *zip(eager.parameters(), planned.parameters(), strict=True),
            *zip(eager.buffers(), planned.buffers(), strict=True),
        ]
        assert all(torch.equal(a, b) for a, b in state)
    assert runner.recomputes > 0


def _custom(model: torch.nn.Module) -> torch.optim.Optimizer:
    """An optimizer memplan does not know to update parameters independently: one group."""

    class Momentum(torch.optim.Optimizer):
        def __init__(self, params: object) -> None:
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self, closure: object = None) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state[p]
                    if "buf" not in state:
                        state["buf"] = torch.zeros_like(p)
                    state["buf"].mul_(0.9).add_(p.grad)
                    p.add_(state["buf"], alpha=-group["lr"])

    return Momentum(model.parameters())


def _hooked(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW with a step hook: the runtime runs its call as one group (a hook runs once per call)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    optimizer.register_step_post_hook(lambda *_: None)
    return optimizer


OPTIMIZERS = {
    "hooked": _hooked,
    "custom": _custom,
    "adam-foreach": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, foreach=True),
    "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2, foreach=False),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_groups_the_graph_shows_hold_the_runtimes_and_stay_whole_in_the_early_order(name: str) -> None:
    """Split per parameter or not (a hook, an optimizer memplan does not know), each group the
    runtime runs as one call lies in one group :func:`call_groups` infers from the graph, so the
    early order it makes keeps each whole."""
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(4, 3, 12, 12, generator=g), torch.randint(0, 10, (4,), generator=g))
    model = small_net()
    capture = capture_train_step(model, OPTIMIZERS[name](model), torch.nn.functional.cross_entropy, batch)
    graph, groups = held_graph(capture), optimizer_update_groups(capture)
    shown = call_groups(graph)
    inferred = {v: c for c, members in enumerate(shown) for v in members}
    for group in groups:
        assert len({inferred.get(v, -1) for v in group}) == 1 and group[0] in inferred, group
    early = early_update_order(graph, list(range(len(graph.ops))), shown)
    position = {v: i for i, v in enumerate(early)}
    for group in groups:
        assert max(position[v] for v in group) - min(position[v] for v in group) + 1 == len(group), group
