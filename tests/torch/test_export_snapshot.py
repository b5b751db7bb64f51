"""Memory snapshots in ``torch.cuda.memory._snapshot()``'s layout, read back by PyTorch's own
``torch.cuda._memory_viz`` (which runs on the CPU): its text summaries (``segsum``/stats,
``trace``, the ``segments``/``memory``/``compare`` flame-graph inputs) and its HTML plots
(``trace_plot``, ``segment_plot``, which embed the pickled snapshot for the JS viewer)."""

from __future__ import annotations

import base64
import copy
import json
import pickle
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.cuda import _memory_viz as viz

import torch
from memplan.api import CompiledStep
from memplan.graph.generate import random_dag
from memplan.graph.liveness import peak_bytes
from memplan.pipeline import make_plan
from memplan.torch.export.snapshot import (
    Allocation,
    Segment,
    SnapshotError,
    build_snapshot,
    check_snapshot,
    eager_snapshot,
    plan_snapshot,
    read_snapshot,
    replay_snapshot,
    write_snapshot,
)
from memplan.torch.measure import allocator_peak_bytes, optimizer_state_tensors, resident_bytes
from memplan.torch.run import allocator

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def lines(text: str) -> str:
    """``format_flamegraph`` stand-in: the flame-graph input lines (the real one downloads
    flamegraph.pl to draw an SVG from them)."""
    return text


def read_by_pytorch(snapshot: dict) -> dict:
    """Run every summary of ``torch.cuda._memory_viz`` on ``snapshot``; return what they say."""
    stats = viz.segsum(snapshot)
    trace = viz.trace(snapshot)
    memory = viz.memory(snapshot, format_flamegraph=lines)
    segments = viz.segments(snapshot, format_flamegraph=lines)
    plots = [viz.trace_plot(copy.deepcopy(snapshot)), viz.segment_plot(snapshot)]
    total = re.search(r"total_allocated: (.*)", stats).group(1)
    flame_bytes = sum(int(line.rsplit(" ", 1)[1]) for line in memory.splitlines() if ";active_allocated;" in line)
    return {"stats": stats, "trace": trace, "segments": segments, "total": total, "flame": flame_bytes, "plots": plots}


def embedded(html: str) -> dict:
    """The snapshot the HTML plot embeds for the viewer (base64 of the pickle, zero padded)."""
    payload = json.loads(re.search(r"const local_files = (\[.*?\])\n", html).group(1))
    return pickle.loads(base64.b64decode(payload[0]["base64"]))  # pickle ignores the zero padding


def active_bytes(snapshot: dict) -> int:
    return sum(b["size"] for s in snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated")


# --------------------------------------------------------------------------- format rules


def test_the_checker_refuses_what_the_viewer_cannot_replay() -> None:
    arena = Segment(0x1000, 256)
    fine = [Allocation(0x1000, 128, 0, 2, segment=0x1000), Allocation(0x1000, 64, 3, None, segment=0x1000)]
    assert check_snapshot(build_snapshot(fine, [arena]))["peak_allocated_bytes"] == 128
    overlap = [Allocation(0x1000, 128, 0, 2, segment=0x1000), Allocation(0x1040, 64, 1, 3, segment=0x1000)]
    with pytest.raises(SnapshotError, match="overlaps"):
        check_snapshot(build_snapshot(overlap, [arena]))
    outside = [Allocation(0x1100, 64, 0, 1, segment=0x1000)]
    with pytest.raises(SnapshotError, match="outside"):
        check_snapshot(build_snapshot(outside, [arena]))
    torn = build_snapshot(fine, [arena])
    torn["segments"][0]["blocks"][0]["size"] += 1
    with pytest.raises(SnapshotError, match=r"cover|starts"):
        check_snapshot(torn)


def test_own_segments_are_mapped_and_unmapped_with_their_allocation() -> None:
    made_before = Allocation(0x9000, 32, None, 3)  # freed in the trace, never allocated in it
    snap = build_snapshot([Allocation(0x5000, 100, 0, 2), Allocation(0x6000, 50, 1, None), made_before])
    numbers = check_snapshot(snap)
    assert numbers["peak_allocated_bytes"] == 182 and numbers["peak_reserved_bytes"] == 182
    actions = [e["action"] for e in snap["device_traces"][0]]
    assert actions.count("segment_alloc") == 2 and actions.count("segment_free") == 2
    assert [s["address"] for s in snap["segments"]] == [0x6000]


# --------------------------------------------------------------------------- the plan


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), num_ops=st.integers(2, 40))
def test_plan_snapshot_replays_to_the_estimators_peak(seed: int, num_ops: int) -> None:
    graph = random_dag(seed, num_ops)
    plan = make_plan(graph, time_limit_seconds=1.0, reorder=False)
    snap = plan_snapshot(graph, plan.order, plan.offsets, plan.arena_bytes)
    numbers = check_snapshot(snap)
    assert numbers["peak_allocated_bytes"] == peak_bytes(graph, plan.order)
    assert numbers["peak_reserved_bytes"] == graph.persistent_bytes + plan.arena_bytes


def test_plan_snapshot_is_read_by_pytorchs_memory_viz(tmp_path) -> None:
    graph = random_dag(7, 60)
    plan = make_plan(graph, time_limit_seconds=1.0)
    snap = read_snapshot(
        write_snapshot(plan_snapshot(graph, plan.order, plan.offsets, plan.arena_bytes), tmp_path / "p.pickle")
    )
    read = read_by_pytorch(snap)
    assert f"segments: {len(snap['segments'])}" in read["stats"]
    assert f"{len(snap['device_traces'][0])} entries" in read["trace"]
    assert read["flame"] == active_bytes(snap)  # what viz attributes is what the snapshot holds
    for html in read["plots"]:
        assert embedded(html) == snap
    assert "memplan arena" in pickle.dumps(snap).decode("latin-1")


# --------------------------------------------------------------------------- real steps


def tiny_step(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(32, 64), torch.randint(0, 8, (32,))

    def step() -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    persistent = {"params": list(model.parameters()), "state": optimizer_state_tensors(optimizer), "batch": (x, y)}
    return model, optimizer, (x, y), step, persistent


def test_eager_snapshot_peak_is_the_allocator_peak_and_viz_reads_it() -> None:
    model, optimizer, batch, step, persistent = tiny_step()
    step()  # creates the optimizer state: steady state from here
    _, allocator_peak = allocator_peak_bytes(step)
    resident = resident_bytes(list(model.parameters()), optimizer_state_tensors(optimizer), batch)
    persistent["state"] = optimizer_state_tensors(optimizer)
    snap, loss = eager_snapshot(step, persistent)
    numbers = check_snapshot(snap)
    # two runs of the same step: equal but for a one-off allocation of a few bytes that one may
    # make, and kernels' own scratch, which varied by up to 1.4 KB between runs on a busy machine
    assert numbers["peak_allocated_bytes"] == pytest.approx(resident + allocator_peak, abs=4096)
    assert numbers["peak_reserved_bytes"] == numbers["peak_allocated_bytes"]  # the CPU allocator caches nothing
    frames = {f["name"] for e in snap["device_traces"][0] for f in e["frames"]}
    assert {"aten::addmm", "aten::mm"} <= frames  # attributed to the ops that allocated
    read = read_by_pytorch(snap)
    assert read["flame"] == active_bytes(snap)
    assert embedded(read["plots"][0]) == snap
    assert loss.ndim == 0


@pytest.mark.skipif(not allocator.available(), reason="the planned CPU allocator needs a C++ compiler")
def test_replay_snapshot_puts_the_step_in_the_arena_and_compares_with_eager() -> None:
    model, optimizer, batch, eager, persistent = tiny_step()
    planned_model = copy.deepcopy(model)
    planned_optimizer = torch.optim.SGD(planned_model.parameters(), lr=0.1, momentum=0.9)
    compiled = CompiledStep.of_loss(
        planned_model, planned_optimizer, torch.nn.functional.cross_entropy, allocator="replay"
    )
    runner = compiled.runner_for(batch)
    for _ in range(5):
        compiled(batch)
    assert runner.replaying
    snap = replay_snapshot(runner, {"params": list(planned_model.parameters())})
    numbers = check_snapshot(snap)
    arena = runner.arena.data_ptr(), runner.arena.data_ptr() + runner.placement.arena_bytes
    in_arena = [e for e in snap["device_traces"][0] if e["action"] == "alloc" and arena[0] <= e["addr"] < arena[1]]
    assert in_arena and numbers["peak_reserved_bytes"] >= runner.placement.arena_bytes
    eager()
    persistent["state"] = optimizer_state_tensors(optimizer)
    eager_snap, _ = eager_snapshot(eager, persistent)
    compared = viz.compare(eager_snap["segments"], snap["segments"], format_flamegraph=lines)
    assert f"only_after;stream_0;seg_{arena[0]};inactive" in compared  # the arena, free after the step


def test_plan_snapshot_of_a_captured_step_names_its_ops() -> None:
    model, optimizer, batch, _, _ = tiny_step()
    compiled = CompiledStep.of_loss(model, optimizer, torch.nn.functional.cross_entropy, allocator="views")
    runner = compiled.runner_for(batch)
    plan = compiled.plans[next(iter(compiled.plans))]
    snap = plan_snapshot(runner.graph, plan.order, plan.offsets, plan.arena_bytes, phases=runner.capture.op_phase)
    check_snapshot(snap)
    files = {f["filename"] for e in snap["device_traces"][0] for f in e["frames"]}
    assert {"memplan:forward", "memplan:backward"} <= files
