"""Issue 37: a new length costs no trace where the symbolic capture's guards hold for it, else
one fake run of the step, and the step that creates the optimizer's state stays within eager's
peak.

With ``dynamic=``, a new length whose guards hold (``memplan.torch.capture.symbolic``) gets its
program from the symbolic capture, without tracing; where a guard fails (a Python branch on the
length), it is traced once (no untraced run) when a kept capture at another length shows the
steady state. The traced program is the new length's own, so a branch on the length is never
served another length's program: a branch that changes the ops is planned on its own, one that
changes only a constant reuses the order and placement but runs its own program, and both train
bit for bit as eager does. A literal that depends on the length sends the capture back to the
full form. On the step that creates AdamW's state, the arena's dead pages are given back before
the optimizer's call."""

from __future__ import annotations

import copy
import itertools

import pytest

import torch
from memplan.api import compile_step
from memplan.torch.capture.trace import steady_like
from memplan.torch.run.first_state import creates_state, free_pages, held_at, run_times
from memplan.torch.zoo import make_optimizer
from torch import nn

PAGE = 4096


class Seq(nn.Module):
    """A small sequence model; ``branch`` picks what depends on the length (dim 1)."""

    def __init__(self, branch: str = "", width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, width)
        self.mix = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.head = nn.Linear(width, 50)
        self.branch = branch

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.mix(h)
        n = ids.shape[1]
        if self.branch == "op" and n > 8:  # other ops for long sequences
            h = torch.tanh(h)
        if self.branch == "constant":  # the same ops, another constant
            h = h * (0.5 if n > 8 else 2.0)
        if self.branch == "literal":  # a tensor made from the length
            h = h * torch.tensor(1.0 + n / 100)
        return self.head(h)


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _batch(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (2, length), generator=g), torch.randint(0, 50, (2, length), generator=g)


def _train(lengths: list[int], branch: str = "", width: int = 16, on_step=None):
    """memplan (``dynamic={1: 16}``) and eager side by side; every loss and parameter bitwise equal."""
    torch.manual_seed(0)
    model = Seq(branch, width)
    reference = copy.deepcopy(model)
    opt, ref_opt = make_optimizer("adamw", model.parameters()), make_optimizer("adamw", reference.parameters())
    step = compile_step(
        model, opt, _loss, _batch(lengths[0], 0), allocator="views", dynamic={1: 16}, time_limit_seconds=1
    )
    for i, length in enumerate(lengths):
        batch = _batch(length, i)
        loss = step(batch)
        if on_step is not None:
            on_step(step, batch)
        ref_loss = _loss(reference(batch[0]), batch[1])
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        assert torch.equal(loss, ref_loss.detach()), (i, length)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))
    return step, model, opt


def _log(step) -> dict[str, dict]:
    return {entry["shape"].split()[0]: entry for entry in step.shape_log}


def test_a_new_length_is_traced_once_and_reuses_the_plan_bit_identical():
    # a constant that depends on the length: the same ops, so the plan is reused, but each length
    # runs its own program (bitwise eager's only if 12 multiplies by 0.5 and 5 and 7 by 2.0)
    step, model, opt = _train([5, 12, 7], branch="constant")
    log = _log(step)
    assert step.plans_made == 1
    assert log["2x5"]["fake_runs"] == 2  # captured before the first step: AdamW has no state yet
    assert log["2x5"]["checked"].startswith("traced: the symbolic capture waits")  # for AdamW's state
    assert log["2x12"]["checked"] == "guards" and log["2x12"]["fake_runs"] == 0  # 16's program holds: no trace
    assert log["2x7"]["checked"].startswith("traced: length 7 lies outside [9, 16]")  # the branch n > 8
    assert log["2x7"]["fake_runs"] == 1
    assert all(entry["plan"] == "reused the plan of 2x16 2x16" for entry in log.values())
    like = step._templates[-1].capture
    assert steady_like(like, model, [opt])  # the state the captured step leaves, now real
    fresh = Seq()
    assert not steady_like(like, fresh, [make_optimizer("adamw", fresh.parameters())])  # no state yet


def test_a_branch_on_the_length_is_never_served_another_lengths_program():
    op_step, _, _ = _train([5, 12], branch="op")
    log = _log(op_step)
    assert op_step.plans_made == 2  # 16 (tanh) and 5 (no tanh): other ops, planned on its own
    assert log["2x5"]["plan"].startswith("planned (")
    assert log["2x12"]["plan"] == "reused the plan of 2x16 2x16" and log["2x12"]["checked"] == "guards"


@pytest.mark.slow
def test_a_literal_made_from_the_length_falls_back_to_the_full_capture():
    step, _, _ = _train([5, 12], branch="literal")
    assert _log(step)["2x12"]["fake_runs"] == 2  # its literal differs from 16's: the untraced run decides
    assert _log(step)["2x12"]["checked"].startswith("traced: the step computes a float from the length")
    assert step.plans_made == 1


def test_the_state_step_gives_back_the_arena_pages_no_later_op_reads():
    seen = []
    _, model, opt = _train([16], width=128, on_step=lambda s, b: seen.append(s.runner_for(b)))
    runner = seen[0]
    assert runner.released_at_state_bytes >= PAGE  # the first step created AdamW's state: dead pages given back
    assert not creates_state(runner.capture, model, [opt])  # the next steps create none: never trimmed
    runs = run_times(runner.capture, runner.plan.order)
    position = {op: t for t, op in enumerate(runner.plan.order)}
    calls = sorted({runs[op] for op in position if runs[op] != position[op]})
    assert calls  # AdamW's update calls
    for call in calls:
        held = held_at(runner.capture, runs, runner.plan.offsets, call)
        assert all(a < b for a, b in held) and all(b1 < a2 for (_, b1), (a2, _) in itertools.pairwise(held))
        for address, length in free_pages(held, runner.plan.arena_bytes, 0):
            assert address % PAGE == 0 and length % PAGE == 0
            assert not any(a < address + length and address < b for a, b in held)  # never a held byte


def test_free_pages_rounds_inward_to_whole_pages():
    assert free_pages([], 3 * PAGE, 0) == [(0, 3 * PAGE)]
    assert free_pages([(10, 20)], 3 * PAGE, 0) == [(PAGE, 2 * PAGE)]
    held = [(0, PAGE), (2 * PAGE + 1, 2 * PAGE + 2)]
    assert free_pages(held, 4 * PAGE, 100) == [(3 * PAGE, PAGE)]  # the arena starts 100 bytes into a page
