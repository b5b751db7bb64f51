"""Data-parallel training with memplan on torch.distributed (gloo, CPU, localhost only).

Two ranks spawned with torch.multiprocessing train a small model with memplan's planned step
and with PyTorch's DistributedDataParallel from the same state: loss, parameters and buffers
must be bit-identical after every step, on every rank, and each rank's measured peak must be
the plan's claim. The planning half is tested without a process group.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import traceback
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import torch
from memplan.errors import MemplanError
from memplan.graph.check import validate_order
from memplan.streams import ddp_buckets, is_collective, is_wait, validate_stream_placement
from memplan.torch.capture import capture_train_step
from memplan.torch.distributed.plan import WAIT_POLICIES, bucket_caps, plan_data_parallel, ready_order_pairs
from memplan.torch.measure import allocator_peak_bytes, optimizer_state_tensors, resident_bytes
from memplan.torch.run.interpreter import allocator_tensors, optimizer_update_groups
from torch import nn

BUCKET_CAP_MB = 0.004  # ~4 KB: several buckets on a small model (27 KB of gradients)


def small_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, 48),
        nn.BatchNorm1d(48),  # buffers: DDP broadcasts rank 0's before every forward
        nn.ReLU(),
        nn.Dropout(0.1),  # random draws: the same seed must give the same mask
        nn.Linear(48, 48),
        nn.LayerNorm(48),
        nn.GELU(),
        nn.Linear(48, 48),
        nn.ReLU(),
        nn.Linear(48, 10),
    )


def batch_of(rank: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(size, 32, generator=g), torch.randint(0, 10, (size,), generator=g)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, target)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)


# ---------------------------------------------------------------- planning, no process group


@pytest.fixture(scope="module")
def captured():
    """The small model's optimizer and captured step (captured once for the module)."""
    model = small_model(0)
    optimizer = sgd(model)
    return optimizer, capture_train_step(model, optimizer, loss_fn, batch_of(0))


def plan_of(capture, optimizer, waits: str):
    cap, first = bucket_caps(BUCKET_CAP_MB)
    return plan_data_parallel(
        capture,
        update_groups=optimizer_update_groups(capture),
        allocator_tensors=allocator_tensors(capture),
        bucket_cap_bytes=cap,
        first_bucket_cap_bytes=first,
        waits=waits,
        time_limit_seconds=2.0,
    )


def test_bucket_caps_follow_ddp() -> None:
    assert bucket_caps(None) == (25 << 20, 1 << 20)  # the default: a 1 MiB first bucket
    assert bucket_caps(4) == (4 << 20, 4 << 20)  # set by the user: every bucket the same
    with pytest.raises(MemplanError, match="bucket_cap_mb must be positive"):
        bucket_caps(0)


@pytest.mark.parametrize("waits", WAIT_POLICIES)
def test_plan_lays_each_bucket_out_as_one_block_and_is_safe(captured, waits: str) -> None:
    optimizer, capture = captured
    plan = plan_of(capture, optimizer, waits)
    step, order = plan.step, plan.order
    validate_order(step, order)
    assert validate_stream_placement(step, plan.offsets, order).safe
    expected = ddp_buckets(capture.graph, *bucket_caps(BUCKET_CAP_MB), pairs=ready_order_pairs(capture)[::-1])
    assert len(plan.buckets) == len(expected) >= 3
    grads = {g for b in plan.buckets for g in b.gradients}
    assert grads == {g for _, g in ready_order_pairs(capture)}  # every gradient in exactly one bucket
    for layout, bucket in zip(plan.buckets, expected, strict=True):
        assert layout.gradients == bucket.gradients
        cursor = layout.offset_bytes
        for g in layout.gradients:  # back to back, each padded to the arena's alignment
            assert plan.offsets[g] == cursor
            cursor += -(-step.tensors[g].size_bytes // 64) * 64
        assert cursor == layout.offset_bytes + layout.size_bytes <= plan.arena_bytes
    position = {v: i for i, v in enumerate(order)}
    for layout in plan.buckets:
        # launched right after its last input exists, waited right before its first reader
        last_input = max(position[p] for p in step.predecessors[layout.all_reduce])
        between = order[last_input + 1 : position[layout.all_reduce]]
        assert all(is_collective(step.ops[v]) for v in between)
        # early updates (OLLA 4.3) respect the waits: every optimizer op reading a gradient of
        # the bucket runs after the bucket's wait
        phase = dict(zip(capture.node_of_op, capture.op_phase, strict=True))
        readers = {c for g in layout.gradients for c in step.consumers[g] if phase.get(step.ops[c].name) == "optimizer"}
        assert readers and min(position[c] for c in readers) > position[layout.wait]
        first_reader = min(position[s] for s in step.successors[layout.wait])
        between = order[position[layout.wait] + 1 : first_reader]
        assert all(is_wait(step.ops[v]) for v in between)


def test_wait_policies_trade_peak_for_overlap(captured) -> None:
    optimizer, capture = captured
    plans = {w: plan_of(capture, optimizer, w) for w in WAIT_POLICIES}
    for waits, plan in plans.items():
        position = {v: i for i, v in enumerate(plan.order)}
        launches = sorted(position[b.all_reduce] for b in plan.buckets)
        for b in plan.buckets:
            later = [p for p in launches if p > position[b.all_reduce]]
            if waits == "end-of-backward":
                assert position[b.wait] > launches[-1]
            elif waits == "next-bucket" and later:
                assert position[b.wait] > later[0]
    delayed = plans["end-of-backward"].report["schedule"]["delayed_peak_bytes"]
    assert plans["earliest"].report["schedule"]["delayed_peak_bytes"] <= delayed


def test_unknown_wait_policy_is_refused(captured) -> None:
    optimizer, capture = captured
    with pytest.raises(MemplanError, match="unknown wait policy 'soon'"):
        plan_of(capture, optimizer, "soon")


def test_a_step_without_a_process_group_is_refused() -> None:
    from memplan.torch.distributed import DataParallelStep

    model = small_model(0)
    with pytest.raises(MemplanError, match=r"torch\.distributed is not initialized"):
        DataParallelStep(model, sgd(model), loss_fn)


# ---------------------------------------------------------------- two ranks, gloo


def _rank(rank: int, world: int, store: str, out: str, policies: list[str]) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        result = _train_both(rank, policies)
    except Exception:
        result = {"error": traceback.format_exc()}
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


def _train_both(rank: int, policies: list[str]) -> dict:
    """DDP and one memplan step per wait policy, from the same state, 4 steps (the last under
    the profiler's memory events); what each memplan step found, by policy."""
    from memplan.torch.distributed import DataParallelStep

    torch.set_num_threads(1)
    model = small_model(seed=rank)  # the ranks start apart: both sides broadcast rank 0's state
    batch = batch_of(rank)
    ddp = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=BUCKET_CAP_MB)
    ddp_opt = sgd(ddp.module)
    ours = {}
    for waits in policies:
        m = copy.deepcopy(model)
        opt = sgd(m)
        step = DataParallelStep(
            m, opt, loss_fn, bucket_cap_mb=BUCKET_CAP_MB, waits=waits, time_limit_seconds=1.0, record_events=True
        )
        ours[waits] = (m, opt, step)
    found = {w: {"diffs": [], "peak": 0} for w in policies}
    for k in range(4):
        torch.manual_seed(7 + 10 * rank + k)
        ddp_loss = loss_fn(ddp(batch[0]), batch[1])
        ddp_loss.backward()
        ddp_opt.step()
        ddp_opt.zero_grad(set_to_none=True)
        for waits, (m, _, step) in ours.items():
            torch.manual_seed(7 + 10 * rank + k)
            if k == 3:
                loss, found[waits]["peak"] = allocator_peak_bytes(step, batch)
            else:
                loss = step(batch)
            pairs = [
                (loss, ddp_loss.detach()),
                *zip(m.state_dict().values(), ddp.module.state_dict().values(), strict=True),
            ]
            found[waits]["diffs"].append(max(float((a.double() - b.double()).abs().max()) for a, b in pairs))
    for waits, (m, opt, step) in ours.items():
        runner = step.runner_for(batch)
        reference = [p.detach().clone() for p in m.parameters()]
        for p in reference:
            dist.broadcast(p, src=0)
        measured = resident_bytes(list(m.parameters()), list(m.buffers()), optimizer_state_tensors(opt), batch)
        found[waits].update(
            spread=max(float((p.detach() - q).abs().max()) for p, q in zip(m.parameters(), reference, strict=True)),
            buckets=len(step.report["bucket_bytes"]),
            events=[vars(e) for e in runner.events],
            measured=measured + runner.arena.numel() + found[waits]["peak"],
            claimed=runner.claimed_peak_bytes(),
        )
    found["refusals"] = _refusals(rank, ddp)
    return found


def _refusals(rank: int, ddp: DistributedDataParallel) -> list[str]:
    """The one-line errors of two bad inputs: a DDP wrapper, ranks with other batch shapes."""
    from memplan.torch.distributed import DataParallelStep

    errors = []
    try:
        DataParallelStep(ddp, sgd(ddp.module), loss_fn)
    except MemplanError as err:
        errors.append(str(err))
    model = small_model(0)
    step = DataParallelStep(model, sgd(model), loss_fn, time_limit_seconds=0.5)
    try:
        step.runner_for(batch_of(rank, size=8 + rank))
    except MemplanError as err:
        errors.append(str(err))
    return errors


def run_two_ranks(policies: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        try:
            mp.spawn(_rank, args=(2, store, tmp, policies), nprocs=2, join=True)
        except mp.ProcessExitedException:
            # a rank that wrote its results and then died in gloo's teardown (seen once, under
            # heavy load: "terminate called without an active exception") trained correctly;
            # one that died before writing them did not
            if not all(Path(tmp, f"{r}.json").exists() for r in range(2)):
                raise
        results = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert "error" not in r, r["error"]
    return results


def test_two_ranks_train_bit_for_bit_like_ddp() -> None:
    policies = ["next-bucket", "earliest"]
    for rank in run_two_ranks(policies):
        ddp_wrapper, other_shapes = rank["refusals"]
        assert ddp_wrapper.startswith("pass the plain module (ddp.module")
        assert other_shapes.startswith("rank(s) [1] captured another step than rank 0")
        for waits in policies:
            r = rank[waits]
            assert r["diffs"] == [0.0] * 4, waits  # loss, parameters and buffers after every step
            assert r["spread"] == 0.0  # the same parameters on both ranks
            assert r["buckets"] >= 3
            for e in r["events"]:  # every bucket launched, finished and waited for, in that order
                assert e["launched"] <= e["wait_start"] <= e["wait_end"]
                assert e["launched"] <= e["done"] <= e["wait_end"]
            # the measured step holds what the plan claims, plus what kernels allocate inside
            # themselves (BatchNorm's backward: a gradient-sized temporary and a few per-channel
            # sums, 2.3 KB here), which no plan of arena views sees
            assert r["claimed"] <= r["measured"] <= r["claimed"] + 2560, (waits, r["claimed"], r["measured"])


@pytest.mark.slow
def test_memplan_run_with_two_ranks(tmp_path: Path) -> None:
    """``memplan run MODEL --nproc 2`` launches torchrun (gloo) and compares with DDP."""
    from typer.testing import CliRunner

    from memplan.cli import app

    out = tmp_path / "run.json"
    args = ["run", "mlp", "--nproc", "2", "--steps", "2", "--time-limit", "1", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    ranks = json.loads(out.read_text())["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["loss_max_abs_diff"] == 0.0 and r["param_spread_over_ranks"] == 0.0
        assert all(v["max_abs_diff"] == 0.0 for v in r["variants"].values())
        assert all(r["buckets_as_ddp"].values())  # the buckets DDP rebuilt, member for member
        peaks = {n: v["resident_bytes"] + v["step_peak_bytes"] + v["bucket_bytes"] for n, v in r["variants"].items()}
        assert peaks["memplan"] == r["claimed_peak_bytes"]
        assert peaks["memplan"] < min(peaks["ddp"], peaks["ddp-view"])
