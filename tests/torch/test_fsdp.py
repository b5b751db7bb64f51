"""FSDP2 (``fully_shard``) training steps planned by memplan (issue 35), on gloo, CPU.

Two spawned ranks train an MLP whose blocks and root are ``fully_shard``-ed (widths that do
not divide by the world size: uneven, padded shards) with AdamW, with memplan's planned step
and with eager FSDP2, from the same seed: the loss, every gathered parameter and every
optimizer state tensor must be bit-identical after every step, on every rank. The refusals
run on a 1-rank group in this process.
"""

from __future__ import annotations

import os
import re
import tempfile
from typing import Any

import pytest
import torch.distributed as dist

import torch
from memplan.errors import UnplannedWrapper
from memplan.torch.distributed import fsdp_compare as fc


def _mlp(seed: int) -> torch.nn.Module:
    return fc.mlp(seed, width=256, depth=3)  # 259 rows: shards of 130 and 129 on 2 ranks, 65 and 64 on 4


def _two_ranks(reshard_after_forward: bool | None, steps: int) -> dict:
    batch = fc.mlp_batch(dist.get_rank())
    return fc.compare_with_fsdp2(
        _mlp, batch, steps=steps, reshard_after_forward=reshard_after_forward, time_limit_seconds=0.5
    )


def _gpt2(steps: int) -> dict:
    from memplan.torch.zoo import build_workload

    w = build_workload("gpt2-2l", 1, seed=dist.get_rank())
    build = lambda seed: build_workload("gpt2-2l", 1, seed=seed).model  # noqa: E731
    return fc.compare_with_fsdp2(build, (w.inputs, w.target), steps=steps, loss_fn=w.loss_fn, time_limit_seconds=1)


def _check(ranks: list[dict], steps: int, collectives: int) -> None:
    for r in ranks:
        assert "error" not in r, r["error"]
        assert r["diffs"] == [0.0] * steps  # loss, gathered parameters, optimizer state: every step
        assert r["ckpt_diffs"] == [0.0] * steps  # FSDP2 + checkpoint-per-block recomputes the same numbers
        assert r["collectives"] == collectives
        # memplan holds the shards, the optimizer state and its arena between steps; eager FSDP2
        # the shards and the state. Peak = what is held + the step's allocations above it.
        ours = r["held_bytes"]["memplan"] + r["step_peak_bytes"]["memplan"]
        eager = r["held_bytes"]["fsdp2"] + r["step_peak_bytes"]["fsdp2"]
        assert ours < eager, (ours, eager)


def _full_and_mixed(steps: int) -> dict[str, dict]:
    """Full precision, bf16 mixed precision (:func:`_mixed_precision`), a prefetching plan
    (:func:`_prefetching_plan`) and the reduce-scatter (:func:`_reduce_scatter_as_gloo`) in one
    spawn of the ranks."""
    return {
        "full": _two_ranks(None, steps),
        "mixed": _mixed_precision(None, steps),
        "prefetch": _prefetching_plan(2),
        "reduce": _reduce_scatter_as_gloo(),
    }


def _reduce_scatter_as_gloo() -> dict[str, Any]:
    """memplan's reduce-scatter against ``dist.reduce_scatter_single(op=AVG)``, bit for bit, run
    synchronously and launched on the communication stream (several in flight, waited for in
    turn); and how many of them gloo's thread still held the reduced buffer of when the wait
    gave up waiting for it (:data:`memplan.torch.distributed.fsdp_ops.LATE_RELEASES`)."""
    from memplan.torch.distributed import fsdp_ops

    group = fsdp_ops.register_group(dist.group.WORLD)
    world, rank = dist.get_world_size(), dist.get_rank()
    generator = torch.Generator().manual_seed(rank)
    equal, late = [], fsdp_ops.LATE_RELEASES
    for numel in (world * 7, world * 100_003, world * 1_000_000):
        inputs = [torch.randn(numel, generator=generator) for _ in range(3)]
        expected = []
        for inp in inputs:
            out = inp.new_empty(numel // world)
            dist.reduce_scatter_single(out, inp, op=dist.ReduceOp.AVG)
            expected.append(out)
        synchronous = [torch.ops.memplan_fsdp.reduce_scatter(inp, group) for inp in inputs]
        equal += [torch.equal(s, e) for s, e in zip(synchronous, expected, strict=True)]
        outs = [inp.new_empty(numel // world) for inp in inputs]
        with fsdp_ops.launching(fsdp_ops.Inflight()) as inflight:
            for inp, out in zip(inputs, outs, strict=True):
                torch.ops.memplan_fsdp.reduce_scatter.out(inp, group, out=out)
            for k in range(len(inputs)):
                inflight.wait(k)
        equal += [torch.equal(o, e) for o, e in zip(outs, expected, strict=True)]
    return {"equal": equal, "late": fsdp_ops.LATE_RELEASES - late}


def test_two_ranks_train_bit_for_bit_like_fsdp2() -> None:
    """FSDP2's defaults: blocks reshard after forward, the root does not. In the forward, one
    gather per parameter of the 4 units (3 blocks and the root: 8); in the backward the blocks'
    again where the backward reads a weight (blocks 1 and 2, not block 0: its input needs no
    gradient: 4); one reduce-scatter per unit (4), all asynchronous on a communication stream
    (:func:`_check_choice`). The same ranks then train in bf16 mixed precision
    (:func:`_check_mixed`) and with prefetch fixed at 2 (:func:`_check_prefetching`)."""
    ranks = fc.run_ranks(2, _full_and_mixed, 3)
    for r in ranks:
        assert "error" not in r, r["error"]
    _check([r["full"] for r in ranks], steps=3, collectives=8 + 4 + 4)
    _check_mixed([r["mixed"] for r in ranks], steps=3, collectives=8 + 4 + 4)
    for r in ranks:
        _check_choice(r["full"]["streams"])
        _check_prefetching(r["prefetch"], collectives=8 + 4 + 4)
        assert r["reduce"]["equal"] == [True] * 18 and r["reduce"]["late"] == 0, r["reduce"]


@pytest.mark.slow
def test_two_ranks_without_reshard_after_forward() -> None:
    _check(fc.run_ranks(2, _two_ranks, False, 5), steps=5, collectives=8 + 4)


@pytest.mark.slow
def test_two_ranks_train_gpt2_bit_for_bit_like_fsdp2() -> None:
    """HF GPT-2 (2 layers): its tied embedding (wte and lm_head, one FSDP2 parameter) gathered once
    into both places."""
    for r in fc.run_ranks(2, _gpt2, 2):
        assert "error" not in r, r["error"]
        assert r["diffs"] == [0.0, 0.0]


# ---------------------------------------------------------------- mixed precision (MixedPrecisionPolicy)


def _mixed_precision(reshard_after_forward: bool | None, steps: int) -> dict:
    """bf16 parameters, fp32 reduction, on every unit."""
    batch = fc.mlp_batch(dist.get_rank())
    build = lambda seed: fc.mlp(seed, width=64, depth=3)  # noqa: E731  (67 rows: shards of 34 and 33)
    return fc.compare_with_fsdp2(
        build,
        batch,
        steps=steps,
        reshard_after_forward=reshard_after_forward,
        time_limit_seconds=0.5,
        mp_policy=fc.bf16_policy(),
    )


BF16_COLLECTIVES = {"all_gather": ["bfloat16"], "reduce_scatter": ["float32"]}


def _check_mixed(ranks: list[dict], steps: int, collectives: int) -> None:
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on every unit: the plan gathers bf16
    parameters and reduce-scatters fp32 gradients (its collectives' dtypes), the loss, gathered
    parameters and optimizer state equal eager FSDP2's (and FSDP2 + checkpoint's) under the same
    policy after every step, and the measured peak is below eager FSDP2's."""
    _check(ranks, steps, collectives)
    for r in ranks:
        assert r["collective_dtypes"] == BF16_COLLECTIVES


@pytest.mark.slow
def test_two_ranks_without_reshard_after_forward_in_bf16_mixed_precision() -> None:
    """reshard_after_forward=False under bf16 mixed precision: no backward gathers (12 collectives)."""
    _check_mixed(fc.run_ranks(2, _mixed_precision, False, 3), steps=3, collectives=8 + 4)


def _gpt2_mixed_precision(steps: int) -> dict:
    from memplan.torch.zoo import build_workload

    w = build_workload("gpt2-2l", 1, seed=dist.get_rank())
    build = lambda seed: build_workload("gpt2-2l", 1, seed=seed).model  # noqa: E731
    batch = (w.inputs, w.target)
    return fc.compare_with_fsdp2(
        build, batch, steps=steps, loss_fn=w.loss_fn, time_limit_seconds=1, mp_policy=fc.bf16_policy()
    )


@pytest.mark.slow
def test_two_ranks_train_gpt2_bit_for_bit_like_fsdp2_in_bf16_mixed_precision() -> None:
    """HF GPT-2 (2 layers) under bf16 mixed precision: its tied embedding's two bf16 gradients are
    summed in bf16 before the fp32 reduction, as in eager FSDP2."""
    for r in fc.run_ranks(2, _gpt2_mixed_precision, 3):
        assert "error" not in r, r["error"]
        assert r["collective_dtypes"] == BF16_COLLECTIVES
        assert r["diffs"] == [0.0] * 3


def _decoder(kind: str, steps: int) -> dict:
    """A 12-layer GPT-2 or a Llama-style decoder, both narrow (the bench runs the real sizes)."""
    import transformers

    from memplan.torch.zoo import Logits

    def build(seed: int) -> torch.nn.Module:
        if kind == "llama":
            return fc.llama(seed, hidden_size=64, intermediate_size=172, num_hidden_layers=2, vocab_size=512)
        torch.manual_seed(seed)
        config = transformers.GPT2Config(n_layer=12, n_embd=32, n_head=2, vocab_size=512, n_positions=64)
        return Logits(transformers.GPT2LMHeadModel(config))

    batch = fc.token_batch(dist.get_rank(), 512, 2, 16)
    return fc.compare_with_fsdp2(build, batch, steps=steps, loss_fn=fc.token_loss, time_limit_seconds=1)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2-12l", "llama"])
def test_two_ranks_train_decoders_bit_for_bit_like_fsdp2(kind: str) -> None:
    """GPT-2 with 12 blocks (tied embedding) and a Llama-style decoder (RMSNorm, RoPE, SwiGLU, GQA):
    every block a unit; identical to eager FSDP2 and to FSDP2 + checkpoint after every step."""
    for r in fc.run_ranks(2, _decoder, kind, 2):
        assert "error" not in r, r["error"]
        assert r["diffs"] == [0.0, 0.0] and r["ckpt_diffs"] == [0.0, 0.0]


def _wide_with_budget(steps: int) -> dict:
    batch = fc.mlp_batch(dist.get_rank(), size=2048)
    build = lambda seed: fc.mlp(seed, width=256, depth=4)  # noqa: E731
    return fc.compare_with_fsdp2(build, batch, steps=steps, memory_budget=0.7, time_limit_seconds=2)


@pytest.mark.slow
def test_two_ranks_with_a_memory_budget_train_bit_for_bit_like_fsdp2() -> None:
    """Remat on top of sharding on 2 ranks: rank 0's plan, run by both (the collectives matched),
    recomputes within the budget and trains like eager FSDP2, below FSDP2 + checkpoint's tracker peak."""
    for r in fc.run_ranks(2, _wide_with_budget, 2):
        assert "error" not in r, r["error"]
        assert r["budget_report"]["method"] == "remat" and r["budget_report"]["recomputed_ops"] > 0
        assert r["budget_diffs"] == [0.0, 0.0]
        ours = r["held_bytes"]["memplan_budget"] + r["step_peak_bytes"]["memplan_budget"]
        assert ours < r["held_bytes"]["fsdp2_ckpt"] + r["step_peak_bytes"]["fsdp2_ckpt"]


@pytest.mark.slow
def test_four_ranks_train_bit_for_bit_like_fsdp2() -> None:
    """Four ranks: gloo's reduction order depends on the buffer, which is FSDP2's own layout."""
    _check(fc.run_ranks(4, _two_ranks, None, 3), steps=3, collectives=8 + 4 + 4)


# ---------------------------------------------------------------- refusals, one rank


@pytest.fixture
def one_rank():
    if dist.is_initialized():
        pytest.fail("a process group is already initialized in the test process")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _half_sharded(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model[0])
    return model


def _fp16_reduction(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return fc.shard(model, 1, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))


def _shard_dim_1(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.tensor import Shard

    return fc.shard(model, 1, shard_placement_fn=lambda p: Shard(p.dim() - 1))


def _fsdp1(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(model, device_id=torch.device("cpu"))


def _grouped_unit(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard([model[0], model[1]])
    return fully_shard(model)


def _offloaded(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy

    return fc.shard(model, 1, offload_policy=CPUOffloadPolicy(pin_memory=False))


REFUSED = {
    "fsdp1": (_fsdp1, r"the model is wrapped in FSDP1's FullyShardedDataParallel: memplan plans FSDP2 only"),
    "half-sharded": (_half_sharded, r"parameter '1\.0\.weight' is not sharded while others are sharded"),
    "fp16 reduction": (
        _fp16_reduction,
        r"the root unit reduces its gradients in torch.float16 .*pre- and post-divides.*reduce_dtype=torch.float32",
    ),
    "shard dim 1": (_shard_dim_1, r"the root unit shards parameter 'weight' on Shard\(1\): .*default Shard\(0\)"),
    "several modules": (_grouped_unit, r"fully_shard was applied to 2 modules at once"),
    "offload": (_offloaded, r"the root unit uses CPUOffloadPolicy"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_the_slice_does_not_plan_is_refused_in_one_line(one_rank, case: str) -> None:
    from memplan.torch.distributed import compile_fsdp_step

    wrap, reason = REFUSED[case]
    model = wrap(fc.mlp(0, width=8, depth=2))
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(UnplannedWrapper, match=reason) as err:
        compile_fsdp_step(model, opt, fc.cross_entropy, fc.mlp_batch(0))
    assert "\n" not in str(err.value)


def test_reshard_after_forward_as_an_int_is_refused(one_rank) -> None:
    """An int resharding mesh needs 4+ ranks to build; the check reads the unit's post-forward
    mesh, which is then another mesh than its shard mesh."""
    from memplan.torch.distributed.fsdp import refuse_unsupported

    model = fc.shard(fc.mlp(0, width=8, depth=1), 1)
    group = model[0]._get_fsdp_state()._fsdp_param_groups[0]
    refuse_unsupported(group, "0", is_root=False)  # reshard_after_forward=True: planned
    group.post_forward_mesh_info = object()
    with pytest.raises(UnplannedWrapper, match=r"unit '0' has reshard_after_forward as an int"):
        refuse_unsupported(group, "0", is_root=False)


def test_one_rank_trains_bit_for_bit_like_fsdp2(one_rank) -> None:
    """The same comparison on one rank, in this process (the collectives copy)."""
    report = fc.compare_with_fsdp2(fc.mlp, fc.mlp_batch(0), steps=3)
    assert report["diffs"] == [0.0] * 3


MIXED_POLICIES = {
    "bf16 reduction": ({"param_dtype": torch.bfloat16}, {"all_gather": ["bfloat16"], "reduce_scatter": ["bfloat16"]}),
    "fp32 output": (
        {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "output_dtype": torch.float32},
        BF16_COLLECTIVES,
    ),
    "fp32 params, bf16 reduction": (
        {"reduce_dtype": torch.bfloat16},
        {"all_gather": ["float32"], "reduce_scatter": ["bfloat16"]},
    ),
}


class _Stack(torch.nn.Module):
    """Every parameter in a block (``layers``: each a unit), none in the root: with output_dtype,
    each block's fp32 output is cast back to bf16 by the next block's input cast, and the root
    unit (no parameters) still casts its input and output, as FSDP2 does."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        blocks = [torch.nn.Sequential(torch.nn.Linear(n, 11), torch.nn.GELU()) for n in (16, 11)]
        self.layers = torch.nn.ModuleList([*blocks, torch.nn.Linear(11, 5)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=[] if c == "fp32 output" else pytest.mark.slow) for c in MIXED_POLICIES]
)
def test_one_rank_trains_bit_for_bit_like_fsdp2_under_other_mixed_precision_policies(one_rank, case: str) -> None:
    """The other pieces of a MixedPrecisionPolicy, on one rank: a bf16 reduction (reduce_dtype None:
    the reduced shard cast back to fp32), output_dtype (each unit's output cast), and fp32 parameters
    with gradients cast to bf16 for the reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    options, dtypes = MIXED_POLICIES[case]
    build = _Stack if "output" in case else lambda seed: fc.mlp(seed, width=8, depth=2)
    report = fc.compare_with_fsdp2(build, fc.mlp_batch(0), steps=2, mp_policy=MixedPrecisionPolicy(**options))
    assert report["collective_dtypes"] == dtypes
    assert report["diffs"] == [0.0] * 2


def test_a_collective_of_the_step_itself_is_refused(one_rank) -> None:
    """A collective the plan cannot place (the loss function's own all-reduce) is refused in one line."""
    from memplan.torch.distributed import compile_fsdp_step

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = fc.cross_entropy(out, target)
        dist.all_reduce(loss.detach())
        return loss

    model = fc.shard(fc.mlp(0, width=8, depth=1), 1)
    with pytest.raises(UnplannedWrapper, match=r"the step runs the collective c10d\.allreduce_\.default itself"):
        compile_fsdp_step(model, fc.adamw(model), loss_fn, fc.mlp_batch(0), time_limit_seconds=0.5)


def test_checkpoint_blocks_recomputes_each_block_once_in_the_backward(one_rank) -> None:
    """The fsdp2_ckpt baseline: every block's forward runs again in the backward (its Linear is
    called twice per step), the head's once; FSDP2 gathers the block for the recomputation."""
    blocks = fc.blocks(fc.mlp(0, width=8, depth=3))
    assert len(blocks) == 3  # the head (the last child) is not a block
    model = fc.eager_model(lambda seed: fc.mlp(seed, width=8, depth=3), "fsdp2_ckpt")
    calls: dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda m, i, o, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    opt = fc.adamw(model)
    x, y = fc.mlp_batch(0)
    fc.cross_entropy(model(x), y).backward()
    opt.step()
    assert calls == {"0.0": 2, "1.0": 2, "2.0": 2, "3": 1}


def test_blocks_of_hf_decoders_are_their_layers() -> None:
    """GPT-2's transformer.h and Llama's model.layers, under the zoo's wrapper, are the units."""
    import transformers

    from memplan.torch.zoo import Logits

    gpt2 = Logits(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=3, n_embd=8, n_head=2, vocab_size=16)))
    assert fc.blocks(gpt2) == list(gpt2.model.transformer.h)
    llama = fc.llama(0, hidden_size=16, intermediate_size=32, num_hidden_layers=2, vocab_size=16)
    assert fc.blocks(llama) == list(llama.model.model.layers)


@pytest.mark.slow
def test_memplan_run_fsdp_with_two_ranks(tmp_path) -> None:
    """``memplan run MODEL --nproc 2 --fsdp`` launches torchrun (gloo) and compares with eager FSDP2."""
    import json

    from typer.testing import CliRunner

    from memplan.cli import app

    out = tmp_path / "run.json"
    args = ["run", "mlp", "--nproc", "2", "--fsdp", "--steps", "2", "--time-limit", "1", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    ranks = json.loads(out.read_text())["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert set(r["variants"]) == {"memplan", "fsdp2", "fsdp2_ckpt"}
        assert all(v["max_abs_diff"] == 0.0 for v in r["variants"].values())
        assert all(v["peak_bytes"] > 0 for v in r["variants"].values())


@pytest.mark.slow
def test_memplan_run_fsdp_with_a_budget(tmp_path) -> None:
    """``memplan run MODEL --nproc 2 --fsdp --budget 0.9``: a fourth variant, memplan under the budget,
    trains like eager FSDP2 on every rank; the JSON says what rank 0's plan decided. A budget no plan
    reaches is refused in one line naming the smallest peak."""
    import json

    from typer.testing import CliRunner

    from memplan.cli import app

    out = tmp_path / "run.json"
    args = ["run", "mlp", "--nproc", "2", "--fsdp", "--steps", "2", "--time-limit", "1"]
    result = CliRunner().invoke(app, [*args, "--budget", "0.9", "--json", str(out)])
    assert result.exit_code == 0, result.output
    for r in json.loads(out.read_text())["ranks"]:
        assert set(r["variants"]) == {"memplan", "fsdp2", "fsdp2_ckpt", "memplan_budget"}
        assert r["variants"]["memplan_budget"]["max_abs_diff"] == 0.0
        assert r["budget"]["memory_budget"] == "0.9" and r["budget"]["method"] in ("reorder", "remat")
    result = CliRunner().invoke(app, [*args, "--budget", "0.5"])
    assert "rank 0 could not plan the step: memory_budget" in str(result.exception)
    assert "\n" not in str(result.exception)


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        (["--budget", "fit"], r"memory_budget='fit' is not planned for an FSDP2 step yet"),
        (["--budget", "0.5", "--max-overhead", "0.1"], r"--budget and --max-overhead plan a training step on one"),
    ],
)
def test_memplan_run_fsdp_refuses_a_budget_it_does_not_take_in_one_line(options: list[str], reason: str) -> None:
    """Refused before any rank starts."""
    from typer.testing import CliRunner

    from memplan.cli import app

    result = CliRunner().invoke(app, ["run", "mlp", "--nproc", "2", "--fsdp", *options])
    assert result.exit_code != 0
    assert re.search(reason, str(result.exception) + result.output), result.output


def test_compile_step_plans_an_fsdp2_model_and_refuses_what_it_does_not_take(one_rank) -> None:
    """``memplan.compile_step`` hands an FSDP2 model to compile_fsdp_step; max_overhead is refused in one line."""
    import memplan
    from memplan.errors import MemplanError
    from memplan.torch.distributed import FsdpStep

    model = fc.shard(fc.mlp(0, width=8, depth=1), 1)
    step = memplan.compile_step(model, fc.adamw(model), fc.cross_entropy, fc.mlp_batch(0), time_limit_seconds=1.0)
    assert isinstance(step, FsdpStep)
    with pytest.raises(MemplanError, match=r"does not take max_overhead yet") as err:
        memplan.compile_step(model, fc.adamw(model), fc.cross_entropy, fc.mlp_batch(0), max_overhead=0.1)
    assert "\n" not in str(err.value)


def test_a_memory_budget_recomputes_on_top_of_sharding_bit_for_bit(one_rank) -> None:
    """memory_budget on an FSDP2 step (through compile_step): where the reordered plan does not fit,
    the remat plan recomputes activations, within the budget it claims, and trains bit for bit like
    eager FSDP2 (and FSDP2 + checkpoint-per-block); its measured peak is below eager FSDP2's."""
    batch = fc.mlp_batch(0, size=512)  # activations (512 x 67) dominate the 67 x 67 weights
    r = fc.compare_with_fsdp2(fc.mlp, batch, steps=2, memory_budget=0.7, time_limit_seconds=1)
    b = r["budget_report"]
    assert b["method"] == "remat" and b["recomputed_ops"] > 0
    assert b["remat_peak_bytes"] <= b["budget_bytes"] < b["reordered_peak_bytes"]
    assert b["budget_bytes"] == int(0.7 * b["checkpoint_all_peak_bytes"])
    assert r["budget_diffs"] == [0.0, 0.0] and r["diffs"] == [0.0, 0.0]
    measured = r["held_bytes"]["memplan_budget"] + r["step_peak_bytes"]["memplan_budget"]
    assert measured < r["held_bytes"]["fsdp2"] + r["step_peak_bytes"]["fsdp2"]
    assert measured <= b["budget_bytes"]  # the budget is a bound, gloo's staging buffers included


def test_the_budget_counts_each_collectives_staging_buffer_as_its_workspace() -> None:
    """gloo runs an all-gather through a buffer of its output's size and a reduce-scatter through
    a copy of its input: the budget's solve counts it as the op's workspace (other ops: none)."""
    from memplan.graph.ir import Graph, Op, Tensor
    from memplan.torch.distributed.fsdp_step import REDUCE_SCATTER_KIND_SUFFIX, staging_workspace

    tensors = (
        Tensor("shard", 10, persistent=True),
        Tensor("full", 20),
        Tensor("y", 20),
        Tensor("flat", 40),
        Tensor("g", 20),
    )
    ops = (
        Op("gather", "memplan_fsdp.all_gather.default", (0,), (1,)),
        Op("mm", "aten.mm.default", (1,), (2,)),
        Op("cat", "aten.cat.default", (2,), (3,)),
        Op("scatter", "memplan_fsdp.reduce_scatter.default" + REDUCE_SCATTER_KIND_SUFFIX, (3,), (4,)),
    )
    assert staging_workspace(Graph(ops, tensors, "step")) == (20, 0, 0, 40)


@pytest.mark.parametrize(
    ("budget", "reason"),
    [
        (1, r"memory_budget 1 B is below what this step can reach: .*checkpoint-all needs"),
        ("fit", r"memory_budget='fit' is not planned for an FSDP2 step yet"),
        ("lots", r"memory_budget"),
    ],
)
def test_a_budget_the_fsdp2_step_cannot_take_is_refused_in_one_line(one_rank, budget, reason: str) -> None:
    import memplan
    from memplan.errors import MemplanError

    model = fc.shard(fc.mlp(0, width=8, depth=1), 1)
    with pytest.raises(MemplanError, match=reason) as err:
        memplan.compile_step(model, fc.adamw(model), fc.cross_entropy, fc.mlp_batch(0), memory_budget=budget)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- collectives on a communication stream


def _in_flight_overlaps(step_graph, order, offsets) -> list[str]:
    """Arena tensors that a plan lets share bytes with an in-flight collective's input or output:
    any tensor made on the compute stream between a collective's launch and its wait (an oracle
    written apart from the streams core)."""
    from memplan.streams import is_collective, is_wait

    position = {v: i for i, v in enumerate(order)}
    bad = []
    for c, op in enumerate(step_graph.ops):
        if not is_collective(op):
            continue
        (w,) = [s for s in step_graph.successors[c] if is_wait(step_graph.ops[s])]
        held = [t for t in (*op.inputs, *op.outputs) if t in offsets]
        for v in order[position[c] + 1 : position[w]]:
            for t in step_graph.ops[v].outputs:
                if t not in offsets:
                    continue
                for h in held:
                    lo, hi = offsets[h], offsets[h] + step_graph.tensors[h].size_bytes
                    if offsets[t] < hi and lo < offsets[t] + step_graph.tensors[t].size_bytes:
                        bad.append(f"{step_graph.tensors[t].name} over {step_graph.tensors[h].name}")
    return bad


def _prefetching_plan(steps: int) -> dict:
    """memplan's two-stream plan with prefetch fixed at 2 (gathers two units ahead, each
    reduce-scatter waited for after the next launch: several collectives in flight at once) vs
    eager FSDP2: the numbers after every step, and the plan's invariants on this rank."""
    from memplan.streams import is_collective, is_wait, validate_stream_placement
    from memplan.torch.distributed.fsdp_step import compile_fsdp_step

    batch = fc.mlp_batch(dist.get_rank())
    build = lambda seed: fc.mlp(seed, width=64, depth=3)  # noqa: E731
    eager = fc.shard(build(0), dist.get_world_size())
    eager_opt = fc.adamw(eager)
    run_eager = fc._eager(eager, eager_opt, fc.cross_entropy)
    model = fc.shard(build(0), dist.get_world_size())
    opt = fc.adamw(model)
    step = compile_fsdp_step(model, opt, fc.cross_entropy, batch, time_limit_seconds=0.5, prefetch=2, record_times=True)
    runner = step.runner_for(batch)
    g, order = runner.step_graph, runner.stream_order
    position = {v: i for i, v in enumerate(order)}
    wrong, in_flight = [], 0
    for c, op in enumerate(g.ops):
        if not is_collective(op):
            continue
        (w,) = [s for s in g.successors[c] if is_wait(g.ops[s])]
        readers = [r for t in op.outputs for r in g.consumers[t] if r != w]
        if not position[c] < position[w] < min(position[r] for r in readers):
            wrong.append(op.name)
        in_flight = max(in_flight, sum(is_collective(g.ops[v]) for v in order[position[c] : position[w]]))
    check = validate_stream_placement(g, runner.plan.offsets, order)
    diffs = []
    for k in range(steps):
        torch.manual_seed(7 + k)
        ours = step(batch)
        torch.manual_seed(7 + k)
        theirs = run_eager(batch)
        diffs.append(max(fc._diff([ours], [theirs]), fc._diff(fc._locals(model, opt), fc._locals(eager, eager_opt))))
    return {
        "collectives": sum(is_collective(op) for op in g.ops),
        "streams": step.report["streams"],
        "misordered": wrong,
        "most_in_flight": in_flight,
        "safe": check.safe and check.overlapping_pairs > 0,
        "overlaps": _in_flight_overlaps(g, order, runner.plan.offsets),
        "diffs": diffs,
        "launched": len(runner.inflight.launches),
        "waited": len(runner.inflight.waited),
        "timed": all(0 < e.launched <= e.wait_start <= e.wait_end for e in runner.inflight.launches)
        and all(e.done > 0 for e in runner.inflight.launches if e.kind == "all_gather"),  # gloo's RS: no future
    }


def _check_prefetching(r: dict, collectives: int) -> None:
    """Each all-gather and reduce-scatter launched asynchronously (gloo) on stream 1, its wait on
    the compute stream after its launch and before the first reader of its output, several in
    flight at once; no arena tensor made while a collective is in flight shares its buffers'
    bytes (an oracle here, and the streams core's execution validator); every launch waited for;
    the loss, gathered parameters and optimizer state equal eager FSDP2's after every step."""
    assert r["collectives"] == r["launched"] == r["waited"] == collectives and r["timed"]
    assert r["misordered"] == [] and r["overlaps"] == [] and r["safe"]
    assert r["most_in_flight"] > 1
    assert r["diffs"] == [0.0] * len(r["diffs"])
    assert r["streams"]["prefetch"] == 2 and "prefetch fixed at 2" in r["streams"]["why"]


def _check_choice(streams: dict) -> None:
    """The plan's own choice among its candidates (every prefetch depth and wait policy): the
    smallest planned peak, ties to the most overlap, with its reason."""
    tried = [(c["prefetch"], c["waits"]) for c in streams["candidates"]]
    assert tried == [(0, "serial"), (0, "earliest"), (0, "next"), (1, "next"), (2, "next")]
    picked = (streams["prefetch"], streams["waits"])
    chosen = [c for c in streams["candidates"] if (c["prefetch"], c["waits"]) == picked]
    smallest = min(c["planned_peak_bytes"] for c in streams["candidates"])
    assert chosen[0]["planned_peak_bytes"] == smallest and streams["why"].startswith("the smallest planned peak")
    deepest = max(streams["candidates"], key=lambda c: c["overlap_ops"])
    assert deepest["prefetch"] == 2 and deepest["overlap_ops"] > 0


def test_the_stream_choice_takes_the_smallest_peak_or_the_most_overlap_within_a_budget() -> None:
    """Without a budget: the smallest planned peak, ties to the most overlap; with one: the most
    overlap whose planned peak fits, else the smallest peak, saying none fits."""
    from memplan.torch.distributed.fsdp_plan import Candidate, choose

    def c(depth: int, waits: str, peak: int, ops: int) -> Candidate:
        return Candidate(depth, waits, (), peak, 0, peak, ops)

    serial, early = c(0, "serial", 100, 0), c(0, "earliest", 100, 5)
    nxt, ahead = c(0, "next", 130, 9), c(1, "next", 160, 20)
    best, why = choose([serial, early, nxt, ahead])
    assert best is early and why.startswith("the smallest planned peak (100 B), shared by 2")
    assert choose([serial, early, nxt, ahead], budget_bytes=150)[0] is nxt
    assert choose([serial, early, nxt, ahead], budget_bytes=10**6)[0] is ahead
    best, why = choose([serial, nxt], budget_bytes=50)
    assert best is serial and "none fits memory_budget (50 B)" in why


def test_under_a_budget_the_plan_takes_the_most_overlap_that_fits(one_rank) -> None:
    """memory_budget that the reordered plan reaches: the communication stream's candidate with the
    most overlap whose planned peak fits the budget (here every one fits: the deepest prefetch), and
    the step still trains bit for bit like eager FSDP2."""
    from memplan.torch.distributed import compile_fsdp_step

    batch = fc.mlp_batch(0)
    eager = fc.shard(fc.mlp(0), 1)
    eager_opt = fc.adamw(eager)
    model = fc.shard(fc.mlp(0), 1)
    opt = fc.adamw(model)
    step = compile_fsdp_step(model, opt, fc.cross_entropy, batch, memory_budget=2**30, time_limit_seconds=0.5)
    streams = step.report["streams"]
    assert step.report["method"] == "reorder"
    picked = (streams["prefetch"], streams["waits"])
    chosen = [c for c in streams["candidates"] if (c["prefetch"], c["waits"]) == picked]
    assert chosen[0]["overlap_ops"] == max(c["overlap_ops"] for c in streams["candidates"]) > 0
    assert "fits memory_budget" in streams["why"]
    run_eager = fc._eager(eager, eager_opt, fc.cross_entropy)
    for k in range(2):
        torch.manual_seed(7 + k)
        ours = step(batch)
        torch.manual_seed(7 + k)
        theirs = run_eager(batch)
        assert fc._diff([ours], [theirs]) == 0.0
        assert fc._diff(fc._locals(model, opt), fc._locals(eager, eager_opt)) == 0.0
