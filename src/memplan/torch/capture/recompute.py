"""Recompute copies in the backward instead of keeping them from the forward.

Chen et al. (section 4.3) note that some recomputation is free: an op that only copies its
inputs (``cat``, ``stack``, ``clone``) can be run again in the backward from inputs that are
resident there anyway, and a copy gives the same bits every time. A U-Net's decoder keeps
each ``cat(skip, upsampled)`` for its convolution's backward although the skip connection is
kept too; recomputing the ``cat`` before the backward reads it keeps only the upsampled half.

The rewrite works on the captured fx program: a copy node read both in the forward and in the
backward gets a twin, placed just before its first backward reader, that the backward readers
read instead. A twin is kept only if it lowers the step's peak (the one estimator, in program
order) and nothing writes the copy's inputs in between.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.fx

import torch
from memplan.graph.ir import Graph
from memplan.graph.liveness import peak_bytes
from memplan.torch.capture.marks import BACKWARD_MARK
from memplan.torch.tensors import storage_key, tensor_leaves, written_storages

COPY_OPS = frozenset({"aten::cat", "aten::stack", "aten::clone"})
MAX_TRIED = 16  # each try rebuilds the graph: the largest copies are the ones that can matter


def recompute_copies(gm: torch.fx.GraphModule, to_graph: Callable[[torch.fx.GraphModule], Graph]) -> list[str]:
    """Give every profitable copy node a backward twin (see the module docstring); returns the
    names of the copies recomputed. ``to_graph`` builds the memplan graph of ``gm``."""
    nodes = list(gm.graph.nodes)
    start = _backward_start(nodes)
    if start is None:
        return []
    position = {node: i for i, node in enumerate(nodes)}
    best = _program_peak(gm, to_graph)
    recomputed: list[str] = []
    for node in sorted(_candidates(nodes, position, start), key=_size, reverse=True)[:MAX_TRIED]:
        if _inputs_written_before(node, position, start, nodes):
            continue
        twin, readers = _add_twin(gm, node, position, start)
        peak = _program_peak(gm, to_graph)
        if peak < best:
            best = peak
            recomputed.append(node.name)
        else:
            _remove_twin(gm, node, twin, readers)
    return recomputed


def recompute_named(gm: torch.fx.GraphModule, names: list[str]) -> bool:
    """Give the copies ``names`` their backward twins, as :func:`recompute_copies` chose them at
    another batch shape (issue 37), without searching again; False (``gm`` left as it was)
    when one of them is not a copy read on both sides of the backward mark here, or an op
    writes its inputs in between."""
    nodes = list(gm.graph.nodes)
    start = _backward_start(nodes)
    if not names:
        return True
    if start is None:
        return False
    position = {node: i for i, node in enumerate(nodes)}
    candidates = {node.name: node for node in _candidates(nodes, position, start)}
    chosen = [candidates.get(name) for name in names]
    if any(node is None or _inputs_written_before(node, position, start, nodes) for node in chosen):
        return False
    for node in chosen:
        _add_twin(gm, node, position, start)
    return True


def _backward_start(nodes: list[torch.fx.Node]) -> int | None:

    for i, node in enumerate(nodes):
        if node.op == "call_function" and node.args and node.args[0] == BACKWARD_MARK:
            return i
    return None


def _candidates(nodes: list[torch.fx.Node], position: dict, start: int) -> list[torch.fx.Node]:
    found = []
    for node in nodes[:start]:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target._schema.name not in COPY_OPS or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        uses = [position.get(u, len(nodes)) for u in node.users]
        if any(p < start for p in uses) and any(p > start for p in uses):
            found.append(node)
    return found


def _size(node: torch.fx.Node) -> int:
    return node.meta["val"].untyped_storage().nbytes()


def _inputs_written_before(node: torch.fx.Node, position: dict, start: int, nodes: list[torch.fx.Node]) -> bool:
    """Whether an op between ``node`` and its first backward reader writes one of its inputs."""

    keys = {storage_key(t) for a in node.all_input_nodes for t in tensor_leaves(a.meta.get("val"))}
    first_backward = min(position[u] for u in node.users if position[u] > start)
    between = nodes[position[node] + 1 : first_backward]
    ops = [n for n in between if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
    return any(keys.intersection(written_storages(n)) for n in ops)


def _add_twin(
    gm: torch.fx.GraphModule, node: torch.fx.Node, position: dict, start: int
) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    readers = sorted((u for u in node.users if position[u] > start), key=position.__getitem__)
    with gm.graph.inserting_before(readers[0]):
        twin = gm.graph.call_function(node.target, node.args, node.kwargs)
    position[twin] = position[readers[0]] - 0.5
    fake_mode = node.meta["val"].fake_mode
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    with fake_mode:
        twin.meta["val"] = node.target(*args, **kwargs)
    for reader in readers:
        reader.replace_input_with(node, twin)
    return twin, readers


def _remove_twin(gm: torch.fx.GraphModule, node: torch.fx.Node, twin: torch.fx.Node, readers: list) -> None:
    for reader in readers:
        reader.replace_input_with(twin, node)
    gm.graph.erase_node(twin)


def _program_peak(gm: torch.fx.GraphModule, to_graph: Callable[[torch.fx.GraphModule], Graph]) -> int:
    graph = to_graph(gm)
    return peak_bytes(graph, list(range(len(graph.ops))))
