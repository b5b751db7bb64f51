"""Run a plan: the captured step, in the planned order, with every planned tensor at its
planned offset in one preallocated arena (OLLA 3.5; Sekiyama et al. 4.2: planned addresses
served at run time, no allocator search on the hot path).

Forward and backward ops are interpreted from the traced fx program on the real model's
parameters and buffers. An op writes a fresh output straight into its arena view through its
``out=`` overload when that overload has a real kernel; otherwise it computes and the result
is copied into its view (a counted fallback). The optimizer is the user's own: at the planned
position of each update group (:mod:`memplan.torch.run.updates`), the real ``optimizer.step()``
runs on that group's parameters, and every other call of a stateful object the step makes
(``scaler.step``, ``scaler.update``, ``scheduler.step``) is made for real at its place, so step
counts, learning-rate changes, skipped steps and state stay the user's objects' and numerics
equal eager PyTorch exactly. Parameters and optimizer state are never copied.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import torch.fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import torch
from memplan.errors import MemplanError
from memplan.graph.ir import Graph, TensorId
from memplan.torch.capture import Capture
from memplan.torch.capture.hf_masks import check_mask_guards
from memplan.torch.capture.inplace import real_out_variant, same_dense_layout, writing_kernel
from memplan.torch.capture.regions import only_params as _only_params
from memplan.torch.run.constants import bind_constants
from memplan.torch.run.selfcheck import SelfCheck, UnobservedCheck
from memplan.torch.run.updates import UpdateGroup, check_optimizers, update_groups
from memplan.torch.tensors import HIDDEN_WRITES, is_random, storage_key, tensor_leaves

ARENA_ALIGNMENT_BYTES = 64
EXECUTORS = ("generated", "interpreted")
_EMPTY_FACTORIES = {"aten::empty_like", "aten::empty", "aten::empty_strided", "aten::new_empty"}


@dataclass(frozen=True)
class Plan:
    """What to run: an order of the captured graph's ops and, for every planned tensor, a byte
    offset in an arena of ``arena_bytes`` (no offsets: every tensor from the allocator)."""

    order: tuple[int, ...]
    offsets: dict[TensorId, int] = field(default_factory=dict)
    arena_bytes: int = 0


@dataclass
class RunStats:
    """What one step did: bytes written in place into the arena, bytes computed then copied
    into it, and bytes left to the allocator."""

    out_bytes: int = 0
    copied_bytes: int = 0
    allocator_bytes: int = 0
    max_scratch_bytes: int = 0  # the most one op held outside the arena while it ran (see _scratch_bytes)
    inplace_bytes: int = 0  # results written into an input storage that died at their op
    copied_ops: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _Output:
    index: int  # position among the op's tensor outputs
    tensor: TensorId
    offset: int | None
    meta: torch.Tensor  # the fake value: dtype, size, stride


@dataclass(frozen=True)
class _Call:
    position: int
    node: torch.fx.Node
    fresh: tuple[_Output, ...]
    strategy: str  # "out", "kernel" (ARENA_KERNELS), "copy", "empty", "plain"
    out_op: Any = None
    out_names: tuple[str, ...] = ()
    fetch: Callable[[dict[str, Any]], Any] | None = None  # env -> (args, kwargs), see _fetcher
    inplace_arg: int = -1  # "inplace": the argument whose dying storage the result is written into

    @cached_property
    def traced_layouts(self) -> tuple[tuple[torch.Size, torch.dtype], ...]:
        """Shape and dtype of each tensor argument as traced (read on every replayed optimizer
        op, :func:`_same_call`: computed once, not per step)."""
        return tuple((t.shape, t.dtype) for a in _arg_nodes(self.node) for t in tensor_leaves(a.meta.get("val")))


@dataclass(frozen=True)
class _Update:
    position: int
    param_names: tuple[str, ...]
    grad_nodes: tuple[torch.fx.Node, ...]
    traced: tuple[_Call, ...] = ()  # the update's ops as traced, in program order
    region: int = 0  # the call it makes (Capture.regions)
    split: bool = False  # optimizer.step() on ``param_names`` only, not the whole call (run/updates.py)
    last_of_call: bool = True  # split: the call's group planned last (it makes the call's own bookkeeping)


class RunHook:
    """Extension hook: an instruction a subclass of :class:`StepRunner` adds to the program
    (``_compile`` returns it among the others), run in the planned sequence as
    ``hook.run(runner, env)``. It reads no fx value through ``env`` and frees none, so
    last uses and frees ignore it (used by :mod:`memplan.torch.distributed` for the
    all-reduce and wait of each gradient bucket)."""

    position: int = -1

    def run(self, runner: StepRunner, env: dict[str, Any]) -> None:
        raise NotImplementedError


def plannable_tensors(graph: Graph) -> list[TensorId]:
    """Tensors that live in the arena: non-persistent, non-empty storages."""
    return [TensorId(t) for t, x in enumerate(graph.tensors) if not x.persistent and x.size_bytes > 0]


class StepRunner:
    """Executes a :class:`Plan` of a captured training (or inference) step on a real model.

    ``runner(batch)`` runs one step and returns the loss (or the model output), detached and
    copied out of the arena.
    """

    def __init__(
        self,
        capture: Capture,
        plan: Plan,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        device: torch.device | str = "cpu",
        *,
        reuse_dying_inputs: bool = True,
        scaler: Any = None,
        executor: str = "generated",
        arena: torch.Tensor | None = None,
    ) -> None:
        if executor not in EXECUTORS:
            raise MemplanError(f"executor must be one of {', '.join(EXECUTORS)}, not {executor!r}")
        self.executor = executor
        self._generated: Any = None  # the GeneratedStep, written on the first generated step
        self._fetching: tuple[list, list] | None = None  # (instructions, the same with fetchers): interpreted steps
        self.capture = capture
        self.plan = plan
        self.model = model
        self.optimizers = _as_list(optimizer)
        self.optimizer = self.optimizers[0] if self.optimizers else None
        self.scaler = scaler
        self._objects = self._runtime_objects()
        self.graph = capture.graph
        self.nodes = {n.name: n for n in capture.gm.graph.nodes}
        self._check_plan()
        # zeros, not empty: the pages are mapped now, not on first touch in the first step;
        # ``arena``: a block shared with the plans of other shapes (memplan.torch.run.arena)
        if arena is not None and arena.numel() < plan.arena_bytes:
            raise MemplanError(f"the arena holds {arena.numel()} bytes, the plan needs {plan.arena_bytes}")
        self._arena = arena if arena is not None else torch.zeros(plan.arena_bytes, dtype=torch.uint8, device=device)
        self.instructions = self._compile()
        self.last_use = self._last_uses()
        self._frees = self._free_schedule()
        if not plan.offsets:
            self.instructions = [self._fresh_kernel(ins) for ins in self.instructions]
            if reuse_dying_inputs:
                self.instructions = self._write_into_dying_inputs()
        self.stats = RunStats()
        self._params = dict(model.named_parameters())
        self._buffers = dict(model.named_buffers())
        constants = bind_constants(capture, model, self.arena.device, scaler)
        self._static_constants = {b.node: b.fetch() for b in constants if b.static}
        self._live_constants = [b for b in constants if not b.static]
        self.self_check = SelfCheck(capture, model, self.optimizers, scaler)
        self._next_check: str | None = "full"
        self._unobserved: UnobservedCheck | None = None  # armed by before_step
        self.last_step_observed = False

    # ------------------------------------------------------------------ compile
    def _check_plan(self) -> None:
        from memplan.graph.check import validate_order

        validate_order(self.graph, self.plan.order)
        if self.capture.mode == "train" and len(self.optimizers) != len(self.capture.optimizers):
            raise MemplanError(
                f"the plan's step calls {len(self.capture.optimizers)} optimizer(s); give the runner the same ones"
            )
        if (self.capture.scaler is None) != (self.scaler is None):
            raise MemplanError("the plan's step uses a GradScaler exactly when the runner is given one")
        for t, offset in self.plan.offsets.items():
            size = self.graph.tensors[t].size_bytes
            if offset % ARENA_ALIGNMENT_BYTES or offset < 0 or offset + size > self.plan.arena_bytes:
                raise MemplanError(f"tensor {self.graph.tensors[t].name!r} is misplaced at offset {offset}")

    def _compile(self) -> list[_Call | _Update]:
        groups = self._update_groups_by_last_op()
        last_of_call = {g.region: op for op, g in groups.items()}  # groups come in planned order
        instructions: list[_Call | _Update] = []
        for position, op_id in enumerate(self.plan.order):
            phase = self.capture.op_phase[op_id]
            if phase in ("input", "release"):
                continue
            if phase == "optimizer":
                group = groups.get(op_id)
                if group is not None:
                    traced = tuple(self._call(-1, m) for m in group.ops if self.capture.node_of_op[m] in self.nodes)
                    grads = tuple(self.nodes[n] for n in group.grad_nodes)
                    last = last_of_call[group.region] == op_id
                    instructions.append(_Update(position, group.params, grads, traced, group.region, group.split, last))
                continue
            instructions.append(self._call(position, op_id))
        return instructions

    def _update_groups_by_last_op(self) -> dict[int, UpdateGroup]:
        """Each update group keyed by its op planned last: the update runs there, when every
        gradient it reads is ready."""
        if self.capture.mode != "train":
            return {}
        check_optimizers(self.optimizers, self.model)
        position = {op: i for i, op in enumerate(self.plan.order)}
        by_last = {max(g.ops, key=position.__getitem__): g for g in update_groups(self.capture)}
        return dict(sorted(by_last.items(), key=lambda item: position[item[0]]))

    def _runtime_objects(self) -> dict[int, Any]:
        """``id(captured object) -> the object to call``: the step may have been captured on
        other (fake) optimizers and scaler than the ones this runner is given."""
        objects: dict[int, Any] = {id(c): r for c, r in zip(self.capture.optimizers, self.optimizers, strict=False)}
        if self.capture.scaler is not None:
            objects[id(self.capture.scaler)] = self.scaler
        return objects

    def _real(self, value: Any) -> Any:
        return self._objects.get(id(value), value)

    def _call(self, position: int, op_id: int) -> _Call:
        return self._strategy(position, op_id)  # its fetcher is built when the interpreter first runs it

    def _strategy(self, position: int, op_id: int) -> _Call:
        node = self.nodes[self.capture.node_of_op[op_id]]
        fresh = tuple(self._fresh_outputs(op_id, node))
        planned = [o for o in fresh if o.offset is not None]
        if not planned:
            return _Call(position, node, fresh, "plain")
        if node.target._schema.name in _EMPTY_FACTORIES and len(fresh) == 1:
            return _Call(position, node, fresh, "empty")
        out_op, names = real_out_variant(node.target, len(tensor_leaves(node.meta.get("val"))))
        if out_op is not None and len(fresh) == len(names):
            return _Call(position, node, fresh, "out", out_op, names)
        kernel = ARENA_KERNELS.get(node.target._schema.name)
        if kernel is not None and len(fresh) == 1 and kernel.applies(node.args, node.kwargs):
            return _Call(position, node, fresh, "kernel")
        return _Call(position, node, fresh, "copy")

    def _fresh_outputs(self, op_id: int, node: torch.fx.Node) -> list[_Output]:
        """The op's outputs that are new storages (views and in-place results are not)."""
        leaves = tensor_leaves(node.meta.get("val"))
        tensor_of = self.capture.tensor_of_storage
        outputs = []
        for index, leaf in enumerate(leaves):
            t = tensor_of.get(storage_key(leaf))
            if t is not None and self.graph.producer[t] == op_id and self.graph.tensors[t].size_bytes > 0:
                outputs.append(_Output(index, t, self.plan.offsets.get(t), leaf))
        return outputs

    def _last_uses(self) -> dict[str, int]:
        last: dict[str, int] = {}
        for ins in self.instructions:
            if isinstance(ins, RunHook):
                continue
            nodes = list(ins.grad_nodes) if isinstance(ins, _Update) else _arg_nodes(ins.node)
            for n in nodes:
                last[n.name] = max(last.get(n.name, -1), ins.position)
        output = next(n for n in self.capture.gm.graph.nodes if n.op == "output")
        for n in _arg_nodes(output):
            last[n.name] = len(self.plan.order)
        return last

    def _fresh_kernel(self, ins: _Call | _Update) -> _Call | _Update:
        """Use an :data:`ARENA_KERNELS` kernel (writing into a fresh output) where one applies:
        it needs less scratch than PyTorch's own CPU kernel and gives the same bits."""
        if not isinstance(ins, _Call) or len(ins.fresh) != 1:
            return ins
        kernel = ARENA_KERNELS.get(ins.node.target._schema.name)
        if kernel is None or not kernel.applies(ins.node.args, ins.node.kwargs):
            return ins
        return replace(ins, strategy="kernel")

    def _write_into_dying_inputs(self) -> list[_Call | _Update]:
        """Chen et al. 4.1's in-place sharing: an elementwise op whose input storage dies at it
        (no later reader, not a parameter, state or batch storage) writes its result into that
        storage through its out= kernel, so the step needs one buffer less there. The kernel is
        the same, so the numbers are too."""
        storage_last = self._storage_last_uses()
        rewritten: list[_Call | _Update] = []
        for ins in self.instructions:
            if isinstance(ins, _Call) and ins.strategy == "plain":
                index = self._dying_input(ins, storage_last)
                if index is not None:
                    out_op, names = real_out_variant(ins.node.target, 1, ins.node.meta["val"].device.type)
                    ins = replace(ins, strategy="inplace", out_op=out_op, out_names=names, inplace_arg=index)
            rewritten.append(ins)
        return rewritten

    def _storage_last_uses(self) -> dict[int, int]:
        """Storage key -> the last position at which any value on it is read."""
        last: dict[int, int] = {}
        for name, position in self.last_use.items():
            for leaf in tensor_leaves(self.nodes[name].meta.get("val")):
                key = storage_key(leaf)
                last[key] = max(last.get(key, -1), position)
        return last

    def _dying_input(self, ins: _Call, storage_last: dict[int, int]) -> int | None:
        node = ins.node
        out = node.meta.get("val")
        if len(ins.fresh) != 1 or writing_kernel(node) is None:
            return None
        keys = [storage_key(v) for a in _arg_nodes(node) for v in tensor_leaves(a.meta.get("val"))]
        for index, arg in enumerate(node.args):
            value = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
            if not isinstance(value, torch.Tensor) or not same_dense_layout(value, out):
                continue
            key = storage_key(value)
            t = self.capture.tensor_of_storage.get(key)
            if t is None or self.graph.tensors[t].persistent or storage_last.get(key) != ins.position:
                continue
            if keys.count(key) == sum(1 for a in node.args if a is arg):  # read through no other view
                return index
        return None

    @property
    def arena(self) -> torch.Tensor:
        return self._arena

    @arena.setter
    def arena(self, block: torch.Tensor) -> None:
        """A new arena block (the shared arena grew or shrank): the generated step, which has
        its views into the old block bound in, is written again on the next step."""
        self._arena = block
        self._generated = None

    # ------------------------------------------------------------------ run
    def __call__(self, batch: Any) -> Any:
        """Run one step; the first one (and one after :meth:`request_self_check`) under the
        self-check of :mod:`memplan.torch.run.selfcheck`."""
        if self.capture.mask_guards:
            check_mask_guards(self.capture.mask_guards, pytree.tree_leaves(batch))
        check, self._next_check = self._next_check, None
        unobserved = check == "full" and self._unobserved is not None
        self.last_step_observed = check == "full" and not unobserved
        if check is None:
            return self.run_step(batch)
        with self.self_check.watch(observe_ops=check == "full", unobserved=self._unobserved if unobserved else None):
            return self.run_step(batch)

    # whether the first step's full check may do without a dispatch mode (before_step); a
    # subclass whose first step runs otherwise than its later ones (remat's) keeps the mode
    unobserved_first_check = True

    def before_step(self) -> bool:
        """Before the planned CPU allocator records or replays a step, outside its recording:
        the program is written (writing it runs ops), and where the next step's full check can
        do without a dispatch mode (:meth:`SelfCheck.unobserved_possible`, no arena views: an
        optimizer's in-place ops served by out= variants move no version counter) the random
        generator's state is taken for it: that step's allocations are then its own, so its
        recording stands for the later steps' (issue 37). :meth:`after_step` checks the state.
        True when the program was written now."""
        wrote = self.prepare()
        self._unobserved = None
        if self._next_check != "full" or not self.unobserved_first_check:
            return wrote
        cpu = not self.plan.offsets and self.arena.device.type == "cpu"
        if cpu and self._random_ops_all_called and self.self_check.unobserved_possible():
            self._unobserved = UnobservedCheck()
            self._unobserved.before()
        return wrote

    @cached_property
    def _random_ops_all_called(self) -> bool:
        """Whether every random op of the captured program is one the runtime calls itself
        (through :meth:`_watched`), none inside an update it hands to the user's optimizer."""
        called = sum(1 for ins in self.instructions if isinstance(ins, _Call) and is_random(ins.node.target))
        return called == len(self.self_check.expected.random_ops)

    def after_step(self) -> None:
        """After a step :meth:`before_step` prepared, outside the recording: the random
        generator's state checked (raises :class:`memplan.errors.SelfCheckFailed`)."""
        check, self._unobserved = self._unobserved, None
        if check is not None:
            check.after()

    def _watched(self, fn: Callable[..., Any], op: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, the call of ``op`` (a random op, or one that writes an
        argument its schema does not mark: :func:`watched_op`), noted for the unobserved check
        when one is armed (:meth:`before_step`); nothing it notes allocates a tensor."""
        check = self._unobserved
        if check is None:
            return fn(*args, **kwargs)
        return check.call(fn, op, args, kwargs)

    def prepare(self) -> bool:
        """Write the generated program now, not in the next step: writing it runs ops (on meta
        tensors, and a few CPU scalars), which a recording of the step must not log (issue 37).
        True when it was written now."""
        if self.executor != "generated" or self._generated is not None:
            return False
        self.generated_step()
        return True

    def request_self_check(self) -> None:
        """Check the next step's optimizer state and gradients (the planned allocator asks for
        its first replay; the ops were observed on the first step, which ran the same program)."""
        self._next_check = self._next_check or "light"

    @torch.no_grad()
    def run_step(self, batch: Any) -> Any:
        """Run one step; the backward is in the program, so autograd stays off. The generated
        executor (:mod:`memplan.torch.run.codegen`) runs the instructions as one Python
        function; the interpreted one walks them (the reference)."""
        env: dict[str, Any] = {}
        self._bind_inputs(env, batch)
        if self.executor == "generated":
            generated = self.generated_step()
            self.stats = RunStats(**generated.static_stats)
            return self._finish(generated.function(env, self))
        self.stats = RunStats()
        frees = self._frees
        plain = not self.plan.offsets  # the planned allocator serves addresses: ops run as they are
        for ins in self._interpreted_instructions():
            if isinstance(ins, RunHook):
                ins.run(self, env)
                continue
            if isinstance(ins, _Update):
                self._update(ins, env)
            elif plain:
                args, kwargs = ins.fetch(env)
                if ins.strategy == "inplace":
                    into = {ins.out_names[0]: args[ins.inplace_arg]}
                    if watched_op(ins.node.target):
                        result = self._watched(ins.out_op, ins.node.target, *args, **kwargs, **into)
                    else:
                        result = ins.out_op(*args, **kwargs, **into)
                    self.stats.inplace_bytes += result.untyped_storage().nbytes()
                elif ins.strategy == "kernel":
                    meta = ins.fresh[0].meta
                    result = torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device=meta.device)
                    ARENA_KERNELS[ins.node.target._schema.name].write(result, *args, **kwargs)
                elif watched_op(ins.node.target):
                    result = self._watched(ins.node.target, ins.node.target, *args, **kwargs)
                else:
                    result = ins.node.target(*args, **kwargs)
                _store(ins.node, result, env)
            else:
                _store(ins.node, self._execute(ins, env), env)
            for name in frees.get(ins.position, ()):
                env.pop(name, None)
        return self._result(env)

    def _interpreted_instructions(self) -> list[_Call | _Update | RunHook]:
        """The instructions with each call's fetcher (:func:`_fetcher`), built on the first
        interpreted step: the generated executor needs none, and a step's thousands of closures
        would stay resident for nothing (issue 15: memplan's RSS beyond its plan)."""
        cached = self._fetching
        if cached is None or cached[0] is not self.instructions:
            bound = [_with_fetcher(ins) for ins in self.instructions]
            cached = self._fetching = (self.instructions, bound)
        return cached[1]

    def generated_step(self) -> Any:
        """The step written as one function (generated once, on first use)."""
        if self._generated is None:
            from memplan.torch.run.codegen import generate

            self._generated = generate(self)
        return self._generated

    def _free_schedule(self) -> dict[int, list[str]]:
        frees: dict[int, list[str]] = {}
        for name, position in self.last_use.items():
            if self.nodes[name].op == "call_function":
                frees.setdefault(position, []).append(name)
        return frees

    def _bind_inputs(self, env: dict[str, Any], batch: Any) -> None:
        flat, spec = pytree.tree_flatten(batch)
        placeholders = [n for n in self.capture.gm.graph.nodes if n.op == "placeholder"]
        if spec != self.capture.batch_spec or len(flat) != len(placeholders):
            raise MemplanError("the batch does not have the structure of the example batch the plan was made for")
        for position, (node, value) in enumerate(zip(placeholders, flat, strict=True)):
            _check_batch_leaf(position, value, node.meta.get("val"), self.capture.batch_constants)
            env[node.name] = value
        env.update(self._static_constants)
        for binding in self._live_constants:
            env[binding.node] = binding.fetch()

    def _execute(self, ins: _Call, env: dict[str, Any]) -> Any:
        args, kwargs = ins.fetch(env)
        return self._place_call(ins, ins.node.target, args, kwargs)

    def _place_call(self, ins: _Call, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """Run ``func`` so that its fresh outputs land at their planned arena views."""
        self.stats.max_scratch_bytes = max(self.stats.max_scratch_bytes, _scratch_bytes(ins, args))
        if ins.strategy == "plain":
            self._count_allocator(ins)
            return func(*args, **kwargs)
        views = {o.index: self._view(o) for o in ins.fresh if o.offset is not None}
        if ins.strategy == "empty":
            self.stats.out_bytes += _nbytes(ins.fresh[0])
            return views[ins.fresh[0].index]
        if ins.strategy == "out":
            outs = {name: views[o.index] for name, o in zip(ins.out_names, ins.fresh, strict=True)}
            result = ins.out_op(*args, **kwargs, **outs)
            self.stats.out_bytes += sum(_nbytes(o) for o in ins.fresh)
            return _with_views(ins.node.meta.get("val"), result, views)
        if ins.strategy == "kernel":
            ARENA_KERNELS[func._schema.name].write(views[ins.fresh[0].index], *args, **kwargs)
            self.stats.out_bytes += _nbytes(ins.fresh[0])
            return views[ins.fresh[0].index]
        result = func(*args, **kwargs)
        leaves = tensor_leaves(result)
        for o in ins.fresh:
            if o.offset is not None:
                views[o.index].copy_(leaves[o.index])
                self.stats.copied_bytes += _nbytes(o)
                key = str(ins.node.target)
                self.stats.copied_ops[key] = self.stats.copied_ops.get(key, 0) + _nbytes(o)
        return _with_views(ins.node.meta.get("val"), result, views)

    def _count_allocator(self, ins: _Call) -> None:
        self.stats.allocator_bytes += sum(_nbytes(o) for o in ins.fresh)

    def _view(self, output: _Output) -> torch.Tensor:
        meta = output.meta
        nbytes = meta.untyped_storage().nbytes()
        raw = self.arena[output.offset : output.offset + nbytes]
        typed = raw.view(meta.dtype)
        # as_strided's offset counts from the start of the arena's storage, not of the slice
        return typed.as_strided(meta.shape, meta.stride(), typed.storage_offset() + meta.storage_offset())

    def _update(self, ins: _Update, env: dict[str, Any]) -> None:
        """Make one call of the step's stateful objects (an optimizer's update of one group of
        parameters whose gradients are ready, OLLA 4.3; a scaler's step; ...) for real, with
        the gradients of that moment set as ``.grad`` for the call only."""
        self._update_with(ins, [_resolve(grad_node, env) for grad_node in ins.grad_nodes])

    def _update_with(self, ins: _Update, grads: Sequence[torch.Tensor]) -> None:
        """:meth:`_update` with the gradients given (the generated executor's call)."""
        params = [self._params[name] for name in ins.param_names]
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        region = self.capture.regions[ins.region]
        replay = _ReplayIntoArena(self, ins.traced) if self.plan.offsets else contextlib.nullcontext()
        try:
            if ins.split and region.kind == "scaler.step":
                with replay:
                    self._scaler_step_on(region, params, ins.last_of_call)
            elif ins.split:
                optimizer = self._real(region.owner)
                with _only_params(optimizer, params), replay:
                    optimizer.step(*region.args, **region.kwargs)
            else:
                args = tuple(self._real(a) for a in region.args)
                kwargs = {k: self._real(v) for k, v in region.kwargs.items()}
                with replay:
                    getattr(self._real(region.owner), region.method)(*args, **kwargs)
        finally:
            for param in params:
                param.grad = None

    def _scaler_step_on(self, region: Any, params: Sequence[torch.Tensor], last: bool) -> None:
        """``scaler.step(optimizer)`` for ``params`` only (run/updates.py, ``scaler_step_splits``):
        the call's group planned last makes the real ``scaler.step`` (its checks, its stage
        bookkeeping); the groups before it make what that call does to their parameters,
        GradScaler's own ``_maybe_opt_step`` (the update unless a gradient was not finite)."""
        scaler = self._real(region.owner)
        args = tuple(self._real(a) for a in region.args)
        optimizer, rest = args[0], args[1:]
        with _only_params(optimizer, params):
            if last:
                scaler.step(optimizer, *rest, **region.kwargs)
            elif not scaler.is_enabled():
                optimizer.step(*rest, **region.kwargs)
            else:
                state = scaler._per_optimizer_states[id(optimizer)]
                if state["stage"].name != "UNSCALED":
                    raise MemplanError(
                        "scaler.step() was split by parameter but its gradients were not unscaled first; "
                        "call scaler.unscale_(optimizer) before it in the step"
                    )
                scaler._maybe_opt_step(optimizer, state, *rest, **region.kwargs)

    def _result(self, env: dict[str, Any]) -> Any:
        output_node = next(n for n in self.capture.gm.graph.nodes if n.op == "output")
        return self._finish(_resolve(output_node.args[0], env))

    def _finish(self, result: Any) -> Any:
        """The step's result, copied out of the arena, in the structure the user's step returned
        (a tuple, a dict, a named tuple, ...): the traced program returns its leaves, flat, and
        make_fx kept the structure (``out_spec``)."""
        copied = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), result)
        spec = out_spec(self.capture.gm)
        if spec is not None and isinstance(copied, (list, tuple)) and spec.num_leaves == len(copied):
            return pytree.tree_unflatten(list(copied), spec)
        if isinstance(copied, (list, tuple)) and len(copied) == 1:
            return copied[0]
        return copied


def watched_op(op: Any) -> bool:
    """Whether the runtime calls ``op`` through ``StepRunner._watched``: it may draw random
    numbers, or write an argument its schema does not mark (the self-check's unobserved form
    follows those calls, :class:`memplan.torch.run.selfcheck.UnobservedCheck`)."""
    schema = getattr(op, "_schema", None)
    return schema is not None and (is_random(op) or schema.name in HIDDEN_WRITES)


class _ReplayIntoArena(TorchDispatchMode):
    """While the user's optimizer updates one parameter, serve each op's fresh outputs at the
    arena views planned for the traced op in the same position of the sequence (Sekiyama et
    al. 4.2: replay the profiled allocation sequence with planned addresses). The scalars the
    optimizer computes in Python (step sizes) are its own, so numerics are eager's. If the
    sequence ever differs from the trace, the rest of the update uses the allocator."""

    def __init__(self, runner: StepRunner, traced: Sequence[_Call]) -> None:
        super().__init__()
        self.runner = runner
        self.traced = list(traced)
        self.next = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "namespace", "") == "profiler":  # dropped from the trace too
            return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:  # a Python number, allocates nothing
            if self.next < len(self.traced) and self.traced[self.next].node.target is func:
                self.next += 1
            return func(*args, **kwargs)
        if self.next < len(self.traced) and _same_call(self.traced[self.next], func, args, kwargs):
            ins = self.traced[self.next]
            self.next += 1
            return self.runner._place_call(ins, func, args, kwargs)
        self.next = len(self.traced)  # diverged: stop replaying
        result = func(*args, **kwargs)
        inputs = {t.untyped_storage()._cdata for t in tensor_leaves((args, kwargs))}
        self.runner.stats.allocator_bytes += sum(
            t.untyped_storage().nbytes() for t in tensor_leaves(result) if t.untyped_storage()._cdata not in inputs
        )
        return result


def _same_call(traced: _Call, func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """The real call is the traced one: same op, and tensor arguments of the same shapes and
    dtypes, in the same places."""
    if traced.node.target is not func:
        return False
    real: list[torch.Tensor] = []
    _tensors_in((args, kwargs), real)
    layouts = traced.traced_layouts
    return len(real) == len(layouts) and all(
        r.shape == shape and r.dtype == dtype for r, (shape, dtype) in zip(real, layouts, strict=True)
    )


def _tensors_in(value: Any, found: list[torch.Tensor]) -> None:
    """The tensors in an op's arguments, in :func:`tensor_leaves`'s order (tuples, lists and
    dicts are all an ATen call's arguments hold), without pytree's generic walk: this runs for
    every op of every replayed optimizer update."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _tensors_in(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors_in(item, found)


# ---------------------------------------------------------------------- helpers


def _check_batch_leaf(position: int, value: Any, expected: Any, constants: dict[int, Any]) -> None:
    """A batch leaf fits the plan: a tensor of the traced shape and dtype, or the very value
    (``None``, a flag) the step was traced with."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(value, torch.Tensor):
            raise MemplanError(f"batch leaf {position} is {type(value).__name__} where the plan has a tensor")
        if value.shape != expected.shape or value.dtype != expected.dtype:
            raise MemplanError(
                f"batch tensor of shape {tuple(value.shape)} {value.dtype} does not match the plan's "
                f"{tuple(expected.shape)} {expected.dtype}: make a plan for this shape"
            )
        return
    if position in constants and not _same_constant(value, constants[position]):
        raise MemplanError(
            f"batch leaf {position} is {value!r} where the plan was traced with {constants[position]!r}: "
            "a batch value that is not a tensor is fixed in the plan; make a plan for this value"
        )


def _same_constant(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # a value without a plain equality: only the same object is the same
        return a is b


def allocator_tensors(capture: Capture) -> set[TensorId]:
    """Fresh outputs of forward/backward ops that cannot write into the arena (no real out=
    kernel, no arena kernel, not an empty factory): the runtime leaves them to the allocator
    rather than computing them aside and copying them in, which would hold them twice."""
    graph = capture.graph
    nodes = {n.name: n for n in capture.gm.graph.nodes}
    left: set[TensorId] = set()
    for op_id, phase in enumerate(capture.op_phase):
        if phase not in ("forward", "backward"):
            continue
        node = nodes[capture.node_of_op[op_id]]
        outputs = [t for t in graph.ops[op_id].outputs if graph.tensors[t].size_bytes > 0]
        if outputs and not _writes_into_arena(node, len(outputs)):
            left.update(TensorId(t) for t in outputs)
    return left


def _writes_into_arena(node: torch.fx.Node, num_fresh: int) -> bool:
    name = node.target._schema.name
    if name in _EMPTY_FACTORIES:
        return True
    kernel = ARENA_KERNELS.get(name)
    if kernel is not None and num_fresh == 1 and kernel.applies(node.args, node.kwargs):
        return True
    out_op, names = real_out_variant(node.target, len(tensor_leaves(node.meta.get("val"))))
    return out_op is not None and len(names) == num_fresh


def optimizer_update_groups(capture: Capture) -> list[tuple[int, ...]]:
    """The ops of each update group, which the runtime runs together (see
    :func:`memplan.pipeline.make_groups_contiguous` and :mod:`memplan.torch.run.updates`)."""
    return [g.ops for g in update_groups(capture)]


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


@dataclass(frozen=True)
class ArenaKernel:
    """Writes an op's output straight into its arena view where PyTorch has no real out=
    kernel; ``applies(node_args, node_kwargs)`` decides at compile time, bit-exactness is
    tested."""

    applies: Callable[..., bool]
    write: Callable[..., None]


def _embedding_backward_into(out: torch.Tensor, grad, indices, num_weights, padding_idx, scale_grad_by_freq) -> None:
    """CPU's ``embedding_dense_backward`` is zeros, then one ``add_`` per index in index order,
    which ``index_add_`` reproduces bit for bit; the padding row stays zero."""
    out.zero_().index_add_(0, indices.reshape(-1), grad.reshape(-1, out.shape[-1]))
    if padding_idx >= 0:
        out[padding_idx] = 0


def _to_copy_applies(args: tuple, kwargs: dict | None = None) -> bool:
    """A dtype (or layout-preserving) conversion on the input's own device: no pinned memory,
    no other layout (the arena view is a dense strided tensor on the arena's device)."""
    kwargs = kwargs or {}
    source = args[0].meta.get("val") if isinstance(args[0], torch.fx.Node) else args[0]
    device = kwargs.get("device")
    return (
        isinstance(source, torch.Tensor)
        and kwargs.get("layout") in (None, torch.strided)
        and not kwargs.get("pin_memory")
        and (device is None or torch.device(device) == source.device)
    )


def _to_copy_into(out: torch.Tensor, source: torch.Tensor, **options: Any) -> None:
    """``aten::_to_copy`` is an empty output of the traced dtype and strides, then
    ``copy_(source)`` (ATen's ``_to_copy``): the same copy into the arena view is the same bits."""
    out.copy_(source, non_blocking=bool(options.get("non_blocking", False)))


def _embedding_backward_applies(args: tuple, kwargs: dict | None = None) -> bool:
    """Without ``scale_grad_by_freq``, on the CPU only: CUDA's kernel sums in another order (and
    its ``index_add_`` is not deterministic), so there the op runs as it is."""
    grad = args[0].meta.get("val") if args and isinstance(args[0], torch.fx.Node) else (args or (None,))[0]
    return len(args) > 4 and args[4] is False and isinstance(grad, torch.Tensor) and grad.device.type == "cpu"


ARENA_KERNELS = {
    "aten::embedding_dense_backward": ArenaKernel(applies=_embedding_backward_applies, write=_embedding_backward_into),
    "aten::_to_copy": ArenaKernel(applies=_to_copy_applies, write=_to_copy_into),
}

_WEIGHT_ARGUMENT = {"aten::convolution": 1, "aten::convolution_backward": 2}


# A reduced loss whose CPU kernel materialises the unreduced loss (issue 33): the index of its
# ``reduction`` argument, and how many buffers of the unreduced loss's size it holds while it runs
# through its out= variant (the views path's "out") and through the functional kernel (whose
# 0-dim result comes back in one of them: "copy", "plain"). Measured with PyTorch 2.13's CPU
# kernels (tests/torch/test_remat_views_peak.py checks each against the allocator's peak).
UNREDUCED_LOSSES = {
    "aten::mse_loss": (2, 1, 2),
    "aten::smooth_l1_loss": (2, 1, 2),
    "aten::huber_loss": (2, 0, 1),
    "aten::binary_cross_entropy": (3, 0, 1),
    "aten::soft_margin_loss": (2, 0, 1),
}


def _scratch_bytes(ins: _Call, args: Any) -> int:
    """Bytes one op holds outside the arena while it runs: outputs computed before their copy
    into the arena, the unreduced loss a reduced loss's kernel materialises
    (:func:`unreduced_loss_bytes`: MSE's 128 KiB for a 0-dim loss of 512 x 64 inputs), and, for a
    CPU convolution, the copy of its weight that oneDNN makes in its blocked layout on every call
    (measured: as large as the weight; eager pays it too)."""
    scratch = sum(_nbytes(o) for o in ins.fresh if ins.strategy == "copy" and o.offset is not None)
    scratch += unreduced_loss_bytes(ins.node, through_out=ins.strategy == "out")
    position = _WEIGHT_ARGUMENT.get(ins.node.target._schema.name)
    if position is not None and isinstance(args[position], torch.Tensor):
        scratch += args[position].untyped_storage().nbytes()
    return scratch


def out_spec(gm: torch.fx.GraphModule) -> pytree.TreeSpec | None:
    """The structure of what the traced step returned (make_fx's pytree code generation), if kept."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    return getattr(info, "out_spec", None)


def unreduced_loss_bytes(node: torch.fx.Node, *, through_out: bool) -> int:
    """What a reduced loss's CPU kernel (:data:`UNREDUCED_LOSSES`) holds beyond its traced output
    while it runs: buffers of the unreduced loss (its inputs' broadcast shape, the output's dtype);
    0 for any other op, for ``reduction="none"`` (the output is the unreduced loss) and off the
    CPU. ``through_out``: called through its out= variant, else the functional kernel."""
    known = UNREDUCED_LOSSES.get(getattr(getattr(node.target, "_schema", None), "name", ""))
    out = node.meta.get("val")
    if known is None or not isinstance(out, torch.Tensor) or out.device.type != "cpu":
        return 0
    index, with_out, functional = known
    reduction = node.args[index] if len(node.args) > index else node.kwargs.get("reduction", 1)
    inputs = [a.meta.get("val") for a in node.args[:2] if isinstance(a, torch.fx.Node)]
    if reduction == 0 or len(inputs) != 2 or not all(isinstance(x, torch.Tensor) for x in inputs):
        return 0
    numel = torch.Size(torch.broadcast_shapes(inputs[0].shape, inputs[1].shape)).numel()
    return (with_out if through_out else functional) * numel * out.element_size() + LOSS_REDUCTION_BYTES


LOSS_REDUCTION_BYTES = 64
"""The reduction's own small temporaries inside a reduced loss's kernel (0-dim intermediates:
8-16 bytes measured), counted beside its unreduced buffers (:func:`unreduced_loss_bytes`)."""


def _nbytes(output: _Output) -> int:
    return output.meta.untyped_storage().nbytes()


def _with_views(meta_value: Any, result: Any, views: dict[int, torch.Tensor]) -> Any:
    """``result`` with its fresh tensor outputs replaced by their arena views."""
    if isinstance(meta_value, torch.Tensor):
        return views.get(0, result)
    if isinstance(result, (tuple, list)):
        out, index = [], 0
        for item in result:
            if isinstance(item, torch.Tensor):
                out.append(views.get(index, item))
                index += 1
            else:
                out.append(item)
        return type(result)(out)
    return result


def _store(node: torch.fx.Node, value: Any, env: dict[str, Any]) -> None:
    """Keep an op's result; a tuple read only through getitem is kept element by element, so
    each element is dropped at its own last use, not at the last use of any of them."""
    users = list(node.users)
    if isinstance(value, (tuple, list)) and users and all(u.target is operator.getitem for u in users):
        for user in users:
            env[user.name] = value[user.args[1]]
    else:
        env[node.name] = value


def _arg_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, torch.fx.Node)]


def _with_fetcher(ins: Any) -> Any:
    if isinstance(ins, _Call) and ins.fetch is None:
        return replace(ins, fetch=_fetcher((ins.node.args, ins.node.kwargs)))
    return ins


def _fetcher(value: Any) -> Callable[[dict[str, Any]], Any]:
    """A function ``env -> value`` with every fx node in ``value`` replaced by its result, built
    once per op so that running a step does not walk argument trees (as :func:`_resolve` does)."""
    if isinstance(value, torch.fx.Node):
        node = value
        if node.target is operator.getitem:
            return lambda env: _resolve(node, env)
        name = node.name
        return lambda env: env[name]
    if isinstance(value, (list, tuple)) and _has_node(value):
        parts = [_fetcher(v) for v in value]
        kind = tuple if isinstance(value, tuple) else list
        return lambda env: kind([part(env) for part in parts])
    if isinstance(value, dict) and _has_node(value):
        items = [(k, _fetcher(v)) for k, v in value.items()]
        return lambda env: {k: part(env) for k, part in items}
    return lambda env: value


def _has_node(value: Any) -> bool:
    return any(isinstance(leaf, torch.fx.Node) for leaf in pytree.tree_leaves(value))


def _resolve(value: Any, env: dict[str, Any]) -> Any:
    # no recursive closure: one would be a reference cycle holding ``env`` (the step's
    # tensors) alive until the garbage collector runs
    return pytree.tree_map_only(torch.fx.Node, lambda node: _lookup(node, env), value)


def _lookup(node: torch.fx.Node, env: dict[str, Any]) -> Any:
    if node.target is operator.getitem and node.name not in env:
        return _lookup(node.args[0], env)[node.args[1]]
    return env[node.name]
