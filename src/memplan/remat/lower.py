"""From Checkmate's decision matrices to a step sequence, and the one estimator for sequences.

A *step sequence* is what the runtime executes: ``("run", op_id)`` runs an op (its first run
or a recompute) and allocates its outputs; ``("free", tensor_id)`` releases the current
instance of a tensor. A read always uses the most recent instance of a tensor.

:func:`lower` is Checkmate's Algorithm 1 (row-major scan of ``R``: stage ``t`` runs every
node ``i`` with ``R[t, i] = 1`` in node order) followed by deallocation code motion (4.7):
each tensor instance is freed right after its last read, before its producer runs again.
``S`` is only checked, never needed: with code motion a value is kept exactly as long as a
later step reads it, which is the least ``S`` consistent with ``R`` (4.6). Two further
passes, both sound, in turn until nothing changes: a 0-byte view whose base has been
recomputed is re-run before it is read (its old handle would point at freed storage), and
runs whose outputs nobody reads are dropped (4.6's "spurious evaluation"). An in-place follower (``relu_`` after a
batch norm, see :mod:`memplan.remat.problem`) is treated like such a view: the decisions
never re-run it on their own (that would apply it twice); it is re-run once after each
recompute of the tensor it rewrites, before the first read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from memplan.errors import MemplanError
from memplan.graph.ir import Category, Graph
from memplan.remat.coarsen import SolverGraph
from memplan.remat.problem import (
    RematProblem,
    RematSchedule,
    Step,
    per_graph,
    recompute_skips_mutation,
    rerun_limits,
    run_cost,
)


class InvalidPlan(MemplanError):
    """A decision matrix or a step sequence breaks a rule of the plan (one-line message)."""


Decisions = Sequence[Iterable[int]]
"""``R`` as rows: ``R[t]`` lists the nodes run in stage ``t`` (a 0/1 row is also accepted)."""


def rows(matrix: Sequence[Sequence[int]] | Decisions) -> list[list[int]]:
    """Normalise a 0/1 lower-triangular matrix or a list of index lists to index lists."""
    out = []
    for row in matrix:
        row = list(row)
        if row and len(row) == len(matrix) and all(x in (0, 1, True, False) for x in row):
            out.append([i for i, x in enumerate(row) if x])
        else:
            out.append(sorted(int(i) for i in row))
    return out


def lower(sg: SolverGraph, R: Decisions, S: Decisions | None = None) -> list[Step]:
    """Checkmate Algorithm 1 + 4.7 on the real graph; raises :class:`InvalidPlan`."""
    r_rows = rows(R)
    _check_decisions(sg, r_rows, rows(S) if S is not None else None)
    graph = sg.graph
    runs = [v for row in r_rows for k in row for v in sg.groups[k]]
    runs = _drop_inplace_reruns(graph, runs)
    return insert_frees(graph, _refresh_and_prune(graph, runs))


def _refresh_and_prune(graph: Graph, runs: list[int]) -> list[int]:
    """Re-run the views that need it (:func:`_refresh_views`), then drop the runs nobody reads
    (:func:`_kept_runs`), until nothing more is dropped.

    Refreshing first matters: an in-place follower applied again (ResNet's residual ``add_``
    after its batch norm is recomputed) reads its other inputs again, so the recompute that
    made the residual anew is read; pruned before the refresh it would look unread, and the
    refresh would read the first instance instead, kept alive all along, over the budget the
    solvers planned. A dropped recompute can make a refresh needless, so the refreshes are
    made again from the runs that are left."""
    while True:
        refreshed, inserted = _refresh_views(graph, runs)
        keep = _kept_runs(graph, refreshed, inserted)
        if all(keep):
            return refreshed
        left = [v for v, kept, new in zip(refreshed, keep, inserted, strict=True) if kept and not new]
        if len(left) == len(runs):  # only refreshes nobody reads were dropped
            return [v for v, kept in zip(refreshed, keep, strict=True) if kept]
        runs = left


def _check_decisions(sg: SolverGraph, r_rows: list[list[int]], s_rows: list[list[int]] | None) -> None:
    if len(r_rows) != sg.size:
        raise InvalidPlan(f"R has {len(r_rows)} stages, the solver graph has {sg.size} nodes")
    computed: set[int] = set()
    for t, row in enumerate(r_rows):
        if t not in row:
            raise InvalidPlan(f"stage {t} does not run node {t} (Checkmate: R[t, t] = 1)")
        for k in row:
            if not sg.may_run(t, k):
                raise InvalidPlan(f"stage {t} runs node {k}, which may not run then (run-once or window over)")
        if s_rows is not None:
            missing = [i for i in s_rows[t] if i not in computed]
            if missing:
                raise InvalidPlan(f"stage {t} checkpoints node {missing[0]}, which has not been computed")
        computed.update(row)


def _instances_read(graph: Graph, runs: list[int]) -> list[bool]:
    """For each run: is some output instance it makes read later (or kept as a step output)?"""
    used = [not graph.ops[v].outputs for v in runs]
    current: dict[int, int] = {}
    for pos, v in enumerate(runs):
        for t in graph.ops[v].inputs:
            if t not in current:
                raise InvalidPlan(
                    f"op {graph.ops[v].name!r} reads {graph.tensors[t].name!r}, which is not live (never computed)"
                )
            used[current[t]] = True
        for t in graph.ops[v].outputs:
            current[t] = pos
    for t in _facts(graph).live_at_end:
        if t in current:
            used[current[t]] = True
    return used


def _kept_runs(graph: Graph, runs: list[int], inserted: list[bool] | None = None) -> list[bool]:
    """Which runs to keep when those nobody reads are dropped (to a fixpoint); every op keeps
    at least its first run, which goes only when a later run of the op that is not one of the
    ``inserted`` refreshes (they are made again each round) is read instead."""
    limits = rerun_limits(graph)
    index = list(range(len(runs)))
    new = inserted or [False] * len(runs)
    while True:
        current = [runs[i] for i in index]
        used = _instances_read(graph, current)
        some_run_used = {v for i, v, u in zip(index, current, used, strict=True) if u and not new[i]}
        first_seen: set[int] = set()
        keep = []
        for pos, v in enumerate(current):
            first = v not in first_seen
            first_seen.add(v)
            removable = limits[v] > v and not used[pos]
            keep.append(not removable or (first and v not in some_run_used))
        if all(keep):
            kept = set(index)
            return [i in kept for i in range(len(runs))]
        index = [i for i, k in zip(index, keep, strict=True) if k]


def _drop_inplace_reruns(graph: Graph, runs: list[int]) -> list[int]:
    """Keep only the first run of an in-place op; :func:`_refresh_views` re-runs it when needed."""
    seen: set[int] = set()
    out = []
    for v in runs:
        if v in seen and graph.ops[v].mutates and not recompute_skips_mutation(graph, v):
            continue
        seen.add(v)
        out.append(v)
    return out


class _Facts:
    """What the lowering asks of a graph again and again, computed once per graph."""

    def __init__(self, graph: Graph) -> None:
        self.view = tuple(_is_view(graph, v) for v in range(len(graph.ops)))
        self.sources = tuple(_sources(graph, v) for v in range(len(graph.ops)))
        self.fresh_outputs = tuple(
            tuple((t, graph.tensors[t].size_bytes) for t in op.outputs if not graph.tensors[t].persistent)
            for op in graph.ops
        )
        self.persistent = tuple(t.persistent for t in graph.tensors)
        self.outputs_of_step = tuple(t for t, x in enumerate(graph.tensors) if x.category is Category.OUTPUT)
        self.live_at_end = tuple(
            t for t, x in enumerate(graph.tensors) if x.category is Category.OUTPUT or x.persistent
        )


_FACTS_CACHE: dict[int, tuple[Graph, _Facts]] = {}


def _facts(graph: Graph) -> _Facts:
    """Cached :class:`_Facts` (by graph identity, as :func:`rerun_limits`)."""
    return per_graph(_FACTS_CACHE, graph, _Facts)


def _is_view(graph: Graph, v: int) -> bool:
    op = graph.ops[v]
    return bool(op.outputs) and all(graph.tensors[t].size_bytes == 0 for t in op.outputs)


def _sources(graph: Graph, v: int) -> tuple[int, ...]:
    """What a 0-byte op's handles point into: the tensor an in-place op rewrites, else its inputs.

    An in-place op is re-run only when *that* tensor is re-created; re-running it because
    another input (the residual it adds) was recomputed would apply it twice."""
    op = graph.ops[v]
    return op.mutates if op.mutates else op.inputs


def _refresh_views(graph: Graph, runs: list[int]) -> tuple[list[int], list[bool]]:
    """Re-run a 0-byte view before a read if an input it was made from has been re-created;
    the runs, and which of them were inserted here."""
    limits = rerun_limits(graph)
    view, sources = _facts(graph).view, _facts(graph).sources
    serial: dict[int, int] = {}
    made_from: dict[int, tuple[int, ...]] = {}
    ran: set[int] = set()
    out: list[int] = []
    inserted: list[bool] = []

    def inputs_now(v: int) -> tuple[int, ...]:
        return tuple(serial.get(t, -1) for t in sources[v])

    def emit(v: int, new: bool = False) -> None:
        out.append(v)
        inserted.append(new)
        ran.add(v)
        is_view = view[v]
        for t in graph.ops[v].outputs:
            serial[t] = len(out)
            if is_view:
                made_from[t] = inputs_now(v)

    def refresh(t: int) -> None:
        p = graph.producer[t]
        if t not in made_from or made_from[t] == inputs_now(p):
            return
        if limits[p] <= p or (limits[p] < len(graph.ops) and limits[p] in ran):
            raise InvalidPlan(f"view {graph.ops[p].name!r} must be re-made but may not run again")
        for u in graph.ops[p].inputs:
            refresh(u)
        emit(p, new=True)

    for v in runs:
        for t in graph.ops[v].inputs:
            if t in made_from:
                refresh(t)
        emit(v)
    return out, inserted


def insert_frees(graph: Graph, runs: Sequence[int]) -> list[Step]:
    """Deallocation code motion (Checkmate 4.7): free every instance after its last read.

    An instance lives from the run that makes it to its last read before its producer runs
    again; an unread one is freed right after it is made; outputs of the step and
    persistent tensors are never freed.
    """
    last_read: list[int] = []
    tensor_of: list[int] = []
    current: dict[int, int] = {}
    ops = graph.ops
    for pos, v in enumerate(runs):
        op = ops[v]
        for t in op.inputs:
            inst = current.get(t)
            if inst is not None:
                last_read[inst] = pos
        for t in op.outputs:
            current[t] = len(tensor_of)
            tensor_of.append(t)
            last_read.append(pos)
    facts = _facts(graph)
    kept = {current[t] for t in facts.outputs_of_step if t in current}
    persistent = facts.persistent
    frees_at: dict[int, list[int]] = {}
    for inst, t in enumerate(tensor_of):
        if inst not in kept and not persistent[t]:
            frees_at.setdefault(last_read[inst], []).append(t)
    steps: list[Step] = []
    for pos, v in enumerate(runs):
        steps.append(("run", int(v)))
        frees = frees_at.get(pos)
        if frees:
            steps.extend(("free", int(t)) for t in sorted(frees))
    return steps


def steps_for_order(graph: Graph, order: Sequence[int]) -> list[Step]:
    """The step sequence of a plain order (every op once), frees at last reads."""
    return insert_frees(graph, order)


def sequence_peak_bytes(graph: Graph, steps: Sequence[Step], workspace: Sequence[int] = ()) -> int:
    """THE peak estimator for step sequences, with :mod:`memplan.graph.liveness`'s semantics.

    At a run, the resident set is every live tensor plus the op's outputs (its inputs are
    freed after it) plus ``workspace[op]``, the scratch the op holds only while it runs;
    persistent tensors are resident throughout. On a plain order lowered by
    :func:`steps_for_order`, without workspace, it equals ``liveness.peak_bytes``.
    """
    resident = peak = graph.persistent_bytes
    fresh_outputs = _facts(graph).fresh_outputs
    live: set[int] = set()
    for kind, i in steps:
        if kind == "run":
            for t, size in fresh_outputs[i]:
                if t not in live:
                    live.add(t)
                    resident += size
            peak = max(peak, resident + (workspace[i] if workspace else 0))
        elif i in live:
            live.discard(i)
            resident -= graph.tensors[i].size_bytes
    return peak


def schedule_from_decisions(
    problem: RematProblem, sg: SolverGraph, R: Decisions, strategy: str, status: str, **extra: object
) -> RematSchedule:
    """Lower ``R``, measure it with :func:`sequence_peak_bytes`, and wrap it as a schedule."""
    r_rows = rows(R)
    steps = lower(sg, r_rows)
    extra.setdefault("details", {"rows": r_rows})
    peak = sequence_peak_bytes(problem.graph, steps, problem.workspace)
    if peak > problem.budget_bytes and status not in ("not-applicable", "infeasible"):
        status = "over-budget"
    return RematSchedule(
        strategy=strategy,
        budget_bytes=problem.budget_bytes,
        steps=steps,
        peak_bytes=peak,
        compute_cost=run_cost(problem.cost, steps),
        plain_cost=problem.plain_cost,
        status=status,
        **extra,  # type: ignore[arg-type]
    )


def validate_sequence(graph: Graph, steps: Sequence[Step]) -> None:
    """Check a step sequence from first principles; raise :class:`InvalidPlan` on the first fault.

    Every operand is live when read; a run-once op (see :func:`rerun_limits`) runs exactly
    once and every op at least once; a re-run reads the same versions of its inputs as the
    first run (no mutation in between; a batch norm's recompute neither reads nor writes its
    running statistics, and a recomputed tensor starts unwritten) and does not re-allocate a
    live tensor; a view is not
    read after the storage it was made from was re-created; only live, non-persistent
    tensors are freed; outputs of the step are live at the end.
    """
    limits = rerun_limits(graph)
    live: set[int] = set()
    version = [0] * len(graph.tensors)
    serial = [0] * len(graph.tensors)
    first_inputs: dict[int, tuple[int, ...]] = {}
    view_made_from: dict[int, tuple[int, ...]] = {}
    runs = [0] * len(graph.ops)
    clock = 0
    for kind, i in steps:
        if kind == "free":
            if i not in live or graph.tensors[i].persistent:
                raise InvalidPlan(f"frees {graph.tensors[i].name!r}, which is not live or is persistent")
            live.discard(i)
            continue
        if kind != "run":
            raise InvalidPlan(f"unknown step kind {kind!r}")
        op = graph.ops[i]
        for t in op.inputs:
            if t not in live:
                raise InvalidPlan(f"op {op.name!r} reads {graph.tensors[t].name!r}, which is not live")
            producer = graph.producer[t]
            if t in view_made_from and view_made_from[t] != tuple(serial[u] for u in _sources(graph, producer)):
                raise InvalidPlan(f"op {op.name!r} reads view {graph.tensors[t].name!r} of re-created storage")
        runs[i] += 1
        skipped = set(op.mutates) if runs[i] > 1 and recompute_skips_mutation(graph, i) else set()
        versions = tuple(-1 if t in skipped else version[t] for t in op.inputs)
        if runs[i] > 1:
            if limits[i] <= i:
                raise InvalidPlan(f"op {op.name!r} may run only once")
            first = tuple(-1 if t in skipped else x for t, x in zip(op.inputs, first_inputs[i], strict=True))
            if versions != first:
                raise InvalidPlan(f"op {op.name!r} is re-run after one of its inputs was mutated")
            if any(t in live and graph.tensors[t].size_bytes for t in op.outputs):
                raise InvalidPlan(f"op {op.name!r} is re-run while its output is still live")
        first_inputs.setdefault(i, versions)
        for t in op.mutates:
            if t not in skipped:
                version[t] += 1
        clock += 1
        for t in op.outputs:
            if graph.tensors[t].size_bytes:
                version[t] = 0  # a new instance: nothing has written it yet
            live.add(t)
            serial[t] = clock
            if _is_view(graph, i):
                view_made_from[t] = tuple(serial[u] for u in _sources(graph, i))
    _check_end(graph, runs, live)


def _check_end(graph: Graph, runs: list[int], live: set[int]) -> None:
    for v, count in enumerate(runs):
        if count == 0:
            raise InvalidPlan(f"op {graph.ops[v].name!r} never runs")
    for t, tensor in enumerate(graph.tensors):
        if tensor.category is Category.OUTPUT and t not in live:
            raise InvalidPlan(f"output {tensor.name!r} is not live at the end of the step")
