"""Train K FSDP2 steps with memplan, with eager FSDP2 and with eager FSDP2 + ``torch.utils.checkpoint``
on every block (``fsdp2_ckpt``, the usual way to trade compute for memory) on every rank, from the
same seed, and compare: the loss, every parameter (gathered: ``full_tensor()``) and every optimizer
state tensor after every step, and each step's measured peak (the CPU allocator's, above what the
process held before the step, plus what each variant holds between steps: shards, optimizer
state, memplan's arena). Runs inside a gloo process group; :func:`run_ranks` spawns one.

Used by ``tests/torch/test_fsdp.py`` and ``bench/fsdp.py``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

import torch
from torch import nn


def mlp(seed: int = 0, width: int = 64, depth: int = 3) -> nn.Module:
    """An MLP of ``depth`` blocks (Linear, GELU), widths not divisible by 2 or 4 (uneven shards)."""
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(width + 3 if k else 16, width + 3), nn.GELU()) for k in range(depth)]
    return nn.Sequential(*blocks, nn.Linear(width + 3, 5))


def mlp_batch(rank: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(size, 16, generator=g), torch.randint(0, 5, (size,), generator=g)


LLAMA = {  # a small Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
}


def llama(seed: int = 0, **config: Any) -> nn.Module:
    """HF ``LlamaForCausalLM`` from :data:`LLAMA` (with ``config``'s changes), random weights, its
    forward returning the logits (the zoo's wrapper); its blocks are ``model.layers``."""
    import transformers

    from memplan.torch.zoo import Logits

    torch.manual_seed(seed)
    return Logits(transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, **config})))


def token_batch(rank: int, vocab: int, size: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens and next-token targets, from its rank's seed."""
    g = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, vocab, (size, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, target)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks, each a ``fully_shard`` unit (and, for ``fsdp2_ckpt``, checkpointed): an HF
    decoder's layers (GPT-2's ``transformer.h``, Llama's ``model.layers``, under the zoo's wrapper),
    else every child of the root but the last (the MLP's head)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in ("h", "layers"):
            return list(module)
    return list(model.children())[:-1]


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Every block's forward under ``torch.utils.checkpoint`` (non-reentrant, RNG state preserved):
    a block keeps only its input for the backward and runs its forward again there. Applied before
    ``fully_shard``, whose hooks stay around the module's call, so a block's parameters are gathered
    for the recomputation by FSDP2's pre-backward hook."""
    from torch.utils.checkpoint import checkpoint

    for block in blocks(model):
        forward = block.forward

        def checkpointed(*args: Any, _forward: Callable = forward, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = checkpointed
    return model


def shard(model: nn.Module, world: int, reshard_after_forward: bool | None = None, **options: Any) -> nn.Module:
    """``fully_shard`` every block (every child of the root) and the root, on a CPU mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _eager(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable) -> Callable:
    def run(batch: tuple[Any, Any]) -> torch.Tensor:
        loss = loss_fn(model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return run


def _locals(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter gathered, then every optimizer state tensor (this rank's shard)."""
    out = [p.full_tensor().detach() for p in model.parameters()]
    for p in model.parameters():
        for v in optimizer.state[p].values():
            out.append(v.to_local() if hasattr(v, "to_local") else v)
    return out


def _diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if x.numel()]
    return max((float((x.double() - y.double()).abs().max()) for x, y in pairs), default=0.0)


def _held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the shards and the optimizer state (each storage once)."""
    seen: dict[int, int] = {}
    tensors = [p.to_local() for p in model.parameters()]
    tensors += [v.to_local() if hasattr(v, "to_local") else v for s in optimizer.state.values() for v in s.values()]
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


EAGER_VARIANTS = ("fsdp2", "fsdp2_ckpt")  # eager FSDP2, and eager FSDP2 with every block checkpointed


def bf16_policy() -> Any:
    """FSDP2's usual mixed precision: parameters gathered (and computed on) in bf16, gradients
    reduced in fp32, the shards and the optimizer in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def eager_model(
    build: Callable[[int], nn.Module], variant: str, reshard_after_forward: bool | None = None, mp_policy: Any = None
):
    """An eager variant's sharded model from seed 0: FSDP2 alone, or with its blocks checkpointed
    (every unit under ``mp_policy``, a ``MixedPrecisionPolicy``, if given)."""
    if variant not in EAGER_VARIANTS:
        raise ValueError(f"unknown variant {variant!r}")
    model = build(0)
    if variant == "fsdp2_ckpt":
        checkpoint_blocks(model)
    return shard(model, dist.get_world_size(), reshard_after_forward, **_policy(mp_policy))


def _policy(mp_policy: Any) -> dict[str, Any]:
    return {} if mp_policy is None else {"mp_policy": mp_policy}


def compare_with_fsdp2(
    build: Callable[[int], nn.Module],
    batch: Any,
    *,
    steps: int = 5,
    reshard_after_forward: bool | None = None,
    loss_fn: Callable = cross_entropy,
    time_limit_seconds: float = 2.0,
    memory_budget: int | float | str | None = None,
    mp_policy: Any = None,
    prefetch: int | None = None,
    trace: bool = False,
) -> dict[str, Any]:
    """This rank's report (every variant's units under ``mp_policy``, a ``MixedPrecisionPolicy``, if
    given). ``prefetch``: a variant ``memplan_prefetchD``, memplan's step with its prefetch depth
    fixed at D (its ``prefetch_diffs`` to eager FSDP2). ``trace``: one more step of each variant
    under the profiler (:func:`memplan.torch.distributed.timeline.profile_step`): ``trace_events``
    and ``overlap`` by variant. ``diffs`` (max abs difference of loss, gathered parameters and optimizer
    state to eager FSDP2's, after each step), ``ckpt_diffs`` (the same to eager FSDP2 with every block
    checkpointed), ``peaks`` (measured, by variant) and the plan's claim. With ``memory_budget``, a
    fourth variant, ``memplan_budget`` (memplan's step under that budget), and its ``budget_diffs``
    to eager FSDP2 and ``budget_report``."""
    from memplan.torch.distributed.fsdp_step import compile_fsdp_step
    from memplan.torch.measure import allocator_peak_bytes

    torch.set_num_threads(1)
    models = {name: eager_model(build, name, reshard_after_forward, mp_policy) for name in EAGER_VARIANTS}
    optimizers = {name: adamw(m) for name, m in models.items()}
    ours = shard(build(0), dist.get_world_size(), reshard_after_forward, **_policy(mp_policy))
    opt = adamw(ours)
    step = compile_fsdp_step(ours, opt, loss_fn, batch, time_limit_seconds=time_limit_seconds)
    runs = {name: _eager(models[name], optimizers[name], loss_fn) for name in EAGER_VARIANTS} | {"memplan": step}
    if memory_budget is not None:
        budgeted = shard(build(0), dist.get_world_size(), reshard_after_forward, **_policy(mp_policy))
        budget_opt = adamw(budgeted)
        runs["memplan_budget"] = compile_fsdp_step(
            budgeted, budget_opt, loss_fn, batch, time_limit_seconds=time_limit_seconds, memory_budget=memory_budget
        )
    fixed = None if prefetch is None else f"memplan_prefetch{prefetch}"
    if fixed is not None:
        prefetched = shard(build(0), dist.get_world_size(), reshard_after_forward, **_policy(mp_policy))
        prefetch_opt = adamw(prefetched)
        runs[fixed] = compile_fsdp_step(
            prefetched, prefetch_opt, loss_fn, batch, time_limit_seconds=time_limit_seconds, prefetch=prefetch
        )
    prefetch_diffs: list[float] = []
    budget_diffs: list[float] = []
    diffs: dict[str, list[float]] = {name: [] for name in EAGER_VARIANTS}
    loss_diffs: list[float] = []
    peaks = dict.fromkeys(runs, 0)
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for k in range(steps):
        measure = k == steps - 1  # the steady state: every optimizer has its state
        losses = {}
        for name, run in runs.items():
            torch.manual_seed(7 + k)
            dist.barrier()
            start = time.perf_counter()
            if measure:
                losses[name], peaks[name] = allocator_peak_bytes(run, batch)
            else:
                losses[name] = run(batch)
            seconds[name].append(time.perf_counter() - start)
        mine = _locals(ours, opt)
        for name in EAGER_VARIANTS:
            theirs = _locals(models[name], optimizers[name])
            diffs[name].append(max(_diff([losses["memplan"]], [losses[name]]), _diff(mine, theirs)))
        loss_diffs.append(_diff([losses["memplan"]], [losses["fsdp2"]]))
        if fixed is not None:
            theirs = _locals(models["fsdp2"], optimizers["fsdp2"])
            prefetch_diffs.append(
                max(_diff([losses[fixed]], [losses["fsdp2"]]), _diff(_locals(prefetched, prefetch_opt), theirs))
            )
        if memory_budget is not None:
            theirs = _locals(models["fsdp2"], optimizers["fsdp2"])
            budget_diffs.append(
                max(_diff([losses["memplan_budget"]], [losses["fsdp2"]]), _diff(_locals(budgeted, budget_opt), theirs))
            )
    runner = step.runner_for(batch)
    held = {name: _held_bytes(models[name], optimizers[name]) for name in EAGER_VARIANTS}
    if memory_budget is not None:
        budget_step = runs["memplan_budget"]
        held["memplan_budget"] = _held_bytes(budgeted, budget_opt) + budget_step.runner_for(batch).arena.numel()
    extra = (
        {} if memory_budget is None else {"budget_diffs": budget_diffs, "budget_report": runs["memplan_budget"].report}
    )
    if fixed is not None:
        held[fixed] = _held_bytes(prefetched, prefetch_opt) + runs[fixed].runner_for(batch).arena.numel()
        extra |= {"prefetch_diffs": prefetch_diffs, "prefetch_report": runs[fixed].report.get("streams")}
    if trace:
        extra |= _traced(runs, batch, steps)
    return {
        **extra,
        "rank": dist.get_rank(),
        "diffs": diffs["fsdp2"],
        "ckpt_diffs": diffs["fsdp2_ckpt"],
        "loss_diffs": loss_diffs,
        "step_peak_bytes": peaks,
        "held_bytes": held | {"memplan": _held_bytes(ours, opt) + runner.arena.numel()},
        "arena_bytes": runner.arena.numel(),
        "planned_peak_bytes": step.report["planned_peak_bytes"],
        "streams": step.report.get("streams"),
        "collectives": sum("memplan_fsdp" in str(n.target) for n in runner.capture.gm.graph.nodes),
        "collective_dtypes": collective_dtypes(runner.capture),
        "median_seconds": {n: sorted(s)[len(s) // 2] for n, s in seconds.items()},
    }


TRACED = ("memplan", "fsdp2")  # and memplan_prefetchD where compared


def _traced(runs: dict[str, Callable], batch: Any, step: int) -> dict[str, Any]:
    """One more step of memplan's variants and eager FSDP2's under the profiler (every rank, in
    turn): their events (compute thread, gloo's threads) and :func:`overlap`."""
    from memplan.torch.distributed.timeline import overlap, profile_step

    events = {}
    for name in [n for n in runs if n in TRACED or n.startswith("memplan_prefetch")]:
        torch.manual_seed(7 + step)
        dist.barrier()
        _, events[name] = profile_step(runs[name], batch)
    return {"trace_events": events, "overlap": {name: overlap(e) for name, e in events.items()}}


def collective_dtypes(capture: Any) -> dict[str, list[str]]:
    """The dtypes the plan's collectives move, by op (``all_gather``, ``reduce_scatter``): under
    bf16 mixed precision, bf16 gathers and fp32 reductions."""
    found: dict[str, set[str]] = {}
    for node in capture.gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", "") == "memplan_fsdp":
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                name = node.target._schema.name.split("::")[-1]
                found.setdefault(name, set()).add(str(val.dtype).removeprefix("torch."))
    return {name: sorted(dtypes) for name, dtypes in sorted(found.items())}


def _rank_main(rank: int, world: int, store: str, out: str, fn: Callable, args: tuple) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        result = fn(*args)
    except Exception:
        result = {"error": traceback.format_exc()}
    Path(out, f"{rank}.json").write_text(json.dumps(result, default=str))
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable, *args: Any) -> list[dict[str, Any]]:
    """``fn(*args)`` on ``world`` spawned gloo ranks; every rank's JSON-able result. A rank's
    exception comes back as ``{"error": traceback}``."""
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        try:
            mp.spawn(_rank_main, args=(world, store, tmp, fn, args), nprocs=world, join=True)
        except mp.ProcessExitedException:
            if not all(Path(tmp, f"{r}.json").exists() for r in range(world)):
                raise
        return [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(world)]


def measure_rss(
    build: Callable[[int], nn.Module],
    batch: Any,
    variant: str,
    *,
    loss_fn: Callable = cross_entropy,
    warmup_steps: int = 2,
    time_limit_seconds: float = 2.0,
    memory_budget: int | float | str | None = None,
    mp_policy: Any = None,
) -> dict[str, Any]:
    """This process's peak resident set during one steady step of ``variant`` ("memplan", "fsdp2",
    "fsdp2_ckpt", "memplan_budget": memplan's step under ``memory_budget``, or "memplan_prefetchD":
    memplan's step with prefetch fixed at D) alone, above ``base``
    (the resident set after the imports and the process group, before the model exists): VmHWM,
    reset just before the step."""
    import gc

    import ortools.sat.python.cp_model  # noqa: F401  (both variants carry the solvers' libraries)

    from memplan.torch.distributed.fsdp_step import compile_fsdp_step
    from memplan.torch.rss import peak_rss_bytes, release_free_memory, reset_peak_rss, rss_bytes

    torch.set_num_threads(1)
    adamw(nn.Linear(1, 1))  # what creating an optimizer imports
    gc.collect()
    release_free_memory()
    base = rss_bytes()
    if variant.startswith("memplan"):
        model = shard(build(0), dist.get_world_size(), **_policy(mp_policy))
        optimizer = adamw(model)
        budget = memory_budget if variant == "memplan_budget" else None
        depth = int(variant.removeprefix("memplan_prefetch")) if variant.startswith("memplan_prefetch") else None
        run = compile_fsdp_step(
            model,
            optimizer,
            loss_fn,
            batch,
            time_limit_seconds=time_limit_seconds,
            memory_budget=budget,
            prefetch=depth,
        )
    else:
        model = eager_model(build, variant, mp_policy=mp_policy)
        optimizer = adamw(model)
        run = _eager(model, optimizer, loss_fn)
    for k in range(warmup_steps):
        torch.manual_seed(7 + k)
        run(batch)
    gc.collect()
    release_free_memory()
    dist.barrier()
    reset_peak_rss()
    torch.manual_seed(7 + warmup_steps)
    run(batch)
    peak = peak_rss_bytes()
    return {"rank": dist.get_rank(), "variant": variant, "base_bytes": base, "peak_above_base": peak - base}


# what zoo_report keeps of the budgeted plan's report (memplan run --fsdp --budget)
BUDGET_KEYS = ("memory_budget", "budget_bytes", "method", "recomputed_ops", "regathered", "overhead")
BUDGET_KEYS += ("remat_peak_bytes", "reordered_peak_bytes")


def zoo_report(
    model_name: str,
    batch_size: int,
    steps: int,
    time_limit_seconds: float = 2.0,
    memory_budget: int | float | str | None = None,
) -> dict[str, Any]:
    """:func:`compare_with_fsdp2` on a zoo model (every rank its own batch, from its rank's seed),
    as ``memplan run MODEL --nproc N --fsdp`` reports it: ``variants.{memplan, fsdp2, fsdp2_ckpt}``
    (FSDP2 with every block under ``torch.utils.checkpoint``), each with
    ``max_abs_diff`` (to memplan's numbers, over every step) and ``peak_bytes`` (measured: what it
    holds between steps + the allocator's peak during a steady step). With ``memory_budget``
    (``--budget``), a fourth variant ``memplan_budget`` (its ``max_abs_diff`` to eager FSDP2's) and
    ``budget``: what rank 0's budgeted plan decided."""
    from memplan.torch.zoo import build_workload

    rank = dist.get_rank()
    w = build_workload(model_name, batch_size, seed=rank)
    batch, loss_fn = (w.inputs, w.target), w.loss_fn
    del w

    def build(seed: int) -> nn.Module:
        return build_workload(model_name, batch_size, seed=seed).model

    r = compare_with_fsdp2(
        build, batch, steps=steps, loss_fn=loss_fn, time_limit_seconds=time_limit_seconds, memory_budget=memory_budget
    )
    worst = {"memplan": 0.0, "fsdp2": max(r["diffs"]), "fsdp2_ckpt": max(r["ckpt_diffs"])}
    names = ("memplan", *EAGER_VARIANTS)
    if memory_budget is not None:
        worst["memplan_budget"] = max(r["budget_diffs"])
        names = (*names, "memplan_budget")
    variants = {
        name: {
            "max_abs_diff": worst[name],
            "peak_bytes": r["held_bytes"][name] + r["step_peak_bytes"][name],
            "step_seconds": r["median_seconds"][name],
        }
        for name in names
    }
    budget = r.get("budget_report")
    extra = {} if budget is None else {"budget": {k: v for k, v in budget.items() if k in BUDGET_KEYS}}
    return {
        "rank": rank,
        "model": model_name,
        "world_size": dist.get_world_size(),
        "batch_size": batch_size,
        "steps": steps,
        "diffs": r["diffs"],
        "variants": variants,
        "arena_bytes": r["arena_bytes"],
        "planned_peak_bytes": r["planned_peak_bytes"],
        "collectives": r["collectives"],
        **extra,
    }
