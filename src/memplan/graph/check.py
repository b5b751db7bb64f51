"""Validators written apart from every algorithm: they check answers from first principles."""

from __future__ import annotations

from collections.abc import Sequence

from memplan.errors import (
    CycleError,
    DanglingReference,
    DuplicateName,
    InvalidOrder,
    NegativeSize,
    ProducerError,
)
from memplan.graph.ir import Category, Graph


def validate_graph(graph: Graph) -> None:
    """Raise a typed :class:`~memplan.errors.GraphError` if ``graph`` is malformed.

    Checks: unique op and tensor names; every referenced tensor exists; every tensor has
    exactly one producer; sizes are >= 0 and control edges have size 0; the graph is
    acyclic and ``graph.ops`` (the program order) is topological.
    """
    _check_unique([op.name for op in graph.ops], "op")
    _check_unique([t.name for t in graph.tensors], "tensor")
    n_tensors = len(graph.tensors)
    producers: list[list[int]] = [[] for _ in range(n_tensors)]
    for op_id, op in enumerate(graph.ops):
        for t in (*op.inputs, *op.outputs):
            if not 0 <= t < n_tensors:
                raise DanglingReference(f"op {op.name!r} refers to tensor #{t}, which does not exist")
        for t in op.outputs:
            producers[t].append(op_id)
        for t in op.mutates:
            if t not in op.inputs:
                raise DanglingReference(f"op {op.name!r} mutates tensor #{t} without reading it")
    for t_id, tensor in enumerate(graph.tensors):
        if len(producers[t_id]) != 1:
            names = [graph.ops[p].name for p in producers[t_id]]
            raise ProducerError(
                f"tensor {tensor.name!r} has {len(names)} producers {names}; each tensor needs exactly one"
            )
        if tensor.size_bytes < 0:
            raise NegativeSize(f"tensor {tensor.name!r} has negative size {tensor.size_bytes}")
        if tensor.category is Category.CONTROL and tensor.size_bytes != 0:
            raise NegativeSize(f"control edge {tensor.name!r} must have size 0, not {tensor.size_bytes}")
    _check_program_order(graph)


def _check_unique(names: Sequence[str], what: str) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise DuplicateName(f"{what} name {name!r} is used twice; names must be unique")
        seen.add(name)


def _check_program_order(graph: Graph) -> None:
    producer = graph.producer
    for op_id, op in enumerate(graph.ops):
        for t in op.inputs:
            if producer[t] >= op_id:
                if _has_cycle(graph):
                    raise CycleError(f"the graph has a cycle through op {op.name!r}; graphs must be acyclic")
                raise InvalidOrder(
                    f"program order is not topological: op {op.name!r} reads "
                    f"{graph.tensors[t].name!r}, produced later by {graph.ops[producer[t]].name!r}"
                )


def _has_cycle(graph: Graph) -> bool:
    indegree = [len(p) for p in graph.predecessors]
    ready = [v for v, d in enumerate(indegree) if d == 0]
    seen = 0
    while ready:
        v = ready.pop()
        seen += 1
        for s in graph.successors[v]:
            indegree[s] -= 1
            if indegree[s] == 0:
                ready.append(s)
    return seen != len(graph.ops)


def validate_order(graph: Graph, order: Sequence[int]) -> None:
    """Raise :class:`~memplan.errors.InvalidOrder` unless ``order`` runs every op once, after
    all the producers of its inputs (data, control, mutation and RNG edges alike)."""
    if len(order) != len(graph.ops):
        raise InvalidOrder(f"order has {len(order)} ops, the graph has {len(graph.ops)}")
    position = [-1] * len(graph.ops)
    for t, op_id in enumerate(order):
        if not 0 <= op_id < len(graph.ops):
            raise InvalidOrder(f"order names op #{op_id}, which does not exist")
        if position[op_id] != -1:
            raise InvalidOrder(f"order runs op {graph.ops[op_id].name!r} twice")
        position[op_id] = t
    for op_id, preds in enumerate(graph.predecessors):
        for p in preds:
            if position[p] >= position[op_id]:
                raise InvalidOrder(f"order runs {graph.ops[op_id].name!r} before its predecessor {graph.ops[p].name!r}")
