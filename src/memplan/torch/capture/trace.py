"""Capture one training or inference step of a real PyTorch model as a memplan Graph.

The step is traced with ``make_fx`` on FakeTensors, so sizes come without allocating: the
forward, the backward in autograd order and the optimizer's updates after the whole backward,
exactly the order eager PyTorch runs them (OLLA 2.1: the whole training step as one graph).

Memplan models *storages*, not tensor objects: a view or an in-place result shares its base's
storage and counts once. Such a result becomes a 0-byte alias handle that orders its readers
after the op that made it. In-place writes (schema ``is_write``, plus BatchNorm's running
statistics, which ``native_batch_norm`` writes although its schema does not say so) are
ordered against the other readers of the storage by control edges (read-after-write,
write-after-read, write-after-write); random ops are chained so their relative order, and so
the random stream, never changes.

The fake runs change nothing of the user's: a real tensor the step writes (an EMA, a counter)
and the random generators are put back after them (:func:`.fake.real_writes_undone`,
:mod:`.generator`). What a replay could not do as eager does is refused in one line: setting
the generator inside the step (:mod:`.generator`), Python numbers that change from one run to
the next (:func:`.literals.check_scalars_repeat`), stepping an LR scheduler memplan was not
given or changing the optimizers' hyper-parameters from one run to the next (:mod:`.hyper`),
keeping a tensor it made outside itself (:mod:`.escape`), calling a ``torch.compile``d function
(:mod:`.compiled`),
reading a value a stateful call computed (:func:`_read_region_writes_from_their_targets`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

import torch
from memplan.errors import CaptureError, DataDependentControlFlow, DynamicShape, MemplanError, UnsupportedOp
from memplan.graph.check import validate_graph
from memplan.graph.ir import Category, Graph, Op, OpId, Tensor, TensorId
from memplan.torch.capture.casts import guarded_casts
from memplan.torch.capture.compiled import watching_compiled_calls
from memplan.torch.capture.escape import held_by_program, refuse_escaped
from memplan.torch.capture.fake import (
    CaptureFakeMode,
    fake_clone_module,
    fake_mode_of,
    new_fake_mode,
    real_writes_undone,
    take_literals,
)
from memplan.torch.capture.frames import user_location
from memplan.torch.capture.generator import watching_generators
from memplan.torch.capture.hf_masks import MaskGuard, follow_mask_shortcuts
from memplan.torch.capture.hyper import watching_hyperparameters
from memplan.torch.capture.literals import check_literals_repeat, check_scalars_repeat, same_literals
from memplan.torch.capture.marks import BACKWARD_MARK, CALL_KIND, CALL_MARK, RELEASE_KIND
from memplan.torch.capture.regions import GRADIENT_METHODS, CallRegion, RegionRecorder
from memplan.torch.capture.steady import (
    SteadyRecord,
    eligible,
    jsonable,
    literal_counts,
    record_key_parts,
    warm_optimizers,
)
from memplan.torch.capture.swap import SCALER_TENSORS, FakeSwap
from memplan.torch.capture.wrappers import refuse_unplanned_wrappers
from memplan.torch.tensors import is_random, storage_key, tensor_leaves, written_storages

LossFn = Callable[[Any, Any], torch.Tensor]

_SKIPPED_NAMESPACES = ("profiler",)


@dataclass
class Capture:
    """A captured step: the graph, the fx program it came from, and how they correspond."""

    graph: Graph
    gm: torch.fx.GraphModule
    mode: str
    capture_seconds: float
    node_of_op: list[str] = field(default_factory=list)
    tensor_of_storage: dict[int, TensorId] = field(default_factory=dict)
    op_phase: list[str] = field(default_factory=list)  # "input", "forward", "backward", "optimizer"
    grad_storage_by_param: dict[str, int] = field(default_factory=dict)  # param name -> storage key
    batch_spec: Any = None  # pytree spec of the flattened batch the step takes
    # position in the flattened batch -> a leaf that is not a tensor (None, a flag): the trace
    # fixed its value, so a batch must bring the same one (see batch_constants)
    batch_constants: dict[int, Any] = field(default_factory=dict)
    # HF's mask shortcuts decided from the example batch: later batches must decide the same
    mask_guards: list[Any] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)  # copies run again in the backward (recompute.py)
    # (node, argument) of each op that writes its result over a dying input (inplace.py)
    written_into: list[tuple[str, int]] = field(default_factory=list)
    fused_loss: list[str] = field(default_factory=list)  # the loss's backward fused (capture/fused.py)
    # param name -> {state key: ("tensor", shape, dtype) or ("value", type name)}: the optimizer
    # state as eager's step leaves it (read off the fake optimizer after the traced step)
    optimizer_state_meta: dict[str, dict[str, tuple]] = field(default_factory=dict)
    optimizer_scalar_stand_ins: int = 0  # tensor values the traced optimizer read (see OptimizerScalars)
    regions: list[CallRegion] = field(default_factory=list)  # calls of stateful objects (regions.py)
    op_region: list[int] = field(default_factory=list)  # op -> index of the call it belongs to, -1 if none
    fake_runs: int = 2  # runs of the step on fakes: 1 when a capture at another shape stood for the untraced one
    # the step leaves gradients and its next call clears them before its backward (zero_grad()
    # first, the tutorials' order): the planned step frees them (see _check_gradients_left)
    leaves_gradients: bool = False
    # modules the step called that are not the model's (a frozen teacher): each one's weak
    # reference and its modes at capture (see outside_modes); another mode needs another capture
    outside_modules: list[tuple[weakref.ref, tuple]] = field(default_factory=list)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    scaler: Any = None


def call_model(model: torch.nn.Module, inputs: Any) -> Any:
    """``model(*inputs)`` for a tuple, ``model(**inputs)`` for a dict, else ``model(inputs)``."""
    if isinstance(inputs, tuple):
        return model(*inputs)
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(inputs)


def capture_train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    batch: tuple[Any, Any],
    *,
    name: str = "",
    recompute_copies: bool = False,
    write_into_dying: bool = True,
) -> Capture:
    """Capture ``loss = loss_fn(model(inputs), target); loss.backward(); optimizer.step();
    optimizer.zero_grad(set_to_none=True)`` for ``batch = (inputs, target)``: the short form
    of :func:`capture_step`."""
    return capture_step(
        standard_step(model, optimizer, loss_fn),
        batch,
        model=model,
        optimizers=[optimizer],
        name=name,
        recompute_copies=recompute_copies,
        write_into_dying=write_into_dying,
    )


def standard_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn) -> Callable[[Any], Any]:
    """The step :func:`memplan.compile_step` plans, as a step function of ``(inputs, target)``."""

    def step(batch: tuple[Any, Any]) -> torch.Tensor:
        inputs, target = batch
        loss = loss_fn(call_model(model, inputs), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def capture_step(
    fn: Callable[[Any], Any],
    batch: Any,
    *,
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    scaler: Any = None,
    schedulers: Sequence[Any] = (),
    name: str = "",
    recompute_copies: bool = False,
    like: Capture | None = None,
    steady: Any = None,
    write_into_dying: bool = True,
    refuse_escapes: bool = True,
) -> Capture:
    """Capture the whole step ``fn(batch)``: forward(s), backward(s), gradient clipping, the
    optimizers' and scaler's calls, as the user wrote it.

    ``fn`` closes over the user's own ``model``, ``optimizers``, ``scaler`` and
    ``schedulers``; while it is traced they hold fakes (:mod:`.swap`), restored afterwards, so
    nothing is allocated or changed. Calls of the stateful objects are marked (:mod:`.regions`):
    the runtime makes them for real at their place in the planned order. The steady-state step
    is captured: the step is first run once untraced (on fakes), which creates an optimizer's
    state when it has none and shows the literals the step makes (:mod:`.literals`). The step
    must leave no gradient on a parameter (end it with ``zero_grad()``).

    ``like``: a capture of this step at another batch shape (issue 37). When the optimizers'
    state is already what that capture's step leaves (:func:`steady_like`), the untraced run is
    skipped: the step is traced once, its literals are checked against ``like``'s (which passed
    the check against their own untraced run) and ``like``'s recomputed copies are applied
    instead of searched. Where either does not hold, the step is captured as without ``like``;
    ``fake_runs`` says which (1 or 2). The caller still compares the programs.

    ``steady``: the plan cache (:class:`memplan.torch.run.plancache.StepCache`), which keeps
    what a full capture's untraced run showed; a restarted process's step is then traced once
    where that record holds, checked by the capture's fingerprint (:mod:`.steady`).

    ``write_into_dying``: ops that may write over a dying input are rewritten to do so
    (:mod:`.inplace`); off where the program is not run by memplan (a SAC policy's ops are eager's).
    ``refuse_escapes``: refuse a tensor the step keeps outside itself (:mod:`.escape`); off for
    a step function of memplan's own that keeps its fakes by design (FSDP2's gathering).
    """
    refuse_unplanned_wrappers(model)
    mode = fake_mode_of(model) or new_fake_mode()
    _check_trainable(model)
    if scaler is not None and scaler.is_enabled() and scaler._scale is None:
        scaler._lazy_init_scale_growth_tracker(next(model.parameters()).device)  # as its first scale() would
    objects = _StepObjects(
        fn, model, list(optimizers), scaler, list(schedulers), name, recompute_copies, write_into_dying, refuse_escapes
    )
    if like is not None and steady_like(like, model, optimizers):
        try:
            return _capture_traced(objects, batch, mode, like)
        except _NotLike:
            pass  # a literal differs from ``like``'s, or its recomputed copies do not apply: as without it
    if like is None and steady is not None and eligible(optimizers, scaler, schedulers):
        return _capture_steady(objects, batch, mode, steady)
    return _capture_traced(objects, batch, mode, None)


def _capture_steady(objects: _StepObjects, batch: Any, mode: Any, store: Any) -> Capture:
    """The capture of a fresh process's step traced once where the store's record of its
    untraced run holds (:mod:`.steady`), else in full, its record kept for the next process.
    The record is a hint: any failure of the shortcut (``_NotLike``, ``NotSteady``, an error of
    the traced run) captures in full, which raises what the step itself raises."""
    parts = record_key_parts(objects.fn, objects.model, objects.optimizers, batch, objects.recompute_copies)
    record = store.steady_record(parts)
    if record is not None:
        try:
            capture = _capture_traced(objects, batch, mode, None, warm=record)
            if store.fingerprint(capture) == record.fingerprint:
                return capture
        except Exception:
            pass  # not the recorded step: captured in full below (the fakes are swapped in afresh)
    capture = _capture_traced(objects, batch, mode, None)
    phases = dict(zip(capture.node_of_op, capture.op_phase, strict=True))
    state, literals = jsonable(capture.optimizer_state_meta), literal_counts(capture.gm, phases)
    record = SteadyRecord(
        state, literals, tuple(capture.recomputed), store.fingerprint(capture), capture.leaves_gradients
    )
    store.keep_steady_record(parts, record)
    return capture


@dataclass(frozen=True)
class _StepObjects:
    """What :func:`capture_step` captures: the step function and the objects it closes over."""

    fn: Callable[[Any], Any]
    model: torch.nn.Module
    optimizers: list[torch.optim.Optimizer]
    scaler: Any
    schedulers: list[Any]
    name: str
    recompute_copies: bool
    write_into_dying: bool = True
    refuse_escapes: bool = True


class _NotLike(Exception):
    """A capture at another shape (``like``) does not stand for the untraced run here."""


def steady_like(like: Capture, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
    """Whether a training step may be traced without its untraced first run because ``like``
    (a capture of it at another shape) shows its steady state: the optimizers' state now has
    exactly the keys, shapes and dtypes ``like``'s step leaves, so the step creates none."""
    if like.mode != "train" or not like.regions or not like.optimizer_state_meta:
        return False
    now = {k: v for opt in optimizers for k, v in optimizer_state_meta(model, opt).items()}
    return now == like.optimizer_state_meta


def _capture_traced(
    objects: _StepObjects, batch: Any, mode: Any, like: Capture | None, warm: SteadyRecord | None = None
) -> Capture:
    """:func:`_capture_runs`, then the refusal of a tensor the step left where its caller sees
    it (:mod:`.escape`), once every reference of capture's own but the program's is gone."""
    made: list[weakref.ref] = []
    capture = _capture_runs(objects, batch, mode, like, warm, made)
    if objects.refuse_escapes:
        refuse_escaped(made, held_by_program(capture.gm))
    return capture


def _capture_runs(
    objects: _StepObjects,
    batch: Any,
    mode: Any,
    like: Capture | None,
    warm: SteadyRecord | None,
    made: list[weakref.ref],
) -> Capture:
    """:func:`capture_step`'s fake runs; with ``like``, the traced run only; with ``warm``, the
    traced run after the optimizers' state is made from the record (:mod:`.steady`). ``made``
    gets a weak reference to every tensor the runs' ops make."""
    model, optimizers, scaler = objects.model, objects.optimizers, objects.scaler
    flat, spec = pytree.tree_flatten(_fake_batch(batch, mode))
    fn = objects.fn

    def run(flat_batch: list[torch.Tensor]) -> Any:
        return fn(pytree.tree_unflatten(flat_batch, spec))

    recorder = RegionRecorder(model, optimizers, scaler, objects.schedulers)
    with (
        real_writes_undone(mode),
        watching_generators(mode) as generators,
        FakeSwap(mode, model, optimizers, scaler) as swap,
        guarded_casts(model),
        watching_hyperparameters(optimizers, objects.schedulers) as hyper,
        watching_compiled_calls() as compiled,
        _noting_made(mode, made),
        _noting_modules(model) as outside,
        recorder.installed(),
    ):
        take_literals(mode)
        logged = isinstance(mode, CaptureFakeMode) and like is None and warm is None
        left: dict[str, torch.Tensor] | None = None  # the gradients the untraced run leaves
        if warm is not None:
            warm_optimizers(model, optimizers, mode, warm)
        elif like is None:
            # creates the optimizers' state lazily (plan the steady state), shows the literals and numbers
            with mode, generators.run(), scalars_logged(mode, recorder, logged):
                _guarded(run, flat)
            compiled.refuse()
            left = _gradients_left(model)
            swap.refuse_rebound_tensors()
            hyper.after_run(may_set=True)
            _refuse_batch_gradients(flat)
        earlier_literals = take_literals(mode) if like is None and warm is None else None
        earlier_scalars = mode.scalar_log if logged else None
        recorder.reset()
        with mode:
            grads = _GradRecorder(model)
        categories = _persistent_categories(model, optimizers, scaler)
        start = time.perf_counter()
        mask_guards: list[MaskGuard] = []
        try:
            with follow_mask_shortcuts(batch, mask_guards), generators.run(), scalars_logged(mode, recorder, logged):
                gm = _trace(run, flat)
            compiled.refuse()
            check_scalars_repeat(earlier_scalars, mode.scalar_log if logged else None)
            swap.refuse_rebound_tensors()
            hyper.after_run(may_set=False)
        finally:
            grads.remove()
            if logged:
                mode.scalar_log = None
        leaves_gradients = _check_gradients_left(model, left, like or warm)
        left = None
        for p in model.parameters():
            p.grad = None  # the fakes' gradients: no longer needed, not the user's (see .escape)
        state_meta = {k: v for opt in optimizers for k, v in optimizer_state_meta(model, opt).items()}
    if not recorder.regions and optimizers:
        raise CaptureError("the step never calls optimizer.step(): memplan plans whole training steps")
    regions = recorder.regions
    grads.add_assigned(regions)

    def to_capture(g: torch.fx.GraphModule, seconds: float) -> Capture:
        return _to_capture(g, categories, grads.storages, "train", seconds, objects.name, regions)

    recomputed = _recomputed(gm, to_capture, objects.recompute_copies, like or warm)
    capture = to_capture(gm, time.perf_counter() - start)
    written, fused = _written_into(gm, capture, grads.storages) if objects.write_into_dying else ([], [])
    if written or fused:
        capture = to_capture(gm, time.perf_counter() - start)
    capture.written_into, capture.fused_loss = written, fused
    phases = dict(zip(capture.node_of_op, capture.op_phase, strict=True))
    if warm is not None:
        if literal_counts(gm, phases) != warm.literals:
            raise _NotLike("the step makes other literals than the recorded run")
    elif like is None:
        check_literals_repeat(gm, phases, earlier_literals)
    elif not same_literals(gm, phases, like):
        raise _NotLike("the step makes other literals than at the other shape")
    capture.fake_runs = 1 if like is not None or warm is not None else 2
    capture.leaves_gradients = leaves_gradients
    capture.outside_modules = [(weakref.ref(m), module_modes(m)) for m in outside]
    capture.recomputed = recomputed
    capture.grad_storage_by_param = dict(grads.by_param)
    capture.optimizer_state_meta = state_meta
    capture.optimizer_scalar_stand_ins = recorder.stand_ins
    capture.batch_spec = spec
    capture.optimizers = list(optimizers)
    capture.scaler = scaler
    capture.batch_constants = batch_constants(flat)
    capture.mask_guards = mask_guards
    if capture.regions:
        capture.graph = hold_update_inputs(capture)
    return capture


def _recomputed(
    gm: torch.fx.GraphModule, to_capture: Callable[..., Capture], enabled: bool, like: Capture | SteadyRecord | None
) -> list[str]:
    """The copies recomputed in ``gm`` (:mod:`.recompute`): searched, or with ``like`` the very
    copies ``like`` recomputes (a copy gives the same bits, so any of them is exact; the
    search only decides which lower the peak)."""
    if not enabled:
        return []
    from memplan.torch.capture.recompute import recompute_copies as recompute
    from memplan.torch.capture.recompute import recompute_named

    if like is not None:
        if not recompute_named(gm, like.recomputed):
            raise _NotLike("the other shape's recomputed copies do not apply here")
        recomputed = list(like.recomputed)
    else:
        recomputed = recompute(gm, lambda g: to_capture(g, 0.0).graph)
    gm.recompile()
    return recomputed


def _written_into(
    gm: torch.fx.GraphModule, capture: Capture, grad_storages: set[int]
) -> tuple[list[tuple[str, int]], list[str]]:
    """Ops of the forward and backward that write their result over a dying input: the loss's
    backward fused first (:mod:`.fused`: the fused nodes' names), then the single ops
    (:mod:`.inplace`: each node's name and the argument it writes over)."""
    from memplan.torch.capture.fused import fuse_loss_backward
    from memplan.torch.capture.inplace import write_into_dying_inputs

    phases = dict(zip(capture.node_of_op, capture.op_phase, strict=True))
    fused = fuse_loss_backward(gm, phases, grad_storages)
    phases.update(dict.fromkeys(fused, "backward"))
    return write_into_dying_inputs(gm, phases, grad_storages), fused


def hold_update_inputs(capture: Capture) -> Graph:
    """``capture.graph`` with each update group's inputs held until the group's last op, as the
    runtime holds them (OLLA eq. 1's liveness, with the runtime's reads): a group runs as one
    call of the user's optimizer with its gradients set as ``.grad`` for the whole call
    (:mod:`memplan.torch.run.updates`), so a gradient stays resident past its last traced read
    while the call allocates its temporaries (AdamW reads a gradient in ``lerp_`` and
    ``addcmul_``, then makes ``sqrt`` and ``div`` as large as the parameter). Each tensor a group
    reads from outside its call (non-persistent, with bytes; not a constant the call makes
    itself, such as ASGD's ``lift_fresh_copy``) becomes an input of every later op of the group,
    so every consumer of the graph (reorder, placement, remat, the reports) counts the bytes the
    runtime holds. The groups are unchanged (the added reads are the group's own)."""
    from memplan.torch.run.updates import update_groups  # the runtime's grouping, one definition

    graph = capture.graph
    ops = list(graph.ops)
    try:
        groups = update_groups(capture)
    except UnsupportedOp:  # a step the planner refuses in one line with this very reason when it plans it
        return graph
    producer = {t: v for v, op in enumerate(graph.ops) for t in op.outputs}
    made_in: dict[int, set[TensorId]] = {}  # call -> what its ops make (a call makes these again itself)
    for v, region in enumerate(capture.op_region):
        made_in.setdefault(region, set()).update(graph.ops[v].outputs)
    for group in groups:
        made = made_in.get(group.region, set())
        held = dict.fromkeys(
            t
            for v in group.ops
            for t in graph.ops[v].inputs
            if t not in made and graph.tensors[t].size_bytes and not graph.tensors[t].persistent
        )
        for v in group.ops:
            extra = tuple(t for t in held if t not in ops[v].inputs and producer.get(t, -1) < v)
            if extra:
                ops[v] = dataclasses.replace(ops[v], inputs=ops[v].inputs + extra)
    if tuple(ops) == graph.ops:
        return graph
    held_graph = Graph(tuple(ops), graph.tensors, graph.name, dict(graph.meta))
    validate_graph(held_graph)
    return held_graph


def batch_constants(flat: Sequence[Any]) -> dict[int, Any]:
    """The leaves of a flattened batch that are not tensors, by position: ``None`` for an
    absent target, a flag, a number. ``make_fx`` traces the step for these very values."""
    return {i: leaf for i, leaf in enumerate(flat) if not isinstance(leaf, torch.Tensor)}


def module_modes(module: torch.nn.Module) -> tuple:
    """What a trace fixes about one module that a training loop may change between calls: its
    ``training`` flag and its own parameters' ``requires_grad``."""
    return (module.training, tuple(p.requires_grad for p in module._parameters.values() if p is not None))


def outside_modes_hold(outside_modules: Sequence[tuple[weakref.ref, tuple]]) -> bool:
    """The modules a capture saw the step call outside the model (``Capture.outside_modules``)
    are alive and in the modes it saw (a frozen teacher still in eval mode): else the step
    needs capturing again."""
    for ref, modes in outside_modules:
        module = ref()
        if module is None or module_modes(module) != modes:
            return False
    return True


@contextlib.contextmanager
def _noting_modules(model: torch.nn.Module) -> Iterator[list[torch.nn.Module]]:
    """While capture runs the step: the modules it calls that are not the model's, in call
    order (a distillation step's teacher, the model's mode key does not see them)."""
    inside = {id(m) for m in model.modules()}
    seen: dict[int, torch.nn.Module] = {}

    def called(module: torch.nn.Module, args: Any) -> None:
        if id(module) not in inside:
            seen.setdefault(id(module), module)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(called)
    found: list[torch.nn.Module] = []
    try:
        yield found
    finally:
        handle.remove()
        found.extend(seen.values())


@contextlib.contextmanager
def _noting_made(mode: Any, made: list[weakref.ref]) -> Iterator[None]:
    """While capture runs the step: ``made`` gets a weak reference to each op's outputs (:mod:`.escape`)."""
    if not isinstance(mode, CaptureFakeMode):
        yield
        return
    mode.made = made
    try:
        yield
    finally:
        mode.made = None


def _refuse_batch_gradients(flat: Sequence[Any]) -> None:
    """A step that gives its batch input a gradient (FGSM's ``x.requires_grad_();
    loss.backward(); x.grad``) is refused: eager sets ``requires_grad`` and ``.grad`` on the
    caller's tensor, and a batch passed again accumulates into its ``.grad``; the planned step
    computes that gradient inside itself and leaves the caller's tensor as it was."""
    given = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.grad is not None]
    if given:
        raise UnsupportedOp(
            f"the step leaves a gradient on its batch input (leaf {given[0]} of the batch: x.requires_grad_() then "
            "backward()), which memplan does not set on the caller's tensor; take it inside the step with "
            "torch.autograd.grad(loss, x) on x = x.clone().requires_grad_()"
        )


def _gradients_left(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradients a run of the step left on the parameters, by parameter name."""
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _check_gradients_left(model: torch.nn.Module, left: dict[str, torch.Tensor] | None, like: Any) -> bool:
    """After the traced run: True when it leaves gradients that the step's next call clears
    before its backward, as it cleared those ``left`` by the untraced run before it
    (``optimizer.zero_grad()`` first, the tutorials' order); then eager's gradients live from
    one call to the next and nothing reads them there, so the planned step frees them at its
    end and trains exactly as eager. A gradient of ``left`` still on its parameter was never
    cleared (eager accumulates across calls): refused, as is a traced run that leaves other
    parameters' gradients than the untraced one. ``left`` None (a capture's only run, at
    another shape or in a restarted process): allowed where ``like`` showed it, else
    :class:`_NotLike` (the caller captures in full); ``like`` may be a plan cache's record of
    a full capture (:class:`.steady.SteadyRecord`) as well."""
    now = _gradients_left(model)
    if not now:
        return False
    if left is None:
        if like is not None and getattr(like, "leaves_gradients", False):
            return True
        raise _NotLike("the step leaves gradients: its two runs show whether the next call clears them")
    kept = [name for name, g in now.items() if left.get(name) is g]
    if kept or set(now) != set(left):
        names = kept or sorted(set(now) ^ set(left)) or sorted(now)
        raise CaptureError(
            f"the step leaves a gradient on {len(now)} parameter(s) ({names[0]}, ...) that its next call "
            f"{'accumulates into' if kept else 'does not clear alike'}: memplan plans steps whose gradients start "
            "from none; call optimizer.zero_grad() (set_to_none=True) at the start or the end of the step, and to "
            "accumulate gradients over micro-batches, run them all in one step (a loop of backward() calls, then "
            "optimizer.step())"
        )
    return True


def optimizer_state_meta(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, tuple]]:
    """``param name -> {key: ("tensor", shape, dtype) | ("value", type name)}`` of the
    optimizer's state (a fake one after capture, or the user's after a real step)."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
    meta: dict[str, dict[str, tuple]] = {}
    for p, state in optimizer.state.items():
        meta[names.get(id(p), "param")] = {
            key: ("tensor", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("value", type(v).__name__)
            for key, v in state.items()
        }
    return meta


def capture_infer_step(model: torch.nn.Module, inputs: Any, *, name: str = "") -> Capture:
    """Capture ``with torch.no_grad(): model(inputs)``."""
    refuse_unplanned_wrappers(model)
    real_inputs = inputs
    mode = fake_mode_of(model)
    if mode is None:
        mode = new_fake_mode()
        model, _ = fake_clone_module(model, mode)
    inputs = _fake_batch(inputs, mode)
    categories = _persistent_categories(model)

    def step(flat_inputs: list[torch.Tensor]) -> Any:
        with torch.no_grad():
            return call_model(model, pytree.tree_unflatten(flat_inputs, spec))

    flat, spec = pytree.tree_flatten(inputs)
    take_literals(mode)
    with real_writes_undone(mode), watching_generators(mode), guarded_casts(model):
        with mode:
            _guarded(step, flat)  # once untraced: shows the literals the step makes
        earlier_literals = take_literals(mode)
        start = time.perf_counter()
        mask_guards: list[MaskGuard] = []
        with follow_mask_shortcuts(real_inputs, mask_guards):
            gm = _trace(step, flat)
    capture = _to_capture(gm, categories, set(), "infer", time.perf_counter() - start, name)
    written, fused = _written_into(gm, capture, set())
    if written or fused:
        capture = _to_capture(gm, categories, set(), "infer", time.perf_counter() - start, name)
    capture.written_into, capture.fused_loss = written, fused
    capture.mask_guards = mask_guards
    check_literals_repeat(gm, dict(zip(capture.node_of_op, capture.op_phase, strict=True)), earlier_literals)
    capture.batch_spec = spec
    capture.batch_constants = batch_constants(flat)
    return capture


def _fake_batch(batch: Any, mode) -> Any:
    from torch._subclasses.fake_tensor import is_fake

    def to_fake(x: Any) -> Any:
        return mode.from_tensor(x) if isinstance(x, torch.Tensor) and not is_fake(x) else x

    return pytree.tree_map(to_fake, batch)


def _check_trainable(model: torch.nn.Module) -> None:
    if not any(p.requires_grad for p in model.parameters()):
        raise CaptureError("the model has no parameter that requires grad: use --mode infer for inference")


class _GradRecorder:
    """Records the storage of every gradient as autograd accumulates it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.by_param: dict[str, int] = {}  # the last gradient of each parameter
        self._every: set[int] = set()  # every gradient, of every backward the step runs
        self._handles = [
            p.register_post_accumulate_grad_hook(lambda p, name=name: self._record(name, p))
            for name, p in model.named_parameters()
            if p.requires_grad
        ]

    @property
    def storages(self) -> set[int]:
        """Every gradient's storage: a step with two backwards (a GAN's discriminator, then its
        generator through the discriminator) gives a parameter a gradient in each, and an
        optimizer's call reads the first one."""
        return set(self._every)

    def _record(self, name: str, param: torch.Tensor) -> None:
        if param.grad is not None:
            self.by_param[name] = storage_key(param.grad)
            self._every.add(self.by_param[name])

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def add_assigned(self, regions: Sequence[CallRegion]) -> None:
        """The gradients the step assigned to ``.grad`` itself (per-sample gradients clipped
        and averaged by hand, ``p.grad = g``): no hook fires for an assignment, but the
        optimizer's call read them (its region's ``grads``, its own parameters only)."""
        for region in regions:
            if region.optimizer is None or region.method not in GRADIENT_METHODS:
                continue
            for name, (key, *_) in region.grads.items():
                if name not in self.by_param:
                    self.by_param[name] = key
                    self._every.add(key)


def _persistent_categories(
    model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer] = (), scaler: Any = None
) -> dict[int, tuple]:
    """``storage key -> (category, name)`` of every tensor that outlives the step."""
    out: dict[int, tuple] = {}
    for name, p in model.named_parameters(remove_duplicate=True):
        out.setdefault(storage_key(p), (Category.PARAMETER, f"param:{name}"))
    for name, b in model.named_buffers(remove_duplicate=True):
        out.setdefault(storage_key(b), (Category.BUFFER, f"buffer:{name}"))
    if scaler is not None:
        for attr in SCALER_TENSORS:
            value = getattr(scaler, attr, None)
            if isinstance(value, torch.Tensor):
                out.setdefault(storage_key(value), (Category.OPTIMIZER_STATE, f"scaler:{attr}"))
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
    for optimizer in optimizers:
        for p, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    label = f"state:{names.get(id(p), 'param')}.{key}"
                    out.setdefault(storage_key(value), (Category.OPTIMIZER_STATE, label))
    return out


@contextlib.contextmanager
def scalars_logged(mode: Any, recorder: RegionRecorder, logged: bool) -> Iterator[None]:
    """Log the Python numbers of the ops outside the optimizers' calls in ``mode`` (a fresh log;
    it stays on the mode after the run, to compare), when ``logged``."""
    if logged:
        mode.scalar_log, mode.logging = [], recorder.outside_calls
    try:
        yield
    finally:
        if logged:
            mode.logging = _never


def _never() -> bool:
    return False


def _trace(step: Callable, flat: Sequence[torch.Tensor]) -> torch.fx.GraphModule:
    return _guarded(make_fx(step, tracing_mode="fake"), list(flat))


def _guarded(fn: Callable, *args: Any) -> Any:
    """Run ``fn`` and turn what goes wrong into one-line capture errors (cause chained), each
    naming the line of the user's (or the model library's) code where it happened."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    try:
        return fn(*args)
    except MemplanError:
        raise  # already one line (a refusal made inside the step, e.g. hf_masks)
    except DynamicOutputShapeException as err:
        raise DynamicShape(
            f"op {err.func}{_where(err)} has an output whose size depends on the data; memplan plans static "
            "shapes only: move it out of the step or give it a fixed size"
        ) from None
    except DataDependentOutputException as err:
        if err.func is torch.ops.aten._local_scalar_dense.default:
            raise DataDependentControlFlow(
                f"the step reads a tensor's value into Python{_where(err)} (.item(), float(t), or an if on a tensor); "
                "memplan replays the step's ops and cannot hand Python a value in the middle of them: return the "
                "tensor and read it after the call (loss.item() outside the step), or take the branch out of the step "
                f"(data-dependent control flow){_distributions_advice(err)}"
            ) from None
        raise DataDependentControlFlow(
            f"the step reads a tensor's value ({err.func}{_where(err)}) to decide what to run (data-dependent "
            "control flow); memplan needs a step whose ops do not depend on data: remove the branch or capture "
            "each branch"
        ) from None
    except Exception as err:
        if "data-dependent" in str(err) or "GuardOnDataDependent" in type(err).__name__:
            raise DataDependentControlFlow(
                f"the step branches on a tensor's value{_where(err)} (data-dependent control flow); memplan needs "
                "a step whose ops do not depend on data: remove the branch or capture each branch"
            ) from None
        first_line = (str(err).strip().splitlines() or [""])[0]
        raise CaptureError(
            f"the step raised {type(err).__name__}{_where(err)} while being captured: {first_line}"
        ) from err


DISTRIBUTIONS = Path(torch.distributions.__file__).parent


def _distributions_advice(err: BaseException) -> str:
    """Where ``torch.distributions`` read the value (its argument checks, on by default): how
    to turn them off, which VAEs' and policy gradients' steps need."""
    import traceback

    frames = traceback.extract_tb(err.__traceback__)
    if not any(Path(f.filename).is_relative_to(DISTRIBUTIONS) for f in frames):
        return ""
    return (
        "; here torch.distributions checks its arguments' values: pass validate_args=False to the "
        "distribution, or call torch.distributions.Distribution.set_default_validate_args(False)"
    )


def _where(err: BaseException) -> str:
    """`` at FILE:LINE``: the innermost frame of the traceback outside torch and memplan (the
    user's model, or the library it comes from), or nothing."""
    import traceback

    where = user_location(traceback.extract_tb(err.__traceback__))
    return f" at {where}" if where else ""


# --------------------------------------------------------------------------- fx -> Graph


class _Builder:
    """Turns a traced fx graph into a memplan Graph, storage by storage."""

    def __init__(self, categories: dict[int, tuple], grad_storages: set[int], mode: str) -> None:
        self.categories = categories
        self.grad_storages = grad_storages
        self.mode = mode
        self.tensors: list[Tensor] = []
        self.ops: list[Op] = []
        self.node_of_op: list[str] = []
        self.storage_tensor: dict[int, TensorId] = {}
        self.value_refs: dict[str, list[tuple[TensorId, ...]]] = {}  # node -> per output: tensors to read
        self.last_writer: dict[int, TensorId] = {}  # storage -> alias handle of its last writer
        self.readers_since_write: dict[int, list[OpId]] = {}
        self.control_out: dict[OpId, TensorId] = {}
        self.extra_inputs: dict[OpId, list[TensorId]] = {}
        self.last_rng: OpId | None = None
        self.phase = "forward"
        self.op_phase: list[str] = []
        self.region = -1  # the call (capture/regions.py) whose ops are being visited
        self.op_region: list[int] = []
        self.spans: dict[str, tuple[str, str, int]] = {}  # enter node -> (span name, phase, region) before it
        self.region_ops: dict[int, list[OpId]] = {}
        self.region_start: dict[int, OpId] = {}
        self.region_end: dict[int, OpId] = {}

    # ---- tensors and ops
    def new_tensor(self, name: str, size: int, category: Category, persistent: bool = False) -> TensorId:
        self.tensors.append(Tensor(name, size, category, persistent))
        return TensorId(len(self.tensors) - 1)

    def new_op(
        self, name: str, kind: str, inputs: list[TensorId], outputs: list[TensorId], mutates=(), flops: int = 0
    ) -> OpId:
        self.ops.append(Op(name, kind, tuple(dict.fromkeys(inputs)), tuple(outputs), 0, tuple(mutates), flops))
        self.node_of_op.append(name)
        phase = {"placeholder": "input", RELEASE_KIND: "release"}.get(kind, self.phase)
        self.op_phase.append(phase)
        op = OpId(len(self.ops) - 1)
        region = self.region if kind not in ("placeholder", RELEASE_KIND) else -1
        self.op_region.append(region)
        if region >= 0:
            self.region_ops.setdefault(region, []).append(op)
            if region in self.region_start:  # a call's ops run after the calls before it (see enter_span)
                self._add_input(op, self.control_of(self.region_start[region]))
        return op

    # ---- spans: backward() and calls of stateful objects (capture/regions.py)
    def enter_span(self, node: torch.fx.Node, span: str) -> None:
        self.spans[node.name] = (span, self.phase, self.region)
        if span == BACKWARD_MARK:
            self.phase = "backward"
        elif span.startswith(CALL_MARK) and self.region < 0:
            self.phase, self.region = "optimizer", int(span[len(CALL_MARK) :])
            previous = self.region_end.get(self.region - 1)
            start = self.new_op(f"{span}:start", CALL_KIND, [], [])
            if previous is not None:
                self._add_input(start, self.control_of(previous))
            self.region_start[self.region] = start

    def exit_span(self, enter: torch.fx.Node) -> None:
        span, phase, region = self.spans.pop(enter.name, ("", self.phase, self.region))
        if span.startswith(CALL_MARK) and region < 0 and self.region >= 0:
            members = list(self.region_ops[self.region])
            end = self.new_op(f"{span}:end", CALL_KIND, [self.control_of(m) for m in members], [])
            self.region_end[self.region] = end
        self.phase, self.region = phase, region

    def order_after_regions(self) -> None:
        """An op outside a call that reads what one of the call's ops made (data or order)
        runs after the whole call: the runtime makes the call as one, at its end."""
        made_in: dict[TensorId, int] = {}
        for op_id, op in enumerate(self.ops):
            if self.op_region[op_id] >= 0:
                for t in op.outputs:
                    made_in[t] = self.op_region[op_id]
        for op_id, op in enumerate(list(self.ops)):
            if self.op_region[op_id] >= 0:
                continue
            for region in {made_in[t] for t in op.inputs if t in made_in}:
                self._add_input(OpId(op_id), self.control_of(self.region_end[region]))

    def control_of(self, op: OpId) -> TensorId:
        """A 0-byte control tensor produced by ``op`` (created once, attached afterwards)."""
        if op not in self.control_out:
            t = self.new_tensor(f"{self.ops[op].name}.ctl", 0, Category.CONTROL)
            old = self.ops[op]
            self.ops[op] = dataclasses.replace(old, outputs=(*old.outputs, t))
            self.control_out[op] = t
        return self.control_out[op]

    # ---- nodes
    def placeholder(self, node: torch.fx.Node, value: Any, default: tuple) -> None:
        refs = []
        for leaf in tensor_leaves(value):
            key = storage_key(leaf)
            if key not in self.storage_tensor:
                category, label = self.categories.get(key, default)
                nbytes = leaf.untyped_storage().nbytes()
                t = self.new_tensor(label if label else node.name, nbytes, category, persistent=True)
                self.new_op(f"{node.name}", "placeholder", [], [t])
                self.storage_tensor[key] = t
            refs.append((self.storage_tensor[key],))
        self.value_refs[node.name] = refs

    def call(self, node: torch.fx.Node) -> None:
        target = node.target
        kind = str(target)
        inputs, input_storages = self._inputs_of(node)
        written = written_storages(node)
        op_name = node.name
        outputs: list[TensorId] = []
        refs: list[tuple[TensorId, ...]] = []
        pending_new: list[tuple[int, int]] = []
        for i, leaf in enumerate(tensor_leaves(node.meta.get("val"))):
            _check_static(leaf, node)
            key = storage_key(leaf)
            suffix = "" if i == 0 else f".{i}"
            if key in self.storage_tensor:  # a view or an in-place result: an alias handle
                handle = self.new_tensor(f"{op_name}{suffix}.alias", 0, Category.CONTROL)
                outputs.append(handle)
                refs.append((self.storage_tensor[key], handle))
            else:
                t = self.new_tensor(f"{op_name}{suffix}", leaf.untyped_storage().nbytes(), self._category(key))
                outputs.append(t)
                refs.append((t,))
                pending_new.append((key, t))
        mutated = [self.storage_tensor[k] for k in written if k in self.storage_tensor]
        op = self.new_op(op_name, kind, inputs, outputs, mutated, op_flops(node))
        for key, t in pending_new:
            self.storage_tensor[key] = t
        self._order_against_writes(op, input_storages, written)
        if is_random(target):
            if self.last_rng is not None:
                self._add_input(op, self.control_of(self.last_rng))
            self.last_rng = op
        self.value_refs[node.name] = refs

    def getitem(self, node: torch.fx.Node) -> None:
        source, index = node.args
        refs = self.value_refs.get(source.name, [])
        position = _leaf_position(source.meta.get("val"), index)
        self.value_refs[node.name] = [refs[position]] if position is not None and position < len(refs) else []

    def _inputs_of(self, node: torch.fx.Node) -> tuple[list[TensorId], list[int]]:
        inputs: list[TensorId] = []
        storages: list[int] = []
        for arg in pytree.tree_leaves((node.args, node.kwargs)):
            if isinstance(arg, torch.fx.Node):
                for ref in self.value_refs.get(arg.name, []):
                    inputs.extend(ref)
                for leaf in tensor_leaves(arg.meta.get("val")):
                    storages.append(storage_key(leaf))
        return inputs, storages

    def _order_against_writes(self, op: OpId, read: list[int], written: list[int]) -> None:
        """Read-after-write, write-after-read and write-after-write edges on shared storages."""
        for key in dict.fromkeys(read):
            if key in self.last_writer:
                self._add_input(op, self.last_writer[key])
            if key not in written:
                self.readers_since_write.setdefault(key, []).append(op)
        for key in written:
            for reader in self.readers_since_write.pop(key, []):
                if reader != op:
                    self._add_input(op, self.control_of(reader))
            self.last_writer[key] = self.control_of(op)

    def _add_input(self, op: OpId, tensor: TensorId) -> None:
        old = self.ops[op]
        if tensor not in old.inputs and tensor not in old.outputs:
            self.ops[op] = dataclasses.replace(old, inputs=(*old.inputs, tensor))

    def _category(self, key: int) -> Category:
        if key in self.grad_storages:
            return Category.GRADIENT
        if self.mode == "infer" or self.phase == "forward":
            return Category.ACTIVATION
        return Category.TEMPORARY

    def release_gradients(self) -> None:
        """One no-op per gradient where ``zero_grad(set_to_none=True)`` drops it: eager holds
        every ``.grad`` until then. A reordering may run a release right after the update."""
        for t_id, tensor in enumerate(list(self.tensors)):
            if tensor.category is Category.GRADIENT:
                self.new_op(f"release:{tensor.name}", RELEASE_KIND, [TensorId(t_id)], [])

    def output(self, node: torch.fx.Node) -> None:
        for arg in pytree.tree_leaves(node.args):
            if isinstance(arg, torch.fx.Node):
                for ref in self.value_refs.get(arg.name, []):
                    t = ref[0]
                    old = self.tensors[t]
                    if not old.persistent:
                        self.tensors[t] = Tensor(old.name, old.size_bytes, Category.OUTPUT, False)


def _to_capture(
    gm: torch.fx.GraphModule,
    categories: dict[int, tuple],
    grads: set[int],
    mode: str,
    seconds: float,
    name: str,
    regions: Sequence[CallRegion] = (),
) -> Capture:
    builder = _Builder(categories, grads, mode)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            builder.placeholder(node, node.meta.get("val"), (Category.INPUT, ""))
        elif node.op == "get_attr":
            value = getattr(gm, node.target)
            if isinstance(value, torch.Tensor):
                builder.placeholder(node, value, (Category.BUFFER, f"const:{node.target}"))
                t = builder.storage_tensor[storage_key(value)]
                builder.value_refs[node.name] = [(t,)]
                traced = node.meta.get("val")
                if isinstance(traced, torch.Tensor):
                    # the ops' reads and writes are seen through the traced (fake) value: a step that
                    # writes a closure tensor (an EMA, a counter) writes this one
                    builder.storage_tensor.setdefault(storage_key(traced), t)
        elif node.op == "call_function":
            _visit_call(builder, node)
        elif node.op == "output":
            builder.order_after_regions()
            if mode == "train":
                builder.release_gradients()
            builder.output(node)
        else:
            raise UnsupportedOp(f"fx node {node.name} of kind {node.op!r} is not supported")
    graph = Graph(
        tuple(builder.ops),
        tuple(builder.tensors),
        name,
        {"mode": mode, "capture_seconds": round(seconds, 3)},
    )
    validate_graph(graph)
    _read_region_writes_from_their_targets(gm, builder, regions)
    capture = Capture(graph, gm, mode, seconds, builder.node_of_op, dict(builder.storage_tensor), builder.op_phase)
    capture.regions = list(regions)
    capture.op_region = builder.op_region
    return capture


def _read_region_writes_from_their_targets(
    gm: torch.fx.GraphModule, builder: _Builder, regions: Sequence[CallRegion]
) -> None:
    """Point the ops after a call (``optimizer.step()``, ...) that read what one of its traced
    in-place ops returned at the tensor that op wrote instead: the runtime makes the call for
    real and runs none of its traced ops, so their results are never bound, while the tensor
    they wrote (a parameter an EMA update reads after the step) is the user's own. The order
    stays the graph's: those readers still follow the whole call there (``order_after_regions``).
    A value the call computed that is no write of a tensor the step holds is refused."""
    region_of = {name: builder.op_region[op] for op, name in enumerate(builder.node_of_op)}
    phase_of = dict(zip(builder.node_of_op, builder.op_phase, strict=True))
    target_of: dict[str, torch.fx.Node] = {}
    changed = False
    for node in gm.graph.nodes:
        if region_of.get(node.name, -1) >= 0:
            written = written_argument(node)
            if written is not None:
                target_of[node.name] = target_of.get(written.name, written)
            continue
        if phase_of.get(node.name) not in ("forward", "backward") and node.op != "output":
            continue  # not run by the program (an optimizer's traced op, a view of the call's values)
        for read in [a for a in node.all_input_nodes if region_of.get(a.name, -1) >= 0]:
            if read.name not in target_of:
                index = region_of[read.name]
                call = f"{regions[index].kind}()" if index < len(regions) else "a call of a stateful object"
                raise UnsupportedOp(
                    f"the step uses {read.name}, a value {call} computed, after that call; memplan makes the call "
                    "for real and does not trace its values: compute it outside the call"
                )
            node.replace_input_with(read, target_of[read.name])
            changed = True
    if changed:
        gm.recompile()


def written_argument(node: torch.fx.Node) -> torch.fx.Node | None:
    """The argument an in-place or out= op writes and returns (``add_``'s ``self``), if any."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or len(schema.returns) != 1:
        return None
    alias = schema.returns[0].alias_info
    if alias is None or not alias.is_write:
        return None
    for argument, value in zip(schema.arguments, node.args, strict=False):
        if argument.alias_info is not None and argument.alias_info.before_set == alias.before_set:
            return value if isinstance(value, torch.fx.Node) else None
    for argument in schema.arguments:
        value = node.kwargs.get(argument.name)
        if argument.alias_info is not None and argument.alias_info.before_set == alias.before_set:
            return value if isinstance(value, torch.fx.Node) else None
    return None


def _visit_call(builder: _Builder, node: torch.fx.Node) -> None:
    target = node.target
    if target is operator.getitem:
        builder.getitem(node)
        return
    namespace = getattr(target, "namespace", "")
    if namespace in _SKIPPED_NAMESPACES:
        if target is torch.ops.profiler._record_function_enter_new.default:
            builder.enter_span(node, node.args[0] if node.args and isinstance(node.args[0], str) else "")
        elif node.args and isinstance(node.args[0], torch.fx.Node):
            builder.exit_span(node.args[0])
        builder.value_refs[node.name] = []
        return
    if not isinstance(target, torch._ops.OpOverload):
        raise UnsupportedOp(f"op {target} ({node.name}) is not an ATen op; memplan captures ATen programs only")
    builder.call(node)


def op_flops(node: torch.fx.Node) -> int:
    """FLOPs of one op: torch.utils.flop_counter's formula where it has one (matmuls,
    convolutions, attention), else one per output element (the stated default)."""
    from torch.utils.flop_counter import flop_registry

    out = node.meta.get("val")
    if node.target is torch.ops.aten.convolution_backward.default:
        return _conv_backward_flops(node)
    formula = flop_registry.get(node.target.overloadpacket)
    if formula is not None:
        args, kwargs = pytree.tree_map_only(torch.fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs))
        try:
            return int(formula(*args, **kwargs, out_val=out))
        except Exception:  # a formula that cannot read these arguments: fall back to the default
            pass
    return sum(t.numel() for t in tensor_leaves(out))


def _conv_backward_flops(node: torch.fx.Node) -> int:
    """``convolution_backward``: each requested gradient (input, weight) costs one forward
    convolution (flop_counter's own formula ignores ``groups`` for the weight gradient, which
    overcounts a depthwise convolution by its channel count)."""
    from torch.utils.flop_counter import conv_flop_count

    grad_out, x, w = (a.meta["val"] for a in node.args[:3])
    transposed, output_mask = node.args[7], node.args[10]
    forward = conv_flop_count(list(x.shape), list(w.shape), list(grad_out.shape), transposed)
    return int(forward * (int(output_mask[0]) + int(output_mask[1])))


def _leaf_position(value: Any, index: int) -> int | None:
    """Which tensor output of a multi-output op ``value[index]`` is (None: not a tensor)."""
    if not isinstance(value, (tuple, list)) or index >= len(value):
        return None
    item = value[index]
    if not isinstance(item, torch.Tensor):
        return None
    return sum(1 for x in value[:index] if isinstance(x, torch.Tensor))


def _check_static(t: torch.Tensor, node: torch.fx.Node) -> None:
    if any(not isinstance(s, int) for s in t.shape):
        raise DynamicShape(
            f"op {node.target} ({node.name}) has a symbolic shape {tuple(t.shape)}; memplan plans static shapes: "
            "capture with concrete example inputs"
        )
