"""The plan cache on disk (issue 37): a restarted step replays its first step from the cache and
trains bit for bit like eager; an entry that is corrupt, foreign, invalid or stale is detected,
warned about and re-planned, never run. Every cache lives in a tmp folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import memplan
import torch
from memplan.errors import MemplanError
from memplan.torch.equivalence import differences, snapshot
from memplan.torch.run.plancache import ENV_DIR, PlanCacheWarning, cache_dir, plan_key
from memplan.torch.run.replay import ReplayedStep
from torch import nn

BATCH = 8


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 10))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 32, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator))] * n


def _step(model: nn.Module, optimizer: torch.optim.Optimizer):
    def step(batch):
        x, y = batch
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def _eager(steps: int) -> tuple[list[torch.Tensor], object]:
    model, optimizer = _model()
    step = _step(model, optimizer)
    torch.manual_seed(2)
    losses = [step(b).detach() for b in _batches(steps)]
    return losses, snapshot(model, optimizer)


def _planned(cache, steps: int, **options):
    """A fresh process's view: new objects, a new compiled step on the same cache."""
    model, optimizer = _model()
    compiled = memplan.compile(_step(model, optimizer), model=model, optimizer=optimizer, plan_cache=cache, **options)
    torch.manual_seed(2)
    losses = []
    for batch in _batches(steps):
        losses.append(compiled(batch).detach())
    return compiled, losses, snapshot(model, optimizer)


def _same_as_eager(losses, state, steps: int) -> None:
    eager_losses, eager_state = _eager(steps)
    assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses, strict=True))
    assert differences(state, eager_state) == []


def _runner(compiled) -> ReplayedStep:
    (runner,) = compiled.runners.values()
    return runner


def _entry(folder: Path) -> Path:
    (path,) = folder.glob("*.json")
    return path


@pytest.mark.parametrize("allocator", ["replay", pytest.param("views", marks=pytest.mark.slow)])
def test_a_restarted_step_uses_the_cached_plan_from_its_first_step_bit_for_bit(tmp_path, allocator):
    cold, cold_losses, cold_state = _planned(tmp_path, 3, allocator=allocator)
    first = cold.report["first_steps"]
    assert first["plan"] == "planned" and _entry(tmp_path).exists()
    warm, warm_losses, warm_state = _planned(tmp_path, 3, allocator=allocator)
    again = warm.report["first_steps"]
    assert again["plan"] == "cached" and again["visits_before_replay"] == 0
    if allocator == "replay":
        # the first step recorded (checked without a dispatch mode, the optimizer state it made
        # left out of the recording), the second replayed
        assert first["placement"] == "solved" and first["visits_before_replay"] == 1
        assert again["placement"] == "cached" and again["replayed_at_call"] == 1
        assert _runner(warm).recordings == 0 and _runner(warm).replays == 3
    assert next(iter(warm.plans.values())).order == next(iter(cold.plans.values())).order
    _same_as_eager(cold_losses, cold_state, 3)
    _same_as_eager(warm_losses, warm_state, 3)


def test_a_restarted_step_that_clears_its_gradients_first_is_traced_once(tmp_path):
    """``zero_grad()`` first leaves gradients at the end of a run: the full capture's two runs
    show the next call clears them, and the record says so, so the restart's one traced run
    stands (before the record kept it, the restart captured in full)."""

    def first(model, optimizer):
        def step(batch):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
            loss.backward()
            optimizer.step()
            return loss

        return step

    runs = []
    for _ in range(2):
        model, optimizer = _model()
        compiled = memplan.compile(first(model, optimizer), model=model, optimizer=optimizer, plan_cache=tmp_path)
        torch.manual_seed(2)
        losses = [compiled(b).detach() for b in _batches(2)]
        runs.append(compiled.report["first_steps"]["fake_runs"])
        _same_as_eager(losses, snapshot(model, optimizer), 2)
    assert runs == [2, 1]


FOREIGN = json.dumps({"format": "something-else", "version": 1})


@pytest.mark.slow
@pytest.mark.parametrize("content", ["{not json", FOREIGN])
def test_a_corrupt_or_foreign_entry_is_ignored_with_a_warning_and_rewritten(tmp_path, content):
    _planned(tmp_path, 2)
    path = _entry(tmp_path)
    path.write_text(content)
    with pytest.warns(PlanCacheWarning, match="ignored, it will be rewritten"):
        compiled, losses, state = _planned(tmp_path, 2)
    assert compiled.report["first_steps"]["plan"] == "planned"
    assert json.loads(path.read_text())["format"] == "memplan-plan-cache"  # rewritten whole
    _same_as_eager(losses, state, 2)


@pytest.mark.slow
def test_an_entry_whose_offsets_overlap_is_replaced_never_run(tmp_path):
    _planned(tmp_path, 2)
    path = _entry(tmp_path)
    entry = json.loads(path.read_text())
    entry["replay"]["offsets"] = [[i, 0] for i, _ in entry["replay"]["offsets"]]  # every buffer at offset 0
    entry["plan"]["order"] = list(reversed(entry["plan"]["order"]))  # not topological
    path.write_text(json.dumps(entry))
    with pytest.warns(PlanCacheWarning, match="does not fit this step"):
        compiled, losses, state = _planned(tmp_path, 3)
    first = compiled.report["first_steps"]
    assert first["plan"] == "planned" and first["placement"] == "solved"
    _same_as_eager(losses, state, 3)


def test_a_cached_placement_that_overlaps_in_a_branch_is_solved_again_never_run(tmp_path):
    """The plan is valid, only the placed recording's offsets are not: the per-branch validation
    of the preload (what the allocator relies on) refuses them before any step runs on them."""
    _planned(tmp_path, 2)
    path = _entry(tmp_path)
    entry = json.loads(path.read_text())
    entry["replay"]["offsets"] = [[i, 0] for i, _ in entry["replay"]["offsets"]]  # every buffer at offset 0
    path.write_text(json.dumps(entry))
    with pytest.warns(PlanCacheWarning, match="holds an invalid placement"):
        compiled, losses, state = _planned(tmp_path, 3)
    first = compiled.report["first_steps"]
    # recorded, then replayed
    assert first["plan"] == "cached" and first["placement"] == "solved" and first["replayed_at_call"] == 2
    _same_as_eager(losses, state, 3)


def test_a_stale_trace_only_makes_the_step_finish_on_the_allocator_then_record_again(tmp_path):
    _planned(tmp_path, 2)
    path = _entry(tmp_path)
    entry = json.loads(path.read_text())
    for trace in entry["replay"]["traces"]:  # a valid placement of requests this step does not make
        trace["sizes"] = [max(1, size - 1) for size in trace["sizes"]]
    path.write_text(json.dumps(entry))
    compiled, losses, state = _planned(tmp_path, 4)  # the first step left it: stale; recorded; replayed
    runner, first = _runner(compiled), compiled.report["first_steps"]
    assert first["plan"] == "cached" and first["placement"] == "solved" and first["cache_entry"].startswith("stale")
    assert runner.recordings == 1 and len(runner.traces) == 1  # the stale branches are gone
    assert runner.last_stats is not None and runner.last_stats.diverged_at is None
    _same_as_eager(losses, state, 4)
    assert json.loads(path.read_text())["replay"]["traces"][0]["sizes"] != entry["replay"]["traces"][0]["sizes"]


@pytest.mark.slow
def test_the_key_holds_the_options_and_the_step(tmp_path):
    compiled, _, _ = _planned(tmp_path, 1, allocator="views")
    capture = next(iter(compiled.runners.values())).capture
    options = {"executor": "generated", "time_limit_seconds": 10.0}
    assert plan_key(capture, options) == plan_key(capture, dict(options))
    assert plan_key(capture, options) != plan_key(capture, {**options, "executor": "interpreted"})
    _planned(tmp_path, 1, allocator="views", executor="interpreted")
    assert len(list(tmp_path.glob("*.json"))) == 2


@pytest.mark.slow
def test_the_cache_folder_and_an_unwritable_one(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "env"))
    assert cache_dir(True) == tmp_path / "env" / "plans" and cache_dir(False) is None and cache_dir(None) is None
    assert cache_dir(str(tmp_path)) == tmp_path
    with pytest.raises(MemplanError, match="plan_cache must be"):
        cache_dir(3)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.warns(PlanCacheWarning, match="not written"):
        _, losses, state = _planned(blocker / "cache", 2)
    _same_as_eager(losses, state, 2)
