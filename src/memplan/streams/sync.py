"""Synchronisation in a multi-stream graph, and the checks that refuse an unsafe one.

Collectives (an all-reduce, an all-gather...) run asynchronously: the op launches the
collective, a *wait* op (``memplan.wait``, or ``_c10d_functional.wait_tensor`` in a graph
captured with PyTorch's functional collectives) reads one of its outputs (its work handle) and
returns once it is done. Everything that uses the collective's result must come after that
wait. Event record/wait pairs need no kind of their own: they are a 0-byte control edge from
the recording op to the waiting one.

:func:`validate_streams` checks what the graph alone cannot: each with one typed error whose
message names the ops and what to do.

* a cycle through the waits (:class:`~memplan.errors.WaitCycle`): streams that wait on each
  other forever;
* a collective nobody waits for, or an op that reads what a collective writes without waiting
  for it (:class:`~memplan.errors.MissingWait`);
* a contiguous group that no placement can lay out back to back, whatever the offsets
  (:class:`~memplan.errors.ContiguityConflict`). Precisely, a group is refused when
  (1) a tensor is in it twice or in two groups: it would need two different neighbours;
  (2) a member lives outside the arena: a persistent tensor (parameters, optimizer state,
  the batch) or a control edge; or (3) a collective reads some members of the group but not
  all of them: it works on the group as one flat block in place, so it would read and write
  the bytes of the members it does not use while another tensor may be placed there.
"""

from __future__ import annotations

from collections.abc import Sequence

from memplan.errors import ContiguityConflict, CycleError, InvalidOrder, MissingWait
from memplan.graph.check import validate_graph
from memplan.graph.ir import Category, Graph, Op, OpId, TensorId
from memplan.graph.multistream import contiguous_groups, happens_before_ancestors, is_multi_stream, relist_streams

ALL_REDUCE_KIND = "memplan.all_reduce"
WAIT_KIND = "memplan.wait"
COLLECTIVE_KINDS = frozenset(
    {
        ALL_REDUCE_KIND,
        "memplan.all_gather",
        "memplan.reduce_scatter",
        "memplan.broadcast",
        "_c10d_functional.all_reduce",
        "_c10d_functional.all_reduce_",
        "_c10d_functional.all_gather_into_tensor",
        "_c10d_functional.reduce_scatter_tensor",
        "_c10d_functional.broadcast",
        "_c10d_functional.all_to_all_single",
        "c10d.allreduce_",
        "c10d.allgather_",
        "c10d.reduce_scatter_",
        "c10d.broadcast_",
    }
)
WAIT_KINDS = frozenset({WAIT_KIND, "_c10d_functional.wait_tensor", "c10d.wait"})


def _matches(kind: str, kinds: frozenset[str]) -> bool:
    """``kind`` is one of ``kinds``, possibly with an overload suffix (``.default``)."""
    return kind in kinds or kind.rsplit(".", 1)[0] in kinds


def is_collective(op: Op) -> bool:
    return _matches(op.kind, COLLECTIVE_KINDS)


def is_wait(op: Op) -> bool:
    return _matches(op.kind, WAIT_KINDS)


def collectives(graph: Graph) -> list[OpId]:
    return [OpId(v) for v, op in enumerate(graph.ops) if is_collective(op)]


def waits_of(graph: Graph, collective: int) -> list[OpId]:
    """The wait ops that read an output of ``collective``."""
    outputs = graph.ops[collective].outputs
    return sorted({c for t in outputs for c in graph.consumers[t] if is_wait(graph.ops[c])})


def written_by(graph: Graph, collective: int) -> list[TensorId]:
    """What ``collective`` writes: the inputs it mutates and its outputs that hold bytes."""
    op = graph.ops[collective]
    return [*op.mutates, *(t for t in op.outputs if graph.tensors[t].size_bytes > 0)]


def validate_streams(graph: Graph, order: Sequence[int] | None = None) -> None:
    """Raise a one-line typed error if ``graph`` (run in ``order``, default its listing) has a
    cycle through its waits, a collective without a wait, or an impossible contiguous group."""
    _validate_listing(graph)
    ancestors = happens_before_ancestors(graph, order)
    for c in collectives(graph):
        _check_collective(graph, c, ancestors)
    validate_contiguous_groups(graph)


def _validate_listing(graph: Graph) -> None:
    """:func:`validate_graph`, naming a cycle through the waits when that is what breaks it."""
    try:
        validate_graph(graph)
    except (InvalidOrder, CycleError) as err:
        if is_multi_stream(graph):
            relist_streams(graph)  # raises WaitCycle if the streams deadlock
            raise InvalidOrder(
                f"{err}; list the ops in a global order with memplan.graph.multistream.relist_streams"
            ) from None
        raise


def _check_collective(graph: Graph, c: int, ancestors: list[int]) -> None:
    op = graph.ops[c]
    waits = waits_of(graph, c)
    if not waits:
        raise MissingWait(
            f"collective {op.name!r} (stream {op.stream}) is never waited for: add a wait op "
            f"(kind {WAIT_KIND!r}) that reads one of its outputs, and make its result's readers depend on it"
        )
    after_wait = 0
    for w in waits:
        after_wait |= 1 << w
    for t in written_by(graph, c):
        for reader in graph.consumers[t]:
            if reader == c or reader in waits or (ancestors[c] >> reader) & 1:
                continue  # the collective itself, its wait, or an op done before it starts
            if not ancestors[reader] & after_wait:
                raise MissingWait(
                    f"op {graph.ops[reader].name!r} (stream {graph.ops[reader].stream}) reads "
                    f"{graph.tensors[t].name!r}, which collective {op.name!r} writes, without waiting for it: "
                    f"make it depend on {graph.ops[waits[0]].name!r} or run before {op.name!r}"
                )


def validate_contiguous_groups(graph: Graph) -> None:
    """Raise :class:`ContiguityConflict` for a group no placement can lay out (module docstring)."""
    groups = contiguous_groups(graph)
    home: dict[int, int] = {}
    for g, members in enumerate(groups):
        for t in members:
            tensor = graph.tensors[t]
            if t in home:
                where = "twice in contiguous group" if home[t] == g else f"in contiguous groups {home[t]} and"
                raise ContiguityConflict(
                    f"tensor {tensor.name!r} is {where} {g}: in memory it can follow only one neighbour; "
                    "merge the groups or drop it from one"
                )
            home[t] = g
            if tensor.persistent or tensor.category is Category.CONTROL:
                what = "a control edge (no memory)" if tensor.category is Category.CONTROL else "persistent"
                raise ContiguityConflict(
                    f"tensor {tensor.name!r} in contiguous group {g} is {what}, so it is not placed in the arena; "
                    "remove it from the group"
                )
    for c in collectives(graph):
        read = set(graph.ops[c].inputs)
        for g, members in enumerate(groups):
            used = [t for t in members if t in read]
            unused = [t for t in members if t not in read and graph.tensors[t].size_bytes > 0]
            if used and unused:
                raise ContiguityConflict(
                    f"collective {graph.ops[c].name!r} works in place on contiguous group {g} but does not read "
                    f"its member {graph.tensors[unused[0]].name!r}, whose bytes it would overwrite while another "
                    "tensor may use them; make the group exactly the collective's inputs"
                )
