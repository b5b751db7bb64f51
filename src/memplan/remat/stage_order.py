"""Stage orders for remat over a reordered step: the optimizer's updates moved as early as they may run.

:func:`memplan.remat.portfolio.solve_remat_in_order` keeps the first runs in a given order (the
reordered plan's, OLLA's lifetime optimisation). That order minimises the peak *without*
recomputation; where that peak is in the forward or backward pass (activations), the reorderer
has no reason to move anything else, and the optimizer's updates stay where the program made
them: after the whole backward, every gradient held until its update (OLLA 4.3's point: a
weight update frees its gradient). Once recomputation takes the activations' peak down, that
second peak binds, and no recomputation can lower it: what is live there is gradients,
optimizer state and the update's temporaries. The Llama-style decoder of
``bench/llama_budget.py`` at batch 2: the reordered plan keeps program order's updates (its
2.01 GiB peak, at the loss, is proven optimal), and the embedding's AdamW update, last in the
backward, peaks at 1.99 GiB with every other gradient resident: every budget between the
1.69 GiB floor and 1.99 GiB found no plan.

:func:`early_update_order` is the given order with each update group (the ops the runtime runs
as one call of the user's optimizer, :func:`memplan.torch.run.interpreter.optimizer_update_groups`,
contiguous in the given order as :func:`memplan.pipeline.make_groups_contiguous` makes them),
each call's start and end marks (:data:`CALL_KIND`, no-ops) and each gradient's release
(:data:`RELEASE_KIND`) moved to the earliest place their inputs allow, their ops' relative
order and contiguity kept (OLLA 4.3's early weight updates and deallocations, Steiner et al.
2022, section 4.3, done on an order rather than with control edges). The groups must be the
runtime's: which calls it splits per parameter depends on the optimizer object
(:func:`memplan.torch.run.updates.updates_are_independent`), not on the graph, so nothing moves
without them. Every other op keeps its place relative to the others; the result is validated
as an order of the graph.
"""

from __future__ import annotations

from collections.abc import Sequence

from memplan.graph.check import validate_order
from memplan.graph.ir import Graph

CALL_KIND = "memplan.call"
"""The kind of the no-op ops capture puts at a call's start and end
(:data:`memplan.torch.capture.marks.CALL_KIND`): each op of the call reads the start's control output."""
RELEASE_KIND = "memplan.release"
"""The kind of a gradient's release (:data:`memplan.torch.capture.marks.RELEASE_KIND`), which
capture puts where the program dropped the gradient (``zero_grad``); a no-op at run time."""

Groups = Sequence[Sequence[int]]


def call_groups(graph: Graph) -> list[list[int]]:
    """The update groups of ``graph``'s calls as the graph shows them, for callers without the
    runtime's (:func:`memplan.torch.run.updates.update_groups`). A call's ops (those that read its
    start mark's control output) joined by every tensor they share but that mark: where the
    runtime splits an optimizer's call per parameter, its groups are the components of what
    their ops read (a finer or equal split); where it runs the call as one group, capture made
    every gradient the call reads an input of each later op of the call
    (:func:`memplan.torch.capture.trace.hold_update_inputs`), which joins them. A call whose ops
    form one component (or none: ``zero_grad`` with ``set_to_none``) is one group with its marks,
    as the runtime runs it; the marks of a call split in several stay out of its groups.
    Checked against the runtime's groups on captured steps (tests/torch/test_remat_stage_order.py)."""
    starts = [v for v, op in enumerate(graph.ops) if op.kind == CALL_KIND and op.name.endswith(":start")]
    mark_of = {t: v for v in starts for t in graph.ops[v].outputs}
    calls: dict[int, list[int]] = {v: [] for v in starts}
    for v, op in enumerate(graph.ops):
        owners = {mark_of[t] for t in op.inputs if t in mark_of}
        if len(owners) == 1:
            calls[owners.pop()].append(v)
    groups: list[list[int]] = []
    for start, ops in calls.items():
        inner = [v for v in ops if graph.ops[v].kind != CALL_KIND]
        components = _components(graph, inner, set(graph.ops[start].outputs))
        if len(components) <= 1:
            groups.append(sorted([start, *ops]))
        else:
            groups += components
    return groups


def _components(graph: Graph, ops: list[int], ignore: set[int]) -> list[list[int]]:
    """``ops`` split into the connected components of the tensors they share (``ignore`` aside)."""
    parent = {v: v for v in ops}

    def find(v: int) -> int:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    holder: dict[int, int] = {}
    for v in ops:
        op = graph.ops[v]
        for t in (*op.inputs, *op.outputs, *op.mutates):
            if t in ignore:
                continue
            if t in holder:
                parent[find(v)] = find(holder[t])
            else:
                holder[t] = v
    found: dict[int, list[int]] = {}
    for v in ops:
        found.setdefault(find(v), []).append(v)
    return list(found.values())


def early_update_order(graph: Graph, order: Sequence[int], groups: Groups) -> list[int]:
    """``order`` with each of ``groups`` (the runtime's update groups, each made contiguous as
    the runtime runs it), each call mark and each release not in a group moved as early as its
    ops' predecessors allow, the placeholders (persistent inputs: no memory an order changes)
    first; see the module docstring. ``list(order)`` when nothing can move (no groups, or a
    group that an op outside it must run inside of). Validated as an order of ``graph``."""
    if not groups:
        return list(order)
    blocks, outside = _blocks(graph, order, groups)
    needs = [{p for v in block for p in graph.predecessors[v]} - set(block) for block in blocks]
    out = [v for v in outside if graph.ops[v].kind == "placeholder"]
    done = set(out)
    pending = list(range(len(blocks)))

    def release() -> None:
        """Emit every pending block whose outside predecessors have all run, in the given order."""
        ready = [b for b in pending if needs[b] <= done]
        while ready:
            for b in ready:
                pending.remove(b)
                out.extend(blocks[b])
                done.update(blocks[b])
            ready = [b for b in pending if needs[b] <= done]

    release()
    for v in outside:
        if v not in done:
            out.append(v)
            done.add(v)
            release()
    if pending:  # a group that something outside it runs inside of (it needs what it feeds): no move
        return list(order)
    validate_order(graph, out)
    return out


def _blocks(graph: Graph, order: Sequence[int], groups: Groups) -> tuple[list[list[int]], list[int]]:
    """Each group as one block (its ops in ``order``'s order, as the runtime runs it: together),
    each call mark and release not in a group as a block of its own, in ``order`` by their last
    op; and the other ops, in order."""
    unit_of: dict[int, int] = {}
    for u, members in enumerate(groups):
        unit_of.update(dict.fromkeys(members, u))
    for v, op in enumerate(graph.ops):
        if op.kind in (CALL_KIND, RELEASE_KIND) and v not in unit_of:
            unit_of[v] = len(groups) + v
    members: dict[int, list[int]] = {}
    outside: list[int] = []
    for v in order:
        if v in unit_of:
            members.setdefault(unit_of[v], []).append(v)
        else:
            outside.append(v)
    return sorted(members.values(), key=lambda block: order.index(block[-1])), outside


def broken_group(steps: Sequence[tuple[str, int]], groups: Groups) -> int | None:
    """The index of the first group some run of another op lies inside of in ``steps`` (the
    lowering puts a stage's re-runs before its op: inside a group when that op is not the
    group's first), None when every group's runs are contiguous, as the runtime runs them."""
    group_of = {v: g for g, members in enumerate(groups) for v in members}
    runs = [i for kind, i in steps if kind == "run"]
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    count: dict[int, int] = {}
    for pos, v in enumerate(runs):
        g = group_of.get(v)
        if g is not None:
            first.setdefault(g, pos)
            last[g], count[g] = pos, count.get(g, 0) + 1
    return next((g for g in sorted(first) if last[g] - first[g] + 1 != count[g]), None)
