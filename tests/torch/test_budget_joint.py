"""Joint order and recomputation in the main budget path (issue 36): the remat runner runs a
plan whose runs were reordered given its recomputations (the joint search's moves), with each
optimizer update group kept contiguous, bit for bit like eager; and ``memory_budget=`` says in
its report which plan it took (the sequential or the joint one) and what each costs."""

from __future__ import annotations

import copy
import random

import pytest

import memplan
import torch
from memplan.remat.baselines import checkpoint_all
from memplan.remat.joint import contiguous_order, expand, groups_breach, steps_in_order
from memplan.remat.portfolio import solve_remat_in_order
from memplan.remat.problem import RematProblem, memory_floor
from memplan.torch.capture import capture_train_step
from memplan.torch.run.budget import held_graph
from memplan.torch.run.interpreter import optimizer_update_groups
from memplan.torch.run.remat import RematRunner, first_run_order
from tests.core.test_remat_joint import random_order


def reordered_plans(graph, steps, groups, count: int, seed: int = 0) -> list[list]:
    """Plans of the same runs as ``steps`` in random orders of their expanded DAG, each update
    group made contiguous (:func:`memplan.remat.joint.contiguous_order`: the joint search's
    reorder), whose first runs are in another order than ``steps``'."""
    expanded = expand(graph, steps)
    rng = random.Random(seed)
    plans = []
    for _ in range(50 * count):
        order = contiguous_order(expanded, random_order(expanded.graph, rng), groups)
        if order is None:
            continue
        moved = steps_in_order(expanded, order, groups)
        if first_run_order(moved) != first_run_order(steps) and moved not in plans:
            plans.append(moved)
        if len(plans) == count:
            break
    return plans


class Block(torch.nn.Module):
    """Conv, batch norm, in-place ReLU, conv, batch norm, a residual ``add_``: the ops a remat
    plan re-runs with care (statistics, views, in-place followers)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(True))
        self.b = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.b(self.a(x)).add_(x))


def small_net() -> torch.nn.Module:
    torch.manual_seed(0)
    stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
    head = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 10))
    return torch.nn.Sequential(stem, Block(), Block(), head)


def optimizer_for(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)


def eager_step(model, optimizer, batch) -> torch.Tensor:
    loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


@pytest.mark.parametrize("optimizer", ["sgd", pytest.param("adamw", marks=pytest.mark.slow)])
def test_the_remat_runner_runs_reordered_plans_with_whole_update_groups_like_eager(optimizer: str) -> None:
    """SGD's momentum (3 ops a group), AdamW's update groups (a dozen ops each, with
    temporaries); batch norms re-run without their statistics, in-place ReLUs, residual
    ``add_``: the same runs reordered, every plan trains bit for bit like eager."""
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(8, 3, 24, 24, generator=g), torch.randint(0, 10, (8,), generator=g))
    model = small_net()
    eager, planned = model, copy.deepcopy(model)
    eager_opt, planned_opt = optimizer_for(optimizer, eager), optimizer_for(optimizer, planned)
    capture = capture_train_step(planned, planned_opt, torch.nn.functional.cross_entropy, batch)
    graph, groups = held_graph(capture), optimizer_update_groups(capture)
    assert max(len(g) for g in groups) > 1
    reference = checkpoint_all(RematProblem(graph, 10**18)).peak_bytes
    floor = memory_floor(RematProblem(graph, reference)).bytes
    # between the floor and no remat; a plan is found in about a second, which a loaded machine may need 3 s for
    plan = solve_remat_in_order(graph, None, (floor + reference) // 2, 10.0)
    assert plan.feasible and groups_breach(graph, plan.steps, groups) is None
    plans = reordered_plans(graph, plan.steps, groups, count=2)
    assert plans, "no other order of the plan's runs keeps its update groups whole"
    for steps in plans:
        runner = RematRunner(capture, steps, planned, planned_opt)
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
        assert runner.recomputes > 0  # the plan recomputes: not a plain step in disguise


def test_a_budget_report_says_which_plan_ran_and_what_each_costs() -> None:
    """``memory_budget=``: the sequential plan recomputes, so the joint search runs after it in
    what is left of ``time_limit_seconds``; the report names the plan taken and both costs, the
    one taken is the one that runs, and the step is eager's bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(64, 64), torch.nn.Tanh())])
    eager = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(512, 64, generator=g), torch.randn(512, 64, generator=g))
    loss_fn = torch.nn.functional.mse_loss
    step = memplan.compile_step(model, opt, loss_fn, batch, memory_budget=0.7, allocator="views", time_limit_seconds=6)
    report = step.report["budget"]
    assert report["method"] == "remat" and report["recomputed_ops"] > 0
    assert report["remat_plan"] in ("sequential", "joint"), report
    if report["joint_seconds"] is not None:  # the joint search ran, within what the sequential solve left of the limit
        assert report["sequential_seconds"] + report["joint_seconds"] <= 6 + 1.0, report
    else:  # on a loaded machine the sequential solve may have left too little
        assert report["joint"].startswith("not run:") and "left of time_limit_seconds" in report["joint"], report
    assert report["overhead"] == report[f"{report['remat_plan']}_overhead"], report
    if report["remat_plan"] == "joint":
        assert report["joint_overhead"] < report["sequential_overhead"] or (
            report["joint_overhead"] == report["sequential_overhead"]
            and report["joint_placed_bytes"] < report["sequential_placed_bytes"]
        )
    for _ in range(2):
        loss = loss_fn(eager(batch[0]), batch[1])
        loss.backward()
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)
        assert torch.equal(loss.detach(), step(batch))
    assert all(torch.equal(a, b) for a, b in zip(eager.parameters(), model.parameters(), strict=True))
