"""The planned step as one generated Python function (issue 15: an executor that does not
interpret).

:class:`memplan.torch.run.interpreter.StepRunner` interprets its instructions one at a time:
per op it walks a fetcher, looks values up in a dict, dispatches on the strategy, slices the
arena view, stores and pops names. Here the same instructions are written out once as Python
source, each op a direct call of its ATen kernel with its arguments as local variables, its
arena views sliced once and bound as constants, its out= / in-place writes spelled out, every
free a ``del`` at the planned position, and every optimizer update, hook and rarely used path
a call of the runner's own method (updates with no op between them as one call: see
:func:`_merged_updates`). Python then runs the step at the cost of eager's dispatch: one call
per op, no interpreter around it. The interpreter stays the reference; generated and
interpreted steps run the same kernels in the same order on the same storages, so they give
the same bits (tested in tests/torch/test_codegen.py).

Each op is called through PyTorch's own Python binding of its ATen function (``torch.add``,
``Tensor.add_``: one argument parse, an unboxed call into the dispatcher) where that binding is
proven, once per argument signature, to make exactly the op's call with the same arguments
(:func:`_direct_binding`); otherwise through ``OpOverload._op``, which builds a boxed stack
from the schema on every call (issue 34: a small ``add`` took 5.1 us through ``_op`` against
3.5 us through ``torch.add``, a small convolution 26 against 17 us, on the CI's CPU; eager's
backward runs in C++ without either cost). Backward ops have no Python binding: they stay boxed.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch.fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import torch

_INLINE_LITERALS = (bool, int, str, type(None))
# consecutive updates run as one optimizer.step() while the gradients that this holds beyond
# their own update total at most this (see _merged_updates): batch-norm and depthwise layers'
# gradients merge, a large layer's does not, so the step's peak stays the plan's
MERGE_HELD_BYTES = 256 * 1024


@dataclass
class GeneratedStep:
    """The generated function ``step(env, runner) -> result`` with its source (for reading
    and debugging), and the statistics every run of it adds up to (``RunStats`` fields of the
    ops written inline; delegated calls and updates count themselves at run time)."""

    source: str
    function: Any
    static_stats: dict[str, Any] = field(default_factory=dict)


class _Writer:
    """Builds the source: names of locals, constants bound into the function's globals."""

    def __init__(self, runner: Any, direct: bool = True) -> None:
        self.runner = runner
        self.direct = direct  # call ops through their proven Python bindings (_direct_binding)
        self.bindings: dict[Any, Any] = {}  # _call_signature -> the binding proven for it, or None
        self.globals: dict[str, Any] = {"_runner_cls": type(runner)}
        self.lines: list[str] = []
        self.local: dict[str, str] = {}  # fx node name -> local variable holding its value
        self.assigned: set[str] = set()  # fx node names assigned by an instruction (freed with del)
        self._constants: dict[int, str] = {}

    def constant(self, value: Any, hint: str = "c") -> str:
        key = id(value)
        name = self._constants.get(key)
        if name is None:
            name = f"_{hint}{len(self.globals)}"
            self.globals[name] = value
            self._constants[key] = name
        return name

    def var(self, node_name: str) -> str:
        name = self.local.get(node_name)
        if name is None:
            name = f"v{len(self.local)}"
            self.local[node_name] = name
        return name

    def expr(self, value: Any) -> str:
        """Python source for ``value`` with each fx node replaced by the local holding its value
        (a getitem nobody stored: its tuple's element, as the interpreter's ``_resolve``)."""
        if isinstance(value, torch.fx.Node):
            if value.name in self.local:
                return self.local[value.name]
            if value.target is operator.getitem:
                return f"{self.expr(value.args[0])}[{value.args[1]!r}]"
            return self.var(value.name)  # unbound at run time: fails as the interpreter's lookup does
        if not _has_node(value):
            if type(value) in _INLINE_LITERALS:
                return repr(value)
            return self.constant(value)
        if isinstance(value, tuple):
            return "(" + "".join(f"{self.expr(v)}, " for v in value) + ")"
        if isinstance(value, list):
            return "[" + ", ".join(self.expr(v) for v in value) + "]"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k!r}: {self.expr(v)}" for k, v in value.items()) + "}"
        raise TypeError(f"cannot generate an argument of type {type(value).__name__}")

    def call_args(self, node: torch.fx.Node, extra: dict[str, str] | None = None) -> str:
        parts = [self.expr(a) for a in node.args]
        parts += [f"{k}={self.expr(v)}" for k, v in node.kwargs.items()]
        parts += [f"{k}={v}" for k, v in (extra or {}).items()]
        return ", ".join(parts)

    def emit(self, line: str) -> None:
        self.lines.append("    " + line)


def generate(runner: Any, *, direct: bool = True) -> GeneratedStep:
    """Write ``runner``'s instructions as one function (see the module docstring). ``direct``:
    each op through its proven Python binding where it has one (``False``: every op through
    ``OpOverload._op``, the same kernels; kept to measure the difference, bench/step_overhead.py)."""
    from memplan.torch.run.interpreter import RunHook, StepRunner, _Update

    w = _Writer(runner, direct)
    stats: dict[str, Any] = {"out_bytes": 0, "allocator_bytes": 0, "max_scratch_bytes": 0, "inplace_bytes": 0}
    env_names = _env_names(runner)
    for name in env_names:
        w.emit(f"{w.var(name)} = env[{name!r}]")
    planned = bool(runner.plan.offsets)
    for run in _merged_updates(runner, runner.instructions):
        ins = run[0]
        if isinstance(ins, RunHook):
            w.emit(f"{w.constant(ins, 'hook')}.run(runner, env)")
            continue
        if isinstance(ins, _Update):
            if type(runner)._update is StepRunner._update:
                update = ins if len(run) == 1 else _merged(run)
                grads = "".join(f"{w.expr(n)}, " for n in update.grad_nodes)
                w.emit(f"runner._update_with({w.constant(update, 'update')}, ({grads}))")
            else:  # a subclass's own update (it reads the gradients from an env)
                grads = ", ".join(f"{n.name!r}: {w.expr(n)}" for n in ins.grad_nodes)
                w.emit(f"runner._update({w.constant(ins, 'update')}, {{{grads}}})")
        elif planned:
            _planned_call(w, ins, stats)
        else:
            _plain_call(w, ins, stats)
        for done in run:
            _frees(w, runner, done.position)
    output = next(n for n in runner.capture.gm.graph.nodes if n.op == "output")
    w.emit(f"return {w.expr(output.args[0])}")
    source = "def step(env, runner):\n" + "\n".join(w.lines) + "\n"
    namespace = dict(w.globals)
    exec(compile(source, f"<memplan step {id(runner):x}>", "exec"), namespace)
    return GeneratedStep(source, namespace["step"], stats)


def _merged_updates(runner: Any, instructions: list[Any]) -> list[list[Any]]:
    """The instructions in runs: each a single instruction, except consecutive updates that
    one ``optimizer.step()`` may make together (:func:`_mergeable`), which form one run.

    OLLA 4.3's early updates run one group of parameters as soon as its gradients are ready,
    often one parameter per group: a batch-norm's weight and bias, a block's last layers, come
    ready at the same op, and a call per parameter costs ``optimizer.step()``'s own overhead
    (profiler range, hooks, argument checks; about 50 us on a CPU) once per parameter, ~10% of
    EfficientNet-B0's step at batch 1. Updates with no op between them run as one call over
    their parameters: the optimizer updates parameters independently (run/updates.py), so the
    bits are those of separate calls. Their gradients are freed after the call instead of one
    by one, so a run only grows while the gradients it holds longer than separate calls would
    (all but its last update's) total at most :data:`MERGE_HELD_BYTES`: a large layer's
    gradient is still freed before the next update's temporaries are made."""
    runs: list[list[Any]] = []
    run_bytes = 0  # the gradient bytes of the last run: held to its end if an update joins it
    for ins in instructions:
        if runs and run_bytes <= MERGE_HELD_BYTES and _mergeable(runner, runs[-1][-1], ins):
            runs[-1].append(ins)
            run_bytes += _grad_bytes(ins)
        else:
            runs.append([ins])
            run_bytes = _grad_bytes(ins)
    return runs


def _grad_bytes(ins: Any) -> int:
    from memplan.torch.run.interpreter import _Update

    if not isinstance(ins, _Update):
        return 0
    values = [n.meta.get("val") for n in ins.grad_nodes]
    return sum(v.untyped_storage().nbytes() for v in values if isinstance(v, torch.Tensor))


def _mergeable(runner: Any, first: Any, then: Any) -> bool:
    """``then`` may run in one ``optimizer.step()`` with ``first``: both split updates of the same
    ``optimizer.step()`` call (not a scaler's step: its last group makes the call's own
    bookkeeping), the runner's own update method, and no arena views to replay the traced
    update into (with offsets, :class:`_ReplayIntoArena` follows each group's traced ops)."""
    from memplan.torch.run.interpreter import StepRunner, _Update

    if not (isinstance(first, _Update) and isinstance(then, _Update)) or runner.plan.offsets:
        return False
    cls = type(runner)
    if cls._update is not StepRunner._update or cls._update_with is not StepRunner._update_with:
        return False
    same_call = first.region == then.region and first.split and then.split
    return same_call and runner.capture.regions[first.region].kind == "optimizer.step"


def _merged(run: list[Any]) -> Any:
    """One update over the parameters of the run's updates (:func:`_merged_updates`)."""
    last = run[-1]
    return replace(
        last,
        param_names=tuple(p for ins in run for p in ins.param_names),
        grad_nodes=tuple(n for ins in run for n in ins.grad_nodes),
        traced=(),
    )


def _env_names(runner: Any) -> list[str]:
    """The values ``_bind_inputs`` puts in ``env``: placeholders and constants."""
    names = [n.name for n in runner.capture.gm.graph.nodes if n.op == "placeholder"]
    names += list(runner._static_constants)
    names += [b.node for b in runner._live_constants]
    return list(dict.fromkeys(names))


def _kernel(w: _Writer, op: Any, node: torch.fx.Node | None = None, extra: dict[str, Any] | None = None) -> str:
    """The callable of ``op`` called with ``node``'s arguments (and ``extra`` keyword arguments:
    out= views, given as their fake values): its proven Python binding where ``w.direct`` and
    one exists (:func:`_direct_binding`), else its C++ entry ``OpOverload._op`` (the same
    dispatcher call as ``op(...)``, one Python frame less)."""
    if w.direct and node is not None and isinstance(op, torch._ops.OpOverload):
        key = _call_signature(op, node, extra)
        if key not in w.bindings:
            w.bindings[key] = _direct_binding(op, node, extra or {})
        binding = w.bindings[key]
        if binding is not None:
            return w.constant(binding, "bind")
    return w.constant(getattr(op, "_op", op), "op")


# PyTorch's generated bindings of ATen functions (PythonArgParser, then an unboxed call)
_BINDING_HOMES = ("_VariableFunctions", "_nn", "_linalg", "_special", "_fft")


def _candidate_bindings(op: torch._ops.OpOverload) -> Iterator[Callable[..., Any]]:
    """The Python bindings named after ``op``'s function: ``torch.<name>`` and its namespaces,
    then the method ``Tensor.<name>`` (called unbound, ``self`` first)."""
    namespace, _, name = op._schema.name.partition("::")
    if namespace != "aten":
        return
    for home in _BINDING_HOMES:
        binding = getattr(getattr(torch._C, home, None), name, None)
        if callable(binding):
            yield binding
    method = getattr(torch._C.TensorBase, name, None)
    if callable(method):
        yield method


def _direct_binding(op: torch._ops.OpOverload, node: torch.fx.Node, extra: dict[str, Any]) -> Any:
    """A Python binding that, called with ``node``'s arguments, makes exactly one dispatcher
    call: ``op`` with the arguments ``op._op`` passes (tensors the same objects, every other
    value of the same type and value), and returns that call's result as it is; None if no
    binding is proven so. The proof runs both on meta tensors under a recording dispatch mode,
    so the kernels, their order and their arguments stay those of the plan (no other mode sees
    it: the self-check's observer may be active while the first step generates its code)."""
    with _disable_current_modes(), torch.no_grad():
        try:
            args, kwargs = _meta_call_args(node, extra)
            if not _all_on_meta(args, kwargs):
                return None  # a factory on the default device would run for real: it keeps its boxed call
            reference = _recorded(op._op, args, kwargs)
        except Exception:  # no meta value or meta kernel: the op keeps its boxed call
            return None
        if reference is None or reference[0][0] is not op:
            return None
        for binding in _candidate_bindings(op):
            try:
                candidate = _recorded(binding, args, kwargs)
            except Exception:  # this binding has no signature for these arguments
                continue
            if candidate is not None and _same_call(candidate, reference):
                return binding
    return None


class _Recorder(TorchDispatchMode):
    """Records every op that reaches the Python dispatch key, and runs it (on meta tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple, dict[str, Any], Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, result))
        return result


def _recorded(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, Any] | None:
    """(the one op ``fn(*args, **kwargs)`` dispatched, what ``fn`` returned); None when it
    dispatched any other number of ops."""
    with _Recorder() as recorder:
        returned = fn(*args, **kwargs)
    return (recorder.calls[0], returned) if len(recorder.calls) == 1 else None


def _same_call(candidate: tuple[tuple, Any], reference: tuple[tuple, Any]) -> bool:
    (func, args, kwargs, result), returned = candidate
    (ref_func, ref_args, ref_kwargs, ref_result), ref_returned = reference
    return (
        func is ref_func
        and _same_value(args, ref_args)
        and _same_value(kwargs, ref_kwargs)
        and _same_value(returned, result)  # the binding hands back the op's own result
        and _same_value(ref_returned, ref_result)
    )


def _same_value(a: Any, b: Any) -> bool:
    """The very same tensors; every other value of the same type and equal (1 is not 1.0)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _meta_call_args(node: torch.fx.Node, extra: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """``node``'s arguments (and ``extra``) with every tensor a meta tensor of its layout, one
    per fx value (a value passed twice is the same meta tensor twice), and every device the meta
    device: a factory's proof (``aten.rand``, ``aten.zeros``: no tensor argument) must not run
    its kernel for real, which would allocate its output and draw from the generator the step
    draws from."""
    made: dict[int, torch.Tensor] = {}

    def meta(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) not in made:
            made[id(value)] = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
        return made[id(value)]

    def fake(n: torch.fx.Node) -> Any:
        if "val" not in n.meta:
            raise LookupError(n.name)
        return pytree.tree_map(meta, n.meta["val"])

    def on_meta(value: Any) -> Any:
        return pytree.tree_map_only(torch.device, lambda _: META, pytree.tree_map_only(torch.fx.Node, fake, value))

    args, kwargs = on_meta(tuple(node.args)), on_meta(dict(node.kwargs))
    kwargs.update(pytree.tree_map(meta, extra))
    return args, kwargs


META = torch.device("meta")


def _all_on_meta(args: tuple, kwargs: dict[str, Any]) -> bool:
    """The call names a device, meta, for what it makes: a tensor argument or a device (a
    factory without one makes its output on the default device)."""
    leaves = pytree.tree_leaves((args, kwargs))
    return any(isinstance(x, torch.Tensor) or x == META for x in leaves if isinstance(x, torch.Tensor | torch.device))


def _call_signature(op: Any, node: torch.fx.Node, extra: dict[str, Any] | None) -> Any:
    """What decides which overload a binding's argument parser picks: each argument's Python
    type and, where it is not a tensor, its value (a binding proven for one signature is proven
    for every call with it)."""

    def shape(value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            return ("node", shape(value.meta.get("val")))
        if isinstance(value, (list, tuple)):
            return (type(value), tuple(shape(v) for v in value))
        if isinstance(value, dict):
            return (dict, tuple((k, shape(v)) for k, v in value.items()))
        return _leaf_kind(value)

    return (op, shape(tuple(node.args)), shape({**node.kwargs, **(extra or {})}))


def _leaf_kind(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, value.dim())
    return (type(value), repr(value))


def _store(w: _Writer, node: torch.fx.Node, expr: str, hold: Callable[[torch.fx.Node], None] | None = None) -> None:
    """Assign an op's result as the interpreter's ``_store`` keeps it: a tuple read only through
    getitem element by element, so each element is freed at its own last use. ``hold(node)``
    is told of each local assigned (default: the writer's ``assigned`` set)."""
    if hold is None:
        hold = lambda held: w.assigned.add(held.name)  # noqa: E731
    users = list(node.users)
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)) and users and all(u.target is operator.getitem for u in users):
        w.emit(f"_r = {expr}")
        for user in users:
            w.emit(f"{w.var(user.name)} = _r[{user.args[1]!r}]")
            hold(user)
        w.emit("del _r")
        return
    w.emit(f"{w.var(node.name)} = {expr}")
    hold(node)


def _frees(w: _Writer, runner: Any, position: int) -> None:
    names = [n for n in runner._frees.get(position, ()) if n in w.assigned]
    for name in names:
        w.assigned.discard(name)
    if names:
        w.emit("del " + ", ".join(w.local[n] for n in names))


def _plain_call(w: _Writer, ins: Any, stats: dict[str, Any]) -> None:
    """No arena offsets (the planned allocator serves the addresses): ops run as they are."""
    from memplan.torch.run.interpreter import ARENA_KERNELS

    node = ins.node
    if ins.strategy == "inplace":
        into = w.expr(node.args[ins.inplace_arg])
        stats["inplace_bytes"] += ins.fresh[0].meta.untyped_storage().nbytes()
        out = {ins.out_names[0]: node.args[ins.inplace_arg].meta.get("val")}
        kernel = _kernel(w, ins.out_op, node, out)
        _store(w, node, _watched_call(w, node, kernel, w.call_args(node, {ins.out_names[0]: into})))
        return
    if ins.strategy == "kernel":
        meta = ins.fresh[0].meta
        empty = w.constant(torch.empty_strided, "fn")
        size, stride = w.constant(tuple(meta.shape), "size"), w.constant(tuple(meta.stride()), "stride")
        device = w.constant(meta.device, "device")
        _store(w, node, f"{empty}({size}, {stride}, dtype={w.constant(meta.dtype, 'dtype')}, device={device})")
        write = w.constant(ARENA_KERNELS[node.target._schema.name].write, "write")
        w.emit(f"{write}({w.local[node.name]}, {w.call_args(node)})")
        return
    _store(w, node, _watched_call(w, node, _kernel(w, node.target, node), w.call_args(node)))


def _watched_call(w: _Writer, node: torch.fx.Node, kernel: str, args: str) -> str:
    """``kernel(args)``; through ``runner._watched`` for an op the self-check follows without a
    dispatch mode (a random op, a write its schema does not mark: :func:`watched_op`)."""
    from memplan.torch.run.interpreter import watched_op

    if not watched_op(node.target):
        return f"{kernel}({args})"
    return f"runner._watched({kernel}, {w.constant(node.target, 'op')}{', ' if args else ''}{args})"


def _planned_call(w: _Writer, ins: Any, stats: dict[str, Any]) -> None:
    """Arena offsets: fresh outputs written into their views (sliced once, bound here)."""
    from memplan.torch.run.interpreter import ARENA_KERNELS, _nbytes, _scratch_bytes

    node = ins.node
    runner = w.runner
    simple_out = ins.strategy == "out" and _tensors_only(node.meta.get("val"))
    if ins.strategy in ("copy",) or (ins.strategy == "out" and not simple_out):
        # rare: the runner's own path (it counts its statistics itself)
        place = w.constant(ins, "call")
        args = w.expr(tuple(node.args))
        kwargs = w.expr(dict(node.kwargs))
        _store(w, node, f"runner._place_call({place}, {w.constant(node.target, 'op')}, {args}, {kwargs})")
        return
    stats["max_scratch_bytes"] = max(stats["max_scratch_bytes"], _scratch_bytes(ins, _meta_args(runner, node)))
    if ins.strategy == "plain":
        stats["allocator_bytes"] += sum(_nbytes(o) for o in ins.fresh)
        _store(w, node, f"{_kernel(w, node.target, node)}({w.call_args(node)})")
        return
    views = {o.index: w.constant(runner._view(o), "view") for o in ins.fresh if o.offset is not None}
    stats["out_bytes"] += sum(_nbytes(o) for o in ins.fresh if o.offset is not None)
    if ins.strategy == "empty":
        _store(w, node, views[ins.fresh[0].index])
    elif ins.strategy == "kernel":
        write = w.constant(ARENA_KERNELS[node.target._schema.name].write, "write")
        w.emit(f"{write}({views[ins.fresh[0].index]}, {w.call_args(node)})")
        _store(w, node, views[ins.fresh[0].index])
    else:  # "out": every output fresh and planned
        outs = {name: views[o.index] for name, o in zip(ins.out_names, ins.fresh, strict=True)}
        metas = {name: o.meta for name, o in zip(ins.out_names, ins.fresh, strict=True)}
        w.emit(f"{_kernel(w, ins.out_op, node, metas)}({w.call_args(node, outs)})")
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            _store(w, node, views[0])
        else:
            items = ", ".join(views[i] for i in range(len(value)))
            _store(w, node, f"({items},)" if isinstance(value, tuple) else f"[{items}]")


def _tensors_only(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value)


def _meta_args(runner: Any, node: torch.fx.Node) -> Any:
    """The op's arguments with each node's value: the bound constant where it is one (a
    parameter), else the traced fake value (shapes, storages' sizes)."""

    def value(n: torch.fx.Node) -> Any:
        if n.name in runner._static_constants:
            return runner._static_constants[n.name]
        return n.meta.get("val")

    return pytree.tree_map_only(torch.fx.Node, value, node.args)


def _has_node(value: Any) -> bool:
    return any(isinstance(leaf, torch.fx.Node) for leaf in pytree.tree_leaves(value))


__all__ = ["GeneratedStep", "generate"]
