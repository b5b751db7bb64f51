"""Joint order and recomputation: an alternating search, and a bound on what it can still gain.

The budget path solves in sequence: reorder (OLLA's lifetime optimisation), rematerialise over
that order (:func:`memplan.remat.portfolio.solve_remat_in_order`, Checkmate's stages in that
order), place. Checkmate (4.1) and Moccasin fix the order of the first runs; here the order is a
decision too, by alternation (issue 36):

1. **remat given an order**: the portfolio over the stage order (the existing solver);
2. **reorder given the recomputations**: the plan's step sequence becomes an *expanded DAG*
   (:func:`expand`), one node per run (a recompute is an ordinary node), one tensor per instance,
   with the edges that keep every read reading the value it read (data edges to the instance
   read; ordering edges for writes after reads, reads after in-place writes, and a new instance
   of a tensor only after the last read of the old one; a view's read counts as a read of what
   it views). Every topological order of it is a valid step sequence of the same runs, hence of
   the same compute, whose peak is the expanded graph's peak in :mod:`memplan.graph.liveness`
   (the one estimator; a kernel's workspace is a tensor its run makes and nobody reads). The
   schedule module's search (:func:`memplan.schedule.optimize_order`) minimises that peak;
3. the slack the new order leaves under the budget is spent: the re-runs the plan fits without
   are taken out (:func:`drop_reruns`, each move measured); then re-runs are taken out one at a
   time where some order of the runs left fits the budget (:func:`refit_reruns`: the exact
   search over ideals under a cap, :func:`memplan.schedule.ideals.fit_under`, on their expanded
   DAG); and the portfolio solves again over the new first-run order;

until neither lowers the compute at the budget (or, at equal compute, the peak: more room for
the placement) or the time is spent. The ops the runtime runs as one call (a captured step's
optimizer update groups, :data:`Groups`) stay contiguous in every plan the search makes, as the
budget path's reorder keeps them (:func:`contiguous_order`). In the budget path
(``memory_budget=``) the search runs after the sequential plan in what is left of the time limit,
and its plan is taken only when it is better once placed (:func:`choose_joint`).

Every plan is a step sequence checked by :func:`memplan.remat.lower.validate_sequence` and measured by
:func:`memplan.remat.lower.sequence_peak_bytes`; the search keeps a plan only when it is
better than the one before, so it is never worse than the sequential plan it starts from.

**How much joint planning can still gain** (:func:`order_free_bound`): the drop cover of
:mod:`memplan.remat.bounds` over *every* order. At any op ``v``'s first run, in any order, a
tensor made by an ancestor of ``v`` and read by a descendant of ``v`` (or kept as an output of
the step) is resident or made again after ``v`` (its producer re-runs, Checkmate 4.9's cost
``C_u``); the bytes that must be resident (``v``'s fan-in and fan-out, its workspace, crossing
tensors of run-once producers or of producers whose re-run window closed: the op that mutates
what they read runs before ``v`` in every order; the order-free floor of
:func:`memplan.graph.analysis.necessarily_resident_bytes`) leave an excess over the budget that
the cheapest set of re-runs must cover (an exact knapsack cover,
:func:`memplan.remat.bounds.cover_search`). The largest cover over ``v``, plus the plain step,
bounds the compute of every plan in every order with any number of re-runs; a floor above the
budget proves that no plan in any order fits. :func:`cut_cover_bound` raises it where what
crosses ``v`` depends on the order (a value needed after ``v`` crosses it as itself or as what
an op made from it): the cover's LP dual at a price per byte, minimised over the ideals before
``v`` by one minimum cut (OLLA's resident set as a closure problem,
:mod:`memplan.schedule.bounds`). Like the drop cover, neither counts what a re-run reads, so
where re-runs need re-runs (a dropped value whose producer's inputs were dropped too) the bound
stays far below the plans.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from memplan.graph.analysis import Reachability
from memplan.graph.ir import Category, Graph, Op, Tensor, TensorId
from memplan.graph.liveness import peak_bytes
from memplan.remat.bounds import TOTAL_COVER_NODES, _greedy_cover, cover_search
from memplan.remat.lower import (
    InvalidPlan,
    _facts,
    _refresh_and_prune,
    _sources,
    insert_frees,
    sequence_peak_bytes,
    validate_sequence,
)
from memplan.remat.problem import (
    RematProblem,
    RematSchedule,
    Step,
    default_costs,
    is_random,
    recompute_skips_mutation,
    rerun_limits,
    run_cost,
)

Progress = Callable[[str], None]


# --------------------------------------------------------------------------------------------
# The expanded DAG of a plan
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expanded:
    """A step sequence as a DAG: ``graph`` has one op per run (``op_of[x]``: the op of
    ``source`` that run ``x`` runs), listed in the sequence's order."""

    graph: Graph
    op_of: tuple[int, ...]
    source: Graph


class _Builder:
    """The state of :func:`expand`'s walk along the runs."""

    def __init__(self, graph: Graph, runs: Sequence[int], workspace: Sequence[int]) -> None:
        self.graph, self.runs, self.workspace = graph, runs, workspace
        self.facts = _facts(graph)
        self.tensors: list[Tensor] = []
        self.current: dict[int, int] = {}  # source tensor -> its current instance (expanded tensor)
        self.writer: dict[int, int] = {}  # source tensor -> the run that last made or wrote it
        self.maker: dict[int, int] = {}  # source tensor -> the run that made its current instance
        self.readers: dict[int, list[int]] = {}  # source tensor -> runs that read it since that write
        self.after: list[set[int]] = [set() for _ in runs]  # run -> runs that must come before it
        made = [0] * len(graph.tensors)
        for v in runs:
            for t in graph.ops[v].outputs:
                made[t] += 1
        self.instances_left = made

    def instance(self, t: int, x: int) -> int:
        """A new expanded tensor for the instance of ``t`` made by run ``x``."""
        tensor = self.graph.tensors[t]
        self.instances_left[t] -= 1
        last = self.instances_left[t] == 0
        category = tensor.category
        if category is Category.OUTPUT and not last:
            category = Category.ACTIVATION  # only the last instance is kept to the end of the step
        name = tensor.name if t not in self.current else f"{tensor.name}@{x}"
        self.tensors.append(Tensor(name, tensor.size_bytes, category, tensor.persistent))
        return len(self.tensors) - 1

    def touched(self, t: int) -> list[int]:
        """``t`` and, for a 0-byte view, what it views (transitively): a read of the view reads those."""
        out, stack, seen = [], [t], set()
        while stack:
            u = stack.pop()
            if u in seen:
                continue
            seen.add(u)
            out.append(u)
            p = self.graph.producer[u]
            if p >= 0 and self.facts.view[p]:
                stack.extend(_sources(self.graph, p))
        return out

    def read(self, t: int, x: int) -> None:
        for u in self.touched(t):
            w = self.writer.get(u)
            if w is not None and w != x and w != self.maker.get(u):  # data edges order the makers
                self.after[x].add(w)
            self.readers.setdefault(u, []).append(x)

    def write(self, t: int, x: int) -> None:
        """Run ``x`` makes a new instance of ``t`` or writes it in place: after every read of the old value."""
        for r in self.readers.get(t, ()):
            if r != x:
                self.after[x].add(r)
        w = self.writer.get(t)
        if w is not None and w != x:
            self.after[x].add(w)
        self.writer[t] = x
        self.readers[t] = []


def expand(graph: Graph, steps: Sequence[Step], workspace: Sequence[int] = ()) -> Expanded:
    """The expanded DAG of ``steps`` (see the module docstring): its peak in the sequence's own
    order equals :func:`memplan.remat.lower.sequence_peak_bytes` of ``steps`` lowered again with
    frees at last reads. Random ops and ops that write in place keep the plan's order among
    themselves (random draws in eager's sequence, so the numerics stay eager's; the calls of
    stateful objects as captured). Raises :class:`InvalidPlan` when a run reads a tensor never made."""
    runs = [i for kind, i in steps if kind == "run"]
    b = _Builder(graph, runs, workspace)
    ops: list[tuple[Op, list[int], list[int]]] = []
    count = [0] * len(graph.ops)
    fixed = None  # the last run of a random or mutating op: those keep the plan's order among them
    for x, v in enumerate(runs):
        op = graph.ops[v]
        count[v] += 1
        if is_random(op.kind) or op.mutates:
            if fixed is not None:
                b.after[x].add(fixed)
            fixed = x
        skipped = set(op.mutates) if count[v] > 1 and recompute_skips_mutation(graph, v) else set()
        inputs = []
        for t in op.inputs:
            if t not in b.current:
                name = graph.tensors[t].name
                raise InvalidPlan(f"run {x} of op {op.name!r} reads {name!r}, which is not made before")
            inputs.append(b.current[t])
            if t not in skipped:
                b.read(t, x)
        for t in op.mutates:
            if t not in skipped:
                b.write(t, x)
        outputs = []
        for t in op.outputs:
            b.write(t, x)
            b.maker[t] = x
            b.current[t] = b.instance(t, x)
            outputs.append(b.current[t])
        if workspace and workspace[v]:
            b.tensors.append(Tensor(f"workspace@{x}", int(workspace[v]), Category.TEMPORARY))
            outputs.append(len(b.tensors) - 1)
        ops.append((op, inputs, outputs))
    return _assemble(graph, runs, ops, b)


def _assemble(graph: Graph, runs: list[int], ops: list[tuple[Op, list[int], list[int]]], b: _Builder) -> Expanded:
    """The expanded graph: each run's op with its instances, and one 0-byte control tensor per
    run that some later run must follow."""
    follows: dict[int, list[int]] = {}
    for x, before in enumerate(b.after):
        for w in before:
            follows.setdefault(w, []).append(x)
    control: dict[int, int] = {}
    for w in sorted(follows):
        b.tensors.append(Tensor(f"order@{w}", 0, Category.CONTROL))
        control[w] = len(b.tensors) - 1
    extra_inputs: list[list[int]] = [[] for _ in runs]
    for w, xs in follows.items():
        for x in xs:
            extra_inputs[x].append(control[w])
    built = []
    seen: set[int] = set()
    for x, (op, inputs, outputs) in enumerate(ops):
        outs = outputs + ([control[x]] if x in control else [])
        name = op.name if runs[x] not in seen else f"{op.name}@{x}"
        seen.add(runs[x])
        built.append(
            Op(
                name,
                op.kind,
                tuple(TensorId(t) for t in inputs + extra_inputs[x]),
                tuple(TensorId(t) for t in outs),
                op.stream,
                (),
                op.flops,
            )
        )
    expanded = Graph(tuple(built), tuple(b.tensors), f"{graph.name}-expanded", {})
    return Expanded(expanded, tuple(runs), graph)


def steps_in_order(expanded: Expanded, order: Sequence[int], groups: Groups = ()) -> list[Step]:
    """The step sequence that runs ``expanded``'s runs in ``order`` (a topological order of
    ``expanded.graph``), less the runs nobody reads (the lowering's pass: a first run read by
    nobody before a re-run goes, so the op runs first later), frees at last reads; checked by
    :func:`validate_sequence` and, with ``groups``, :func:`check_groups_contiguous`."""
    runs = _refresh_and_prune(expanded.source, [expanded.op_of[x] for x in order])
    steps = insert_frees(expanded.source, runs)
    validate_sequence(expanded.source, steps)
    check_groups_contiguous(expanded.source, steps, groups)
    return steps


# --------------------------------------------------------------------------------------------
# Update groups: ops the runtime runs as one call
# --------------------------------------------------------------------------------------------

Groups = Sequence[Sequence[int]]
"""Groups of op ids the runtime runs as one call at the place of the last of them (a captured
step's optimizer update groups, :func:`memplan.torch.run.interpreter.optimizer_update_groups`):
the runs of a group's ops must be contiguous in a plan, no other run between them, or the
lifetimes the plan counts (each op's outputs made at its own run) are not the runtime's (the
call makes them all at its place)."""


def groups_breach(graph: Graph, steps: Sequence[Step], groups: Groups) -> str | None:
    """None when, in ``steps``, no run of an op outside a group lies between the first and the
    last run of the group's ops (:func:`memplan.remat.stage_order.broken_group`); else one line
    naming the first group that is broken."""
    from memplan.remat.stage_order import broken_group

    g = broken_group(steps, groups)
    if g is None:
        return None
    members = set(groups[g])
    runs = [i for kind, i in steps if kind == "run"]
    at = [p for p, v in enumerate(runs) if v in members]
    inside = next(runs[p] for p in range(at[0], at[-1]) if runs[p] not in members)
    name = graph.ops[groups[g][0]].name
    return f"op {graph.ops[inside].name!r} runs inside the group of {name!r}, which runs as one call"


def check_groups_contiguous(graph: Graph, steps: Sequence[Step], groups: Groups) -> None:
    """Raise :class:`InvalidPlan` when ``steps`` breaks a group (:func:`groups_breach`)."""
    breach = groups_breach(graph, steps, groups) if groups else None
    if breach is not None:
        raise InvalidPlan(breach)


def contiguous_order(expanded: Expanded, order: Sequence[int], groups: Groups) -> list[int] | None:
    """``order`` (of ``expanded``'s runs) with each group's runs moved to the place of its last
    run, as the budget path's reorder makes its order (:func:`memplan.pipeline.make_groups_contiguous`,
    after OLLA's lifetime optimisation); None when that is no topological order of the expanded DAG
    (a run outside a group reads what a member makes before the group's end)."""
    from memplan.errors import InvalidOrder
    from memplan.graph.check import validate_order
    from memplan.pipeline import make_groups_contiguous

    if not groups:
        return list(order)
    runs_of: dict[int, list[int]] = {}
    for x, v in enumerate(expanded.op_of):
        runs_of.setdefault(v, []).append(x)
    as_runs = [[x for v in members for x in runs_of.get(v, ())] for members in groups]
    moved = [int(x) for x in make_groups_contiguous(order, [g for g in as_runs if g])]
    try:
        validate_order(expanded.graph, moved)
    except InvalidOrder:
        return None
    return moved


# --------------------------------------------------------------------------------------------
# The moves of the alternating search
# --------------------------------------------------------------------------------------------


def _schedule(problem: RematProblem, steps: list[Step], strategy: str, status: str, **details: object) -> RematSchedule:
    """``steps`` as a schedule, measured by the one estimator."""
    peak = sequence_peak_bytes(problem.graph, steps, problem.workspace)
    return RematSchedule(
        strategy,
        problem.budget_bytes,
        steps,
        peak,
        run_cost(problem.cost, steps),
        problem.plain_cost,
        status if peak <= problem.budget_bytes else "over-budget",
        details=dict(details),
    )


def reorder_runs(
    problem: RematProblem, steps: Sequence[Step], seconds: float, workers: int = 2, groups: Groups = ()
) -> list[Step] | None:
    """The same runs in the order of least peak the schedule search finds for their expanded
    DAG in ``seconds`` (None when it is no lower than the sequence's own). ``groups`` (ops the
    runtime runs as one call, :func:`contiguous_order`) are made contiguous in that order as the
    budget path's reorder makes them (:func:`memplan.pipeline.make_groups_contiguous`); the new
    order's peak is checked against the expanded graph's: both are the one estimator's."""
    from memplan.schedule import optimize_order

    expanded = expand(problem.graph, steps, problem.workspace)
    own = list(range(len(expanded.op_of)))
    before = peak_bytes(expanded.graph, own)
    at_last_reads = insert_frees(problem.graph, [i for kind, i in steps if kind == "run"])
    if before != sequence_peak_bytes(problem.graph, at_last_reads, problem.workspace):
        raise InvalidPlan("the expanded DAG's peak differs from its step sequence's")
    result = optimize_order(expanded.graph, time_limit_seconds=max(0.1, seconds), workers=workers)
    order = contiguous_order(expanded, result.order, groups)
    if order is None:
        return None
    peak = peak_bytes(expanded.graph, order)
    if peak >= before:
        return None
    reordered = steps_in_order(expanded, order, groups)
    after = sequence_peak_bytes(problem.graph, reordered, problem.workspace)
    if after != peak:
        raise InvalidPlan(f"reordered plan peaks at {after} B, its expanded DAG at {peak} B")
    return reordered


def _rerun_positions(problem: RematProblem, runs: Sequence[int]) -> list[int]:
    """Positions of the re-runs in ``runs`` (not first runs) that cost something, the costliest first."""
    seen: set[int] = set()
    out = []
    for pos, v in enumerate(runs):
        if v in seen and problem.cost[v] > 0:
            out.append(pos)
        seen.add(v)
    return sorted(out, key=lambda pos: -problem.cost[runs[pos]])


def _without(problem: RematProblem, runs: Sequence[int], pos: int) -> list[Step] | None:
    """``runs`` without the run at ``pos`` (its readers read the instance before it), less the
    runs nobody reads then, frees at last reads; None when that is no valid plan."""
    try:
        left = _refresh_and_prune(problem.graph, [v for i, v in enumerate(runs) if i != pos])
        steps = insert_frees(problem.graph, left)
        validate_sequence(problem.graph, steps)
    except InvalidPlan:
        return None
    return steps


def drop_reruns(
    problem: RematProblem, steps: Sequence[Step], deadline: float = float("inf"), groups: Groups = ()
) -> list[Step]:
    """Take re-runs out of ``steps`` while the plan stays valid, within the budget and keeps
    ``groups`` contiguous, in the order as it is: the costliest first, each move measured. What
    the slack of a better order buys without a solver."""
    current = list(steps)
    tried: set[tuple[int, int]] = set()
    while time.perf_counter() < deadline:
        runs = [i for kind, i in current if kind == "run"]
        move = _next_move(problem, runs, tried)
        if move is None:
            break
        trial = _without(problem, runs, move)
        if trial is None or (groups and groups_breach(problem.graph, trial, groups)):
            continue
        if sequence_peak_bytes(problem.graph, trial, problem.workspace) <= problem.budget_bytes:
            current = trial
    return current


def _next_move(problem: RematProblem, runs: Sequence[int], tried: set[tuple[int, int]]) -> int | None:
    """The costliest re-run not tried yet (named by its op and how many runs of the op precede it)."""
    for pos in _rerun_positions(problem, runs):
        key = (runs[pos], sum(1 for v in runs[:pos] if v == runs[pos]))
        if key not in tried:
            tried.add(key)
            return pos
    return None


PROBE_SECONDS = 1.0
"""Each search for an order that fits a plan without one more re-run stops after this long."""


def refit_reruns(
    problem: RematProblem,
    steps: Sequence[Step],
    deadline: float,
    probe_seconds: float = PROBE_SECONDS,
    groups: Groups = (),
) -> tuple[list[Step], int]:
    """Reorder given the recomputations, one re-run fewer at a time: take the costliest re-run
    out and search an order of the runs left whose peak fits the budget (the exact search over
    ideals under a cap, :func:`memplan.schedule.ideals.fit_under`, on their expanded DAG; then
    ``groups`` made contiguous, :func:`contiguous_order`); keep the move when one is found. The
    plan and the re-runs taken out."""
    from memplan.schedule.ideals import fit_under

    current = list(steps)
    tried: set[tuple[int, int]] = set()
    dropped = 0
    while time.perf_counter() < deadline:
        runs = [i for kind, i in current if kind == "run"]
        move = _next_move(problem, runs, tried)
        if move is None:
            break
        trial = _without(problem, runs, move)
        if trial is None or (groups and groups_breach(problem.graph, trial, groups)):
            continue
        if sequence_peak_bytes(problem.graph, trial, problem.workspace) > problem.budget_bytes:
            expanded = expand(problem.graph, trial, problem.workspace)
            found = fit_under(expanded.graph, problem.budget_bytes, min(deadline, time.perf_counter() + probe_seconds))
            order = None if found.order is None else contiguous_order(expanded, found.order, groups)
            if order is None:
                continue
            trial = steps_in_order(expanded, order, groups)
            if sequence_peak_bytes(problem.graph, trial, problem.workspace) > problem.budget_bytes:
                if order != list(found.order):
                    continue  # the groups made contiguous peak over the budget: no move
                raise InvalidPlan("an order the ideal search fit under the budget peaks over it")
        current = trial
        dropped += 1
    return current, dropped


# --------------------------------------------------------------------------------------------
# The alternating search
# --------------------------------------------------------------------------------------------

REORDER_SHARE = 0.3
"""Each reorder of an expanded DAG gets at most this share of the time left ..."""
REORDER_MAX_SECONDS = 10.0
"""... and at most this long."""
SEQUENTIAL_SHARE = 0.5
"""The sequential solve that starts the search gets this share of the time (when not given)."""
REFIT_SHARE = 0.4
"""Taking re-runs out one at a time (:func:`refit_reruns`) stops after this share of a round's time."""
SOLVE_MARGIN_SECONDS = 2.0
"""Kept back from a round's solve for lowering and checking, so that the search ends in time."""
MAX_ROUNDS = 8
"""Rounds of the alternation at most (each is a reorder and a solve)."""


@dataclass
class JointSearch:
    """What :func:`solve_joint` found: the best plan, the sequential one it started from, and
    one line per round."""

    best: RematSchedule
    sequential: RematSchedule
    rounds: list[dict[str, object]] = field(default_factory=list)


def solve_joint(
    graph: Graph,
    order: Sequence[int] | None,
    budget_bytes: int,
    time_limit_seconds: float = 60.0,
    *,
    cost: tuple[float, ...] = (),
    workspace: tuple[int, ...] = (),
    workers: int = 2,
    sequential: RematSchedule | None = None,
    progress: Progress | None = None,
    groups: Groups = (),
) -> JointSearch:
    """Alternate remat given an order and reorder given the recomputations (module docstring),
    from ``sequential`` (the plan of :func:`memplan.remat.portfolio.solve_remat_in_order` over
    ``order``; solved here with :data:`SEQUENTIAL_SHARE` of the time when not given), until a
    round lowers the compute (or, at equal compute, the peak) no more or ``time_limit_seconds``
    are spent. ``groups``: ops the runtime runs as one call (:data:`Groups`); every plan the
    search makes keeps each contiguous (a move that breaks one is not taken). The best plan's
    ``details["joint"]`` says where it came from; it is the sequential plan when nothing beat it."""
    from memplan.remat.portfolio import solve_remat_in_order

    start = time.perf_counter()
    end = start + time_limit_seconds
    cost = tuple(cost or default_costs(graph))
    problem = RematProblem(graph, int(budget_bytes), cost, time_limit_seconds, workers, workspace=workspace)

    def solve(stage_order: Sequence[int] | None, seconds: float) -> RematSchedule:
        return solve_remat_in_order(
            graph, stage_order, budget_bytes, max(0.5, seconds), cost=cost, workspace=workspace, workers=workers
        )

    if sequential is None:
        sequential = solve(order, SEQUENTIAL_SHARE * time_limit_seconds)
    search = JointSearch(sequential, sequential)
    if not sequential.feasible:
        return search
    current = sequential
    for round_ in range(MAX_ROUNDS):
        left = end - time.perf_counter()
        if left <= 1.0:
            break
        try:
            found = _round(problem, current, left, workers, solve, groups)
        except InvalidPlan as err:  # a move that fails its check is dropped, and said so
            search.rounds.append({"round": round_ + 1, "dropped": str(err)})
            break
        found["round"] = round_ + 1
        if progress is not None:
            progress(f"joint round {round_ + 1}: {found}")
        search.rounds.append({k: v for k, v in found.items() if k != "plan"})
        plan = found.get("plan")
        if not isinstance(plan, RematSchedule) or not _better(plan, current):
            break
        current = plan
    search.best = current
    search.best.details["joint"] = {
        "rounds": search.rounds,
        "sequential_overhead": sequential.overhead,
        "seconds": round(time.perf_counter() - start, 3),
    }
    return search


def _better(plan: RematSchedule, than: RematSchedule) -> bool:
    """Less compute, or as much with a lower peak (more room for the placement)."""
    if plan.compute_cost < than.compute_cost * (1 - 1e-12):
        return True
    return plan.compute_cost <= than.compute_cost and plan.peak_bytes < than.peak_bytes


def _round(
    problem: RematProblem,
    current: RematSchedule,
    left: float,
    workers: int,
    solve: Callable[[Sequence[int] | None, float], RematSchedule],
    groups: Groups = (),
) -> dict[str, object]:
    """One round from ``current``: reorder given its recomputations (the order of least peak,
    then the re-runs that order fits without; and re-runs taken out one at a time where an order
    fits without them), then remat given the new first-run order; the cheapest valid plan within
    the budget."""
    began = time.perf_counter()
    end = began + left
    out: dict[str, object] = {"from_overhead": round(current.overhead, 6)}
    candidates = []
    seconds = min(REORDER_MAX_SECONDS, REORDER_SHARE * left)
    reordered = reorder_runs(problem, current.steps, seconds, workers, groups)
    start = current.steps
    if reordered is not None:
        out["reordered_peak_bytes"] = sequence_peak_bytes(problem.graph, reordered, problem.workspace)
        start = drop_reruns(problem, reordered, end, groups)
        candidates.append(_schedule(problem, start, "joint", "feasible", how="reorder"))
    refit, dropped = refit_reruns(problem, start, began + REFIT_SHARE * left, groups=groups)
    out["refit_dropped"] = dropped
    if dropped:
        candidates.append(_schedule(problem, refit, "joint", "feasible", how="refit"))
    changed = [c for c in candidates if c.feasible]
    rest = end - time.perf_counter()
    if changed and rest > 2 * SOLVE_MARGIN_SECONDS:
        lead = min(changed, key=lambda c: c.compute_cost)
        solved = solve(_first_runs(lead.steps), rest - SOLVE_MARGIN_SECONDS)
        breach = groups_breach(problem.graph, solved.steps, groups) if solved.feasible and groups else None
        if breach is not None:
            out["solve_dropped"] = breach
        elif solved.feasible:
            validate_sequence(problem.graph, solved.steps)
            solved.details["how"] = "solve"
            candidates.append(solved)
    fits = [c for c in candidates if c.feasible]
    out.update({f"{c.details['how']}_overhead": round(c.overhead, 6) for c in fits})
    if fits:
        best = min(fits, key=lambda c: (c.compute_cost, c.peak_bytes))
        best.strategy = "joint"
        best.details["stage_order"] = "joint"
        out["plan"] = best
    out["seconds"] = round(time.perf_counter() - began, 3)
    return out


def _first_runs(steps: Sequence[Step]) -> list[int]:
    seen: dict[int, None] = {}
    for kind, i in steps:
        if kind == "run" and i not in seen:
            seen[i] = None
    return list(seen)


# --------------------------------------------------------------------------------------------
# The budget path's choice: the sequential plan or the joint one
# --------------------------------------------------------------------------------------------

JOINT_MIN_SECONDS = 4.0
"""The budget path runs the joint search only with at least this long left of its time limit."""
SEARCH_SHARE = 0.7
"""The joint search is given this share of the time left after the placements: its moves (the
schedule search's heuristics, expanding and lowering a plan) can outlast their own limits on
large graphs on a busy machine, and the choice must end within the user's time limit."""
PLACE_SECONDS = 2.0
"""Each placed peak the choice compares gets at most this long ..."""
PLACE_SHARE = 0.15
"""... and at most this share of the time left."""
CHOICE_MARGIN_SECONDS = 0.5
"""Kept back from the joint search for the checks after it, so that the choice ends in time."""


@dataclass
class JointChoice:
    """What :func:`choose_joint` took (``plan``) and why (``report``: ``remat_plan`` is "joint" or
    "sequential", with both plans' compute overheads and placed peaks where measured)."""

    plan: RematSchedule
    report: dict[str, object]


def placed_peak_bytes(
    graph: Graph, steps: Sequence[Step], workspace: Sequence[int] = (), seconds: float = PLACE_SECONDS
) -> int:
    """The persistent bytes plus the arena of ``steps``' expanded DAG placed in its own order
    (OLLA 3.3, :func:`memplan.pipeline.place_order`, 64-byte alignment): the plan's peak once
    its tensors have static offsets, fragmentation included (OLLA eq. 6 over eq. 1)."""
    from memplan.pipeline import place_order

    expanded = expand(graph, steps, workspace)
    order = list(range(len(expanded.op_of)))
    _, placement = place_order(expanded.graph, order, max(0.1, seconds))  # type: ignore[arg-type]
    return graph.persistent_bytes + int(placement.arena_bytes)


def _recomputes(steps: Sequence[Step]) -> int:
    runs = [i for kind, i in steps if kind == "run"]
    return len(runs) - len(set(runs))


def joint_skipped(sequential: RematSchedule, seconds: float) -> JointChoice | None:
    """The choice of :func:`choose_joint` when it does not run the search (``sequential``
    recomputes nothing, or less than :data:`JOINT_MIN_SECONDS` are left), else None."""
    why = None
    if not sequential.feasible:
        why = "no sequential plan to start from"
    elif not _recomputes(sequential.steps):
        why = "the sequential plan recomputes nothing"
    elif seconds < JOINT_MIN_SECONDS:
        why = f"{max(0.0, seconds):.1f} s left of time_limit_seconds, below {JOINT_MIN_SECONDS:g} s"
    if why is None:
        return None
    return JointChoice(sequential, {**_report(sequential), "joint": f"not run: {why}"})


def _report(sequential: RematSchedule) -> dict[str, object]:
    """The choice's report before the search: every key, so that a report updated with a later
    choice (a re-plan) keeps nothing of an earlier one."""
    return {
        "remat_plan": "sequential",
        "joint": None,
        "sequential_overhead": round(sequential.overhead, 6) if sequential.feasible else None,
        "sequential_seconds": round(sequential.seconds, 3),
        "joint_overhead": None,
        "joint_rounds": None,
        "sequential_placed_bytes": None,
        "joint_placed_bytes": None,
        "joint_seconds": None,
    }


def choose_joint(
    graph: Graph,
    sequential: RematSchedule,
    seconds: float,
    *,
    limit_bytes: int,
    cost: tuple[float, ...] = (),
    workspace: tuple[int, ...] = (),
    workers: int = 2,
    groups: Groups = (),
) -> JointChoice:
    """The budget path's plan after its sequential solve (issue 36): :func:`solve_joint` from
    ``sequential`` in ``seconds`` (what is left of the user's time limit; the choice never takes
    longer), then the joint plan only when it computes less at a placed peak
    (:func:`placed_peak_bytes`) within ``limit_bytes`` (the user's budget), or as much at a lower
    placed peak; else ``sequential``. Not run when ``sequential`` recomputes nothing or less than
    :data:`JOINT_MIN_SECONDS` are left. ``groups`` stay contiguous (:data:`Groups`)."""
    start = time.perf_counter()
    skipped = joint_skipped(sequential, seconds)
    if skipped is not None:
        return skipped
    report = _report(sequential)
    place = min(PLACE_SECONDS, PLACE_SHARE * seconds)
    search_seconds = SEARCH_SHARE * (seconds - 2 * place - CHOICE_MARGIN_SECONDS)
    search = solve_joint(
        graph,
        None,
        sequential.budget_bytes,
        search_seconds,
        cost=cost,
        workspace=workspace,
        workers=workers,
        sequential=sequential,
        groups=groups,
    )
    joint = search.best
    report.update(joint_overhead=round(joint.overhead, 6), joint_rounds=len(search.rounds))
    if joint is sequential:
        report["joint"] = "no round beat the sequential plan"
        return JointChoice(sequential, _timed(report, start))
    validate_sequence(graph, joint.steps)
    check_groups_contiguous(graph, joint.steps, groups)
    placed_joint = placed_peak_bytes(graph, joint.steps, workspace, place)
    placed_sequential = placed_peak_bytes(graph, sequential.steps, workspace, place)
    report.update(sequential_placed_bytes=placed_sequential, joint_placed_bytes=placed_joint)
    cheaper = joint.compute_cost < sequential.compute_cost * (1 - 1e-12)
    same = joint.compute_cost <= sequential.compute_cost and placed_joint < placed_sequential
    if placed_joint > limit_bytes:
        report["joint"] = "its placed peak is over the budget"
    elif cheaper or same:
        report.update(remat_plan="joint", joint="less compute" if cheaper else "as much compute, lower placed peak")
        report = _timed(report, start)
        joint.seconds = sequential.seconds + float(report["joint_seconds"])  # type: ignore[arg-type]
        return JointChoice(joint, report)
    else:
        report["joint"] = "no less compute and no lower placed peak"
    return JointChoice(sequential, _timed(report, start))


def _timed(report: dict[str, object], start: float) -> dict[str, object]:
    return {**report, "joint_seconds": round(time.perf_counter() - start, 3)}


# --------------------------------------------------------------------------------------------
# The order-free bound
# --------------------------------------------------------------------------------------------

ORDER_FREE_SCOPE = "every plan: any order of the first runs, any number of re-runs (order-free drop cover)"


@dataclass(frozen=True)
class OrderFreeBound:
    """``cost``: no plan in any order computes less (infinite: none fits, the floor ``floor_bytes``
    at ``op`` is over the budget); ``extra`` of it is above the plain step, attained at ``op``."""

    cost: float
    extra: float
    op: int
    floor_bytes: int


CUT_SECONDS = 5.0
""":func:`order_free_bound` spends at most this long on the cuts of :func:`cut_cover_bound`."""
COVER_OPS = 512
"""The exact covers are solved at the ops where the most bytes cross in every order, at most this many ..."""
CUT_OPS = 8
"""... over the ops where the most bytes cross in every order ..."""
CUT_LAMBDAS = 8
"""... at this many prices of a byte."""


def order_free_bound(problem: RematProblem, seconds: float = CUT_SECONDS) -> OrderFreeBound:
    """The order-free bound (see the module docstring): the exact drop cover of the tensors
    that cross each op in every order, raised by :func:`cut_cover_bound` in ``seconds``."""
    graph, budget = problem.graph, problem.budget_bytes
    crossing = _crossing(problem)
    forced = crossing.forced
    floor = int(forced.max(initial=graph.persistent_bytes))
    worst = int(forced.argmax()) if len(forced) else 0
    if floor > budget:
        return OrderFreeBound(float("inf"), float("inf"), worst, floor)
    best = OrderFreeBound(problem.plain_cost, 0.0, -1, floor)
    nodes_left = TOTAL_COVER_NODES
    need = forced + crossing.spare
    ratios: list[float] = []
    for v in np.argsort(-need)[:COVER_OPS]:
        excess = int(need[v]) - budget
        if excess <= 0:
            break
        items = [(problem.cost[u], size) for u, size in crossing.row(int(v)).items()]
        ratios.append(_stopping_ratio(excess, items))
        if _greedy_cover(excess, items) <= best.extra:
            continue  # this op's cover cannot beat the best one
        extra, used = cover_search(excess, items, nodes_left)
        nodes_left = max(0, nodes_left - used)
        if extra > best.extra:
            best = OrderFreeBound(problem.plain_cost + extra, extra, int(v), floor)
    if seconds > 0 and ratios:
        ops = [int(v) for v in np.argsort(-need)[:CUT_OPS]]
        extra, v = cut_cover_bound(problem, ops, _lambdas(ratios), time.perf_counter() + seconds)
        if extra > best.extra:
            best = OrderFreeBound(problem.plain_cost + extra, extra, v, floor)
    return best


def _stopping_ratio(excess: int, items: list[tuple[float, int]]) -> float:
    """The cost per byte of the item where the LP cover of ``excess`` stops (the dual price)."""
    ratio = 0.0
    for cost, size in sorted(items, key=lambda item: item[0] / item[1]):
        ratio = cost / size
        excess -= size
        if excess <= 0:
            break
    return ratio


def _lambdas(ratios: list[float]) -> list[float]:
    """Prices of a byte to try: the LP covers' own, and a geometric spread around them."""
    top = max(ratios)
    spread = [top * 2.0**-k for k in range(CUT_LAMBDAS - len(set(ratios[:2])))]
    return sorted({*ratios[:2], *spread}, reverse=True)


def cut_cover_bound(
    problem: RematProblem, ops: Sequence[int], lambdas: Sequence[float], deadline: float
) -> tuple[float, int]:
    """The drop cover's Lagrangian over every ideal: for a price ``lam`` of a byte, a plan that
    runs ``v`` with the ops of an ideal ``D`` before it holds the tensors ``X(D)`` that cross
    ``v`` (made in ``D``, read after) or re-runs their producers after ``v``; the LP dual of
    that knapsack cover gives ``extra >= W_lam(X(D)) + lam (workspace(v) - budget)`` with
    ``W_lam(t) = lam * bytes(t)`` for a tensor that must stay (run-once producer, persistent,
    ``v``'s own) and ``min(lam * bytes(t), c_t)`` for one a re-run may spare (``c_t``: its
    producer's cost split over its outputs by bytes). Minimised over ``D`` it is a minimum cut
    (:func:`memplan.schedule.bounds.resident_floor` over the weights), so it holds for every
    order; unlike the crossing of every order it sees that a value needed after ``v`` crosses
    it in some form (the tensor or what an op made from it). The best over ``ops`` and
    ``lambdas``, and the op (-1: none) until ``deadline``."""
    from memplan.schedule.bounds import CutNetwork, resident_floor

    graph = problem.graph
    reach = Reachability.of(graph)
    best, at = 0.0, -1
    for lam in lambdas:
        if time.perf_counter() > deadline:
            break
        weighted, keep, scale = _weighted(problem, lam)
        network = CutNetwork.of(weighted)
        for v in ops:
            if time.perf_counter() > deadline:
                break
            floor = resident_floor(weighted, reach, network, v)
            if floor is None:
                continue
            own = {*graph.ops[v].inputs, *graph.ops[v].outputs}
            fixed = sum(keep[t] - weighted.tensors[t].size_bytes for t in own if not graph.tensors[t].persistent)
            scratch = problem.workspace[v] if problem.workspace else 0
            extra = (floor + fixed) / scale + lam * (scratch - problem.budget_bytes)
            if extra > best:
                best, at = extra * (1 - 1e-9), v
    return best, at


def _weighted(problem: RematProblem, lam: float) -> tuple[Graph, list[int], float]:
    """``problem.graph`` with every tensor's bytes replaced by its weight ``W_lam`` (see
    :func:`cut_cover_bound`), rounded down in units of ``1 / scale``; and each tensor's weight
    as one that must stay (``lam * bytes``), in the same units."""
    graph = problem.graph
    limits = rerun_limits(graph)
    spare: dict[int, int] = {}
    for t, tensor in enumerate(graph.tensors):
        u = graph.producer[t]
        if not tensor.persistent and tensor.size_bytes and u >= 0 and limits[u] > u:
            spare[u] = spare.get(u, 0) + tensor.size_bytes
    total = lam * sum(t.size_bytes for t in graph.tensors) + 1.0
    scale = min(1.0, 2.0**50 / total)
    keep, tensors = [], []
    for t, tensor in enumerate(graph.tensors):
        u = graph.producer[t]
        stay = lam * tensor.size_bytes
        weight = stay
        if u >= 0 and u in spare and not tensor.persistent and tensor.size_bytes:
            weight = min(stay, problem.cost[u] * tensor.size_bytes / spare[u])
        keep.append(int(stay * scale))
        tensors.append(Tensor(tensor.name, int(weight * scale), tensor.category, tensor.persistent))
    return Graph(graph.ops, tuple(tensors), graph.name, {}), keep, scale


@dataclass(frozen=True)
class _Crossing:
    """Per op ``v``: bytes resident at its run in every plan of every order (``forced[v]``) and
    bytes that cross it in every order but that a re-run after ``v`` may spare (``spare[v]``);
    per such tensor, its producer, bytes and the ops it crosses (a bitset)."""

    forced: np.ndarray
    spare: np.ndarray
    tensors: list[tuple[int, int, int]]

    def row(self, v: int) -> dict[int, int]:
        """Bytes per producer ``u`` of the tensors crossing ``v`` that only a re-run of ``u`` after ``v`` spares."""
        out: dict[int, int] = {}
        for u, size, bits in self.tensors:
            if bits >> v & 1:
                out[u] = out.get(u, 0) + size
        return out


def _crossing(problem: RematProblem) -> _Crossing:
    """:class:`_Crossing` of ``problem``'s graph (see the module docstring)."""
    graph = problem.graph
    n = len(graph.ops)
    reach = Reachability.of(graph)
    limits = rerun_limits(graph)
    forced = np.full(n, graph.persistent_bytes, dtype=np.int64)
    if problem.workspace:
        forced += np.asarray(problem.workspace, dtype=np.int64)
    spare = np.zeros(n, dtype=np.int64)
    tensors = []
    for t, tensor in enumerate(graph.tensors):
        u = graph.producer[t]
        if tensor.persistent or tensor.size_bytes == 0 or u < 0:
            continue
        own = 1 << u
        later = 0
        for c in graph.consumers[t]:
            own |= 1 << c
            later |= reach.ancestors[c]
        if tensor.category is Category.OUTPUT:
            later = reach.descendants[u]  # kept to the end of the step
        forced += tensor.size_bytes * _bits(own, n)
        crossing = reach.descendants[u] & later & ~own
        closed = crossing if limits[u] <= u else crossing & _window_closed(reach, limits[u], n)
        forced += tensor.size_bytes * _bits(closed, n)
        if crossing & ~closed:
            spare += tensor.size_bytes * _bits(crossing & ~closed, n)
            tensors.append((u, tensor.size_bytes, crossing & ~closed))
    return _Crossing(forced, spare, tensors)


def _window_closed(reach: Reachability, m: int, n: int) -> int:
    """The ops at whose first run a re-run of a producer whose window ends at op ``m`` (it reads
    what ``m`` mutates, :func:`memplan.remat.problem.rerun_limits`) can no longer come later:
    ``m`` and its descendants (``m`` runs before them in every order). No window: none."""
    return 0 if m >= n else reach.descendants[m] | (1 << m)


def _bits(bits: int, n: int) -> np.ndarray:
    raw = np.frombuffer(bits.to_bytes((n + 7) // 8, "little"), dtype=np.uint8)
    return np.unpackbits(raw, bitorder="little")[:n].astype(bool)


__all__ = [
    "ORDER_FREE_SCOPE",
    "Expanded",
    "Groups",
    "JointChoice",
    "JointSearch",
    "OrderFreeBound",
    "check_groups_contiguous",
    "choose_joint",
    "contiguous_order",
    "cut_cover_bound",
    "drop_reruns",
    "expand",
    "groups_breach",
    "joint_skipped",
    "order_free_bound",
    "placed_peak_bytes",
    "refit_reruns",
    "reorder_runs",
    "solve_joint",
    "steps_in_order",
]
