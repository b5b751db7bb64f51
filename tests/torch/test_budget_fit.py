"""A budget that holds from the first call, and ``memory_budget="fit"`` (issue 33).

The first calls of a budgeted step (the kernels' workspace measured, the recording steps on
the ordinary allocator) stay within the budget, counted in live bytes; ``"fit"`` reads the
limit of the process from cgroup files and ``/proc/meminfo`` (here fake ones) and refuses, in
one line and before any step runs, a limit below what any plan reaches."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

import memplan
import memplan.torch.run.budget as budget_module
import memplan.torch.run.fit as fit
import torch
from memplan.errors import InfeasibleBudget
from memplan.torch.measure import LiveBytesTracker, optimizer_state_tensors
from memplan.torch.run.fit import GroupLimit

MIB = 2**20


def _mlp(width: int = 64, depth: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def _batch(rows: int = 512, width: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, width, generator=g), torch.randint(0, 10, (rows,), generator=g)


def _eager_step(model, optimizer, batch):
    loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _state(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


# ------------------------------------------------------------------ the first calls


def test_every_call_of_a_budgeted_step_stays_within_the_budget_from_the_first(monkeypatch) -> None:
    """The workspace measurement (before the first step) and every step, recorded or replayed,
    hold at most the budget in live bytes; the old measurement (a copy of the model, program
    order) held the parameters twice and every activation."""
    model, batch = _mlp(), _batch()
    model.train()
    eager = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    peaks: dict[str, int] = {}
    measure = budget_module.measure_op_workspace

    def tracked(capture, model_, optimizers, batch_, steps=None):
        tracker = LiveBytesTracker()
        tracker.track(_state(model_), [optimizer_state_tensors(o) for o in optimizers], batch_)
        with tracker:
            result = measure(capture, model_, optimizers, batch_, steps=steps)
        peaks["workspace"] = tracker.peak_bytes
        return result

    monkeypatch.setattr(budget_module, "measure_op_workspace", tracked)
    versions = [p._version for p in model.parameters()]
    step = memplan.compile(
        lambda b: _loss_step(model, opt, b), model=model, optimizer=opt, memory_budget=0.6, time_limit_seconds=5
    )
    runner = step.runner_for(batch)
    report = step.report["budget"]
    assert report["method"] == "remat" and report["workspace_measured_within"] == "remat plan", report
    assert [p._version for p in model.parameters()] == versions and all(p.grad is None for p in model.parameters())
    assert 0 < peaks["workspace"] <= report["budget_bytes"], (peaks, report)
    for k in range(4):  # two recordings (the first creates the momentum), placed, replayed
        torch.manual_seed(100 + k)
        expected = _eager_step(eager, eager_opt, batch)
        tracker = LiveBytesTracker()
        tracker.track(_state(model), optimizer_state_tensors(opt), batch)
        torch.manual_seed(100 + k)
        with tracker:
            got = step(batch)
        assert tracker.peak_bytes <= report["budget_bytes"], (k, tracker.peak_bytes, report)
        assert torch.equal(expected, got)
        assert all(torch.equal(a, b) for a, b in zip(_state(eager), _state(model), strict=True))
    assert runner.replaying


def _loss_step(model, optimizer, batch):
    loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


FIRST_CALLS_RSS = """
import json, torch, memplan
from memplan.torch.rss import peak_rss_bytes, release_free_memory, reset_peak_rss, rss_bytes
torch.manual_seed(0)
layers = []
for _ in range(16):  # activations dominate: 32 MiB each, the parameters 0.3 MiB
    layers += [torch.nn.Linear(64, 64), torch.nn.Tanh()]
model = torch.nn.Sequential(*layers, torch.nn.Linear(64, 10))
g = torch.Generator().manual_seed(1)
batch = torch.randn(131072, 64, generator=g), torch.randint(0, 10, (131072,), generator=g)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
counted = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *batch])

def train_step(b):
    loss = torch.nn.functional.cross_entropy(model(b[0]), b[1])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss

step = memplan.compile(train_step, model=model, optimizer=opt, memory_budget="50%", time_limit_seconds=5)
release_free_memory()
outside = rss_bytes() - counted  # the process, its libraries: what no budget counts
reset_peak_rss()
for _ in range(4):
    step(batch)
report = step.report["budget"]
print(json.dumps([peak_rss_bytes(), outside, report["budget_bytes"], report["checkpoint_all_peak_bytes"]]))
"""


@pytest.mark.slow
def test_the_first_calls_peak_rss_stays_within_the_budget() -> None:
    """In a process of its own: the peak resident set over a budgeted step's first four calls
    (capture, workspace measurement, recordings, replay) is within the budget plus what the
    process held outside the step (a 64 MiB allowance for the C library's heap); the budget is
    half of the checkpoint-all peak, so a first visit at eager's peak would be over by far."""
    done = subprocess.run([sys.executable, "-c", FIRST_CALLS_RSS], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-2000:]
    peak, outside, budget, checkpoint_all = json.loads(done.stdout.strip().splitlines()[-1])
    assert checkpoint_all - budget > 256 * MIB, (budget, checkpoint_all)
    assert peak <= outside + budget + 64 * MIB, (peak / MIB, outside / MIB, budget / MIB)


# ------------------------------------------------------------------ "fit": where the limit comes from


def test_a_cgroup_v2_limit_is_read_with_what_the_group_holds(tmp_path: Path) -> None:
    (tmp_path / "memory.max").write_text("2726297600\n")
    (tmp_path / "memory.current").write_text("1000000000\n")
    (tmp_path / "memory.stat").write_text("anon 700000000\nfile 200000000\nkernel 1000\nshmem 100000000\n")
    group = fit.read_group(tmp_path)
    assert group == GroupLimit(str(tmp_path), 2726297600, 800000000)
    # the group's other processes hold 7e8 + 1e8 (shared) - 5e8 (this one's) anonymous bytes
    assert group.room_for(500_000_000) == 2726297600 - 300_000_000
    assert group.room_for(900_000_000) == 2726297600  # nobody else


def test_a_cgroup_v1_limit_is_read_and_no_limit_is_none(tmp_path: Path) -> None:
    (tmp_path / "memory.limit_in_bytes").write_text("2147483648\n")
    (tmp_path / "memory.usage_in_bytes").write_text("600000000\n")
    (tmp_path / "memory.stat").write_text("cache 1\nrss 2\ntotal_cache 100000000\ntotal_rss 400000000\n")
    assert fit.read_group(tmp_path) == GroupLimit(str(tmp_path), 2147483648, 400000000)
    (tmp_path / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert fit.read_group(tmp_path) is None
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("max\n")
    assert fit.read_group(v2) is None


def test_own_groups_are_found_from_proc_files_up_to_the_root(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/jobs/a\n1:cpu:/\n0::/user/b\n")
    mounts = tmp_path / "mountinfo"
    mounts.write_text(
        "30 25 0:26 / /sys/fs/cgroup/memory rw,relatime shared:9 - cgroup cgroup rw,memory\n"
        "31 25 0:27 / /sys/fs/cgroup/unified rw,relatime shared:10 - cgroup2 cgroup2 rw\n"
        "32 25 0:28 / /sys/fs/cgroup/cpu rw,relatime shared:11 - cgroup cgroup rw,cpu\n"
    )
    dirs = fit.own_group_dirs(proc, mounts)
    assert dirs == [
        Path("/sys/fs/cgroup/memory/jobs/a"),
        Path("/sys/fs/cgroup/memory/jobs"),
        Path("/sys/fs/cgroup/memory"),
        Path("/sys/fs/cgroup/unified/user/b"),
        Path("/sys/fs/cgroup/unified/user"),
        Path("/sys/fs/cgroup/unified"),
    ]


def test_the_tightest_limit_wins_and_is_named(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  1000 kB\nMemAvailable:   20000000 kB\n")
    available = fit.mem_available_bytes(meminfo)
    assert available == 20000000 * 1024
    group = GroupLimit("/sys/fs/cgroup/memory/x", 3 * 2**30, None)
    expected = (3 * 2**30, "cgroup limit 3.00 GiB at /sys/fs/cgroup/memory/x")
    assert fit.cpu_limit(2**30, [group], available, 2**29) == expected
    limit, source = fit.cpu_limit(2**30, [], available, 2**29)
    assert limit == 2**30 + available and "MemAvailable" in source
    assert fit.margin_for(2600 * MIB, "cpu") == 130 * MIB and fit.margin_for(MIB, "cpu") == 128 * MIB


def _limited(monkeypatch, above_rss_bytes: int) -> None:
    """This process's limit: its resident set when the limit is read plus ``above_rss_bytes``
    (a fake cgroup), so that the step gets ``above_rss_bytes`` less the margin plus its own
    tensors already resident."""
    from memplan.torch.rss import rss_bytes

    def groups(directories=None) -> list[GroupLimit]:
        return [GroupLimit("fake", rss_bytes() + above_rss_bytes, None)]

    monkeypatch.setattr(fit, "cgroup_limits", groups)


@pytest.mark.slow
def test_fit_trains_like_eager_within_the_limit_it_reports(monkeypatch) -> None:
    model, batch = _mlp(width=256, depth=12), _batch(rows=2048, width=256)
    eager = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    # checkpoint-all needs 36 MiB, the smallest plan 21 MiB: 27 MiB for the step (the margin,
    # 128 MiB, kept on top) fits with recomputation only
    _limited(monkeypatch, 128 * MIB + 25 * MIB)
    step = memplan.compile(
        lambda b: _loss_step(model, opt, b), model=model, optimizer=opt, memory_budget="fit", time_limit_seconds=2
    )
    for k in range(3):
        torch.manual_seed(100 + k)
        expected = _eager_step(eager, eager_opt, batch)
        torch.manual_seed(100 + k)
        assert torch.equal(expected, step(batch))
        assert all(torch.equal(a, b) for a, b in zip(_state(eager), _state(model), strict=True))
    report = step.report["budget"]
    limit = report["limit"]
    assert limit["source"].startswith("cgroup limit") and limit["margin_bytes"] == 128 * MIB
    assert (
        report["budget_bytes"] == limit["budget_bytes"] == limit["limit_bytes"] - limit["outside_bytes"] - (128 * MIB)
    )
    assert report["method"] == "remat" and report["planned_peak_bytes"] <= report["budget_bytes"]
    json.dumps(report)  # the report is plain data (memplan run --json)


def test_fit_below_every_plan_is_refused_in_one_line_before_anything_runs(monkeypatch) -> None:
    model, batch = _mlp(width=256, depth=12), _batch(rows=2048, width=256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = [t.clone() for t in _state(model)]
    _limited(monkeypatch, 128 * MIB + 6 * MIB)  # 11 MiB for the step: the floor is 14 MiB
    step = memplan.compile(
        lambda b: _loss_step(model, opt, b), model=model, optimizer=opt, memory_budget="fit", time_limit_seconds=2
    )
    with pytest.raises(InfeasibleBudget) as err:
        step(batch)
    message = str(err.value)
    assert "\n" not in message and message.startswith("memory_budget='fit': this process may use")
    assert "smallest peak found is" in message
    assert all(torch.equal(a, b) for a, b in zip(before, _state(model), strict=True))
    assert not opt.state and all(p.grad is None for p in model.parameters())


def test_fit_with_no_room_for_the_parameters_is_refused(monkeypatch) -> None:
    model, batch = _mlp(), _batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _limited(monkeypatch, 100 * MIB)  # below the margin
    with pytest.raises(InfeasibleBudget, match="does not even hold the step's parameters"):
        memplan.compile_step(model, opt, torch.nn.functional.cross_entropy, batch, memory_budget="fit")
