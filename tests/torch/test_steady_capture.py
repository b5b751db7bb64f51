"""A restarted process traces its step once (issue 37): the plan cache's record of the untraced
run stands for it only where it holds (state, literals, copies, fingerprint), else the step is
captured in full; bit for bit like eager either way. Every cache lives in a tmp folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import memplan
import torch
from memplan.torch.equivalence import differences, snapshot
from tests.torch.test_plancache import _batches, _model, _planned, _same_as_eager, _step
from torch import nn

VIEWS = {"allocator": "views"}  # the record is the capture's: any allocator (test_plancache runs the others)


def _record(folder: Path) -> Path:
    (path,) = (folder / "steady").glob("*.json")
    return path


def _first(compiled) -> dict:
    (plan,) = compiled.plans.values()
    return plan.report["first_steps"]


def test_a_restarted_step_is_traced_once_and_trains_like_eager(tmp_path):
    cold, _, _ = _planned(tmp_path, 1, **VIEWS)
    assert _first(cold)["fake_runs"] == 2 and _first(cold)["plan"] == "planned"
    restarted, losses, state = _planned(tmp_path, 2, **VIEWS)
    assert _first(restarted)["fake_runs"] == 1 and _first(restarted)["plan"] == "cached"
    _same_as_eager(losses, state, 2)


@pytest.mark.parametrize(
    ("field", "wrong"),
    [
        ("state_meta", {"0.weight": {}}),
        ("literals", [["x", 1]]),
        ("fingerprint", "0" * 64),
    ],
)
def test_a_record_that_does_not_hold_is_captured_in_full_and_rewritten(tmp_path, field, wrong):
    _planned(tmp_path, 1, **VIEWS)
    path = _record(tmp_path)
    entry = json.loads(path.read_text())
    good = json.dumps(entry["steady"], sort_keys=True)
    path.write_text(json.dumps({**entry, "steady": {**entry["steady"], field: wrong}}))
    restarted, losses, state = _planned(tmp_path, 1, **VIEWS)
    assert _first(restarted)["fake_runs"] == 2  # the untraced run ran: the record did not hold
    _same_as_eager(losses, state, 1)
    assert json.dumps(json.loads(path.read_text())["steady"], sort_keys=True) == good


class _Scaled(nn.Module):
    """Multiplies by a literal made from a Python number each step (the same in every step of a
    process, not across processes)."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(32, 10)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * torch.tensor(self.scale)


def _scaled_run(scale: float, cache: Path | None, steps: int = 2):
    model = _Scaled(scale)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)

    def step(batch):
        x, y = batch
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    run = step if cache is None else memplan.compile(step, model=model, optimizer=optimizer, plan_cache=cache, **VIEWS)
    losses = [run(b).detach() for b in _batches(steps)]
    return run, losses, snapshot(model, optimizer)


def test_a_literal_that_differs_from_the_record_is_captured_in_full(tmp_path):
    _scaled_run(1.0, tmp_path)
    compiled, losses, state = _scaled_run(3.0, tmp_path)
    assert _first(compiled)["fake_runs"] == 2  # the record's literal is 1.0: not this step's
    _, eager_losses, eager_state = _scaled_run(3.0, None)
    assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses, strict=True))
    assert differences(state, eager_state) == []


def test_a_step_whose_optimizer_has_state_is_captured_in_full_and_not_recorded(tmp_path):
    """One eager step first (a resumed job): the untraced run creates no state, the record
    would not say what it showed."""
    model, optimizer = _model()
    step = _step(model, optimizer)
    step(_batches(1)[0])
    compiled = memplan.compile(step, model=model, optimizer=optimizer, plan_cache=tmp_path, **VIEWS)
    compiled(_batches(1)[0])
    assert _first(compiled)["fake_runs"] == 2
    assert list((tmp_path / "steady").glob("*.json")) == []
