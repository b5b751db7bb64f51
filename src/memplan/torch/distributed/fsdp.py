"""FSDP2 (``fully_shard``) training steps, planned: a first slice (issue 35).

::

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())          # over the DTensor shards
    step = memplan.torch.distributed.compile_fsdp_step(model, optimizer, loss_fn, example_batch)
    loss = step(batch)                                          # trains as eager FSDP2 does

How a step is captured. FSDP2 keeps each parameter as a DTensor whose local tensor is this
rank's dim-0 shard, gathers a unit's parameters before its forward (and again before its
backward when ``reshard_after_forward``), and reduce-scatters the unit's gradients after its
backward, averaged over the ranks; the optimizer then updates the shards. memplan captures
exactly that dataflow on fakes, with no FSDP2 hook running:

* the model is mirrored by a plain *shard model* (:func:`shard_model`): the same modules (their
  original classes, FSDP2's hooks left out), whose parameters are plain tensors sharing storage
  with the DTensors' local shards and whose buffers are the model's own;
* a forward pre-hook on each unit gathers its parameters (``memplan_fsdp::all_gather``,
  :mod:`.fsdp_ops`) and puts the full ones in the modules for the forward; with
  ``reshard_after_forward`` a saved-tensor hook drops the reference autograd keeps and gathers
  the unit again where the backward first needs it (FSDP2's free-after-forward);
* when autograd has accumulated every gradient of a unit, ``memplan_fsdp::reduce_scatter``
  averages them into this rank's flat shard (FSDP2's layout and reduction), and each shard
  parameter's ``.grad`` is a view of it, as FSDP2's ``foreach_reduce`` leaves them;
* the optimizer is a twin of the user's (same class, groups and hyper-parameters, synced from
  the user's before every step) over the shard parameters, whose state tensors are the local
  tensors of the user's DTensor state (given to the user's optimizer as DTensors after the first
  step, if it had none: :func:`link_state`), so every update lands in the user's own objects.
* tied parameters (one FSDP2 parameter in several modules, as GPT-2's embedding and LM head)
  are gathered once and put in every place.
* mixed precision (a unit's ``MixedPrecisionPolicy``) is mirrored where FSDP2 applies it: each
  shard is cast to ``param_dtype`` into its all-gather input (the gathered parameters, their
  forward and their gradients are in that dtype), the gradients are cast into a ``reduce_dtype``
  reduce-scatter buffer and the reduced shard back to the shards' dtype (what the optimizer
  sees), and every ``fully_shard``-ed module (one without parameters too) casts its floating-point
  forward inputs to ``param_dtype`` (``cast_forward_inputs``) and its outputs to ``output_dtype``
  with FSDP2's own functions (:class:`UnitPrecision`, :func:`forward_casts`).

The graph is planned by rank 0 (order) and placed by every rank for its own shard sizes (a
rank's last shard may be smaller). The collectives run on a communication stream
(:mod:`memplan.torch.distributed.fsdp_plan`): each launched asynchronously, its buffers held in
the arena until its wait, which the plan places, as the prefetch depth (how many units are
gathered ahead) and the reduce-scatters' waits, chosen among candidates by their placed peak;
under a remat plan (``memory_budget`` that reordering does not reach) they run synchronously at
their place. What this slice does not do yet is
refused in one line each (:func:`read_layout`, :func:`refuse_unsupported`,
:func:`refuse_foreign_collectives`): FSDP1's wrapper, a float16 gradient reduction (FSDP2 pre- and
post-divides it), CPU offload, HSDP meshes,
``reshard_after_forward`` as an int, a unit over several modules, a shard dim other than 0, a
model only partly sharded, a collective the step runs itself.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

import torch
from memplan.errors import MemplanError, UnplannedWrapper
from memplan.torch.capture import Capture
from memplan.torch.distributed import fsdp_ops
from memplan.torch.tensors import storage_key


@dataclass
class FsdpParam:
    """One sharded parameter: where it lives in the model and how it is cut."""

    name: str  # the model's parameter name
    module: str  # the owning module's name
    attr: str  # the parameter's attribute in that module
    full_shape: tuple[int, ...]
    local: torch.Tensor  # this rank's shard (the DTensor's local tensor)
    dtensor: torch.nn.Parameter
    aliases: tuple[tuple[str, str], ...] = ()  # (module, attribute) of every other place it is tied to
    gather_dtype: torch.dtype | None = None  # the gathered (unsharded) parameter's: mp_policy.param_dtype, clamped


@dataclass
class FsdpUnit:
    """A module ``fully_shard`` was applied to, with the parameters it manages."""

    module: str
    params: list[FsdpParam]
    reshard_after_forward: bool
    group: Any  # its shard process group
    precision: UnitPrecision | None = None  # its MixedPrecisionPolicy's reduction (None: full precision)


@dataclass(frozen=True)
class UnitPrecision:
    """How a unit's gradients are reduced under its ``MixedPrecisionPolicy`` (``FSDPParam.init_dtype_attrs``,
    ``foreach_reduce``): they come in the gathered parameters' dtype, are cast to ``reduce_dtype``
    for the reduce-scatter, and the reduced shard back to ``orig_dtype`` (the shards' dtype, what the
    optimizer sees). The policy's forward casts are :attr:`FsdpLayout.casts`."""

    reduce_dtype: torch.dtype | None  # None: the gradients' own dtype
    orig_dtype: torch.dtype | None  # None: the unit has no trainable parameter


@dataclass
class FsdpLayout:
    """How a model is sharded: its units (outermost first), its mesh's group, world and rank."""

    units: list[FsdpUnit]
    group: Any
    world: int
    rank: int
    mesh: Any = None
    placements: tuple = ()
    # every fully_shard-ed module (parameters or not) whose MixedPrecisionPolicy casts its forward's
    # floating-point inputs or outputs: module name -> (input dtype or None, output dtype or None)
    casts: dict[str, tuple[torch.dtype | None, torch.dtype | None]] = field(default_factory=dict)

    @property
    def params(self) -> list[FsdpParam]:
        return [p for u in self.units for p in u.params]


def is_fsdp2(model: torch.nn.Module) -> bool:
    """Whether ``model`` or a submodule was sharded with FSDP2's ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def read_layout(model: torch.nn.Module) -> FsdpLayout:
    """The model's FSDP2 sharding, refusing (one line each) what this slice does not plan."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    for name, module in model.named_modules():
        if isinstance(module, FullyShardedDataParallel):
            where = f"submodule {name!r}" if name else "the model"
            raise UnplannedWrapper(
                f"{where} is wrapped in FSDP1's FullyShardedDataParallel: memplan plans FSDP2 only; shard the plain "
                "module with torch.distributed.fsdp.fully_shard instead"
            )
    names = {id(m): n for n, m in model.named_modules()}
    units: list[FsdpUnit] = []
    groups = []
    casts = {}
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        if forward_casts(state._mp_policy) != (None, None):
            casts[name] = forward_casts(state._mp_policy)
        if len(state._modules) != 1:
            raise UnplannedWrapper(
                f"fully_shard was applied to {len(state._modules)} modules at once ({name!r}, ...): memplan plans "
                "one module per fully_shard call for now; call fully_shard on each module"
            )
        for group in state._fsdp_param_groups:
            refuse_unsupported(group, name, is_root=not name)
            groups.append(group)
            params = [_param_of(fp, names, name, group.mp_policy) for fp in group.fsdp_params]
            precision = unit_precision(group.mp_policy, params)
            pg = group.mesh_info.shard_process_group
            units.append(FsdpUnit(name, params, _reshards(state, group, not name), pg, precision))
    if not units:
        raise MemplanError("the model has no fully_shard-ed module; use memplan.compile_step for an unsharded model")
    sharded = {id(p.dtensor) for u in units for p in u.params}
    for pname, p in model.named_parameters():
        if id(p) not in sharded:
            kind = "a DTensor outside FSDP2" if isinstance(p, DTensor) else "not sharded"
            raise UnplannedWrapper(
                f"parameter {pname!r} is {kind} while others are sharded with fully_shard: memplan plans models "
                "whose parameters are all sharded by FSDP2; call fully_shard on the root module too"
            )
    pgs = {id(u.group) for u in units}
    if len(pgs) != 1:
        raise UnplannedWrapper("the units of this model shard over different process groups; memplan plans one mesh")
    first = units[0].params[0].dtensor
    pg = units[0].group
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    return FsdpLayout(units, pg, world, rank, first.device_mesh, first.placements, casts)


def _param_of(fsdp_param: Any, names: dict[int, str], unit: str, policy: Any) -> FsdpParam:
    from torch.distributed.tensor import Shard

    info = fsdp_param._module_info
    placement = fsdp_param.fsdp_placement
    if not isinstance(placement, Shard) or placement.dim != 0:
        where = f"unit {unit!r}" if unit else "the root unit"
        shown = f"Shard({placement.dim})" if isinstance(placement, Shard) else str(placement)
        raise UnplannedWrapper(
            f"{where} shards parameter {info.param_name!r} on {shown}: memplan plans FSDP2's default Shard(0) only "
            "(drop shard_placement_fn)"
        )
    module = names[id(info.module)]
    name = f"{module}.{info.param_name}" if module else info.param_name
    dtensor = fsdp_param.sharded_param
    if dtensor.dim() == 0:
        raise UnplannedWrapper(f"parameter {name!r} is a scalar: memplan does not plan sharded 0-d parameters")
    aliases = tuple((names[id(m)], a) for m, a in zip(info.shared_modules, info.shared_param_names, strict=True))
    gather = _gather_dtype(policy, dtensor.dtype)
    return FsdpParam(
        name, module, info.param_name, tuple(dtensor.shape), dtensor._local_tensor, dtensor, aliases, gather
    )


def _gather_dtype(policy: Any, orig: torch.dtype) -> torch.dtype:
    """The dtype FSDP2 gathers a parameter in: ``param_dtype``, unless the parameter is not
    floating point or already of that dtype (``FSDPParam.init_dtype_attrs``)."""
    if policy.param_dtype is None or not orig.is_floating_point:
        return orig
    return policy.param_dtype


def unit_precision(policy: Any, params: list[FsdpParam]) -> UnitPrecision | None:
    """How FSDP2 reduces a unit's gradients under ``policy`` (:class:`UnitPrecision`; None when
    nothing is cast). ``reduce_dtype`` equal to ``param_dtype`` is FSDP2's "no cast" (its clamp)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if policy == MixedPrecisionPolicy():
        return None
    trainable = [p for p in params if p.dtensor.requires_grad]
    reduce = None if policy.reduce_dtype == policy.param_dtype else policy.reduce_dtype
    return UnitPrecision(reduce, trainable[0].dtensor.dtype if trainable else None)


def forward_casts(policy: Any) -> tuple[torch.dtype | None, torch.dtype | None]:
    """The dtypes a fully_shard-ed module's forward inputs and outputs are cast to under ``policy``
    (``FSDPState._cast_forward_inputs`` / ``_cast_output_dtype``; None: not cast)."""
    cast_inputs = policy.param_dtype if policy.cast_forward_inputs else None
    return cast_inputs, policy.output_dtype


def _reshards(state: Any, group: Any, is_root: bool) -> bool:
    """FSDP2's ``reshard_after_forward`` for the unit: ``None`` (auto) is True, except the root's."""
    if is_root and state._auto_reshard_after_forward:
        return False
    return group.post_forward_mesh_info is not None


def refuse_unsupported(group: Any, unit: str, *, is_root: bool) -> None:
    """Raise :class:`UnplannedWrapper` naming the first FSDP2 option of ``group`` this slice does
    not plan (``unit``: the module's name, "" for the root)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    where = f"unit {unit!r}" if unit else "the root unit"
    refuse_unsupported_precision(group.mp_policy, [fp.sharded_param.dtype for fp in group.fsdp_params], where)
    if isinstance(group.offload_policy, CPUOffloadPolicy):
        raise UnplannedWrapper(f"{where} uses CPUOffloadPolicy: memplan does not plan FSDP2 offloading; drop it")
    if type(group.mesh_info).__name__ != "FSDPMeshInfo":
        raise UnplannedWrapper(
            f"{where} shards over a {type(group.mesh_info).__name__} (HSDP or replication): memplan plans a 1-D "
            "FSDP mesh only"
        )
    post = group.post_forward_mesh_info
    if post is not None and post is not group.mesh_info and post != group.mesh_info:
        raise UnplannedWrapper(
            f"{where} has reshard_after_forward as an int (resharding to a smaller mesh): memplan plans True or "
            "False only"
        )
    changed = [
        name
        for name, default in (
            ("gradient_divide_factor", None),
            ("reduce_grads", True),
            ("force_sum_reduction_for_comms", False),
            ("_all_reduce_hook", None),
        )
        if getattr(group, name, default) != default
    ]
    if changed:
        raise UnplannedWrapper(f"{where} sets {changed[0]}: memplan plans FSDP2's default gradient reduction only")


REDUCED_DTYPES = (torch.float32, torch.bfloat16)  # reduced with AVG, no pre/post-division (FSDP2's rule)


def refuse_unsupported_precision(policy: Any, dtypes: list[torch.dtype], where: str) -> None:
    """Raise :class:`UnplannedWrapper` if ``policy`` reduces gradients in a dtype FSDP2 pre- and
    post-divides (float16: ``_get_gradient_divide_factors``' overflow guard), which memplan does not
    mirror; fp32 and bf16 reductions (any ``param_dtype``, ``output_dtype``, ``cast_forward_inputs``)
    are planned. ``dtypes``: the unit's parameters' dtypes."""
    floating = [d for d in dtypes if d.is_floating_point]
    grads = {_gather_dtype(policy, d) for d in floating}
    reduce = policy.reduce_dtype if policy.reduce_dtype not in (None, policy.param_dtype) else None
    reduced = {reduce} if reduce is not None else grads
    odd = [d for d in reduced if d not in REDUCED_DTYPES]
    if odd:
        raise UnplannedWrapper(
            f"{where} reduces its gradients in {odd[0]} ({policy}), which FSDP2 pre- and "
            "post-divides: memplan plans fp32 or bf16 reductions only; set reduce_dtype=torch.float32"
        )


# ---------------------------------------------------------------- the shard model


def shard_model(model: torch.nn.Module, layout: FsdpLayout) -> torch.nn.Module:
    """The model's modules as their original classes, FSDP2's hooks left out, each sharded
    parameter a plain ``nn.Parameter`` sharing storage with its DTensor's local shard, buffers
    and other attributes the model's own (a shallow mirror: nothing is copied)."""
    local = {id(p.dtensor): p for p in layout.params}
    return _mirror(model, local, {})


def _mirror(module: torch.nn.Module, local: dict[int, FsdpParam], made: dict[int, Any]) -> torch.nn.Module:
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if isinstance(module, FSDPModule):
        cls = cls.__mro__[cls._orig_cls_mro_index]
    twin = cls.__new__(cls)
    twin.__dict__.update(module.__dict__)
    params: dict[str, Any] = {}
    for name, p in module._parameters.items():
        if p is None:
            params[name] = None
            continue
        if id(p) not in made:  # one shard parameter per DTensor: tied weights stay tied
            made[id(p)] = torch.nn.Parameter(local[id(p)].local, requires_grad=p.requires_grad)
        params[name] = made[id(p)]
    twin._parameters = params
    twin._buffers = dict(module._buffers)
    twin._modules = {n: None if c is None else _mirror(c, local, made) for n, c in module._modules.items()}
    for attr in ("_forward_pre_hooks", "_forward_hooks"):
        hooks = getattr(module, attr)
        setattr(twin, attr, OrderedDict((k, h) for k, h in hooks.items() if not _is_fsdp_hook(h)))
    for attr in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
        setattr(twin, attr, OrderedDict(getattr(module, attr)))  # the twin's own: hooks added while tracing
    return twin


def _is_fsdp_hook(hook: Any) -> bool:
    owner = getattr(hook, "__self__", None) or getattr(getattr(hook, "func", None), "__self__", None)
    return owner is not None and type(owner).__module__.startswith("torch.distributed.fsdp")


def twin_optimizer(optimizer: torch.optim.Optimizer, shards: torch.nn.Module, layout: FsdpLayout):
    """An optimizer of ``optimizer``'s class over the shard model's parameters, with its groups'
    hyper-parameters and its state's local tensors (shared storage: updates land in the user's
    DTensors and state)."""
    from torch.distributed.tensor import DTensor

    by_dtensor = {id(p.dtensor): p.name for p in layout.params}
    shard_params = dict(shards.named_parameters())
    groups = []
    for g in optimizer.param_groups:
        missing = [p for p in g["params"] if id(p) not in by_dtensor]
        if missing:
            raise MemplanError("the optimizer holds a parameter that is not one of the model's FSDP2 shards")
        groups.append({**g, "params": [shard_params[by_dtensor[id(p)]] for p in g["params"]]})
    twin = type(optimizer).__new__(type(optimizer))  # not __init__: its defaults are not all arguments
    twin.__dict__.update(optimizer.__dict__)
    twin.param_groups = groups
    twin.state = defaultdict(dict)
    for attr in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
        setattr(twin, attr, OrderedDict())  # the user's hooks expect the user's optimizer
    for p, state in optimizer.state.items():
        twin.state[shard_params[by_dtensor[id(p)]]] = {
            k: v._local_tensor if isinstance(v, DTensor) else v for k, v in state.items()
        }
    return twin


def link_state(optimizer: torch.optim.Optimizer, twin: torch.optim.Optimizer, layout: FsdpLayout) -> None:
    """Give the user's optimizer the twin's state as DTensors over the same local tensors (for the
    parameters it has no state for yet), so both always hold the same tensors."""
    by_dtensor = {id(p.dtensor): p for p in layout.params}
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    user_params = [p for g in optimizer.param_groups for p in g["params"]]
    for user, mine in zip(user_params, twin_params, strict=True):
        if user in optimizer.state or mine not in twin.state:
            continue
        fp = by_dtensor[id(user)]
        optimizer.state[user] = {
            k: _as_dtensor(v, fp) if isinstance(v, torch.Tensor) and v.shape == fp.local.shape and v.dim() else v
            for k, v in twin.state[mine].items()
        }


def _as_dtensor(local: torch.Tensor, fp: FsdpParam) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    d = fp.dtensor
    return DTensor.from_local(local, d.device_mesh, d.placements, run_check=False, shape=d.shape, stride=d.stride())


# ---------------------------------------------------------------- capture


@dataclass
class _UnitTrace:
    unit: FsdpUnit
    owners: list[tuple[torch.nn.Module, str]]
    aliases: list[list[tuple[torch.nn.Module, str]]]  # per parameter: the other places it is tied to
    shards: list[torch.Tensor] = field(default_factory=list)  # the fakes capture swapped in
    fulls: list[torch.Tensor] = field(default_factory=list)
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    gathered: bool = False
    reduced: bool = False


class Gathering:
    """While tracing: the shard model's units gather their parameters before their forward (and
    before their backward after a reshard), and reduce-scatter their gradients (module docstring)."""

    def __init__(self, shards: torch.nn.Module, layout: FsdpLayout) -> None:
        modules = dict(shards.named_modules())
        self.modules = modules
        self.units = [
            _UnitTrace(
                u,
                [(modules[p.module], p.attr) for p in u.params],
                [[(modules[m], a) for m, a in p.aliases] for p in u.params],
            )
            for u in layout.units
        ]
        self.group = fsdp_ops.register_group(layout.group)
        self.casts = layout.casts
        # storage of a gathered parameter -> (unit, index, the parameter: held, so its key is not reused)
        self._saved: dict[int, tuple[_UnitTrace, int, torch.Tensor]] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[Gathering]:
        handles = []
        self._saved = {}
        for ut in self.units:
            ut.shards = [owner._parameters[attr] for owner, attr in ut.owners]
            ut.fulls, ut.grads, ut.gathered, ut.reduced = [], {}, False, False
            module = self.modules[ut.unit.module]
            handles.append(module.register_forward_pre_hook(self._pre_forward(ut), prepend=True))
        for name, (cast_in, cast_out) in self.casts.items():
            handles += _cast_hooks(self.modules[name], cast_in, cast_out)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            for h in handles:
                h.remove()
            self._saved = {}
            for ut in self.units:
                for (owner, attr), aliases, shard in zip(ut.owners, ut.aliases, ut.shards, strict=True):
                    for module, name in [(owner, attr), *aliases]:
                        module._parameters[name] = shard
        not_reduced = [ut.unit.module or "<root>" for ut in self.units if ut.gathered and not ut.reduced]
        if not_reduced:
            raise MemplanError(
                f"unit {not_reduced[0]!r} did not get a gradient for every parameter in the backward: memplan plans "
                "FSDP2 steps in which every sharded parameter gets a gradient"
            )

    def _pre_forward(self, ut: _UnitTrace) -> Callable:
        def hook(module: torch.nn.Module, args: Any) -> None:
            if ut.gathered:
                return
            ut.gathered = True
            ut.fulls = self._gather(ut)
            for k, ((owner, attr), full, shard) in enumerate(zip(ut.owners, ut.fulls, ut.shards, strict=True)):
                full.requires_grad_(shard.requires_grad)
                for m, name in [(owner, attr), *ut.aliases[k]]:  # tied weights: every place reads it
                    m._parameters[name] = full
                if shard.requires_grad:
                    full.register_post_accumulate_grad_hook(lambda t, k=k: self._on_grad(ut, k, t))
                if ut.unit.reshard_after_forward:
                    self._saved[storage_key(full)] = (ut, k, full)

        return hook

    def _gather(self, ut: _UnitTrace) -> list[torch.Tensor]:
        rows = [p.full_shape[0] for p in ut.unit.params]
        dtypes = [p.gather_dtype for p in ut.unit.params]
        with torch.no_grad():
            return [f.detach() for f in fsdp_ops.gather_unit(ut.shards, rows, self.group, dtypes)]

    def _pack(self, t: torch.Tensor) -> Any:
        where = self._saved.get(storage_key(t))
        if where is None:
            return t
        ut, k, full = where
        return ((ut, k), t.shape, t.stride(), t.storage_offset() - full.storage_offset())

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        (ut, k), shape, stride, offset = packed
        if not ut.fulls or ut.fulls[k] is None or storage_key(ut.fulls[k]) in self._saved:
            ut.fulls = self._gather(ut)  # the backward's gather: once per unit
        base = ut.fulls[k]
        if offset:  # as_strided without an offset keeps the base's: the view stays relative to it
            base = base.reshape(-1).narrow(0, offset, base.numel() - offset)
        return base.as_strided(shape, stride)

    def _on_grad(self, ut: _UnitTrace, k: int, full: torch.Tensor) -> None:
        ut.grads[k] = full.grad
        wanted = [i for i, s in enumerate(ut.shards) if s.requires_grad]
        if len(ut.grads) < len(wanted) or ut.reduced:
            return
        ut.reduced = True
        grads = [ut.grads[i] for i in wanted]
        precision = ut.unit.precision
        with torch.no_grad():
            flat = fsdp_ops.reduce_scatter_unit(grads, self.group, precision and precision.reduce_dtype)
            if precision is not None and precision.orig_dtype not in (None, flat.dtype):
                flat = flat.to(precision.orig_dtype)  # foreach_reduce's cast of the reduced shard
            offset = 0
            numels = fsdp_ops.scatter_numels(grads, dist.get_world_size(fsdp_ops.GROUPS[self.group]))
            for i, n in zip(wanted, numels, strict=True):
                shard = ut.shards[i]
                # narrow, not as_strided: an arena view's offsets are relative to the arena
                shard.grad = flat.narrow(0, offset, shard.numel()).view(shard.shape)
                offset += n
        for i in wanted:
            owner, attr = ut.owners[i]
            owner._parameters[attr].grad = None  # the full gradient is freed, as FSDP2 does
            shard = ut.shards[i]
            for hook in (getattr(shard, "_post_accumulate_grad_hooks", None) or {}).values():
                hook(shard)  # as FSDP2's foreach_reduce calls them on the sharded parameter
        ut.grads = {}


def _cast_hooks(module: torch.nn.Module, input_dtype: torch.dtype | None, output_dtype: torch.dtype | None) -> list:
    """FSDP2's forward casts of a fully_shard-ed module under its MixedPrecisionPolicy, with FSDP2's
    own functions: its floating-point inputs (args and kwargs) to ``input_dtype`` before the forward,
    its outputs to ``output_dtype`` after it (``FSDPState._pre_forward`` / ``_post_forward``)."""
    import functools

    from torch.distributed.fsdp._fully_shard._fsdp_common import _cast_fp_tensor
    from torch.distributed.utils import _apply_to_tensors

    handles = []
    if input_dtype is not None:
        cast_in = functools.partial(_cast_fp_tensor, input_dtype)

        def pre(_: torch.nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
            return _apply_to_tensors(cast_in, args), _apply_to_tensors(cast_in, kwargs)

        handles.append(module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True))
    if output_dtype is not None:
        cast_out = functools.partial(_cast_fp_tensor, output_dtype)
        handles.append(module.register_forward_hook(lambda _m, _a, out: _apply_to_tensors(cast_out, out)))
    return handles


def capture_fsdp_step(
    shards: torch.nn.Module,
    twin: torch.optim.Optimizer,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    batch: Any,
    layout: FsdpLayout,
    *,
    recompute_copies: bool = False,
) -> Capture:
    """Capture one FSDP2 training step of the shard model (module docstring)."""
    from memplan.torch.capture.trace import call_model, capture_step

    gathering = Gathering(shards, layout)

    def step(b: tuple[Any, Any]) -> torch.Tensor:
        inputs, target = b
        with gathering.installed():
            loss = loss_fn(call_model(shards, inputs), target)
            loss.backward()
        twin.step()
        twin.zero_grad(set_to_none=True)
        return loss

    # the gathering keeps the gathered units' fakes by design: no tensor of the user's step escapes here
    return capture_step(
        step, batch, model=shards, optimizers=[twin], recompute_copies=recompute_copies, refuse_escapes=False
    )


def structure_fingerprint(capture: Capture) -> str:
    """A digest of the captured graph's structure (ops and their tensors, not sizes): every rank
    captures the same one, though a rank's last shard may be smaller."""
    digest = hashlib.sha256()
    for op in capture.graph.ops:
        digest.update(f"{op.name}|{op.kind}|{op.inputs}|{op.outputs}|{op.mutates}\n".encode())
    return digest.hexdigest()


COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")


def refuse_foreign_collectives(capture: Capture) -> None:
    """Raise :class:`UnplannedWrapper` if the captured step runs a collective of its own (the
    loss function's ``dist.all_reduce``, a DTensor redistribution): the plan would run it at a
    place chosen for memory, not where the other ranks run theirs, and would not wait for it."""
    for node in capture.gm.graph.nodes:
        namespace = getattr(node.target, "namespace", "")
        if node.op == "call_function" and namespace in COLLECTIVE_NAMESPACES:
            raise UnplannedWrapper(
                f"the step runs the collective {node.target} itself: memplan places FSDP2's all-gathers and "
                "reduce-scatters only; run other collectives outside the step (after step(batch))"
            )
