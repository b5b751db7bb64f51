"""The solver graph: Checkmate's nodes as contiguous groups of real ops.

Checkmate's MILP (section 4.5) has O(n^2) decision variables; captured training steps have
1-6k ops. Every strategy in :mod:`memplan.remat` therefore decides over a *solver graph* whose
node ``k`` is a group of real ops, contiguous in program order (after the placeholders are
hoisted into a prologue group), so the quotient is acyclic and node order is topological.
A decision "run node k in stage t" runs the group's ops in program order; the lowering
(:mod:`memplan.remat.lower`) then prunes runs whose outputs nobody reads and frees every
tensor at its last read, on the real graph.

How groups are formed:

1. placeholders whose outputs are all persistent form group 0 (they never need deciding);
2. every other op starts as one unit; an op whose outputs are all 0 bytes (views, control
   tokens, in-place ops) joins the previous unit if both may be re-run or both may not;
   a re-runnable 0-byte op whose inputs nobody can re-create is treated as run-once. A
   re-runnable in-place op that rewrites a tensor made outside the previous unit (a
   ResNet's residual ``add_`` into the main branch's batch norm, right after the shortcut's)
   stays a unit of its own and is never merged into the unit before it: the lowering
   re-applies it after each recompute of the tensor it rewrites, and then it reads its
   other inputs again, so they must be outputs the solver keeps or re-makes, not a unit's
   temporaries;
3. adjacent units of the same kind (re-runnable or not, forward or backward) are merged,
   smallest produced bytes first, until at most ``max_nodes`` remain; where merging by kind
   alone cannot get there (Adam's update alternates the kinds for every parameter), units
   after the forward pass may also merge with a neighbour of the other kind (the group then
   runs once).

What is lost, compared with deciding per op:

* recomputation is all-or-nothing per group (the lowering drops runs nobody reads, so a
  member that is not needed is not re-run, but the solver pays for it);
* memory timing inside a group: the solver frees a group's inputs only after the whole
  group and keeps all of its outputs until the group ends; Checkmate's Free (eq. 4) is per
  node, so a group's outputs are kept or freed together. Both make the solver's memory
  model an upper bound of the real lowered peak, so a plan within budget in the model is
  within budget on the real graph, but a tight budget may look infeasible to the solver;
* an op's workspace (kernel scratch, :class:`memplan.remat.problem.RematProblem`) is counted
  in its group's peak while the group runs, as ``sequence_peak_bytes`` counts it at the op;
* the window of a re-runnable op that reads a tensor mutated later (optimizer updates) is
  rounded down to the group that holds the mutating op.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property

from memplan.graph.ir import Category, Graph
from memplan.remat.problem import RematProblem, forward_end, rerun_limits


@dataclass(frozen=True)
class SolverGraph:
    """Checkmate's graph over groups of real ops (see module docstring).

    ``out_bytes[k]`` is Checkmate's ``M_k``: bytes of the group's outputs read by another
    group. ``peak_bytes[k]``: the most the group allocates while it runs (its outputs and
    its temporaries). ``output_bytes[k]``: outputs of the step it makes (kept to the end).
    ``limit[k]``: node ``k`` may be re-run only in stages ``t < limit[k]`` (``limit[k] == k``:
    run once). Nodes ``0 .. num_forward - 1`` are the forward pass (up to the loss).
    """

    graph: Graph
    groups: tuple[tuple[int, ...], ...]
    preds: tuple[tuple[int, ...], ...]
    users: tuple[tuple[int, ...], ...]
    out_bytes: tuple[int, ...]
    peak_bytes: tuple[int, ...]
    output_bytes: tuple[int, ...]
    cost: tuple[float, ...]
    limit: tuple[int, ...]
    num_forward: int
    parts: tuple[tuple[tuple[int, tuple[int, ...]], ...], ...] = ()
    """``parts[k]``: node ``k``'s outputs read by other nodes, grouped by the set of nodes
    that read them, as ``(bytes, readers)``: each part is kept or freed on its own."""
    split: str = ""
    """How the end of the forward pass was found (:func:`memplan.remat.problem.forward_end`),
    or why there is none (then ``num_forward == size``)."""

    @property
    def has_split(self) -> bool:
        return self.num_forward < self.size

    @property
    def size(self) -> int:
        return len(self.groups)

    def recomputable(self, k: int) -> bool:
        return self.limit[k] > k + 1

    def may_run(self, t: int, k: int) -> bool:
        """Checkmate's R[t, k] may be 1: first run in stage k, re-runs within the window."""
        return t == k or (k < t < self.limit[k])

    @cached_property
    def byte_preds(self) -> tuple[tuple[int, ...], ...]:
        """``byte_preds[j]``: the predecessors ``p`` of ``j`` whose memory ``j`` reads (a part of
        ``p``'s outputs with bytes has ``j`` among its readers; see
        :func:`memplan.remat.baselines.reads_bytes`), in ``preds`` order."""
        reading: list[set[int]] = [set() for _ in range(self.size)]
        for p, parts in enumerate(self.parts):
            for b, readers in parts:
                if b > 0:
                    for j in readers:
                        reading[j].add(p)
        return tuple(tuple(p for p in self.preds[j] if p in reading[j]) for j in range(self.size))

    @cached_property
    def pinned(self) -> frozenset[int]:
        """Nodes some user reads (bytes) at or after the end of their re-run window: always kept."""
        late = {p for j in range(self.size) for p in self.byte_preds[j] if j >= self.limit[p]}
        return frozenset(late)


def coarsen(problem: RematProblem, max_nodes: int | None = None) -> SolverGraph:
    """Build the solver graph of ``problem`` with at most about ``max_nodes`` nodes."""
    graph = problem.graph
    limits = rerun_limits(graph)
    prologue = [v for v, op in enumerate(graph.ops) if _is_persistent_source(graph, v)]
    rest = [v for v in range(len(graph.ops)) if v not in set(prologue)]
    fixed = _fixed_ops(graph, limits)
    end = forward_end(graph)
    units = _initial_units(graph, rest, fixed, end.op)
    units = _merge_units(graph, units, fixed, end.op, max_nodes or problem.max_solver_nodes)
    groups = ([tuple(prologue)] if prologue else []) + [tuple(u) for u in units]
    return build_solver_graph(problem, groups, limits, end.op, end.how)


def identity(problem: RematProblem) -> SolverGraph:
    """One node per op, in program order: Checkmate's MILP on the real graph (small graphs)."""
    limits = rerun_limits(problem.graph)
    groups = [(v,) for v in range(len(problem.graph.ops))]
    end = forward_end(problem.graph)
    return build_solver_graph(problem, groups, limits, end.op, end.how)


def build_solver_graph(
    problem: RematProblem, groups: list[tuple[int, ...]], limits: list[int], loss_op: int | None, split: str = ""
) -> SolverGraph:
    graph = problem.graph
    group_of = [0] * len(graph.ops)
    for k, members in enumerate(groups):
        for v in members:
            group_of[v] = k
    persistent = [_all_persistent(graph, members) for members in groups]
    preds = []
    for members in groups:
        ps = {group_of[graph.producer[t]] for v in members for t in graph.ops[v].inputs}
        ps.discard(group_of[members[0]])
        preds.append(tuple(sorted(p for p in ps if not persistent[p])))
    users: list[list[int]] = [[] for _ in groups]
    for k, ps in enumerate(preds):
        for p in ps:
            users[p].append(k)
    workspace = problem.workspace or (0,) * len(graph.ops)
    memory = (_group_memory(graph, members, group_of, workspace) for members in groups)
    out, peak, outputs, parts = zip(*memory, strict=True)
    cost = tuple(float(sum(problem.cost[v] for v in members)) for members in groups)
    limit = tuple(_group_limit(members, k, limits, group_of) for k, members in enumerate(groups))
    num_forward = group_of[loss_op] + 1 if loss_op is not None else len(groups)
    return SolverGraph(
        graph,
        tuple(groups),
        tuple(preds),
        tuple(tuple(u) for u in users),
        out,
        peak,
        outputs,
        cost,
        limit,
        num_forward,
        parts,
        split,
    )


def _is_persistent_source(graph: Graph, v: int) -> bool:
    op = graph.ops[v]
    return op.kind == "placeholder" and not op.inputs and all(graph.tensors[t].persistent for t in op.outputs)


def _all_persistent(graph: Graph, members: tuple[int, ...]) -> bool:
    return all(_is_persistent_source(graph, v) for v in members)


def _zero_bytes(graph: Graph, v: int) -> bool:
    return all(graph.tensors[t].size_bytes == 0 for t in graph.ops[v].outputs)


def _fixed_ops(graph: Graph, limits: list[int]) -> list[bool]:
    """Run-once ops, plus 0-byte re-runnable ops that read only what is never re-created."""
    fixed = [limits[v] <= v + 1 for v in range(len(graph.ops))]
    for v in range(len(graph.ops)):
        if not fixed[v] and _zero_bytes(graph, v):
            sources = (graph.producer[t] for t in graph.ops[v].inputs if not graph.tensors[t].persistent)
            fixed[v] = all(fixed[p] for p in sources)
    return fixed


def _initial_units(graph: Graph, ops: list[int], fixed: list[bool], loss_op: int | None) -> list[list[int]]:
    units: list[list[int]] = []
    for v in ops:
        if (
            units
            and _zero_bytes(graph, v)
            and fixed[units[-1][-1]] == fixed[v]
            and units[-1][-1] != loss_op
            and not _rewrites_from_outside(graph, v, units[-1], fixed)
        ):
            units[-1].append(v)
        else:
            units.append([v])
    return units


def _rewrites_from_outside(graph: Graph, v: int, unit: list[int], fixed: list[bool]) -> bool:
    """Op ``v`` is a re-runnable in-place op that rewrites a tensor made outside ``unit``."""
    members = set(unit)
    return not fixed[v] and any(graph.producer[t] not in members for t in graph.ops[v].mutates)


def _merge_units(
    graph: Graph,
    units: list[list[int]],
    fixed: list[bool],
    loss_op: int | None,
    max_nodes: int,
) -> list[list[int]]:
    """Merge adjacent compatible units, smallest combined produced bytes first; a unit that
    starts with an in-place op rewriting a tensor made before the unit ahead of it is never
    merged into that unit (see :func:`coarsen`)."""
    produced = [sum(graph.tensors[t].size_bytes for v in u for t in graph.ops[v].outputs) for u in units]
    forward = _forward_flags(units, loss_op)
    apart = [
        i > 0 and _zero_bytes(graph, u[0]) and _rewrites_from_outside(graph, u[0], units[i - 1], fixed)
        for i, u in enumerate(units)
    ]
    alive = [True] * len(units)
    nxt = [*range(1, len(units)), -1]
    version = [0] * len(units)
    heap: list[tuple[int, bool, int, int, int]] = []
    same_kind_floor = 1 + sum(
        fixed[units[i][0]] != fixed[units[i + 1][0]] or forward[i] != forward[i + 1] or apart[i + 1]
        for i in range(len(units) - 1)
    )
    # Adam's update alternates run-once ops (lerp_, addcdiv_) with re-runnable ones (sqrt, div)
    # for every parameter: merged by kind alone, a ResNet-50 keeps 300 such units and the whole
    # backward pass becomes one node. Where merging by kind cannot reach max_nodes, a unit after
    # the forward pass may join its neighbour of the other kind (the group then runs once).
    mix = same_kind_floor > max_nodes

    def push(a: int) -> None:
        b = nxt[a]
        if b < 0 or forward[a] != forward[b] or apart[b]:
            return
        mixed = fixed[units[a][0]] != fixed[units[b][0]]
        if mixed and (forward[a] or not mix):
            return
        heapq.heappush(heap, (produced[a] + produced[b], mixed, a, version[a], version[b]))

    for a in range(len(units)):
        push(a)
    prev = [-1, *range(len(units) - 1)]
    count = len(units)
    while count > max_nodes and heap:
        _, _, a, va, vb = heapq.heappop(heap)
        b = nxt[a]
        if not alive[a] or b < 0 or version[a] != va or version[b] != vb:
            continue
        units[a].extend(units[b])
        produced[a] += produced[b]
        alive[b] = False
        nxt[a] = nxt[b]
        if nxt[b] >= 0:
            prev[nxt[b]] = a
        version[a] += 1
        count -= 1
        push(a)
        if prev[a] >= 0:
            push(prev[a])
    return [u for u, keep in zip(units, alive, strict=True) if keep]


def _forward_flags(units: list[list[int]], loss_op: int | None) -> list[bool]:
    flags = []
    forward = loss_op is not None
    for u in units:
        flags.append(forward)
        if loss_op is not None and loss_op in u:
            forward = False
    return flags


def _group_memory(
    graph: Graph, members: tuple[int, ...], group_of: list[int], workspace: tuple[int, ...]
) -> tuple[int, int, int, tuple[tuple[int, tuple[int, ...]], ...]]:
    """(M_k, peak while the group runs, output-of-step bytes, parts), with liveness's semantics;
    the peak counts each member's workspace while it runs (see :class:`RematProblem`)."""
    parts: dict[tuple[int, ...], int] = {}
    k = group_of[members[0]]
    inside = set(members)
    last_inside: dict[int, int] = {}
    for pos, v in enumerate(members):
        for t in graph.ops[v].inputs:
            last_inside[t] = pos
    out_bytes = output_bytes = live = peak = 0
    for pos, v in enumerate(members):
        for t in graph.ops[v].outputs:
            tensor = graph.tensors[t]
            if not tensor.persistent:
                live += tensor.size_bytes
        peak = max(peak, live + workspace[v])
        for t in graph.ops[v].outputs:
            tensor = graph.tensors[t]
            if tensor.persistent:
                continue
            read_outside = any(group_of[c] != k for c in graph.consumers[t])
            if tensor.category is Category.OUTPUT:
                output_bytes += tensor.size_bytes
                if read_outside:  # kept to the end anyway: an edge without bytes
                    readers = tuple(sorted({group_of[c] for c in graph.consumers[t]} - {k}))
                    parts[readers] = parts.get(readers, 0)
            elif read_outside:
                out_bytes += tensor.size_bytes
                readers = tuple(sorted({group_of[c] for c in graph.consumers[t]} - {k}))
                parts[readers] = parts.get(readers, 0) + tensor.size_bytes
            elif last_inside.get(t, pos) <= pos:
                live -= tensor.size_bytes
        for t in graph.ops[v].inputs:
            p = graph.producer[t]
            tensor = graph.tensors[t]
            internal = tensor.category is not Category.OUTPUT and all(group_of[c] == k for c in graph.consumers[t])
            if p in inside and last_inside[t] == pos and not tensor.persistent and p != v and internal:
                live -= tensor.size_bytes
    return out_bytes, peak, output_bytes, tuple((b, r) for r, b in sorted(parts.items()))


def _group_limit(members: tuple[int, ...], k: int, limits: list[int], group_of: list[int]) -> int:
    """Stage before which node ``k`` may be re-run: the group of the earliest window end."""
    if any(limits[v] <= v for v in members):
        return k
    end = min(limits[v] for v in members)
    return group_of[end] if end < len(group_of) else len(set(group_of))


def refine_rows(coarse: SolverGraph, fine: SolverGraph, rows: list[list[int]]) -> list[list[int]]:
    """Checkmate's ``R`` over ``coarse`` as ``R`` over ``fine``, where every coarse node is a
    run of consecutive fine nodes: a recompute of coarse node ``k`` in stage ``t`` becomes a
    recompute of each of ``k``'s fine nodes in the stage of ``t``'s first fine node. Both
    lower to the same op sequence (the lowering runs a node's ops in program order)."""
    fine_of = [0] * len(fine.graph.ops)
    for k, members in enumerate(fine.groups):
        for v in members:
            fine_of[v] = k
    spans = [sorted({fine_of[v] for v in members}) for members in coarse.groups]
    if any(span != list(range(span[0], span[-1] + 1)) for span in spans):
        raise ValueError("the coarse graph's nodes are not runs of consecutive fine nodes")
    out: list[list[int]] = [[t] for t in range(fine.size)]
    for t, row in enumerate(rows):
        stage = spans[t][0]
        for k in row:
            if k != t:
                out[stage].extend(spans[k])
    return [sorted(set(r)) for r in out]
