"""A step captured once with a symbolic sequence length, checked against a new length by its
guards instead of being traced again (issue 37).

The step is traced once more at the declared largest shape (``dynamic={dim: max}``), on fakes
whose batch dimension ``dim`` is a symbol of a ``ShapeEnv`` (``DimDynamic.DYNAMIC``, range
``[2, max]``), with the same machinery as :func:`memplan.torch.capture.trace.capture_step`
(fakes swapped into the user's objects, calls of stateful objects marked, HF's mask shortcut
followed). Kept from it, node by node against the concrete capture at the largest shape:

* the op sequence, which must be the concrete capture's (same ops, same constant arguments,
  same storages shared), else the symbolic capture is not used;
* every size as an expression in the symbols: each argument the program computed from the
  length (a ``view``'s shape, ``arange``'s end, a mask's size) and each tensor's shape, strides,
  storage offset and storage bytes;
* the guards the program's Python raised on the symbols (a branch on the length, ``% 2``, a
  size compared in an ``if``) and the range they were traced under.

For a new length, :meth:`SymbolicStep.instantiate` evaluates the guards and the expressions
there (sympy on integers: exact) and builds that length's capture from the largest one's
program without tracing: the same nodes with the evaluated arguments and tensors of the
evaluated layouts. Every integer expression is checked to give the concrete capture's value at
the largest shape before any length uses it. Where a guard fails, a length lies outside the
traced range, the program computed a float from the length (its rounding is Python's, not
sympy's) or pinned the symbol to one value, the caller traces that length as before.
"""

from __future__ import annotations

import dataclasses
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree

import torch
from memplan.graph.ir import Graph
from memplan.torch.capture.casts import guarded_casts
from memplan.torch.capture.fake import CaptureFakeMode, fake_mode_of, real_writes_undone, take_literals
from memplan.torch.capture.generator import watching_generators
from memplan.torch.capture.hf_masks import follow_mask_shortcuts
from memplan.torch.capture.literals import is_literal, literal_key
from memplan.torch.capture.regions import RegionRecorder
from memplan.torch.capture.swap import FakeSwap
from memplan.torch.capture.trace import (
    Capture,
    _gradients_left,
    _GradRecorder,
    _guarded,
    op_flops,
    optimizer_state_meta,
    steady_like,
)
from memplan.torch.tensors import storage_key

SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)
_ASSERTS = frozenset({"aten::_assert_scalar", "aten::sym_constrain_range", "aten::sym_constrain_range_for_size"})
LOWEST = 2  # PyTorch specialises sizes 0 and 1: a symbol stands for lengths from 2 up


class NotSymbolic(Exception):
    """The symbolic capture cannot stand for the step (the message says why, one line)."""


@dataclass(frozen=True)
class _Layout:
    """One tensor of a node's value: where its shape, strides, offset come from (indices into
    the step's expressions) and which storage it lives in."""

    position: int  # leaf index in the node's value
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    storage: int  # storage group


@dataclass
class _NodePlan:
    """How one node of the largest capture is made at another length."""

    node: torch.fx.Node  # the largest capture's node
    args: list[tuple[int, int]] = field(default_factory=list)  # (leaf position in (args, kwargs), expression)
    layouts: list[_Layout] = field(default_factory=list)  # its tensors that live in a storage that varies


@dataclass
class SymbolicStep:
    """The largest capture (``template``) with its sizes as expressions in the batch's symbols."""

    template: Capture
    leaf_symbols: dict[int, dict[int, sympy.Symbol]]  # batch leaf -> dim -> symbol
    ranges: dict[sympy.Symbol, tuple[int, int]]
    hints: dict[sympy.Symbol, int]  # the symbols' values in the trace (the largest shape)
    guards: list[sympy.Basic]
    expressions: list[sympy.Expr]
    nodes: list[_NodePlan]
    storages: dict[int, tuple[int, torch.Tensor]]  # storage group -> (expression of its bytes, a template tensor)
    growing: set[int]  # the groups whose bytes depend on a symbol: a new storage at each length
    tensor_storage: dict[int, int]  # graph tensor -> storage group (the groups that vary)
    state_before: dict[str, dict[str, tuple]]  # the optimizers' state when it was traced
    seconds: float = 0.0
    _values: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def check(self, flat: Sequence[Any], spec: Any) -> dict[sympy.Symbol, int] | str:
        """The symbols' values for a flattened batch, or why that batch is not the template's
        program at another length (another structure, dtype, non-tensor leaf, a size outside the
        traced range, a failing guard)."""
        template = self.template
        if spec != template.batch_spec or len(flat) != len(_placeholders(template)):
            return "the batch has another structure"
        values: dict[sympy.Symbol, int] = {}
        for position, (leaf, node) in enumerate(zip(flat, _placeholders(template), strict=True)):
            expected = node.meta.get("val")
            if not isinstance(expected, torch.Tensor):
                if position in template.batch_constants and not _same(leaf, template.batch_constants[position]):
                    return f"batch leaf {position} is another value"
                continue
            if not isinstance(leaf, torch.Tensor) or leaf.dtype != expected.dtype or leaf.dim() != expected.dim():
                return f"batch leaf {position} has another type, dtype or rank"
            dims = self.leaf_symbols.get(position, {})
            for d, size in enumerate(leaf.shape):
                if d in dims:
                    if values.setdefault(dims[d], int(size)) != size:  # dimensions the trace found equal
                        return f"batch leaf {position} has size {size} in dimension {d}, another of its length"
                elif size != expected.shape[d]:
                    return f"batch leaf {position} has size {size} in dimension {d}, the capture {expected.shape[d]}"
        for symbol, (low, high) in self.ranges.items():
            if not low <= values[symbol] <= high:
                return (
                    f"length {values[symbol]} lies outside [{low}, {high}], the lengths the traced program holds "
                    "for (a branch on the length?)"
                )
        at_hints = all(values[s] == v for s, v in self.hints.items())
        for guard in self.guards:
            if _is_float(guard) and not at_hints:  # sympy's float rounding is not Python's: hold it at the trace's
                return f"the step computes a float from the length ({guard})"
            if guard.xreplace({s: sympy.Integer(v) for s, v in values.items()}) is not sympy.true:
                return f"the guard {guard} fails at {_text(values)}"
        return values

    def evaluate(self, values: dict[sympy.Symbol, int]) -> list[int]:
        """Every expression at ``values`` (cached per point)."""
        key = tuple(values[s] for s in sorted(values, key=str))
        if key not in self._values:
            subs = {s: sympy.Integer(v) for s, v in values.items()}
            self._values[key] = [_integer(e.xreplace(subs)) for e in self.expressions]
        return self._values[key]

    def instantiate(
        self, batch: Any, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]
    ) -> Capture | str:
        """The capture of the step at ``batch``'s length, made from the template's program
        without tracing; or why it cannot be (then the caller traces the step)."""
        start = time.perf_counter()
        flat, spec = pytree.tree_flatten(batch)
        values = self.check(flat, spec)
        if isinstance(values, str):
            return values
        for guard in self.template.mask_guards:
            if guard.decide(flat[guard.leaf]) != guard.expected:
                return f"HF's mask shortcut ({guard.name}) decides otherwise for this batch"
        if state_meta(model, optimizers) not in (self.template.optimizer_state_meta, self.state_before):
            return "the optimizers' state is neither the traced one nor the state the step leaves"
        try:
            capture = self._build(self.evaluate(values))
        except Exception as err:  # the program cannot be made here: the caller traces it instead
            return f"the program could not be made at {_text(values)}: {type(err).__name__}: {_first_line(err)}"
        capture.capture_seconds = time.perf_counter() - start
        return capture

    def _build(self, value: list[int]) -> Capture:
        template = self.template
        mode = _fake_mode(template)
        storages = {
            g: _storage(value[nbytes]) if g in self.growing else tensor.untyped_storage()
            for g, (nbytes, tensor) in self.storages.items()
        }
        graph = torch.fx.Graph(tracer_cls=template.gm.graph._tracer_cls)
        graph._codegen = template.gm.graph._codegen  # make_fx's pytree signature: the same code as a trace's
        new: dict[torch.fx.Node, torch.fx.Node] = {}
        keys: dict[int, int] = {}
        flops: dict[str, int] = {}
        plans = iter(self.nodes)
        plan = next(plans, None)
        remade: set[torch.fx.Node] = set()
        for node in template.gm.graph.nodes:
            copy = graph.node_copy(node, new.__getitem__)
            new[node] = copy
            if plan is not None and plan.node is node:
                if plan.args:
                    copy.args, copy.kwargs = _substituted((copy.args, copy.kwargs), plan.args, value)
                if plan.layouts:
                    copy.meta = dict(copy.meta)
                    copy.meta["val"] = _value(node.meta["val"], plan.layouts, value, storages, mode, keys)
                remade.add(copy)
                plan = next(plans, None)
            elif not any(arg in remade for arg in copy.all_input_nodes):
                continue
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                flops[node.name] = op_flops(copy)
        gm = torch.fx.GraphModule(template.gm, graph)
        return dataclasses.replace(
            template,
            graph=self._graph(value, flops),
            gm=gm,
            tensor_of_storage={keys.get(k, k): t for k, t in template.tensor_of_storage.items()},
            grad_storage_by_param={p: keys.get(k, k) for p, k in template.grad_storage_by_param.items()},
            regions=[
                dataclasses.replace(r, grads={p: (keys.get(g[0], g[0]), *g[1:]) for p, g in r.grads.items()})
                for r in template.regions
            ],
            fake_runs=0,
        )

    def _graph(self, value: list[int], flops: dict[str, int]) -> Graph:
        """The template's graph with every varying tensor's bytes and every op's FLOPs at this length."""
        graph = self.template.graph
        tensors = list(graph.tensors)
        for t, group in self.tensor_storage.items():
            tensors[t] = dataclasses.replace(tensors[t], size_bytes=value[self.storages[group][0]])
        ops = tuple(
            dataclasses.replace(op, flops=flops[op.name]) if flops.get(op.name, op.flops) != op.flops else op
            for op in graph.ops
        )
        return Graph(ops, tuple(tensors), graph.name, dict(graph.meta))


def trace_symbolic(
    fn: Callable[[Any], Any],
    batch: Any,
    dims: dict[int, int],
    template: Capture,
    *,
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    scaler: Any = None,
    schedulers: Sequence[Any] = (),
) -> SymbolicStep:
    """Trace the step ``fn(batch)`` with each batch tensor's dimensions in ``dims`` symbolic
    (``batch`` at the largest declared sizes, ``dims[d]``), and relate it to ``template``, the
    concrete capture at that batch. Raises :class:`NotSymbolic` (one line) where it cannot."""
    start = time.perf_counter()
    if template.mode != "train" or fake_mode_of(model) is not None:
        raise NotSymbolic("only training steps of a real model are captured symbolically")
    state_before = state_meta(model, optimizers)
    try:
        objects = (fn, model, list(optimizers), scaler, list(schedulers))
        gm, env, leaf_symbols = _trace(objects, batch, dims, template)
        step = _relate(template, gm, leaf_symbols, env, dims)
    except NotSymbolic:
        raise
    except Exception as err:  # any failure only means: trace each length
        raise NotSymbolic(f"the symbolic capture failed: {type(err).__name__}: {_first_line(err)}") from None
    step.state_before = state_before
    step.seconds = time.perf_counter() - start
    return step


def _trace(
    objects: tuple, batch: Any, dims: dict[int, int], template: Capture
) -> tuple[torch.fx.GraphModule, Any, dict[int, dict[int, sympy.Symbol]]]:
    """:func:`trace_symbolic`'s fake runs, as :func:`memplan.torch.capture.trace.capture_step`
    makes them (fakes swapped into the user's objects, calls of stateful objects marked, HF's
    mask shortcut followed), the batch's dimensions in ``dims`` symbolic; with the recomputed
    copies of ``template`` applied. Returns the program, its ShapeEnv and the batch's symbols."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fn, model, optimizers, scaler, schedulers = objects
    env = ShapeEnv()
    mode = CaptureFakeMode(allow_non_fake_inputs=True, shape_env=env, static_shapes=True)
    mode.cache_enabled = False  # its cache rebuilds symbolic outputs on every hit: slower than no cache
    flat, spec = pytree.tree_flatten(batch)
    symbolic, leaf_symbols = _symbolic_batch(flat, dims, mode)
    steady = steady_like(template, model, optimizers)

    def run(flat_batch: list[Any]) -> Any:
        return fn(pytree.tree_unflatten(flat_batch, spec))

    recorder = RegionRecorder(model, optimizers, scaler, schedulers)
    with (
        real_writes_undone(mode),
        watching_generators(mode),
        FakeSwap(mode, model, optimizers, scaler),
        guarded_casts(model),
        recorder.installed(),
    ):
        take_literals(mode)
        if not steady:  # the optimizers' state made on fakes first, as capture_step does (static shapes)
            with mode:
                _guarded(run, [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in flat])
            if _gradients_left(model) and not template.leaves_gradients:
                raise NotSymbolic("the step leaves gradients its concrete capture did not")
        take_literals(mode)
        recorder.reset()
        with mode:
            grads = _GradRecorder(model)
        try:
            with follow_mask_shortcuts(batch, []):
                gm = make_fx(run, tracing_mode="fake")(symbolic)
        finally:
            grads.remove()
    if template.recomputed:
        from memplan.torch.capture.recompute import recompute_named

        if not recompute_named(gm, template.recomputed):
            raise NotSymbolic("the capture's recomputed copies do not apply to the symbolic program")
    if template.fused_loss:
        from memplan.torch.capture.fused import fuse_loss_backward

        if len(fuse_loss_backward(gm, None, ())) != len(template.fused_loss):
            raise NotSymbolic("the capture's fused loss backward does not apply to the symbolic program")
    if template.written_into:
        from memplan.torch.capture.inplace import write_into_named

        concrete = [n.name for n in template.gm.graph.nodes]
        symbolic = [n.name for n in gm.graph.nodes if not _is_symbolic_arithmetic(n)]
        if len(concrete) != len(symbolic):
            raise NotSymbolic(f"the symbolic program has {len(symbolic)} nodes, the capture {len(concrete)}")
        names = dict(zip(concrete, symbolic, strict=True))  # size arithmetic shifts fx's names
        if not write_into_named(gm, [(names[n], i) for n, i in template.written_into]):
            raise NotSymbolic("the capture's writes over dying inputs do not apply to the symbolic program")
    if [r.kind for r in recorder.regions] != [r.kind for r in template.regions]:
        raise NotSymbolic("the symbolic step makes other calls of its stateful objects")
    return gm, env, leaf_symbols


def state_meta(model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, dict[str, tuple]]:
    """The optimizers' state by parameter name: what each holds, its shapes and dtypes."""
    return {k: v for opt in optimizers for k, v in optimizer_state_meta(model, opt).items()}


def _symbolic_batch(
    flat: Sequence[Any], dims: dict[int, int], mode: FakeTensorMode
) -> tuple[list[Any], dict[int, dict[int, sympy.Symbol]]]:
    """Fakes of the batch leaves, dimensions in ``dims`` symbolic within ``[LOWEST, dims[d]]``."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    env = mode.shape_env
    out: list[Any] = []
    leaf_symbols: dict[int, dict[int, sympy.Symbol]] = {}
    for i, x in enumerate(flat):
        if not isinstance(x, torch.Tensor):
            out.append(x)
            continue
        dynamic = [d in dims and x.shape[d] >= LOWEST for d in range(x.dim())]
        if not any(dynamic):
            out.append(mode.from_tensor(x))
            continue
        context = StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC if dyn else DimDynamic.STATIC for dyn in dynamic]
        )
        fake = mode.from_tensor(x, static_shapes=False, symbolic_context=context, source=ConstantSource(f"batch{i}"))
        leaf_symbols[i] = {}
        for d, dyn in enumerate(dynamic):
            size = fake.shape[d]
            if dyn and isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                env.constrain_symbol_range(size.node.expr, compiler_min=LOWEST, compiler_max=dims[d])
                leaf_symbols[i][d] = size.node.expr
        out.append(fake)
    if not leaf_symbols:
        raise NotSymbolic("no batch tensor has a declared dynamic dimension")
    return out, leaf_symbols


class _Relating:
    """Builds a :class:`SymbolicStep`: walks the concrete and the symbolic program side by side."""

    def __init__(self, template: Capture, symbols: set[sympy.Symbol], hints: dict[sympy.Symbol, int]) -> None:
        self.template = template
        self.symbols = symbols
        self.hints = hints
        self.expressions: list[sympy.Expr] = []
        self.index: dict[sympy.Expr, int] = {}
        self.groups: dict[int, int] = {}  # template storage key -> group
        self.sym_groups: dict[int, int] = {}  # symbolic storage key -> group
        self.storages: dict[int, tuple[int, torch.Tensor]] = {}  # group -> (bytes, a template tensor in it)
        self.growing: set[int] = set()  # groups whose bytes depend on a symbol

    def expression(self, value: Any, expected: Any, what: str) -> int:
        """The index of ``value``'s expression (an int or a SymInt), checked to give
        ``expected`` at the largest shape."""
        if isinstance(value, (torch.SymFloat, torch.SymBool, float)):
            raise NotSymbolic(f"{what} is a float or a bool computed from the length")
        expr = sympy.sympify(value.node.expr if isinstance(value, torch.SymInt) else int(value))
        if not expr.free_symbols <= self.symbols:
            raise NotSymbolic(f"{what} depends on a value read from a tensor ({expr})")
        if _integer(expr.xreplace({s: sympy.Integer(v) for s, v in self.hints.items()})) != expected:
            raise NotSymbolic(f"{what} is {expr}, which is not the capture's {expected} at the largest shape")
        if expr not in self.index:
            self.index[expr] = len(self.expressions)
            self.expressions.append(expr)
        return self.index[expr]

    def varies(self, index: int) -> bool:
        return bool(self.expressions[index].free_symbols)

    def group(self, concrete: torch.Tensor, symbolic: torch.Tensor, what: str) -> int:
        """The storage group of a pair of tensors (the same in both programs, else an error)."""
        key, sym_key = storage_key(concrete), storage_key(symbolic)
        group = self.groups.get(key)
        if group is None:
            if sym_key in self.sym_groups:
                raise NotSymbolic(f"{what} shares a storage in one program only")
            group = self.groups[key] = self.sym_groups[sym_key] = len(self.groups)
            nbytes = symbolic.untyped_storage().nbytes()
            index = self.expression(nbytes, concrete.untyped_storage().nbytes(), f"the storage of {what}")
            self.storages[group] = (index, concrete)
            if self.varies(index):
                self.growing.add(group)
        elif self.sym_groups.get(sym_key) != group:
            raise NotSymbolic(f"{what} shares a storage in one program only")
        return group

    def remade(self, layout: _Layout) -> bool:
        """Whether a tensor is made anew at another length: its storage or its layout varies."""
        return layout.storage in self.growing or any(
            self.varies(i) for i in (*layout.shape, *layout.stride, layout.offset)
        )


def _relate(
    template: Capture,
    gm: torch.fx.GraphModule,
    leaf_symbols: dict[int, dict[int, sympy.Symbol]],
    env: Any,
    dims: dict[int, int],
) -> SymbolicStep:
    """Pair the symbolic program's nodes with the concrete capture's and record every size
    as an expression (checked at the largest shape); the guards and ranges of the trace."""
    symbols = {s for d in leaf_symbols.values() for s in d.values()}
    hints = {s: int(env.backed_var_to_val[s]) for s in symbols}
    for symbol in symbols:
        replaced = env.replacements.get(symbol)
        if replaced is not None and not replaced.free_symbols:
            raise NotSymbolic(f"the step pins the length to {replaced} (a Python int made from it?)")
    relating = _Relating(template, symbols, hints)
    concrete = list(template.gm.graph.nodes)
    symbolic = [n for n in gm.graph.nodes if not _is_symbolic_arithmetic(n)]
    if len(concrete) != len(symbolic):
        raise NotSymbolic(f"the symbolic program has {len(symbolic)} nodes, the capture {len(concrete)}")
    pairs = dict(zip(symbolic, concrete, strict=True))
    plans = [_plan(relating, c, s, pairs, gm) for c, s in zip(concrete, symbolic, strict=True)]
    for plan in plans:
        plan.layouts = [lay for lay in plan.layouts if relating.remade(lay)]
    tensor_storage = {
        t: relating.groups[key]
        for key, t in template.tensor_of_storage.items()
        if relating.groups.get(key) in relating.growing
    }
    guards = [g.expr for g in env.guards]
    guards += [ra.expr for asserts in env.deferred_runtime_asserts.values() for ra in asserts]
    guards += [sympy.Eq(s, r) for s, r in env.replacements.items() if s in symbols]  # found equal: recorded twice
    guards += [sympy.Eq(m, 0) for m in getattr(env, "divisible", ())]
    for guard in guards:
        if not guard.free_symbols <= symbols:
            raise NotSymbolic(f"a guard depends on a value read from a tensor ({guard})")
    ranges = {s: (max(LOWEST, int(env.var_to_range[s].lower)), _upper(env, s, dims)) for s in symbols}
    return SymbolicStep(
        template,
        leaf_symbols,
        ranges,
        hints,
        guards,
        relating.expressions,
        [p for p in plans if p.args or p.layouts],
        dict(relating.storages),
        relating.growing,
        tensor_storage,
        {},
    )


def _upper(env: Any, symbol: sympy.Symbol, dims: dict[int, int]) -> int:
    upper = env.var_to_range[symbol].upper
    return int(upper) if upper.is_finite else max(dims.values())


def _plan(
    relating: _Relating,
    concrete: torch.fx.Node,
    symbolic: torch.fx.Node,
    pairs: dict[torch.fx.Node, torch.fx.Node],
    gm: torch.fx.GraphModule,
) -> _NodePlan:
    """How ``concrete`` is made at another length: checked against its symbolic twin."""
    what = f"node {concrete.name}"
    if concrete.op != symbolic.op or (concrete.op == "call_function" and concrete.target != symbolic.target):
        raise NotSymbolic(f"{what} is {concrete.target}, the symbolic program has {symbolic.target} there")
    plan = _NodePlan(concrete)
    if concrete.op == "get_attr":
        _same_attribute(relating.template.gm, concrete, gm, symbolic)
        return plan
    c_leaves, c_spec = pytree.tree_flatten((concrete.args, concrete.kwargs))
    s_leaves, s_spec = pytree.tree_flatten((symbolic.args, symbolic.kwargs))
    if c_spec != s_spec:
        raise NotSymbolic(f"{what} has other arguments in the symbolic program")
    for position, (c, s) in enumerate(zip(c_leaves, s_leaves, strict=True)):
        if isinstance(s, torch.fx.Node) and isinstance(s.meta.get("val"), SYM_TYPES):
            index = relating.expression(s.meta["val"], c, f"an argument of {what}")
            if index >= 0:
                plan.args.append((position, index))
        elif isinstance(s, torch.fx.Node):
            if pairs.get(s) is not c:
                raise NotSymbolic(f"{what} reads another node in the symbolic program")
        elif isinstance(s, SYM_TYPES) or type(c) is not type(s) or not _equal(c, s):
            raise NotSymbolic(f"{what} has the constant {c!r} where the symbolic program has {s!r}")
    plan.layouts = _layouts(relating, concrete, symbolic, what)
    return plan


def _layouts(relating: _Relating, concrete: torch.fx.Node, symbolic: torch.fx.Node, what: str) -> list[_Layout]:
    c_leaves, c_spec = pytree.tree_flatten(concrete.meta.get("val"))
    s_leaves, s_spec = pytree.tree_flatten(symbolic.meta.get("val"))
    if c_spec != s_spec:
        raise NotSymbolic(f"{what} has another value in the symbolic program")
    layouts = []
    for position, (c, s) in enumerate(zip(c_leaves, s_leaves, strict=True)):
        if not isinstance(c, torch.Tensor):
            if isinstance(s, (*SYM_TYPES, torch.Tensor)):
                raise NotSymbolic(f"{what} has a symbolic value")
            continue
        if not isinstance(s, torch.Tensor) or (c.dtype, c.device, c.layout) != (s.dtype, s.device, s.layout):
            raise NotSymbolic(f"{what} has another tensor in the symbolic program")
        if c.layout != torch.strided or c.dim() != s.dim():
            raise NotSymbolic(f"{what} is not a strided tensor of the same rank")
        exprs = [relating.expression(x, y, f"a size of {what}") for x, y in zip(s.shape, c.shape, strict=True)]
        strides = [
            relating.expression(x, y, f"a stride of {what}") for x, y in zip(s.stride(), c.stride(), strict=True)
        ]
        offset = relating.expression(s.storage_offset(), c.storage_offset(), f"the offset of {what}")
        group = relating.group(c, s, what)
        layouts.append(
            _Layout(position, c.dtype, c.device, c.requires_grad, tuple(exprs), tuple(strides), offset, group)
        )
    return layouts


def _same_attribute(c_gm: torch.fx.GraphModule, c: torch.fx.Node, s_gm: torch.fx.GraphModule, s: torch.fx.Node) -> None:
    """A constant of the program (a parameter, a literal) has the same static layout, and a
    literal the same value, in both programs."""
    a, b = getattr(c_gm, c.target), getattr(s_gm, s.target)
    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        raise NotSymbolic(f"the constant {c.target} differs in the symbolic program")
    if not isinstance(a, torch.Tensor):
        return
    if any(isinstance(x, torch.SymInt) for x in (*b.shape, *b.stride())) or (a.shape, a.dtype) != (b.shape, b.dtype):
        raise NotSymbolic(f"the constant {c.target} has another shape in the symbolic program")
    if is_literal(c) and literal_key(a) != literal_key(b):
        raise NotSymbolic(f"the literal {c.target} has another value in the symbolic program")


def _is_symbolic_arithmetic(node: torch.fx.Node) -> bool:
    """A node the symbolic program adds: size reads, arithmetic on sizes, asserts on them."""
    if node.op != "call_function":
        return False
    if isinstance(node.meta.get("val"), SYM_TYPES):
        return True
    schema = getattr(node.target, "_schema", None)
    return (schema is not None and schema.name in _ASSERTS) or node.target in _SYM_FUNCTIONS


_SYM_FUNCTIONS = frozenset({operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.neg})


def _fake_mode(template: Capture) -> FakeTensorMode:
    for node in template.gm.graph.nodes:
        for leaf in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(leaf, FakeTensor):
                return leaf.fake_mode
    raise NotSymbolic("the capture holds no fake tensor")


def _storage(nbytes: int) -> Any:
    return torch.empty((nbytes,), dtype=torch.uint8, device="meta").untyped_storage()


def _value(
    old: Any,
    layouts: list[_Layout],
    value: list[int],
    storages: dict[int, Any],
    mode: FakeTensorMode,
    keys: dict[int, int],
) -> Any:
    """A node's value at another length: each tensor in a varying storage made anew (a meta
    tensor of the evaluated layout on that length's storage, wrapped as a fake of the
    template's mode), every other leaf the template's own."""
    leaves, spec = pytree.tree_flatten(old)
    for lay in layouts:
        meta = torch.empty((0,), dtype=lay.dtype, device="meta").set_(
            storages[lay.storage],
            value[lay.offset],
            [value[i] for i in lay.shape],
            [value[i] for i in lay.stride],
        )
        fake = FakeTensor(mode, meta, lay.device)
        if lay.requires_grad:
            fake.requires_grad_(True)
        keys[storage_key(leaves[lay.position])] = storage_key(fake)
        leaves[lay.position] = fake
    return pytree.tree_unflatten(leaves, spec)


def _substituted(args: Any, positions: list[tuple[int, int]], value: list[int]) -> Any:
    leaves, spec = pytree.tree_flatten(args)
    for position, index in positions:
        leaves[position] = value[index]
    return pytree.tree_unflatten(leaves, spec)


def _placeholders(capture: Capture) -> list[torch.fx.Node]:
    return [n for n in capture.gm.graph.nodes if n.op == "placeholder"]


def _is_float(expr: sympy.Basic) -> bool:
    """Whether an expression computes with floats (a Python float made from a size)."""
    names = {type(f).__name__ for f in expr.atoms(sympy.Function)}
    return bool(expr.atoms(sympy.Float)) or any("Float" in n or "TrueDiv" in n for n in names)


def _integer(expr: Any) -> int:
    if isinstance(expr, int):
        return expr
    if not getattr(expr, "is_Integer", False):
        raise NotSymbolic(f"the size {expr} is not an integer")
    return int(expr)


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # no plain equality: only the same object is the same
        return a is b


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and not isinstance(a, torch.Tensor) and _equal(a, b)


def _text(values: dict[sympy.Symbol, int]) -> str:
    return ", ".join(f"{s} = {v}" for s, v in sorted(values.items(), key=lambda item: str(item[0])))


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:200]


__all__ = ["NotSymbolic", "SymbolicStep", "state_meta", "trace_symbolic"]
