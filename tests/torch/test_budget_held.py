"""Issue 33: under a budget the plan counts what the runtime holds. An optimizer's update of a
parameter is one call of the user's optimizer with the gradient set as ``.grad`` for the whole
call, so AdamW's two temporaries as large as the parameter are allocated while the gradient is
still resident: the plan counts it until the call ends (:func:`held_graph`), and the arena
placed from the real, recorded allocations is what the plan said."""

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
    exceed the planned one (before: by the 1 MiB gradient, so a budget between the two was
    accepted by the plan and refused once placed)."""
    model, batch = _model_and_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = compile_step(model, opt, torch.nn.functional.cross_entropy, batch, memory_budget=1.0, time_limit_seconds=2)
    for _ in range(6):
        step(batch)
    report = step.report["budget"]
    assert report["method"] == "reorder" and report.get("placed_peak_bytes"), report
    slack = 64 * 1024  # alignment of the recorded allocations
    assert report["placed_peak_bytes"] <= report["plain_planned_peak_bytes"] + slack, report
    capture, plan = next(iter(step.runners.values())).run.capture, next(iter(step.plans.values()))
    held = held_graph(capture)
    assert peak_bytes(held, plan.order) - peak_bytes(capture.graph, plan.order) == 64 * WIDE * 4  # the gradient
    assert [op.outputs for op in held.ops] == [op.outputs for op in capture.graph.ops]  # only reads added
    assert report["placed_peak_bytes"] > plan.report["planned_peak_bytes"] + slack  # what was counted before


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
