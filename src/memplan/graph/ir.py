"""The framework-free dataflow graph of one step (OLLA sections 2.1 and 3.1).

A graph G = (V, E): ops are the vertices, tensors the edges. Every tensor has exactly one
producer op and any number of consumer ops; an op may produce several tensors (OLLA's
siblings, ``sib(e)``). Control edges are tensors of ``Category.CONTROL`` and size 0: they
order two ops without costing memory (OLLA 4.3).

Conventions used everywhere in memplan:

* ``OpId`` and ``TensorId`` are indices into ``Graph.ops`` and ``Graph.tensors``.
* ``Graph.ops`` is listed in *program order*: the order eager PyTorch runs the ops.
* An *order* is a sequence of ``OpId``; position ``t`` in it is timestep ``t``.
* Intervals are half-open, ``[start, end)``, in timesteps.
* A *persistent* tensor is resident for the whole step (parameters, optimizer state, model
  buffers, and the caller's input batch); every other tensor lives from its producer's
  timestep to its last consumer's timestep (outputs: to the end of the step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import NewType

OpId = NewType("OpId", int)
TensorId = NewType("TensorId", int)


class Category(str, Enum):
    """What a tensor is in the training step."""

    PARAMETER = "parameter"
    OPTIMIZER_STATE = "optimizer_state"
    BUFFER = "buffer"
    INPUT = "input"
    ACTIVATION = "activation"
    GRADIENT = "gradient"
    TEMPORARY = "temporary"
    OUTPUT = "output"
    CONTROL = "control"


PERSISTENT_CATEGORIES = frozenset({Category.PARAMETER, Category.OPTIMIZER_STATE, Category.BUFFER, Category.INPUT})


@dataclass(frozen=True)
class Tensor:
    """One storage: ``size_bytes`` of memory produced by one op."""

    name: str
    size_bytes: int
    category: Category = Category.ACTIVATION
    persistent: bool = False


@dataclass(frozen=True)
class Op:
    """One operator: reads ``inputs``, allocates ``outputs``, runs on ``stream``.

    ``mutates`` lists the inputs it writes in place (an optimizer's update of a parameter,
    BatchNorm's running statistics); capture orders every such write against the other
    readers of that storage with control edges. ``flops`` is its compute cost (the cost
    model of rematerialisation, Checkmate section 4.1); 0 when unknown.
    """

    name: str
    kind: str
    inputs: tuple[TensorId, ...] = ()
    outputs: tuple[TensorId, ...] = ()
    stream: int = 0
    mutates: tuple[TensorId, ...] = ()
    flops: int = 0


@dataclass(frozen=True)
class Graph:
    """A dataflow graph whose ``ops`` are listed in program order.

    Build one with :func:`make_graph` (names instead of ids) or directly with ids, then
    check it with :func:`memplan.graph.check.validate_graph`.
    """

    ops: tuple[Op, ...]
    tensors: tuple[Tensor, ...]
    name: str = ""
    meta: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    @property
    def num_tensors(self) -> int:
        return len(self.tensors)

    @cached_property
    def producer(self) -> tuple[OpId, ...]:
        """``producer[t]``: the op that creates tensor ``t`` (-1 if none, which is invalid)."""
        producer = [-1] * len(self.tensors)
        for op_id, op in enumerate(self.ops):
            for t in op.outputs:
                producer[t] = op_id
        return tuple(OpId(p) for p in producer)

    @cached_property
    def consumers(self) -> tuple[tuple[OpId, ...], ...]:
        """``consumers[t]``: the ops that read tensor ``t``, in program order, no repeats."""
        consumers: list[list[OpId]] = [[] for _ in self.tensors]
        for op_id, op in enumerate(self.ops):
            for t in dict.fromkeys(op.inputs):
                consumers[t].append(OpId(op_id))
        return tuple(tuple(c) for c in consumers)

    @cached_property
    def predecessors(self) -> tuple[tuple[OpId, ...], ...]:
        """Ops whose outputs each op reads (data and control edges), no repeats."""
        producer = self.producer
        return tuple(tuple(dict.fromkeys(producer[t] for t in op.inputs)) for op in self.ops)

    @cached_property
    def successors(self) -> tuple[tuple[OpId, ...], ...]:
        """Ops that read each op's outputs (data and control edges), no repeats."""
        succ: list[dict[OpId, None]] = [{} for _ in self.ops]
        for op_id, preds in enumerate(self.predecessors):
            for p in preds:
                succ[p][OpId(op_id)] = None
        return tuple(tuple(s) for s in succ)

    @cached_property
    def persistent_bytes(self) -> int:
        """Bytes resident for the whole step, whatever the order."""
        return sum(t.size_bytes for t in self.tensors if t.persistent)

    @cached_property
    def op_index(self) -> dict[str, OpId]:
        return {op.name: OpId(i) for i, op in enumerate(self.ops)}

    @cached_property
    def tensor_index(self) -> dict[str, TensorId]:
        return {t.name: TensorId(i) for i, t in enumerate(self.tensors)}

    def program_order(self) -> list[OpId]:
        """The order eager PyTorch runs the ops in."""
        return [OpId(i) for i in range(len(self.ops))]


def make_graph(
    tensors: Sequence[Tensor],
    ops: Sequence[tuple[str, str, Sequence[str], Sequence[str]] | tuple[str, str, Sequence[str], Sequence[str], int]],
    name: str = "",
) -> Graph:
    """Build a graph from tensor objects and ops given by tensor *names*.

    Each op is ``(name, kind, input_names, output_names[, stream])``, listed in program
    order.

    Examples
    --------
    >>> g = make_graph(
    ...     [Tensor("a", 4), Tensor("b", 8)],
    ...     [("src", "x", [], ["a"]), ("f", "y", ["a"], ["b"]), ("sink", "z", ["b"], [])],
    ... )
    >>> g.consumers[0], g.producer[1]
    ((1,), 1)
    """
    index = {t.name: TensorId(i) for i, t in enumerate(tensors)}
    built = []
    for spec in ops:
        op_name, kind, ins, outs = spec[0], spec[1], spec[2], spec[3]
        stream = spec[4] if len(spec) > 4 else 0  # type: ignore[misc]
        built.append(Op(op_name, kind, tuple(index[n] for n in ins), tuple(index[n] for n in outs), stream))
    return Graph(tuple(built), tuple(tensors), name)
