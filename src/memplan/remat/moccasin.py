"""A second exact formulation beside the MILP: Moccasin's CP model (Bartan et al., ICML 2023).

Checkmate's MILP (:mod:`memplan.remat.milp`) has O(n^2) Boolean variables. Moccasin keeps
Checkmate's time axis but gives each node at most ``C`` compute *intervals* instead of a row
of booleans per stage, so the model has O(C n) variables and CP-SAT's scheduling
propagators (cumulative) do the memory reasoning. Over the solver graph
(:mod:`memplan.remat.coarsen`):

* **time** (Moccasin's "stages"): Checkmate's frontier-advancing stages flattened into
  events. Stage ``t`` holds one event per node ``k < t`` that may be re-run then (its
  window is open and a reader of it can still run), in node order, and ends with node
  ``t``'s first run. A plan that keeps program order for the first runs is a choice of
  recompute events, exactly Checkmate's ``R``;
* **runs**: node ``k`` runs at most ``C`` times (``C = 2``: the first run, fixed at its own
  stage, and at most one recompute, an optional event in a later stage of its window).
  Run-once nodes (:func:`memplan.remat.problem.rerun_limits`) run once;
* **retention intervals** (Moccasin's intervals): each run ``r`` of ``k`` keeps each of its
  parts ``q`` (outputs grouped by the nodes that read them, as in the MILP) resident over
  ``[start_r, end_rq)``, at least over its own event; a part of run 0 ends before run 1
  starts (a tensor is not made again while it is live);
* **memory** (Moccasin's cumulative constraint): the retention intervals (part bytes), a
  one-event interval per run for the node's temporaries beyond its outputs (its peak), and
  a fixed interval from the first run to the end for outputs of the step, against
  ``budget - persistent bytes``. This is the MILP's ``U`` with its own accounting: inputs
  are resident while a node runs (a retention interval reaches past every read), so a plan
  within the model is within the budget on the real graph (re-measured after lowering);
* **precedence** (Moccasin's ``x_uv^ij``): each run of ``j`` reads each part it needs
  (:class:`Reads`: what the lowering will run, in-place re-applications included) from a run
  of its producer that started before it and whose interval reaches past it. Parts without
  bytes (control tokens, view handles) are never freed and need nothing;
* **objective**: ``min sum_k C_k (runs of k)``: the plain step's cost is part of it, so the
  gap is relative to the whole step's compute.

Beyond the paper: phase 1 (Moccasin's, an elastic capacity) runs only when the direct search
finds no first plan; first runs may be *deferred* to a later stage (``defer``: recomputation
and reordering decided together); parts and per-run reads follow memplan's lowering.

Also beyond the paper, **stage cuts** (:func:`_stage_cuts`), redundant constraints for the
bound: the cumulative constraint's linear relaxation says nothing about re-runs, so on a
budget near the memory floor the search's bound stays at the plain step (a random layered
DAG of 100 nodes at 0.9 of its peak: gap 37% after 20 s). At each stage over the budget, a
part read later is resident or its node runs again after the stage, and so on back through
what that re-run reads; with the re-run flags tied to the objective, the relaxation bounds
the compute (that DAG: proven optimal in about a second). They are solved alone first
(:func:`stage_cut_bound`) and join the model only when they bound something. Solved alone as
a MILP (:func:`stage_cut_relaxation`, SCIP's LP bound with cutting planes), they bound much
sooner, and the nodes their best solution re-runs guide a search of the model restricted to
those nodes (:func:`solve_restricted`): the portfolio's way to a plan on graphs whose whole
model is too slow (:mod:`memplan.remat.portfolio`). Alone, they count one re-run per node and
segment of :class:`RerunWindows` (re-runs asked for in windows that cannot overlap are
different runs): the 250-node DAG at 0.7 of its peak, +18.9% of compute, proven in 13 s,
where one flag per node bounded +18.3% after 15 s. With reader windows (a part that a re-run
reads is made before that re-run, whose window may close long before its producer's; see
:func:`_relaxation_model`) the LP alone bounds +20.0% in 4.5 s, and HiGHS's branch and bound
on that model (:class:`CutMilp`, in a child process beside the portfolio's search) proves its
optimum, +20.65%, in about 21 s (SCIP's gives no bound in 20 s).

The answer becomes Checkmate's ``R`` (stage ``t`` runs node ``t`` and the recomputes placed
in it) and goes through the same lowering and estimator as every other strategy
(:func:`memplan.remat.lower.schedule_from_decisions`). The search is hinted with a plan's
``R`` (a baseline's or the MILP's) where that plan runs no node more than ``C`` times.

The model is exact for plans with at most ``C`` runs per node (tested against brute force):
its status and bound speak for that space (``details["scope"]``), not for plans that
recompute a node more often.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import reduce

from ortools.sat.python import cp_model

from memplan.graph.ir import Category
from memplan.remat.coarsen import SolverGraph
from memplan.remat.lower import schedule_from_decisions
from memplan.remat.problem import RematProblem, RematSchedule, recompute_skips_mutation, rerun_limits
from memplan.solvers import BOUND_MARGIN, Found, SolveStatus, solve_as_mip, solve_cp_sat

RUNS_PER_NODE = 2
"""Moccasin's C: the paper's default, the first run and one recompute."""
COST_STEPS = 10**7
"""Resolution of the objective when costs are not small integers (1e-7 of the costliest node)."""


Part = tuple[int, int]
"""``(p, q)``: part ``q`` of node ``p`` (its outputs read by one set of other nodes)."""


@dataclass(frozen=True)
class Reads:
    """Which byte-holding parts each run of a node needs resident, as the lowering runs it.

    ``first[j]``: parts read by the first run of ``j``; ``rerun[j]``: by a recompute, which
    leaves out the in-place members that the lowering does not repeat
    (:func:`memplan.remat.lower.lower` re-applies an in-place op only when the tensor it
    rewrites is made again). A 0-byte input made by a re-runnable 0-byte op (a view, an
    in-place follower) is followed to that op's inputs: the lowering may re-run it right
    before the read, and then those must be resident too.
    """

    first: tuple[tuple[Part, ...], ...]
    rerun: tuple[tuple[Part, ...], ...]

    def of(self, j: int, r: int) -> tuple[Part, ...]:
        return self.first[j] if r == 0 else self.rerun[j]

    def readers(self, size: int) -> dict[Part, set[int]]:
        out: dict[Part, set[int]] = {}
        for j in range(size):
            for part in (*self.first[j], *self.rerun[j]):
                out.setdefault(part, set()).add(j)
        return out


def node_reads(sg: SolverGraph) -> Reads:
    """:class:`Reads` of every node of ``sg`` (see there)."""
    graph = sg.graph
    limits = rerun_limits(graph)
    group_of = [0] * len(graph.ops)
    for k, members in enumerate(sg.groups):
        for v in members:
            group_of[v] = k
    part_index = [{readers: q for q, (_, readers) in enumerate(parts)} for parts in sg.parts]

    def sources(j: int, members: list[int]) -> tuple[Part, ...]:
        found: set[Part] = set()
        stack = [t for v in members for t in graph.ops[v].inputs]
        seen: set[int] = set()
        while stack:
            t = stack.pop()
            tensor = graph.tensors[t]
            if t in seen or tensor.persistent:
                continue
            seen.add(t)
            m = graph.producer[t]
            p = group_of[m]
            if tensor.size_bytes == 0:
                if limits[m] > m and all(graph.tensors[u].size_bytes == 0 for u in graph.ops[m].outputs):
                    stack.extend(graph.ops[m].inputs)
                continue
            if p == j or tensor.category is Category.OUTPUT:
                continue
            readers = tuple(sorted({group_of[c] for c in graph.consumers[t]} - {p}))
            q = part_index[p].get(readers)
            if q is not None and sg.parts[p][q][0]:
                found.add((p, q))
        return tuple(sorted(found))

    def repeated(v: int) -> bool:
        return not graph.ops[v].mutates or recompute_skips_mutation(graph, v)

    first = tuple(sources(j, list(members)) for j, members in enumerate(sg.groups))
    rerun = tuple(sources(j, [v for v in members if repeated(v)]) for j, members in enumerate(sg.groups))
    return Reads(first, rerun)


@dataclass
class Events:
    """Checkmate's stages flattened: ``index[(t, k)]`` is the event of node ``k`` in stage ``t``."""

    index: dict[tuple[int, int], int]
    stage_node: list[tuple[int, int]]
    recompute: list[list[int]]
    """``recompute[k]``: the stages (after ``k``) in which node ``k`` may be re-run."""

    @property
    def horizon(self) -> int:
        return len(self.stage_node) + 1

    def first(self, k: int) -> int:
        return self.index[k, k]

    def latest(self, k: int) -> int:
        return self.index[self.recompute[k][-1], k] if self.recompute[k] else self.first(k)


def build_events(sg: SolverGraph, reads: Reads) -> Events:
    """One event per (stage, node) pair that can run: node ``t`` in stage ``t``, and ``k < t``
    where ``k``'s re-run window is open at ``t`` and a reader of ``k`` can still run then."""
    readers = reads.readers(sg.size)
    last_stage = list(range(sg.size))
    for k in range(sg.size - 1, -1, -1):
        for q in range(len(sg.parts[k])):
            for j in readers.get((k, q), ()):
                latest = min(sg.limit[j] - 1, max(j, last_stage[j])) if sg.recomputable(j) else j
                last_stage[k] = max(last_stage[k], latest)
    recompute: list[list[int]] = [[] for _ in range(sg.size)]
    candidates: list[list[int]] = [[] for _ in range(sg.size)]
    for k in range(sg.size):
        if not sg.recomputable(k) or not any(b for b, _ in sg.parts[k]):
            continue
        for t in range(k + 1, min(sg.limit[k], last_stage[k] + 1, sg.size)):
            recompute[k].append(t)
            candidates[t].append(k)
    index: dict[tuple[int, int], int] = {}
    stage_node: list[tuple[int, int]] = []
    for t in range(sg.size):
        for k in [*candidates[t], t]:
            index[t, k] = len(stage_node)
            stage_node.append((t, k))
    return Events(index, stage_node, recompute)


@dataclass
class _Run:
    start: cp_model.IntVar | int
    present: cp_model.IntVar | int
    ends: dict[int, cp_model.IntVar] = field(default_factory=dict)
    """``ends[q]``: end of the retention interval of part ``q`` (parts with bytes only)."""


@dataclass
class CpModel:
    """The built model and what decoding and hinting need."""

    model: cp_model.CpModel
    events: Events
    reads: Reads
    runs: list[list[_Run]]
    cost_unit: float
    memory_unit: int


def _scale(values: list[int]) -> int:
    """The largest unit every value is a multiple of (exact integer scaling)."""
    return max(1, reduce(math.gcd, (v for v in values if v), 0))


def cost_scale(costs: tuple[float, ...]) -> tuple[list[int], float]:
    """Integer costs and their unit: exact for integral costs (FLOPs), else ``COST_STEPS``
    steps of the costliest node (measured seconds)."""
    if all(float(c).is_integer() for c in costs) and sum(costs) < 2**52:
        unit = _scale([int(c) for c in costs])
        return [int(c) // unit for c in costs], float(unit)
    top = max(max(costs, default=1.0), 1e-30)
    unit = top / COST_STEPS
    return [max(0, round(c / unit)) for c in costs], unit


def _scaled_floor(floor: float, unit: float, costs: tuple[float, ...], runs_per_node: int) -> int:
    """``floor`` in the scaled costs' units, rounded down past what the scaling can lose:
    nothing for exact integer costs, half a unit per run for rounded ones."""
    exact = all(float(c).is_integer() for c in costs)
    slack = 0.0 if exact else 0.5 * runs_per_node * len(costs)
    return max(0, math.floor(floor / unit - slack) - 1)


def build_model(
    sg: SolverGraph,
    budget_bytes: int,
    persistent_bytes: int,
    runs_per_node: int,
    defer: bool = False,
    elastic: bool = False,
    stage_cuts: bool = True,
    objective_floor: float | None = None,
) -> CpModel:
    """Moccasin over ``sg`` (see the module docstring). With ``defer``, a node's first run in
    its own stage is optional too: the node may first run in a later stage (a slot of its
    re-run window), which moves it later in the order (see :func:`solve_moccasin`).

    ``elastic`` is Moccasin's phase 1: the memory capacity is a variable and the objective is
    its excess over the budget, so every plan is a solution (checkpoint-all among them) and
    the search walks from one to a plan within the budget (excess 0, proven optimal).

    ``stage_cuts`` adds the redundant constraints of :func:`_stage_cuts` (not with ``defer``
    or ``elastic``): they change no solution, they give the search a lower bound.
    ``objective_floor``: a cost (problem units) no plan in program order goes below (e.g.
    :func:`memplan.remat.bounds.drop_cover_bound`), given to the search as its bound, less the
    rounding of the scaled costs (not with ``defer`` or ``elastic``)."""
    reads = node_reads(sg)
    events = build_events(sg, reads)
    model = cp_model.CpModel()
    units = memory_units(sg, budget_bytes, persistent_bytes)
    work, unit, capacity = units.work, units.memory, units.capacity
    horizon = events.horizon
    last_read = _last_read_events(sg, events, reads)
    runs: list[list[_Run]] = []
    for k in range(sg.size):
        deferrable = defer and bool(events.recompute[k]) and not _read_without_bytes(sg, k)
        first = model.new_bool_var(f"p{k}_0") if deferrable else 1
        node_runs = [_Run(events.first(k), first)]
        if events.recompute[k]:
            domain = cp_model.Domain.from_values([events.index[t, k] for t in events.recompute[k]])
            for r in range(1, min(runs_per_node, len(events.recompute[k]) + 1)):
                start = model.new_int_var_from_domain(domain, f"s{k}_{r}")
                node_runs.append(_Run(start, model.new_bool_var(f"p{k}_{r}")))
        for r, run in enumerate(node_runs):
            for q, (b, _) in enumerate(sg.parts[k]):
                if b:
                    low = events.first(k) + 1 if r == 0 else 0
                    # a part nobody reads any more still lives over its own event
                    high = max(low, last_read[k][q] + 1, (events.first(k) if r == 0 else events.latest(k)) + 1)
                    run.ends[q] = model.new_int_var(low, high, f"e{k}_{r}_{q}")
        if not isinstance(first, int):
            model.add(sum(run.present for run in node_runs) >= 1)  # every node runs; linear, for the bound
        runs.append(node_runs)
    intervals, demands = _memory_intervals(model, sg, events, runs, work, unit, horizon)
    _precedence(model, reads, runs)
    _runs_do_not_overlap(model, runs)
    if stage_cuts and not defer and not elastic and runs_per_node > 1:
        _stage_cuts(model, sg, events, reads, units, lambda p, v: _runs_again_after(model, runs[p], events.first(v)))
    costs, cost_unit = cost_scale(sg.cost)
    if elastic:
        memory = model.new_int_var(0, sum(demands), "memory")
        excess = model.new_int_var(0, sum(demands), "excess")
        model.add(excess >= memory - capacity)
        model.add_cumulative(intervals, demands, memory)
        model.minimize(excess)
    else:
        if capacity < 0:
            model.add_bool_or([])  # the persistent bytes alone exceed the budget
        model.add_cumulative(intervals, demands, max(0, capacity))
        objective = sum(costs[k] * run.present for k, node_runs in enumerate(runs) for run in node_runs)
        if objective_floor is not None and not defer:
            model.add(objective >= _scaled_floor(objective_floor, cost_unit, sg.cost, runs_per_node))
        model.minimize(objective)
    return CpModel(model, events, reads, runs, cost_unit, unit)


STAGE_CUT_PAIRS = 6_000
"""The stage cuts get at most this many (node, stage) variables, the stages most over the budget first."""


@dataclass(frozen=True)
class MemoryUnits:
    """The model's memory scale: bytes per demand unit and the capacity in units."""

    memory: int
    capacity: int
    work: list[int]
    """Bytes (not units) of each node's temporaries beyond its outputs."""


def memory_units(sg: SolverGraph, budget_bytes: int, persistent_bytes: int) -> MemoryUnits:
    """The largest unit every size is a multiple of (exact), and the capacity in it."""
    sizes = [b for parts in sg.parts for b, _ in parts] + list(sg.output_bytes)
    work = [max(0, sg.peak_bytes[k] - sum(b for b, _ in sg.parts[k])) for k in range(sg.size)]
    unit = _scale(sizes + work)
    return MemoryUnits(unit, (budget_bytes - persistent_bytes) // unit, work)


AgainAfter = Callable[[int, int], cp_model.IntVar]
"""``again(p, v)``: a Boolean that implies a re-run of node ``p`` after the first run of node
``v`` (and, in the relaxation, before the window of :func:`rerun_windows` closes)."""
ChainKey = Callable[[int, int], int]
"""``key(p, v)``: stages ``v`` with the same key for node ``p`` have nested ``again`` windows."""
Narrow = Callable[[int, Part, int, cp_model.IntVar, cp_model.IntVar], None]
"""``narrow(v, part, j, r, b_j)``: more constraints on a part's residence ``r`` at stage ``v``
when a re-run of ``j`` after ``v`` (``b_j``) reads it."""


def _stage_cuts(
    model: cp_model.CpModel,
    sg: SolverGraph,
    events: Events,
    reads: Reads,
    units: MemoryUnits,
    again: AgainAfter,
    chain_key: ChainKey = lambda _p, _v: 0,
    narrow: Narrow | None = None,
    stages: list[Stage] | None = None,
) -> None:
    """Redundant constraints: the memory at each tight stage, with re-runs as its only way out.

    At node ``v``'s first run (event ``e_v``) every byte part ``(p, q)`` made before and read by
    the first run of a later node is resident, or ``p`` runs again after ``e_v`` (``b[p, v]``);
    a part that a re-run of ``j`` after ``e_v`` reads is resident unless ``p`` runs again after
    ``e_v`` too (``r >= b[j, v] - b[p, v]``). The resident parts, ``v``'s inputs, outputs and
    temporaries and the outputs of the step made before it fit the capacity (Checkmate's
    ``U <= budget`` at one stage). Every plan of the model meets them (``b`` and ``r`` as the
    plan has them), so they cut no plan; but with ``b[p, v] <= present`` (of ``p``'s re-run)
    their linear relaxation ties the budget to the objective, which the cumulative constraint
    alone does not: on a budget near the memory floor it is the search's lower bound.
    ``narrow(v, part, j, r, b_j)``: called for each part a re-run of ``j`` after ``e_v`` reads,
    to bound its residence ``r`` further (see :func:`stage_cut_relaxation`). ``stages``: the
    stages to cut (default :func:`chosen_stages`); fewer stages, fewer constraints: still a
    relaxation of every plan (:mod:`memplan.remat.stage_bounds`)."""
    size = part_units(sg, units)
    rerun_readers: dict[Part, list[int]] = {}
    for j in range(sg.size):
        for part in reads.rerun[j]:
            rerun_readers.setdefault(part, []).append(j)
    later: dict[tuple[int, int], cp_model.IntVar] = {}
    cut = chosen_stages(sg, events, reads, units) if stages is None else stages
    for v, fixed, crossing, movable in sorted(cut, key=lambda c: -c[0]):
        after = {p: again(p, v) for p in movable}
        for p, b in after.items():
            key = (p, chain_key(p, v))
            if key in later:
                model.add_implication(later[key], b)  # a re-run after a later stage is after this one
            later[key] = b
        inputs = set(reads.first[v])
        _stage_memory(model, v, fixed, crossing, after, size, rerun_readers, units.capacity, inputs, narrow)


Stage = tuple[int, int, list[Part], list[int]]
"""A stage the cuts bound: ``(v, fixed, crossing, movable)`` (see :func:`over_budget_stages`)."""


def chosen_stages(sg: SolverGraph, events: Events, reads: Reads, units: MemoryUnits) -> list[Stage]:
    """The stages over the budget the cuts bound, the most over it first, with the nodes that
    may run again after each (:func:`_movable_closure`), up to :data:`STAGE_CUT_PAIRS` pairs."""
    pairs = 0
    chosen = []
    stages = over_budget_stages(sg, reads, units, part_units(sg, units))
    for _excess, v, fixed, crossing in sorted(stages, key=lambda s: -s[0]):
        movable = _movable_closure(events, reads, v, crossing)
        if pairs + len(movable) > STAGE_CUT_PAIRS:
            break
        pairs += len(movable)
        chosen.append((v, fixed, crossing, movable))
    return chosen


def part_units(sg: SolverGraph, units: MemoryUnits) -> dict[Part, int]:
    """Each byte part's size in the model's memory units (parts without bytes left out)."""
    return {(p, q): b // units.memory for p, parts in enumerate(sg.parts) for q, (b, _) in enumerate(parts) if b}


def over_budget_stages(
    sg: SolverGraph, reads: Reads, units: MemoryUnits, size: dict[Part, int]
) -> list[tuple[int, int, int, list[Part]]]:
    """The stages where keeping every part over the budget: ``(excess, v, fixed, crossing)``
    per such first run ``v`` (memory units). ``fixed``: the outputs of the step made before
    ``v``, ``v``'s inputs, outputs and temporaries; ``crossing``: the parts made before ``v``
    and read by the first run of a later node; ``excess``: what ``fixed`` and ``crossing``
    together exceed the capacity by, what re-runs must make room for."""
    last_first_read: dict[Part, int] = {}
    for j in range(sg.size):
        for part in reads.first[j]:
            last_first_read[part] = max(last_first_read.get(part, j), j)
    stages = []
    made_before = 0
    for v in range(sg.size):
        own = sum(size.get((v, q), 0) for q in range(len(sg.parts[v]))) + units.work[v] // units.memory
        inputs = set(reads.first[v])
        crossing = [part for part, last in last_first_read.items() if part[0] < v < last and part not in inputs]
        fixed = made_before + own + sum(size[part] for part in inputs if part in size)
        excess = fixed + sum(size[part] for part in crossing) - units.capacity
        if excess > 0:
            stages.append((excess, v, fixed, crossing))
        made_before += sg.output_bytes[v] // units.memory
    return stages


def stage_cut_bound(
    sg: SolverGraph, budget_bytes: int, persistent_bytes: int, seconds: float, workers: int = 2
) -> tuple[float | None, SolveStatus]:
    """The stage cuts alone (:func:`_stage_cuts`, one re-run flag per node and segment of
    :class:`RerunWindows` instead of runs),
    solved exactly by CP-SAT: a lower bound on the cost of every plan of the model (in the
    problem's cost units, the plain step included), or None when the cuts alone have no
    solution in ``seconds`` (a proof that no plan exists when the status is "infeasible").
    Cheap next to the model; it tells whether the cuts bound anything the trivial bound (the
    plain step) does not. :func:`stage_cut_relaxation` solves the same as a MILP."""
    relaxation = stage_cut_relaxation(sg, budget_bytes, persistent_bytes, seconds, workers, backend="cp-sat")
    return relaxation.bound, relaxation.status


class RerunWindows:
    """Where a re-run that a stage cut asks for must fall, so that re-runs asked for in
    different segments are different runs (the relaxation counts each, not one per node).

    The cut of stage ``v`` asks node ``p`` to run again after ``v`` when a part of ``p`` it
    needs is not resident there: a part crossing ``v``, needed by the next first run ``j > v``
    that reads it, or read by a re-run that follows. Either way ``p`` runs again before the
    next first run that reads that part (it is resident there), or at any later time when no
    first run reads it after ``v``. The window of ``(p, v)`` ends at ``end(p, v)``, the latest
    of these over ``p``'s parts (the stage count when one has no first reader left). A stage
    ``m`` where every earlier window of ``p`` has closed (at or before ``m``'s first run) starts
    a new segment: windows in different segments are disjoint, so a plan that meets the cuts
    of ``k`` segments runs ``p`` again at least ``k`` times (Checkmate's ``R`` summed over the
    stages of each window, Eq. 4.9's cost counted per run)."""

    def __init__(self, sg: SolverGraph, reads: Reads) -> None:
        self.size = sg.size
        self.readers: list[list[list[int]]] = [[[] for _ in parts] for parts in sg.parts]
        for j in range(sg.size):
            for p, q in reads.first[j]:
                self.readers[p][q].append(j)
        self._ends: dict[int, list[int]] = {}
        self._segments: dict[int, list[int]] = {}

    def end(self, p: int, v: int) -> int:
        """The last stage (the one whose first run closes it) of the window of ``(p, v)``, ``v > p``."""
        return self._table(p)[0][v - p - 1]

    def segment(self, p: int, v: int) -> int:
        """The segment of stage ``v > p`` for node ``p``: 0, 1, ... in stage order."""
        return self._table(p)[1][v - p - 1]

    def _table(self, p: int) -> tuple[list[int], list[int]]:
        if p not in self._ends:
            ends = [
                max((_next_after(js, v, self.size) for js in self.readers[p]), default=self.size)
                for v in range(p + 1, self.size)
            ]
            segments, segment, reach = [], 0, p
            for v, end in zip(range(p + 1, self.size), ends, strict=True):
                if v > p + 1 and reach <= v:
                    segment += 1  # every window opened before v closes at or before v's first run
                segments.append(segment)
                reach = max(reach, end)
            self._ends[p], self._segments[p] = ends, segments
        return self._ends[p], self._segments[p]


def _next_after(stages: list[int], v: int, none: int) -> int:
    """The first of the sorted ``stages`` after ``v``, else ``none``."""
    i = bisect.bisect_right(stages, v)
    return stages[i] if i < len(stages) else none


@dataclass(frozen=True)
class CutRelaxation:
    """The stage cuts alone, a covering problem over re-run flags (:func:`_relaxation_model`).

    ``bound``: no plan whose first runs keep program order costs less (problem cost units,
    the plain step included; None without one); ``rerun``: the nodes the best solution found
    re-runs, a guess at which nodes a cheap plan re-runs (:func:`solve_restricted`)."""

    bound: float | None
    rerun: tuple[int, ...]
    status: SolveStatus


TIGHT_LP_SHARE = 0.5
"""Share of :func:`stage_cut_relaxation`'s time for the LP with reader windows."""
TIGHT_LP_MIN_SECONDS = 10.0
"""The LP with reader windows is solved only when the relaxation has this long (see there)."""


def stage_cut_relaxation(
    sg: SolverGraph,
    budget_bytes: int,
    persistent_bytes: int,
    seconds: float,
    workers: int = 2,
    backend: str = "mip",
    enough: float | None = None,
    lp_seconds: float = 0.0,
) -> CutRelaxation:
    """Solve the stage cuts alone (see :func:`stage_cut_bound`) with ``backend``: "mip" (an
    LP relaxation first, then a branch and bound with cutting planes,
    :func:`memplan.solvers.solve_as_mip`; the LP alone bounds these covering models far
    sooner than CP-SAT's search) or "cp-sat" (exact, and may prove the cuts infeasible).
    ``enough``: a bound (cost units) that already settles the caller's question; once the LP
    reaches it the branch and bound is skipped (and ``rerun`` is empty). Without an integer
    solution in time, ``rerun`` is the LP solution's support.

    With "mip" the LP is that of the cuts with **reader windows** (:func:`_relaxation_model`):
    a re-run of ``j`` after ``v`` reads a part of ``p`` that is resident at ``v`` or made by
    a run of ``p`` before that re-run, i.e. before ``j``'s window closes, which may be long
    before ``p``'s own window does; re-runs are counted per stage span (Checkmate's ``R``
    summed over stages), not per segment. On the 250-node DAG at 0.7 of its peak its LP
    bounds plans in program order at +20.0% of compute in 4.5 s, where the segments' LP says
    +18.3% and their branch and bound +18.9% (its optimum). The segments' LP is solved first
    (1.6 s there), then the LP with reader windows, in :data:`TIGHT_LP_SHARE` of the time and
    only with at least :data:`TIGHT_LP_MIN_SECONDS`. The branch and bound (on the segments'
    model: it solves much faster than the other) runs only where the reader windows bound no
    more than the segments' LP: where they do, its bound stays below theirs (0.7: 18.9%
    against 20.0%), and the rest of the time is returned (in a 60 s solve of the portfolio,
    about 6 s more for the neighbourhood search). The best of the bounds counts.
    A 20 s solve leaves the relaxation 5.5 s: at 0.7 of that DAG's peak the LP with reader
    windows does not finish in its share, and at 0.8 (where it bounds no more than the
    segments' LP) its 2 s left their branch and bound too little (gap 0.85%, was 0.64%).
    ``lp_seconds``: the segments' LP may run this long even past ``seconds`` (the rest of the
    steps then get nothing): on the 500-node DAG it took 3-6 s on 2 loaded cores."""
    start = time.perf_counter()
    reads = node_reads(sg)
    events = build_events(sg, reads)
    windows = RerunWindows(sg, reads)
    units = memory_units(sg, budget_bytes, persistent_bytes)
    plain = float(sum(sg.cost))
    if backend != "mip":
        cuts = _relaxation_model(sg, reads, events, windows, units, reader_windows=False)
        solver, status = solve_cp_sat(cuts.model, seconds, workers=workers)
        chosen = cuts.support(solver.value) if status.status in ("optimal", "feasible") else []
        return CutRelaxation(cuts.in_cost_units(status.bound, plain), _rerun(events, chosen), status)
    cuts = _relaxation_model(sg, reads, events, windows, units, reader_windows=False)
    # the models' building counts in the time (seconds on a graph of 2000 nodes)
    lp_time = max(seconds, lp_seconds) - (time.perf_counter() - start)  # the LP may have more than the rest
    status, fractional = solve_as_mip(cuts.model, max(0.1, lp_time), relax=True)
    lp_bound, tight = cuts.in_cost_units(status.bound, plain), cuts
    if seconds >= TIGHT_LP_MIN_SECONDS:
        windowed = _relaxation_model(sg, reads, events, windows, units, reader_windows=True)
        share = min(TIGHT_LP_SHARE * seconds, seconds - (time.perf_counter() - start))
        found, values = solve_as_mip(windowed.model, max(0.1, share), relax=True)
        bound = windowed.in_cost_units(found.bound, plain)
        if bound is not None and (lp_bound is None or bound > lp_bound):
            status, fractional, lp_bound, tight = found, values, bound, windowed
    if enough is not None and lp_bound is not None and lp_bound >= enough:
        return CutRelaxation(lp_bound, (), status)
    chosen: list[int] = []
    if fractional is not None:  # the LP's support, unless the branch and bound finds better
        chosen = tight.support(lambda x: fractional[x.index] > 1e-6)
    left = seconds - (time.perf_counter() - start)
    if tight is cuts and left > 0.1:  # where the reader windows bind, the time is the caller's
        found, values = solve_as_mip(cuts.model, left)
        if values is not None:
            chosen = cuts.support(lambda x: values[x.index] > 0.5)
        mip_bound = cuts.in_cost_units(found.bound, plain)
        if mip_bound is not None and (lp_bound is None or mip_bound > lp_bound):
            status, lp_bound = found, mip_bound
    return CutRelaxation(lp_bound, _rerun(events, chosen), status)


CUT_MILP_NICE = 10
""":class:`CutMilp`'s child runs at this lower priority: the portfolio's own search comes first."""


class CutMilp:
    """The stage cuts with reader windows as a MILP (:func:`_relaxation_model`), solved by
    HiGHS in a child process (:class:`memplan.remat.highs.MilpInBackground`) while the caller
    goes on: its bound, once it has one, bounds plans in program order as
    :func:`stage_cut_relaxation`'s does. On the 250-node DAG at 0.7 of its peak HiGHS bounds
    +20.22% after 6 s, +20.61% after 12 s and proves the model's optimum, +20.65%, in about
    21 s on one core (the LP with reader windows: +20.02%; SCIP's branch and bound on this
    model gave no bound in 20 s); at 0.8, +9.05% after 8 s and +9.19% proven in about 19 s."""

    def __init__(self, sg: SolverGraph, budget_bytes: int, persistent_bytes: int, seconds: float) -> None:
        from memplan.remat.highs import MilpInBackground, milp_from_cp_model

        reads = node_reads(sg)
        events = build_events(sg, reads)
        units = memory_units(sg, budget_bytes, persistent_bytes)
        self.cuts = _relaxation_model(sg, reads, events, RerunWindows(sg, reads), units, reader_windows=True)
        self.plain = float(sum(sg.cost))
        milp = milp_from_cp_model(self.cuts.model.proto)
        self.child = MilpInBackground(milp, seconds, mip_abs_gap=0.999, nice=CUT_MILP_NICE)

    def poll(self) -> float | None:
        """The bound (problem cost units, the plain step included) once HiGHS has ended, else None."""
        answer = self.child.poll()
        return None if answer is None else self._bound(answer[0])

    def finish(self, wait_seconds: float) -> float | None:
        """The bound, waiting up to ``wait_seconds`` for HiGHS (None without one)."""
        return self._bound(self.child.finish(wait_seconds)[0])

    def close(self) -> None:
        self.child.close()

    def _bound(self, status: SolveStatus) -> float | None:
        if status.bound is None:
            return None
        return self.cuts.in_cost_units(status.bound - BOUND_MARGIN * max(1.0, abs(status.bound)), self.plain)


def _rerun(events: Events, chosen: list[int]) -> tuple[int, ...]:
    return tuple(k for k in chosen if events.recompute[k])


@dataclass
class _CutModel:
    """The stage cuts alone as a covering model, and how to read it."""

    model: cp_model.CpModel
    reruns: list[list[cp_model.IntVar]]
    """Per node, the variables that count its re-runs (one per segment, or its total)."""
    unit: float

    def in_cost_units(self, bound: float | None, plain: float) -> float | None:
        return None if bound is None else plain + max(0.0, bound) * self.unit

    def support(self, used: Callable[[cp_model.IntVar], bool]) -> list[int]:
        return [k for k, xs in enumerate(self.reruns) if any(used(x) for x in xs)]


def _relaxation_model(
    sg: SolverGraph,
    reads: Reads,
    events: Events,
    windows: RerunWindows,
    units: MemoryUnits,
    reader_windows: bool,
    stages: list[Stage] | None = None,
) -> _CutModel:
    """The stage cuts (:func:`_stage_cuts`) with one flag ``b[p, v]`` per node ``p`` and stage
    ``v``: ``p`` runs again in ``(v, end(p, v)]`` (:class:`RerunWindows`), each such re-run paid.

    Without ``reader_windows`` one flag per node and segment pays for every ``b`` of the
    segment (Checkmate's ``R`` summed over the segment's stages). With them, a node whose part
    a re-run of another node ``j`` reads, where ``j``'s window closes first, gets a count of
    its re-runs up to each stage that matters (``n[p, t]``, non-decreasing), with
    ``n[p, end] - n[p, v] >= b[p, v]``, and the part is resident at ``v`` unless ``p`` runs
    again in ``(v, min(end(p, v), end(j, v))]``: ``r >= b[j, v] - (n[p, e] - n[p, v])``. A plan
    that re-runs ``p`` after ``j``'s re-run, to have it absent later, pays for two re-runs.
    Costs are rounded down to whole units (no plan is cut off). ``stages``: the stages cut
    (default :func:`chosen_stages`; a subset bounds less, never more)."""
    model = cp_model.CpModel()
    costs, unit = _costs_rounded_down(sg.cost)
    stages = chosen_stages(sg, events, reads, units) if stages is None else stages
    last = [events.recompute[k][-1] if events.recompute[k] else k for k in range(sg.size)]

    def end(p: int, v: int) -> int:
        return min(windows.end(p, v), last[p])

    counted = _narrow_nodes(sg, reads, stages, end) if reader_windows else {}
    counts: dict[tuple[int, int], cp_model.IntVar] = {}
    for p, points in counted.items():
        previous = None
        for t in sorted(points):
            n = model.new_int_var(0, 0 if previous is None else sg.size, f"n{p}_{t}")
            if previous is not None:
                model.add(n >= previous)
            counts[p, t] = n
            previous = n

    def runs_in(p: int, v: int, e: int) -> cp_model.LinearExprT:
        return counts[p, e] - counts[p, v] if e > v else 0

    segments: dict[tuple[int, int], cp_model.IntVar] = {}

    def again(p: int, v: int) -> cp_model.IntVar:
        b = model.new_bool_var("")
        if p in counted:
            model.add(runs_in(p, v, end(p, v)) >= b)
            model.add(runs_in(p, v, end(p, v)) <= sg.size * b)  # b is 1 for every re-run
            return b
        key = (p, windows.segment(p, v))
        if key not in segments:
            segments[key] = model.new_bool_var(f"y{p}_{key[1]}")
        model.add_implication(b, segments[key])
        return b

    def narrow(v: int, part: Part, j: int, r: cp_model.IntVar, b_j: cp_model.IntVar) -> None:
        p = part[0]
        e = min(end(p, v), end(j, v))
        if p in counted and e < end(p, v):
            model.add(r >= b_j - runs_in(p, v, e))

    _stage_cuts(model, sg, events, reads, units, again, windows.end, narrow if counted else None, stages)
    reruns: list[list[cp_model.IntVar]] = [[] for _ in range(sg.size)]
    for (p, _), y in segments.items():
        reruns[p].append(y)
    for p, points in counted.items():
        reruns[p].append(counts[p, max(points)])
    model.minimize(sum(costs[p] * x for p, xs in enumerate(reruns) for x in xs))
    return _CutModel(model, reruns, unit)


def _narrow_nodes(
    sg: SolverGraph, reads: Reads, stages: list[Stage], end: Callable[[int, int], int]
) -> dict[int, set[int]]:
    """Nodes ``p`` with a part that a re-run of ``j`` after a cut stage ``v`` reads where
    ``j``'s window closes before ``p``'s, with the stages their re-run counts are needed at
    (every ``v`` and window end of ``p``, and those earlier ends)."""
    narrow: set[int] = set()
    for v, _fixed, _crossing, movable in stages:
        again, inputs = set(movable), set(reads.first[v])
        for j in movable:
            for part in reads.rerun[j]:
                p = part[0]
                if p in again and p != j and p < v and part not in inputs and end(j, v) < end(p, v):
                    narrow.add(p)
    points: dict[int, set[int]] = {p: set() for p in narrow}
    for v, _fixed, _crossing, movable in stages:
        for p in movable:
            if p in narrow:
                points[p].update((v, end(p, v)))
        for j in movable:
            for p, _ in reads.rerun[j]:
                if p in narrow and p in movable and p != j:
                    points[p].add(min(end(p, v), end(j, v)))
    return points


def _costs_rounded_down(costs: tuple[float, ...]) -> tuple[list[int], float]:
    """:func:`cost_scale`'s units, each cost rounded down (exact for integral costs): a bound
    in them is a bound on the real costs."""
    scaled, unit = cost_scale(costs)
    if all(float(c).is_integer() for c in costs):
        return scaled, unit
    return [max(0, math.floor(c / unit * (1 - 1e-9))) for c in costs], unit


def restricted_graph(sg: SolverGraph, nodes: set[int]) -> SolverGraph:
    """``sg`` where only ``nodes`` may run again: every other node's window closes at once."""
    return replace(sg, limit=tuple(lim if k in nodes else min(lim, k + 1) for k, lim in enumerate(sg.limit)))


def rerun_neighbours(sg: SolverGraph, nodes: set[int]) -> set[int]:
    """``nodes`` and the re-runnable nodes whose outputs their re-runs read: the next nodes to
    let run again when re-running ``nodes`` alone cannot fit (their inputs take the room)."""
    reads = node_reads(sg)
    events = build_events(sg, reads)
    return nodes | {p for j in nodes for p, _ in reads.rerun[j] if events.recompute[p]}


def solve_restricted(
    problem: RematProblem,
    sg: SolverGraph,
    nodes: set[int],
    runs_per_node: int,
    time_limit_seconds: float,
    gap_limit: float = 0.0,
) -> tuple[RematSchedule | None, SolveStatus, dict[str, object]]:
    """The CP model where only ``nodes`` may run again (e.g. those the stage cuts' relaxation
    re-runs, :class:`CutRelaxation`): a model of a tenth of the events or less, solved in
    seconds where the whole one finds no better plan in minutes (a random 250-node DAG at 0.8
    of its peak: +10.3% of compute in 0.5 s; the whole model: +12.4% after 20 s, +11.9% after
    150 s). Its status and bound speak only for plans re-running ``nodes`` ("infeasible":
    none of those fits), never for the problem. The plan's decisions are over ``sg``'s nodes."""
    return solve_moccasin(
        problem,
        restricted_graph(sg, nodes),
        None,
        runs_per_node,
        time_limit_seconds,
        gap_limit,
        probe_cuts=False,
        fallback=False,
    )


def rerun_nodes(rows: list[list[int]]) -> set[int]:
    """The nodes a plan's ``R`` runs again (in a stage after their own)."""
    return {k for t, row in enumerate(rows) for k in row if k != t}


def most_runs(rows: list[list[int]]) -> int:
    """The most runs a plan's ``R`` makes of one node."""
    runs: dict[int, int] = {}
    for row in rows:
        for k in row:
            runs[k] = runs.get(k, 0) + 1
    return max(runs.values(), default=1)


def solve_neighbourhood(
    problem: RematProblem,
    sg: SolverGraph,
    rows: list[list[int]],
    free: set[int],
    runs_per_node: int,
    time_limit_seconds: float,
) -> tuple[RematSchedule | None, SolveStatus, dict[str, object]]:
    """One step of a large neighbourhood search (Shaw, CP 1998) over the CP model: the plan
    ``rows`` (Checkmate's ``R`` over ``sg``) with only the runs of ``free`` open to change.
    Nodes that ``rows`` re-runs keep their runs unless free (:func:`fix_runs`), the others
    run once unless free (:func:`restricted_graph`): a model a fraction of the whole one's
    size, hinted with ``rows``, so its first solution is that plan. Each node may run
    ``runs_per_node`` times, or as often as ``rows`` runs one. The status and bound speak
    only for the neighbourhood, never for the problem."""
    again = rerun_nodes(rows)
    return solve_moccasin(
        problem,
        restricted_graph(sg, again | free),
        rows,
        max(runs_per_node, most_runs(rows)),
        time_limit_seconds,
        probe_cuts=False,
        fallback=False,
        fixed=again - free,
    )


def _movable_closure(events: Events, reads: Reads, v: int, crossing: list[Part]) -> list[int]:
    """Nodes before ``v`` that may run again after ``v``'s first run and whose outputs matter
    there: producers of parts crossing ``v``, and the producers of what their re-runs read."""

    def movable(p: int) -> bool:
        return bool(events.recompute[p]) and events.latest(p) > events.first(v)

    found: set[int] = set()
    stack = [p for p, _ in crossing if movable(p)]
    while stack:
        p = stack.pop()
        if p in found:
            continue
        found.add(p)
        stack.extend(u for u, _ in reads.rerun[p] if movable(u) and u not in found)
    return sorted(found)


def _runs_again_after(model: cp_model.CpModel, node_runs: list[_Run], event: int) -> cp_model.IntVar:
    """A Boolean that implies a re-run of the node after ``event``."""
    b = model.new_bool_var("")
    options = []
    for run in node_runs[1:]:
        z = b if len(node_runs) == 2 else model.new_bool_var("")
        model.add_implication(z, run.present)
        model.add(run.start >= event + 1).only_enforce_if(z)
        options.append(z)
    if len(options) > 1:
        model.add_bool_or([b.Not(), *options])
    return b


def _stage_memory(
    model: cp_model.CpModel,
    v: int,
    fixed: int,
    crossing: list[Part],
    again: dict[int, cp_model.IntVar],
    size: dict[Part, int],
    rerun_readers: dict[Part, list[int]],
    capacity: int,
    inputs: set[Part],
    narrow: Narrow | None = None,
) -> None:
    """The cut of stage ``v`` (see :func:`_stage_cuts`). ``v``'s ``inputs`` are in ``fixed``
    already (resident at its run whatever the plan): counting one again because a later re-run
    reads it would cut plans off (random 9-op DAGs: a bound of 58 over an optimum of 48)."""
    direct = set(crossing)
    parts = direct | {
        part
        for part in size
        if part not in inputs and (part[0] in again or any(j in again for j in rerun_readers.get(part, ())))
    }
    terms = []
    for part in sorted(parts):
        p, _ = part
        if p >= v:
            continue
        readers = [j for j in rerun_readers.get(part, ()) if j in again and j != p]
        b = again.get(p)
        if b is None:
            if part in direct:
                fixed += size[part]
                continue
            if not readers:
                continue
        if part not in direct and not readers:
            continue
        r = model.new_bool_var("")
        if part in direct:
            model.add_bool_or([r] + ([b] if b is not None else []))
        for j in readers:
            model.add_bool_or([r, again[j].Not()] + ([b] if b is not None else []))
            if narrow is not None and b is not None:
                narrow(v, part, j, r, again[j])
        terms.append(size[part] * r)
    model.add(sum(terms) <= capacity - fixed)


def _read_without_bytes(sg: SolverGraph, k: int) -> bool:
    """Another node reads an output of ``k`` that is no part with bytes (a control token, a
    view handle, a persistent tensor): it reads the first instance whatever the plan, so
    ``k``'s first run may not be deferred past it."""
    graph = sg.graph
    members = set(sg.groups[k])
    for v in sg.groups[k]:
        for t in graph.ops[v].outputs:
            tensor = graph.tensors[t]
            if any(c not in members for c in graph.consumers[t]) and (tensor.persistent or tensor.size_bytes == 0):
                return True
            if tensor.category is Category.OUTPUT:
                return True
    return False


def _last_read_events(sg: SolverGraph, events: Events, reads: Reads) -> list[list[int]]:
    """Latest event at which some run that reads each part of each node can run."""
    readers = reads.readers(sg.size)
    return [
        [max((events.latest(j) for j in readers.get((k, q), ())), default=events.first(k)) for q in range(len(parts))]
        for k, parts in enumerate(sg.parts)
    ]


def _memory_intervals(
    model: cp_model.CpModel,
    sg: SolverGraph,
    events: Events,
    runs: list[list[_Run]],
    work: list[int],
    unit: int,
    horizon: int,
) -> tuple[list[cp_model.IntervalVar], list[int]]:
    intervals: list[cp_model.IntervalVar] = []
    demands: list[int] = []
    for k, node_runs in enumerate(runs):
        for r, run in enumerate(node_runs):
            for q, end in run.ends.items():
                size = model.new_int_var(1, horizon, f"len{k}_{r}_{q}")
                if isinstance(run.present, int):
                    intervals.append(model.new_interval_var(run.start, size, end, f"i{k}_{r}_{q}"))
                else:
                    name = f"i{k}_{r}_{q}"
                    intervals.append(model.new_optional_interval_var(run.start, size, end, run.present, name))
                demands.append(sg.parts[k][q][0] // unit)
            if work[k]:
                if isinstance(run.present, int):
                    intervals.append(model.new_fixed_size_interval_var(run.start, 1, f"w{k}"))
                else:
                    intervals.append(model.new_optional_fixed_size_interval_var(run.start, 1, run.present, f"w{k}_{r}"))
                demands.append(work[k] // unit)
        if sg.output_bytes[k]:
            start = events.first(k) + 1
            intervals.append(model.new_fixed_size_interval_var(start, horizon - start, f"out{k}"))
            demands.append(sg.output_bytes[k] // unit)
    return intervals, demands


def _precedence(model: cp_model.CpModel, reads: Reads, runs: list[list[_Run]]) -> None:
    """Every run of ``j`` reads each part it needs (:class:`Reads`) from a run of its node that
    started before it and is still resident after it (Moccasin's x_uv^ij)."""
    for j, node_runs in enumerate(runs):
        for r, reader in enumerate(node_runs):
            for p, q in reads.of(j, r):
                _served(model, runs[p], q, reader)


def _served(model: cp_model.CpModel, sources: list[_Run], q: int, reader: _Run) -> None:
    when = [] if isinstance(reader.present, int) else [reader.present]
    if len(sources) == 1 and isinstance(sources[0].present, int):
        model.add(sources[0].ends[q] >= reader.start + 1).only_enforce_if(when)
        return
    chosen = [model.new_bool_var("") for _ in sources]
    model.add_bool_or([*chosen, *(w.Not() for w in when)])
    for source, x in zip(sources, chosen, strict=True):
        model.add(source.ends[q] >= reader.start + 1).only_enforce_if([*when, x])
        if not isinstance(source.present, int):
            model.add_implication(x, source.present)
        if not isinstance(source.start, int):
            model.add(source.start + 1 <= reader.start).only_enforce_if([*when, x])


def _runs_do_not_overlap(model: cp_model.CpModel, runs: list[list[_Run]]) -> None:
    """Runs come in order, and a node's outputs are freed before it runs again (a live
    tensor is not made twice). Re-runs fill their slots in order; the first run (in the
    node's own stage) may be absent only when first runs may be deferred."""
    for node_runs in runs:
        for r, (before, after) in enumerate(itertools.pairwise(node_runs)):
            both = [after.present] + ([] if isinstance(before.present, int) else [before.present])
            if r > 0:
                model.add_implication(after.present, before.present)
                model.add(before.start < after.start).only_enforce_if(after.present)
            for end in before.ends.values():
                model.add(end <= after.start).only_enforce_if(both)


def rows_from_solution(cm: CpModel, solver: cp_model.CpSolver, n: int) -> list[list[int]]:
    """Checkmate's ``R`` as rows: stage ``t`` runs node ``t`` and every recompute placed in it."""
    rows: list[list[int]] = [[t] for t in range(n)]
    for k, node_runs in enumerate(cm.runs):
        for run in node_runs[1:]:
            if solver.boolean_value(run.present):
                t, _ = cm.events.stage_node[solver.value(run.start)]
                rows[t].append(k)
    return [sorted(r) for r in rows]


def _placed_runs(cm: CpModel, sg: SolverGraph, rows: list[list[int]]) -> list[list[int]] | None:
    """The events of each node's runs in a plan's ``R`` (a re-run that is no event of the
    model is left out: nothing can read it then); None if a run breaks a window or a node
    runs more often than the model allows."""
    placed: list[list[int]] = [[] for _ in range(sg.size)]
    for t, row in enumerate(rows):
        for k in row:
            if (t, k) in cm.events.index:
                placed[k].append(cm.events.index[t, k])
            elif not sg.may_run(t, k):
                return None
    if any(len(p) > len(cm.runs[k]) for k, p in enumerate(placed)):
        return None
    return placed


def add_hints(cm: CpModel, sg: SolverGraph, rows: list[list[int]]) -> bool:
    """Hint the search with a plan's ``R``, if no node runs more than the model allows; every
    retention ends at its run's last read (the least ``S`` for ``R``, Checkmate 4.6). A
    re-run that is no event of the model (nothing can read it then) is left out: it could
    only cost memory. False (no hint) if a run breaks a window."""
    placed = _placed_runs(cm, sg, rows)
    if placed is None:
        return False
    ends = _least_retention(sg, cm.reads, placed)
    if ends is None:
        return False
    for k, node_runs in enumerate(cm.runs):
        for r, run in enumerate(node_runs):
            used = r < len(placed[k])
            if not isinstance(run.present, int):
                cm.model.add_hint(run.present, used)
            if not isinstance(run.start, int):
                cm.model.add_hint(run.start, placed[k][r] if used else _domain_min(run.start))
            for q, end in run.ends.items():
                cm.model.add_hint(end, ends[k][r][q] if used else _domain_min(end))
    return True


def fix_runs(cm: CpModel, sg: SolverGraph, rows: list[list[int]], nodes: set[int]) -> bool:
    """Fix the runs of ``nodes`` to those of a plan's ``R`` (each present run at its event,
    the rest absent): the other nodes are the neighbourhood a search may change. Retention
    ends stay free. False (nothing fixed) if the plan does not fit the model."""
    placed = _placed_runs(cm, sg, rows)
    if placed is None:
        return False
    for k in nodes:
        for r, run in enumerate(cm.runs[k]):
            used = r < len(placed[k])
            if not isinstance(run.present, int):
                cm.model.add(run.present == int(used))
            if used and not isinstance(run.start, int):
                cm.model.add(run.start == placed[k][r])
    return True


def _domain_min(var: cp_model.IntVar) -> int:
    return int(var.proto.domain[0])


def _least_retention(sg: SolverGraph, reads: Reads, placed: list[list[int]]) -> list[list[dict[int, int]]] | None:
    """For each run of each node and each byte part, one past the event of its last read."""
    timeline = sorted((e, k, r) for k, evs in enumerate(placed) for r, e in enumerate(evs))
    ends = [[{q: e + 1 for q, (b, _) in enumerate(sg.parts[k]) if b} for e in evs] for k, evs in enumerate(placed)]
    current: dict[int, int] = {}
    for e, j, r in timeline:
        for p, q in reads.of(j, r):
            if p not in current:
                return None
            ends[p][current[p]][q] = e + 1
        current[j] = r
    return ends


def solve_moccasin(
    problem: RematProblem,
    sg: SolverGraph,
    hint_rows: list[list[int]] | None = None,
    runs_per_node: int = RUNS_PER_NODE,
    time_limit_seconds: float | None = None,
    gap_limit: float = 0.0,
    defer: bool = False,
    start_rows: list[list[int]] | None = None,
    objective_floor: float | None = None,
    *,
    probe_cuts: bool = True,
    known_cut_bound: float | None = None,
    fallback: bool = True,
    fixed: set[int] | None = None,
) -> tuple[RematSchedule | None, SolveStatus, dict[str, object]]:
    """Solve Moccasin over ``sg``: the lowered plan (None without one), the solver's status
    (objective and bound in the problem's cost units) and details for the result. The search
    stops once the plan is proven within ``gap_limit`` of the optimum (relative);
    ``plan.details["found_at"]``: seconds from the call's start to the search's last improving
    solution.

    ``hint_rows``: decisions of a plan within the budget, to start from. Without one, a
    search that finds no plan in :data:`FIRST_PLAN_SHARE` of the time stops, and phase 1
    (Moccasin's) looks for any plan within the budget, starting from ``start_rows`` (a plan
    over the budget, e.g. the baseline with the lowest peak) or checkpoint-all, in up to
    :data:`PHASE1_SHARE` of the time left; the model is then solved from that plan.

    ``defer`` (joint recomputation and reordering, which Checkmate and Moccasin do not do):
    a node's first run may move to a later stage, i.e. later in the order. The decisions still
    list node ``t`` in stage ``t`` (Checkmate's ``R[t, t] = 1``); the lowering drops that run
    since nobody reads it (:func:`memplan.remat.lower.lower`), so the plan runs the node first
    where the model put it.

    Without ``defer``, the stage cuts (:func:`_stage_cuts`) are first solved alone
    (:func:`stage_cut_bound`, :data:`CUT_PROBE_SECONDS`); they join the model when their bound
    is above the plain step by more than :data:`CUTS_MIN_GAIN`, and their bound counts in the
    answer's bound either way. ``probe_cuts=False`` skips that probe: ``known_cut_bound`` (the
    stage cuts' bound found before, e.g. by :func:`stage_cut_relaxation`) counts instead, by
    the same rule. ``objective_floor``: a bound known before the search (see
    :func:`build_model`), so that the gap limit can stop it. ``fallback=False``: no phase 1,
    the direct search has the whole time. ``fixed``: nodes whose runs stay those of
    ``hint_rows`` (:func:`fix_runs`; see :func:`solve_neighbourhood`)."""
    start = time.perf_counter()
    limit = problem.time_limit_seconds if time_limit_seconds is None else time_limit_seconds
    details: dict[str, object] = {"formulation": "moccasin", "phase1": None}
    runs_per_node = runs_for_hint(sg, hint_rows, runs_per_node)
    if probe_cuts:
        cut_bound, cuts = _probe_cuts(problem, sg, runs_per_node, defer, limit)
    else:
        cut_bound = known_cut_bound
        cuts = not defer and runs_per_node >= 2 and _cuts_pay(cut_bound, sg)
    details.update(cut_bound=cut_bound, stage_cuts=cuts)

    def model() -> CpModel:
        persistent = problem.graph.persistent_bytes
        return build_model(
            sg, problem.budget_bytes, persistent, runs_per_node, defer, stage_cuts=cuts, objective_floor=objective_floor
        )

    cm = model()
    hinted = add_hints(cm, sg, hint_rows) if hint_rows is not None else False
    if hinted and fixed and hint_rows is not None:
        fix_runs(cm, sg, hint_rows, fixed)
    # CP-SAT's presolve spends tens of seconds on the larger models for little gain
    parameters: dict[str, object] = {"cp_model_presolve": False, "relative_gap_limit": gap_limit}
    # without a plan to start from, give up on the direct search after a while and look for a
    # first plan with phase 1 instead
    stall = None if hinted or not fallback else FIRST_PLAN_SHARE * limit
    found = Found(start)
    solver, status = _solve(cm, problem, limit - (time.perf_counter() - start), parameters, stall, found)
    if status.status not in ("optimal", "feasible", "infeasible") and not hinted and fallback:
        left = limit - (time.perf_counter() - start)
        rows, details["phase1"] = _phase1(problem, sg, start_rows, runs_per_node, left * PHASE1_SHARE, defer)
        if rows is not None:
            cm = model()
            hinted = add_hints(cm, sg, rows)
            solver, status = _solve(cm, problem, limit - (time.perf_counter() - start), parameters, None, found)
    status = _with_bound(_in_cost_units(status, cm.cost_unit), cut_bound)
    details.update(
        events=cm.events.horizon - 1,
        hinted=hinted,
        runs_per_node=runs_per_node,
        scope=f"plans with at most {runs_per_node} runs per node of the {sg.size}-node solver graph"
        + (", first runs deferrable" if defer else ", first runs in program order"),
        bound=status.bound if status.bound is not None else cut_bound,
    )
    if status.status not in ("optimal", "feasible"):
        return None, status, details
    rows = rows_from_solution(cm, solver, sg.size)
    plan = schedule_from_decisions(problem, sg, rows, "moccasin", status.status, details={"rows": rows, **details})
    plan.gap = status.gap
    plan.seconds = time.perf_counter() - start
    return found.mark(plan, found.at()), status, details


HINT_RUNS = 3
"""The most runs per node :func:`runs_for_hint` allows, so that a plan recomputing a node twice can start the search."""


def runs_for_hint(sg: SolverGraph, hint_rows: list[list[int]] | None, runs_per_node: int) -> int:
    """``runs_per_node``, raised to the runs the hint's plan makes of one node where that is
    at most :data:`HINT_RUNS`: a search that starts from a plan beats one that looks for a
    first plan (a plan near the memory floor may recompute some node twice, e.g. DTR's)."""
    if hint_rows is None or len(hint_rows) != sg.size or runs_per_node >= HINT_RUNS:
        return runs_per_node  # no hint, or one over another solver graph
    events = build_events(sg, node_reads(sg))
    runs: dict[int, int] = {}
    for t, row in enumerate(hint_rows):
        for k in row:
            if (t, k) in events.index:
                runs[k] = runs.get(k, 0) + 1
    needed = max(runs.values(), default=1)
    return needed if runs_per_node < needed <= HINT_RUNS else runs_per_node


CUT_PROBE_SECONDS = 2.0
"""The stage cuts alone are solved for at most this long (and a tenth of the time limit)."""
CUTS_MIN_GAIN = 0.01
"""The stage cuts join the model when they alone prove 1% of compute above the plain step:
below that they slow the search for a first plan (vgg16 at 0.8: 5 s instead of 1 s) for a
bound that the gap limit hardly needs."""


def _probe_cuts(
    problem: RematProblem, sg: SolverGraph, runs_per_node: int, defer: bool, limit: float
) -> tuple[float | None, bool]:
    """The stage cuts' own bound (None without one) and whether they join the model."""
    if defer or runs_per_node < 2:
        return None, False
    seconds = min(CUT_PROBE_SECONDS, 0.1 * limit)
    bound, _ = stage_cut_bound(sg, problem.budget_bytes, problem.graph.persistent_bytes, seconds, problem.workers)
    return bound, _cuts_pay(bound, sg)


def _cuts_pay(bound: float | None, sg: SolverGraph) -> bool:
    """The stage cuts join the model: alone they bound the cost :data:`CUTS_MIN_GAIN` above the plain step."""
    return bound is not None and bound > (1 + CUTS_MIN_GAIN) * sum(sg.cost)


def _with_bound(status: SolveStatus, bound: float | None) -> SolveStatus:
    """``status`` with the better of its bound and ``bound`` (both valid for the model)."""
    if bound is None or status.objective is None or (status.bound is not None and status.bound >= bound):
        return status
    bound = min(bound, status.objective)
    gap = (status.objective - bound) / status.objective if status.objective else 0.0
    return SolveStatus("optimal" if gap <= 0 else status.status, status.objective, bound, gap, status.seconds)


def _solve(
    cm: CpModel,
    problem: RematProblem,
    seconds: float,
    parameters: dict[str, object],
    stall: float | None,
    found: Found | None = None,
) -> tuple[cp_model.CpSolver, SolveStatus]:
    return solve_cp_sat(
        cm.model,
        max(0.05, seconds),
        workers=problem.workers,
        parameters=parameters,
        first_solution_seconds=stall,
        progress=found.solution if found is not None else None,
    )


FIRST_PLAN_SHARE = 0.25
"""Without a plan to start from, the direct search gets this share of the time to find one."""
PHASE1_SHARE = 0.5
"""At most this share of the time goes to finding a first plan within the budget."""


def _phase1(
    problem: RematProblem,
    sg: SolverGraph,
    start_rows: list[list[int]] | None,
    runs_per_node: int,
    seconds: float,
    defer: bool,
) -> tuple[list[list[int]] | None, str]:
    """Moccasin's phase 1: a plan within the budget (its decisions), or None; and what happened."""
    cm = build_model(sg, problem.budget_bytes, problem.graph.persistent_bytes, runs_per_node, defer, elastic=True)
    if start_rows is None or not add_hints(cm, sg, start_rows):
        add_hints(cm, sg, [[t] for t in range(sg.size)])  # checkpoint-all: always a plan
    parameters: dict[str, object] = {"cp_model_presolve": False}
    solver, status = solve_cp_sat(cm.model, max(0.05, seconds), workers=problem.workers, parameters=parameters)
    found = status.status in ("optimal", "feasible") and status.objective == 0
    outcome = f"{'found a plan' if found else 'no plan'} in {status.seconds:.1f} s ({status.status})"
    return (rows_from_solution(cm, solver, sg.size) if found else None), outcome


def _in_cost_units(status: SolveStatus, unit: float) -> SolveStatus:
    objective = None if status.objective is None else status.objective * unit
    bound = None if status.bound is None else status.bound * unit
    return SolveStatus(status.status, objective, bound, status.gap, status.seconds)
