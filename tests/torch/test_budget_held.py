"""Issue 33: the plan counts what the runtime holds. An optimizer's update of a parameter is
one call of the user's optimizer with the gradient set as ``.grad`` for the whole call, so
AdamW's two temporaries as large as the parameter are allocated while the gradient is still
resident: capture makes each gradient an input of every op of its update group
(:func:`memplan.torch.capture.trace.hold_update_inputs`), so the main path's planned peak, the
budget path's and the estimator's on :func:`held_graph` are one number, and the arena placed
from the real, recorded allocations is what the plan said."""

from __future__ import annotations

import torch
from memplan.api import compile_step
from memplan.graph.liveness import peak_bytes
from memplan.torch.run.budget import held_graph

WIDE = 4096  # the last layer's weight: 64 x 4096 floats = 1 MiB, the largest update


def _model_and_batch() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, WIDE))
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(8, 64, generator=g), torch.randint(0, WIDE, (8,), generator=g))


def test_the_budget_plan_counts_each_gradient_until_its_update_call_ends() -> None:
    """The oracle is the planned allocator's recording of the real step: the placed peak may not
    exceed the main path's planned peak (before the hold was made at capture, the main path's
    plan undercounted the 1 MiB gradient, so a budget between the two was accepted by the plan
    and refused once placed), and that planned peak is the estimator's on the held graph."""
    from memplan.torch.run.updates import update_groups

    model, batch = _model_and_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = compile_step(model, opt, torch.nn.functional.cross_entropy, batch, memory_budget=1.0, time_limit_seconds=2)
    for _ in range(6):
        step(batch)
    report = step.report["budget"]
    assert report["method"] == "reorder" and report.get("placed_peak_bytes"), report
    process = report["process"]  # the OS's account, made before the first step ran
    assert process["predicted_peak_rss_bytes"] == process["outside_bytes"] + report["planned_peak_bytes"]
    capture, plan = next(iter(step.runners.values())).run.capture, next(iter(step.plans.values()))
    held = held_graph(capture)
    assert plan.report["optimized_order_peak_bytes"] == peak_bytes(held, plan.order)
    assert report["plain_planned_peak_bytes"] == plan.report["planned_peak_bytes"] + report["workspace_bytes_max"]
    slack = 64 * 1024  # alignment of the recorded allocations
    assert report["placed_peak_bytes"] <= plan.report["planned_peak_bytes"] + slack, (report, plan.report)
    sizes = capture.graph.tensors
    widest = max(
        update_groups(capture), key=lambda g: max((sizes[t].size_bytes for t in _reads(capture, g)), default=0)
    )
    last = capture.graph.ops[max(widest.ops)]  # the group's ops run as one call: its last op holds what it reads
    grads = [t for t in _reads(capture, widest) if capture.graph.tensors[t].category.name == "GRADIENT"]
    assert grads and all(t in last.inputs for t in grads)
    assert max(capture.graph.tensors[t].size_bytes for t in grads) == 64 * WIDE * 4  # the last layer's gradient


def _reads(capture, group) -> set[int]:
    made = {t for v in group.ops for t in capture.graph.ops[v].outputs}
    return {t for v in group.ops for t in capture.graph.ops[v].inputs if t not in made}


def test_ops_pytorch_tags_seeded_are_never_recomputed_under_a_budget() -> None:
    """CPU's flash attention is tagged ``nondeterministic_seeded`` (its dropout): the self-check
    refuses a step that runs it more often than eager (the Llama at 1.75 GiB was refused so), so
    the budget path's graph marks it random and no remat plan re-runs it."""
    from memplan.remat.problem import is_random, rerun_limits
    from memplan.torch.capture import capture_train_step

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(32, 96)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(2, 16, 3, 2, 16).permute(2, 0, 3, 1, 4)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v).sum(dim=(1, 3))

    torch.manual_seed(0)
    model = Attention()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(2, 16, 32), torch.randint(0, 16, (2,)))
    capture = capture_train_step(model, opt, torch.nn.functional.cross_entropy, batch)
    held = held_graph(capture)
    attention = [v for v, op in enumerate(held.ops) if "scaled_dot_product" in op.kind and "backward" not in op.kind]
    assert attention and all(is_random(held.ops[v].kind) for v in attention)
    assert not any(is_random(capture.graph.ops[v].kind) for v in attention)  # what the core saw before
    assert all(rerun_limits(held)[v] == v for v in attention)  # run once


def test_a_budget_the_process_cannot_hold_is_refused_in_one_line_before_the_step_runs() -> None:
    """The OS measures the step's peak on top of what the process holds outside it (libraries,
    memplan's capture): the plan's report says so, and where that sum is above what the process
    may use the step is refused in one line naming a budget that fits."""
    import pytest

    from memplan.errors import InfeasibleBudget
    from memplan.torch.rss import rss_bytes
    from memplan.torch.run.budget import check_process_room

    model, batch = _model_and_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    planned = 3 * 2**20
    account = check_process_room(planned, model, opt, batch, limit=(2**50, "a test's limit"))
    assert 0 < account["outside_bytes"] <= rss_bytes()
    assert account["predicted_peak_rss_bytes"] == account["outside_bytes"] + planned
    with pytest.raises(InfeasibleBudget) as refused:
        check_process_room(planned, model, opt, batch, limit=(account["outside_bytes"], "a test's limit"))
    message = str(refused.value)
    assert "\n" not in message and "a test's limit" in message and "memory_budget='fit'" in message
