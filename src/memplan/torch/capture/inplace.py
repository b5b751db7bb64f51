"""Write results over dying inputs in the captured program, so every planner counts it.

Chen et al. (section 4.1, "in-place operation"): an op whose input is read by nobody after it
may write its result into that input's memory, and the step needs one buffer less there. The
runtime did this only for plans without offsets (PyTorch's allocator), so the schedule, the
rematerialisation and the placement still counted input and output at once: a GPT-2 LM's
``_log_softmax_backward_data`` holds three vocabulary-sized buffers in every plan (2.10 GiB floor at
batch 20), two with the gradient written over its input.

The rewrite works on the fx program: such a node becomes its ``out=`` overload writing into
that input, so the graph sees an in-place result (an alias handle and a write) in every order.
A node is rewritten only where it is exact in *every* order the planners may choose:

* its kernel reads each element before writing it (:data:`INPLACE_ELEMENTWISE`: TensorIterator
  ops, where full overlap is allowed; :data:`INPLACE_ROWWISE`: CPU row kernels that reduce a row
  before writing it, tested bit for bit against the functional kernel), and has a real out=
  kernel on the tensor's device;
* the input covers its whole storage with the output's dtype, shape and strides, and is read
  once by the node;
* every other node that touches that storage (its maker, views of it, readers) is a data
  ancestor of the node, so no order runs one after the write;
* the storage is made by the step's forward or backward: not a parameter, state, buffer, batch
  input or gradient, not what the step returns, and the node's own result is none of those.

Ops of the optimizer's calls are left alone: the runtime calls the optimizer itself there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.fx
from torch.utils import _pytree as pytree

import torch
from memplan.torch.tensors import storage_key, tensor_leaves

# Elementwise TensorIterator ops: their out= kernel may write over an input of the same layout
# (full overlap is allowed), each element read before it is written.
INPLACE_ELEMENTWISE = frozenset(
    {
        "aten::add.Tensor",
        "aten::sub.Tensor",
        "aten::mul.Tensor",
        "aten::div.Tensor",
        "aten::threshold_backward",
        "aten::sigmoid_backward",
        "aten::tanh_backward",
        "aten::gelu_backward",
        "aten::silu_backward",
        "aten::hardtanh_backward",
        "aten::hardswish_backward",
        "aten::gelu",
        "aten::silu",
        "aten::sigmoid",
        "aten::tanh",
        "aten::hardtanh",
        "aten::hardswish",
        "aten::clamp_min",
        "aten::neg",
        "aten::where.self",
        "aten::native_dropout_backward",
    }
)
# Row-wise kernels (CPU): each row's reductions are taken before any of its elements is written,
# and each element is written only after it was read, so the out= kernel may write over an input
# of the same layout; bit-exactness against the functional kernel is tested. Other devices'
# kernels are not known to keep that order: there these ops are not rewritten.
INPLACE_ROWWISE = frozenset(
    {"aten::_softmax", "aten::_log_softmax", "aten::_softmax_backward_data", "aten::_log_softmax_backward_data"}
)
PLANNED_PHASES = frozenset({"forward", "backward"})


def op_name(node: torch.fx.Node) -> str:
    schema = node.target._schema
    return f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name


def real_out_variant(op: Any, num_outputs: int, device: str = "cpu") -> tuple[Any, tuple[str, ...]]:
    """The ``out=`` overload of ``op`` if it has a real kernel on ``device`` (not a wrapper that
    allocates a temporary and copies), with the names of its out arguments."""
    from torch._library._out_variant import to_out_variant

    try:
        out_op = to_out_variant(op)
    except RuntimeError:
        return None, ()
    key = "CUDA" if device == "cuda" else "CPU"
    if out_op is None or not torch._C._dispatch_has_kernel_for_dispatch_key(out_op.name(), key):
        return None, ()
    names = tuple(a.name for a in out_op._schema.arguments if a.is_out)
    return (out_op, names) if len(names) == num_outputs else (None, ())


def same_dense_layout(value: torch.Tensor, out: torch.Tensor) -> bool:
    """``value`` covers its whole storage with ``out``'s dtype, shape and strides."""
    return (
        value.dtype == out.dtype
        and value.device == out.device
        and value.shape == out.shape
        and value.stride() == out.stride()
        and value.storage_offset() == 0
        and value.is_contiguous()
        and value.untyped_storage().nbytes() == out.untyped_storage().nbytes()
    )


def write_into_dying_inputs(
    gm: torch.fx.GraphModule, phases: dict[str, str], grad_storages: Iterable[int]
) -> list[tuple[str, int]]:
    """Rewrite every node that may write over a dying input (module docstring) into its out=
    overload; ``phases``: node name -> its op's phase in the capture. Returns (node name,
    argument written over) for each node rewritten."""
    nodes = list(gm.graph.nodes)
    protected = _protected_storages(nodes, grad_storages)
    touching = _storage_touchers(nodes)
    written: list[tuple[str, int]] = []
    for node in nodes:
        if phases.get(node.name) not in PLANNED_PHASES:
            continue
        index = _dying_argument(node, protected, touching)
        if index is not None:
            _rewrite(node, index, touching)
            written.append((node.name, index))
    if written:
        gm.recompile()
    return written


def write_into_named(gm: torch.fx.GraphModule, written: list[tuple[str, int]]) -> bool:
    """Rewrite the nodes as :func:`write_into_dying_inputs` chose them in another trace of
    this step (the symbolic one of issue 37), without deciding again; False (``gm`` unchanged)
    when one of them is not a node of the same op with that input to write into."""
    by_name = {n.name: n for n in gm.graph.nodes}
    chosen = []
    for name, index in written:
        node = by_name.get(name)
        if node is None or writing_kernel(node) is None or index >= len(node.args):
            return False
        if not isinstance(node.args[index], torch.fx.Node) or not _read_once(node, node.args[index]):
            return False
        chosen.append((node, index))
    touching = _storage_touchers(list(gm.graph.nodes))
    for node, index in chosen:  # in program order, as they were chosen
        _rewrite(node, index, touching)
    if chosen:
        gm.recompile()
    return True


def writing_kernel(node: torch.fx.Node) -> Any:
    """The out= overload through which ``node``'s kernel may write its result over an input of
    the same layout (the module docstring's first rule), or None."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    name = op_name(node)
    out = node.meta.get("val")
    if name not in INPLACE_ELEMENTWISE | INPLACE_ROWWISE or not isinstance(out, torch.Tensor):
        return None
    if name in INPLACE_ROWWISE and out.device.type != "cpu":
        return None
    return real_out_variant(node.target, 1, out.device.type)[0]


def _dying_argument(node: torch.fx.Node, protected: set[int], touching: dict[int, set[torch.fx.Node]]) -> int | None:
    out = node.meta.get("val")
    if writing_kernel(node) is None or storage_key(out) in protected:
        return None
    for index, arg in enumerate(node.args):
        value = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or not same_dense_layout(value, out):
            continue
        key = storage_key(value)
        if key in protected or not _read_once(node, arg):
            continue
        if _all_ancestors(node, touching.get(key, set()) - {node}):
            return index
    return None


def _read_once(node: torch.fx.Node, arg: torch.fx.Node) -> bool:
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    return sum(1 for leaf in leaves if leaf is arg) == 1


def _all_ancestors(node: torch.fx.Node, others: set[torch.fx.Node]) -> bool:
    """Every node of ``others`` is reached from ``node`` through inputs within ``others``."""
    reached: set[torch.fx.Node] = set()
    frontier = [node]
    while frontier:
        current = frontier.pop()
        for parent in current.all_input_nodes:
            if parent in others and parent not in reached:
                reached.add(parent)
                frontier.append(parent)
    return reached == others


def _protected_storages(nodes: list[torch.fx.Node], grad_storages: Iterable[int]) -> set[int]:
    """Storages the step does not own: inputs, parameters, state, constants, gradients, and
    what it returns."""
    protected = set(grad_storages)
    for node in nodes:
        if node.op in ("placeholder", "get_attr"):
            protected.update(storage_key(v) for v in tensor_leaves(node.meta.get("val")))
        elif node.op == "output":
            for arg in pytree.tree_leaves((node.args, node.kwargs)):
                if isinstance(arg, torch.fx.Node):
                    protected.update(storage_key(v) for v in tensor_leaves(arg.meta.get("val")))
    return protected


def _storage_touchers(nodes: list[torch.fx.Node]) -> dict[int, set[torch.fx.Node]]:
    """Storage key -> the nodes that make, view or read it."""
    touching: dict[int, set[torch.fx.Node]] = {}
    for node in nodes:
        if node.op == "output":
            continue
        for v in tensor_leaves(node.meta.get("val")):
            touching.setdefault(storage_key(v), set()).add(node)
        for arg in pytree.tree_leaves((node.args, node.kwargs)):
            if isinstance(arg, torch.fx.Node):
                for v in tensor_leaves(arg.meta.get("val")):
                    touching.setdefault(storage_key(v), set()).add(node)
    return touching


def _rewrite(node: torch.fx.Node, index: int, touching: dict[int, set[torch.fx.Node]]) -> None:
    """``node`` becomes its out= overload writing into argument ``index``, whose value it
    returns; views of its old result move onto the input's storage, and ``touching`` (storage
    -> the nodes that make, view or read it) follows."""
    source = node.args[index]
    old = storage_key(node.meta["val"])
    out_op, names = real_out_variant(node.target, 1, node.meta["val"].device.type)
    node.target = out_op
    node.kwargs = {**node.kwargs, names[0]: source}
    base = source.meta["val"]
    node.meta["val"] = base
    readers = move_views(base, old, touching.pop(old, set()) - {node})
    touching.setdefault(storage_key(base), set()).update(readers | {node})


def move_views(base: torch.Tensor, old: int, readers: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """The views among ``readers`` (the nodes touching storage ``old``, a result now written
    into ``base``'s storage) as the same views of ``base``; returns ``readers``."""
    for other in readers:
        value = other.meta.get("val")
        if any(storage_key(leaf) == old for leaf in tensor_leaves(value)):
            other.meta["val"] = pytree.tree_map(lambda leaf: _on(base, leaf, old), value)
    return readers


def _on(base: torch.Tensor, leaf: Any, old: int) -> Any:
    """``leaf`` (a view of the storage ``old``) as the same view of ``base``'s storage."""
    if not isinstance(leaf, torch.Tensor) or storage_key(leaf) != old:
        return leaf
    with base.fake_mode, torch.no_grad():
        if leaf.dtype != base.dtype:
            return base.view(leaf.dtype).as_strided(leaf.shape, leaf.stride(), leaf.storage_offset())
        return base.as_strided(leaf.shape, leaf.stride(), leaf.storage_offset())
