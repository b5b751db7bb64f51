"""Wrappers memplan does not plan, refused by name before capture.

A wrapper that shards the parameters (FSDP2's ``fully_shard``, FSDP1's
``FullyShardedDataParallel``), averages the gradients in autograd hooks (``DistributedData
Parallel``), replicates the model on several GPUs (``DataParallel``) or compiles the forward
(``torch.compile``) does work a captured step does not see: traced, it fails deep inside
(a gradient that is a DTensor, a meta device) or, worse, would train without the wrapper's
communication. Each is refused up front in one line that names it and says what to do.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from memplan.errors import UnplannedWrapper

DATA_PARALLEL_HINT = "use memplan.compile_data_parallel_step for data parallelism (DDP's buckets, planned)"


def refuse_unplanned_wrappers(model: torch.nn.Module) -> None:
    """Raise :class:`UnplannedWrapper` if ``model`` or one of its submodules is a wrapper memplan
    does not plan, or holds DTensor parameters (FSDP2, tensor parallelism)."""
    for name, module in model.named_modules(remove_duplicate=True):
        where = f"the model ({type(module).__name__})" if not name else f"submodule {name!r} ({type(module).__name__})"
        reason = _wrapper_reason(module)
        if reason:
            raise UnplannedWrapper(f"{where} {reason}")
    dtensor = _dtensor_parameter(model)
    if dtensor is not None:
        raise UnplannedWrapper(
            f"parameter {dtensor!r} is a DTensor (FSDP2's fully_shard or tensor parallelism): memplan does not plan "
            f"sharded models yet; plan the unsharded model, or {DATA_PARALLEL_HINT}"
        )


def _wrapper_reason(module: torch.nn.Module) -> str:
    """What to say about ``module`` if it is a wrapper memplan refuses, else ``""``."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # imported by whoever wrapped the model
    if fsdp is not None and isinstance(module, getattr(fsdp, "FSDPModule", ())):
        return (
            "is sharded with FSDP2's fully_shard (its parameters are DTensors): pass it to "
            "memplan.compile_step(model, optimizer, loss_fn, batch) on every rank, which plans FSDP2's collectives, "
            "or plan the unsharded model"
        )
    if fsdp is not None and isinstance(module, getattr(fsdp, "FullyShardedDataParallel", ())):
        return (
            "is wrapped in FSDP's FullyShardedDataParallel: memplan does not plan FSDP-sharded models yet; "
            f"plan the unwrapped model (fsdp.module), or {DATA_PARALLEL_HINT}"
        )
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return (
            "is wrapped in DistributedDataParallel, whose gradient all-reduce runs in autograd hooks a planned "
            "step does not run: pass the plain module (ddp.module, with process_group=ddp.process_group) to "
            "memplan.compile_data_parallel_step, which plans DDP's buckets itself"
        )
    if isinstance(module, torch.nn.DataParallel) and len(module.device_ids) > 1:
        return (
            f"is wrapped in DataParallel over {len(module.device_ids)} GPUs, which replicates the model in "
            f"threads each step: memplan plans one device; pass dp.module, or {DATA_PARALLEL_HINT}"
        )
    if _is_torch_compiled(module):
        return (
            "is compiled with torch.compile: memplan captures and plans the step itself; pass the original "
            "module (compiled._orig_mod, or the module before .compile()) to memplan"
        )
    return ""


def _is_torch_compiled(module: torch.nn.Module) -> bool:
    """``torch.compile(module)`` (an OptimizedModule) or ``module.compile()`` (in place)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None) if eval_frame is not None else None
    if optimized is not None and isinstance(module, optimized):
        return True
    return getattr(module, "_compiled_call_impl", None) is not None


def _dtensor_parameter(model: torch.nn.Module) -> str | None:
    """The name of the first parameter or buffer that is a DTensor, if any."""
    tensor_module: Any = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(tensor_module, "DTensor", None) if tensor_module is not None else None
    if dtensor is None:
        return None
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if isinstance(t, dtensor):
            return name
    return None
