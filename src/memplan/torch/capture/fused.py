"""The loss's backward in row chunks, written over the log-probabilities: one vocabulary-sized
buffer less at the step's peak.

A language model's cross-entropy is ``log_softmax`` then ``nll_loss``. Its backward makes the
gradient of the log-probabilities (``nll_loss_backward``: zeros but at each row's target) and
turns it into the logits' gradient (``_log_softmax_backward_data``), which reads the
log-probabilities too. Chen et al.'s in-place sharing (:mod:`.inplace`) writes the result over
that zero-filled gradient, but the gradient and the log-probabilities are still both resident:
two ``rows x vocabulary`` buffers at once, the floor of every plan of a small LM (GPT-2 with 2
layers at batch 30: 2.14 GiB, 1.44 GiB of it these two; no recomputation lowers it; fused:
1.57 GiB, ``memplan remat gpt2-2l -b 30 --optimizer adamw --budget 1.5e9`` names both).
``torch.compile`` fuses the pair into one kernel that needs neither.

:func:`fuse_loss_backward` replaces the pair with one op,
``memplan_loss::nll_log_softmax_backward.out``, that makes the zero-filled gradient a few rows
at a time and writes each chunk's result over the log-probabilities' rows, which die there. The
bits are the pair's: both kernels work row by row (``nll_loss_backward`` writes each row from its
target, the weight and the forward's ``total_weight``; the CPU ``_log_softmax_backward_data``
reduces a row before writing it, each element read before it is written: the rule
:data:`memplan.torch.capture.inplace.INPLACE_ROWWISE` rests on), tested bit for bit against the
pair on every reduction, with and without class weights and ignored rows.

The pair is fused only where that is exact in every order a planner may choose, as for the
in-place rewrite: CPU, float32, 2-D log-probabilities reduced over their last dimension that
cover their storage; the gradient read by nothing else; every other node touching the
log-probabilities' storage an ancestor of the fused op; and neither storage one the step does not
own (an input, a parameter, a gradient, what it returns).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.fx

import torch
from memplan.torch.capture.inplace import (
    PLANNED_PHASES,
    _protected_storages,
    _storage_touchers,
    move_views,
    same_dense_layout,
)
from memplan.torch.tensors import storage_key

CHUNK_BYTES = 4 * 2**20
"""The rows of one chunk hold about this many bytes of the gradient (at least one row)."""

_LIB = torch.library.Library("memplan_loss", "DEF")  # the op lives as long as the process
_LIB.define(
    "nll_log_softmax_backward.out(Tensor grad_loss, Tensor output, Tensor target, Tensor? weight, int reduction, "
    "SymInt ignore_index, Tensor total_weight, int dim, ScalarType input_dtype, *, Tensor(a!) out) -> Tensor(a!)",
    tags=torch.Tag.out,
)


def _nll_log_softmax_backward_out(
    grad_loss: torch.Tensor,
    output: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    reduction: int,
    ignore_index: int,
    total_weight: torch.Tensor,
    dim: int,
    input_dtype: torch.dtype,
    *,
    out: torch.Tensor,
) -> torch.Tensor:
    """``_log_softmax_backward_data(nll_loss_backward(grad_loss, output, ...), output, dim,
    input_dtype)`` into ``out`` (the log-probabilities themselves, or a buffer of their layout),
    :data:`CHUNK_BYTES` of rows at a time."""
    aten = torch.ops.aten
    rows = output.shape[0]
    step = max(1, CHUNK_BYTES // max(1, output[0].numel() * output.element_size()))
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        grad = grad_loss[lo:hi] if reduction == 0 else grad_loss  # "none": one gradient per row
        rows_out = output[lo:hi]
        chunk = aten.nll_loss_backward(grad, rows_out, target[lo:hi], weight, reduction, ignore_index, total_weight)
        aten._log_softmax_backward_data.out(chunk, rows_out, dim, input_dtype, out=out[lo:hi])
        del chunk
    return out


_LIB.impl("nll_log_softmax_backward.out", _nll_log_softmax_backward_out, "CPU")
_LIB.impl("nll_log_softmax_backward.out", lambda *args, out: out, "Meta")
FUSED = torch.ops.memplan_loss.nll_log_softmax_backward.out
_ALIASES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def fuse_loss_backward(
    gm: torch.fx.GraphModule, phases: dict[str, str] | None, grad_storages: Iterable[int]
) -> list[str]:
    """Replace each ``nll_loss_backward`` -> ``_log_softmax_backward_data`` pair of ``gm`` that
    may be fused (module docstring) by :data:`FUSED` writing over the log-probabilities; returns
    the fused nodes' names. ``phases``: node name -> its op's phase (only the forward's and
    backward's ops are fused; None: not checked, for a trace whose template was)."""
    nodes = list(gm.graph.nodes)
    protected = _protected_storages(nodes, grad_storages)
    touching = _storage_touchers(nodes)
    fused: list[str] = []
    for node in nodes:
        pair = _fusable(node, phases, protected, touching)
        if pair is not None:
            fused.append(_fuse(gm, node, pair, touching).name)
    if fused:
        gm.graph.lint()
        gm.recompile()
    return fused


def _fusable(
    node: torch.fx.Node,
    phases: dict[str, str] | None,
    protected: set[int],
    touching: dict[int, set[torch.fx.Node]],
) -> torch.fx.Node | None:
    """The ``nll_loss_backward`` node ``node`` (a ``_log_softmax_backward_data``) may be fused
    with, or None."""
    aten = torch.ops.aten
    if node.op != "call_function" or node.target is not aten._log_softmax_backward_data.default:
        return None
    grad, logp, dim, input_dtype = node.args
    if not isinstance(grad, torch.fx.Node) or grad.target is not aten.nll_loss_backward.default:
        return None
    read = grad.args[1]  # the log-probabilities again, often through another alias (autograd's detach)
    if not isinstance(logp, torch.fx.Node) or not isinstance(read, torch.fx.Node) or list(grad.users) != [node]:
        return None
    if phases is not None and not {phases.get(node.name), phases.get(grad.name)} <= PLANNED_PHASES:
        return None
    value, result = logp.meta.get("val"), node.meta.get("val")
    if not isinstance(value, torch.Tensor) or not isinstance(result, torch.Tensor):
        return None
    if value.device.type != "cpu" or value.dtype != torch.float32 or input_dtype != torch.float32:
        return None
    if value.dim() != 2 or dim not in (1, -1) or not same_dense_layout(value, result):
        return None
    if not isinstance(read.meta.get("val"), torch.Tensor) or not same_dense_layout(read.meta["val"], value):
        return None
    if storage_key(read.meta["val"]) != storage_key(value):
        return None
    if {storage_key(value), storage_key(result), storage_key(grad.meta["val"])} & protected:
        return None
    if sum(1 for a in node.args if a is logp) != 1:
        return None
    others = touching.get(storage_key(value), set()) - {node, grad}
    return grad if others <= _ancestors(node) else None


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    """Every node ``node`` depends on through its inputs."""
    seen: set[torch.fx.Node] = set()
    frontier = list(node.all_input_nodes)
    while frontier:
        current = frontier.pop()
        if current not in seen:
            seen.add(current)
            frontier.extend(current.all_input_nodes)
    return seen


def _fuse(
    gm: torch.fx.GraphModule, node: torch.fx.Node, grad: torch.fx.Node, touching: dict[int, set[torch.fx.Node]]
) -> torch.fx.Node:
    """The fused node in place of ``grad`` -> ``node``; views of ``node``'s result move onto the
    log-probabilities' storage (:func:`memplan.torch.capture.inplace.move_views`)."""
    grad_loss, logp, target, weight, reduction, ignore_index, total_weight = grad.args
    _, _, dim, input_dtype = node.args
    with gm.graph.inserting_before(node):
        fused = gm.graph.call_function(
            FUSED,
            (grad_loss, logp, target, weight, reduction, ignore_index, total_weight, dim, input_dtype),
            {"out": logp},
        )
    fused.meta = dict(node.meta)
    base = logp.meta["val"]
    fused.meta["val"] = base
    old = storage_key(node.meta["val"])
    readers = move_views(base, old, touching.pop(old, set()) - {node})
    node.replace_all_uses_with(fused)
    gm.graph.erase_node(node)
    gm.graph.erase_node(grad)
    gone = {node, grad} | _erase_dead_aliases(gm, touching.get(storage_key(base), set()) - {node, grad})
    for users in touching.values():
        users.difference_update(gone)
    touching.setdefault(storage_key(base), set()).update(readers | {fused})
    return fused


def _erase_dead_aliases(gm: torch.fx.GraphModule, nodes: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """Erase the aliases among ``nodes`` (``detach``, ``alias``) that nothing reads, until none
    is left: autograd's saved copies of the log-probabilities, read by no op of the program,
    whose values the runtime would otherwise hold, and with them the storage the fused op
    writes the logits' gradient into, to the end of the step. Returns the erased nodes."""
    erased: set[torch.fx.Node] = set()
    dead = [n for n in nodes if n.op == "call_function" and n.target in _ALIASES and not n.users]
    while dead:
        current = dead.pop()
        source = current.args[0]
        gm.graph.erase_node(current)
        erased.add(current)
        if isinstance(source, torch.fx.Node) and source.target in _ALIASES and not source.users:
            dead.append(source)
    return erased

