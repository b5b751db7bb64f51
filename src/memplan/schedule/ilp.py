"""The exact reordering optimiser: OLLA eq. (1)-(5) and (13)-(14) in OR-Tools CP-SAT.

Timestep model: ONE op per timestep (the estimator's model: a step of n ops has n
timesteps). Consequences, and how each OLLA technique is used:

* Spans (OLLA 4.1, eq. 10-12). With one op per timestep, op ``v`` runs no earlier than
  ``|ancestors(v)|`` and no later than ``n - 1 - |descendants(v)|``
  (:attr:`Reachability.earliest_positions` / ``latest_positions``). These are tighter than
  the ASAP/ALAP *levels* of the paper, which assume ops of one level run together, so they
  are the spans used here: ``C`` is 0 outside them (eq. 10), ``P`` is 0 outside the Maximum
  Useful Lifetime (eq. 11) and fixed to 1 on PRES (eq. 12).
* Variables. Eq. (5) ties the ``C`` of siblings, so one variable per *op* suffices. We keep
  the cumulative form ``R[v, t]`` = "v has run by timestep t" (monotone in t), so that
  ``C[e, t] = R[src(e), t] - R[src(e), t - 1]`` (eq. 3 holds by construction) and
  ``P[e, t] >= R[src(e), t - 1] - R[s, t - 1]`` for each sink ``s`` of ``e`` (eq. 1, 2 and 4:
  created strictly before ``t`` and still needed at ``t``). Minimising the peak drives ``P``
  to exactly the estimator's lifetimes wherever it matters.
* Precedence (OLLA 4.2). Reachability gives the spans, and a sink that is an ancestor of
  another sink of the same tensor never decides when it dies, so its ``P`` rows are pruned.
  Eq. (4) becomes ``R[v, t] <= R[u, t - 1]`` for each edge ``u -> v``.
* Splitting (OLLA 4.4 in spirit). Only the lifetime half is solved (eq. 14). Where no span
  crosses the boundary between two timesteps, the ops before and after never mix and no
  memory term couples them, so the step splits into independent *segments*; each is solved
  on its own, the bottleneck first. Segments whose model exceeds a size budget are solved
  in windows of the incumbent order (each op may move ``W`` positions), then re-centred.
* Early updates (OLLA 4.3). When the exact model is too big, weight updates get control
  edges to anchors (:mod:`memplan.schedule.early_updates`), which narrows spans.
* Warm start: the best heuristic per segment is the hint (``AddHint``) and an upper bound;
  decoding (Function 1) sorts the ops by the timestep at which ``R`` turns 1.

Before the model, :func:`optimize_ilp` runs the exact search over ideals
(:mod:`memplan.schedule.ideals`) with :data:`IDEAL_SHARE` of the time, then, if a gap is
left, the cut bound and the ordering bound (:mod:`memplan.schedule.bounds`) and, where they
raised the bound, the search again from it (a probe at a bound that is met finds the order
at once; the first search spent its time below it); the model only runs if the best order
is still above the best proven bound.

A result is "optimal" only when its peak meets a proven lower bound: the search over ideals
exhausted the cap below it, a bound of :mod:`memplan.schedule.bounds` meets it, or every
segment that can reach the peak was solved exactly on the original graph (no control edges,
no windows); otherwise it is "feasible" with the gap to the best valid lower bound. It is
never worse than the best heuristic.

With a relative gap limit (``ScheduleProblem.relative_gap_limit``, the MIP solvers' relative
gap) every stage stops as soon as the best order's peak is within that fraction of the best
proven bound: the lower bound is probed briefly, then one below the best order, then the cut
and ordering bounds are raised at once (not after the whole bisection), and CP-SAT gets the
limit as its own ``relative_gap_limit``; the result is then "feasible" with its gap.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memplan.errors import SolverError
from memplan.graph.analysis import Reachability, necessarily_resident_bytes, peak_lower_bound
from memplan.graph.check import validate_order
from memplan.graph.ir import Category, Graph, OpId
from memplan.graph.liveness import memory_timeline, peak_bytes, positions
from memplan.schedule.bounds import ORDERING_OPS, cut_lower_bound, ordering_bound
from memplan.schedule.early_updates import enforce_early_weight_updates, map_order
from memplan.schedule.heuristics import Candidate, early_release_ops, free_sources, hoist_free_sources, portfolio
from memplan.schedule.ideals import minimise_peak
from memplan.schedule.problem import ScheduleProblem, ScheduleResult, gap_met, relative_gap
from memplan.solvers import SolveStatus, solve_cp_sat

if TYPE_CHECKING:  # OR-Tools is imported when a model is built (issue 37: most plans settle before)
    from ortools.sat.python import cp_model

    Term = int | cp_model.IntVar  # a 0/1 constant or a Boolean variable
STALL_FRACTION = 0.2  # stop a segment's search once this share of its time brought nothing better
# Time-indexed literals built per second (in Python, on a 2-core machine); a model that would
# take more than half of its time to build is not started.
BUILD_LITERALS_PER_SECOND = 20_000


# ----------------------------------------------------------------------------- spans


@dataclass(frozen=True)
class Spans:
    """``lo[v] <= position(v) <= hi[v]`` in every order considered."""

    lo: tuple[int, ...]
    hi: tuple[int, ...]

    @classmethod
    def of(cls, graph: Graph, reach: Reachability) -> Spans:
        """Reachability spans, with the :func:`free_sources` pinned to the front in listed
        order (WLOG, see :func:`hoist_free_sources`): op ``v`` then runs no earlier than
        ``|free| + |ancestors(v) - free|``."""
        free = sorted(free_sources(graph))
        free_mask = sum(1 << v for v in free)
        lo = [len(free) + (a & ~free_mask).bit_count() for a in reach.ancestors]
        hi = list(reach.latest_positions)
        for rank, v in enumerate(free):
            lo[v] = hi[v] = rank
        return cls(tuple(lo), tuple(hi))

    def windowed(self, incumbent: Sequence[int], width: int) -> Spans:
        """Spans cut to ``width`` positions either side of the incumbent order; the incumbent
        and every edge's ``lo[u] < lo[v]``, ``hi[u] < hi[v]`` survive the cut."""
        pos = positions(incumbent)
        lo = tuple(max(a, p - width) for a, p in zip(self.lo, pos, strict=True))
        hi = tuple(min(b, p + width) for b, p in zip(self.hi, pos, strict=True))
        return Spans(lo, hi)

    def literal_count(self, ops: Sequence[int]) -> int:
        """Number of ``R`` variables of these ops: the size of the model."""
        return sum(self.hi[v] - self.lo[v] for v in ops)


def segments(spans: Spans) -> list[tuple[int, int, list[int]]]:
    """Maximal timestep ranges ``[a, b]`` that no span crosses, with their ops (OLLA 4.4
    splitting): the order inside one range never changes the memory of another."""
    n = len(spans.lo)
    crossing = [0] * (n + 1)
    for lo, hi in zip(spans.lo, spans.hi, strict=True):
        crossing[lo] += 1
        crossing[hi] -= 1
    by_start: dict[int, list[int]] = {}
    for v, lo in enumerate(spans.lo):
        by_start.setdefault(lo, []).append(v)
    result: list[tuple[int, int, list[int]]] = []
    open_spans, start = 0, 0
    for k in range(n):
        open_spans += crossing[k]
        if open_spans == 0:  # no span covers the boundary k | k + 1
            ops = [v for t in range(start, k + 1) for v in by_start.get(t, ())]
            result.append((start, k, ops))
            start = k + 1
    return result


def last_sinks(graph: Graph, reach: Reachability, tensor: int) -> list[int]:
    """Readers of ``tensor`` that are not ancestors of another reader (OLLA 4.2): only they
    can be the last one."""
    readers = graph.consumers[tensor]
    return [c for c in readers if not any(reach.is_ancestor(c, d) for d in readers if d != c)]


# ----------------------------------------------------------------------------- objective check


def ilp_peak_of_order(graph: Graph, order: Sequence[int]) -> int:
    """Eq. (13) evaluated on the C and P that an order induces: ``C[e, t]`` is 1 at the step of
    ``src(e)``; ``P[e, t]`` is 1 from the step after it while a sink runs at ``t`` or later
    (or to the end for outputs). Persistent tensors are always resident. Written apart from
    the estimator so the two can be checked against each other."""
    pos = positions(order)
    n = len(order)
    peak = 0
    for t in range(n):
        total = 0
        for e, tensor in enumerate(graph.tensors):
            if tensor.persistent:
                total += tensor.size_bytes
                continue
            created = pos[graph.producer[e]]
            c_et = created == t
            needed_later = tensor.category is Category.OUTPUT or any(pos[s] >= t for s in graph.consumers[e])
            p_et = created < t and needed_later
            total += tensor.size_bytes * (c_et + p_et)
        peak = max(peak, total)
    return peak if n else graph.persistent_bytes


# ----------------------------------------------------------------------------- one segment model


@dataclass(frozen=True)
class Segment:
    """Timesteps ``[first, last]``, the ops that run in them, the tensors those ops make or
    read, and the bytes of tensors that pass through untouched (resident throughout)."""

    first: int
    last: int
    ops: tuple[int, ...]
    tensors: tuple[int, ...]
    through_bytes: int


def split_segments(graph: Graph, spans: Spans) -> list[Segment]:
    """:func:`segments` with the tensors each one touches and its pass-through bytes."""
    parts = segments(spans)
    seg_of = [0] * graph.num_ops
    for i, (_, _, ops) in enumerate(parts):
        for v in ops:
            seg_of[v] = i
    touched: list[dict[int, None]] = [{} for _ in parts]
    delta = [0] * (len(parts) + 1)
    for e, tensor in enumerate(graph.tensors):
        if tensor.persistent or tensor.size_bytes == 0:
            continue
        home = seg_of[graph.producer[e]]
        touched[home][e] = None
        readers = {seg_of[c] for c in graph.consumers[e]}
        for i in readers:
            touched[i][e] = None
        last = len(parts) - 1 if tensor.category is Category.OUTPUT else max(readers, default=home)
        # resident throughout every segment after its producer's, up to its last reader's,
        # where no op touches it
        delta[home + 1] += tensor.size_bytes
        delta[max(last, home) + 1] -= tensor.size_bytes
        for i in readers - {home}:
            delta[i] -= tensor.size_bytes
            delta[i + 1] += tensor.size_bytes
    result, running = [], 0
    for i, (first, last, ops) in enumerate(parts):
        running += delta[i]
        result.append(Segment(first, last, tuple(ops), tuple(sorted(touched[i])), running))
    return result


class SegmentModel:
    """Eq. (1)-(5), (13), (14) for the timesteps of one segment, in scaled bytes."""

    def __init__(self, graph: Graph, reach: Reachability, spans: Spans, segment: Segment):
        from ortools.sat.python import cp_model

        self.graph, self.spans, self.segment = graph, spans, segment
        self.first, self.last = segment.first, segment.last
        self.model = cp_model.CpModel()
        self.scale = _size_scale(graph)
        self.r: dict[tuple[int, int], cp_model.IntVar] = {}
        self.p: dict[tuple[int, int], tuple[cp_model.IntVar, int, list[int]]] = {}
        self._make_run_variables()
        self._one_op_per_timestep()
        self._precedence()
        const, terms = self._memory_terms(reach)
        self.peak = self.model.NewIntVar(0, _total_scaled(graph, self.scale), "peak_mem_no_frag")
        for k, row in enumerate(terms):
            if row:
                variables, coefficients = zip(*row, strict=True)
                self.model.Add(self.peak >= const[k] + cp_model.LinearExpr.weighted_sum(variables, coefficients))
            else:
                self.model.Add(self.peak >= const[k])
        self.model.Minimize(self.peak)

    def run_by(self, v: int, t: int) -> Term:
        """R[v, t]: 0 before the span, 1 after it, a variable inside."""
        if t < self.spans.lo[v]:
            return 0
        if t >= self.spans.hi[v]:
            return 1
        return self.r[v, t]

    def _make_run_variables(self) -> None:
        for v in self.segment.ops:
            lo, hi = self.spans.lo[v], self.spans.hi[v]
            for t in range(lo, hi):
                self.r[v, t] = self.model.NewBoolVar(f"R_{v}_{t}")
                if t > lo:
                    self.model.AddImplication(self.r[v, t - 1], self.r[v, t])

    def _one_op_per_timestep(self) -> None:
        """Exactly ``t + 1 - first`` of the segment's ops have run by timestep ``t``."""
        for t in range(self.first, self.last):
            fixed, row = 0, []
            for v in self.segment.ops:
                term = self.run_by(v, t)
                if isinstance(term, int):
                    fixed += term
                else:
                    row.append(term)
            if row:
                self.model.Add(sum(row) == t + 1 - self.first - fixed)

    def _precedence(self) -> None:
        """Eq. (4) on ops: ``v`` may run at ``t`` only if each predecessor ran by ``t - 1``."""
        for v in self.segment.ops:
            for u in self.graph.predecessors[v]:
                for t in range(self.spans.lo[v], self.spans.hi[v] + 1):
                    self._add_le(self.run_by(v, t), self.run_by(u, t - 1))

    def _add_le(self, a: Term, b: Term) -> None:
        if isinstance(b, int) and b == 1:
            return
        if isinstance(a, int):
            if a == 1 and isinstance(b, int):
                raise SolverError("internal: a precedence contradicts the spans")
            if a == 1:
                self.model.Add(b == 1)
        elif isinstance(b, int):
            self.model.Add(a == 0)
        else:
            self.model.AddImplication(a, b)

    def _memory_terms(self, reach: Reachability) -> tuple[list[int], list[list[tuple[cp_model.IntVar, int]]]]:
        """Eq. (13) per timestep: constant scaled bytes and (variable, scaled bytes) terms."""
        width = self.last - self.first + 1
        base = (self.graph.persistent_bytes + self.segment.through_bytes) // self.scale
        const = [base] * width
        terms: list[list[tuple[cp_model.IntVar, int]]] = [[] for _ in range(width)]
        for e in self.segment.tensors:
            size = self.graph.tensors[e].size_bytes // self.scale
            self._creation_terms(e, size, const, terms)
            self._preservation_terms(e, size, reach, const, terms)
        return const, terms

    def _creation_terms(self, e: int, size: int, const: list[int], terms: list[list[tuple[cp_model.IntVar, int]]]):
        """C[e, t] = R[src, t] - R[src, t - 1] over the span of ``src(e)`` (eq. 10)."""
        src = self.graph.producer[e]
        for t in range(max(self.spans.lo[src], self.first), min(self.spans.hi[src], self.last) + 1):
            self._add_term(self.run_by(src, t), size, t, const, terms)
            self._add_term(self.run_by(src, t - 1), -size, t, const, terms)

    def _preservation_terms(
        self, e: int, size: int, reach: Reachability, const: list[int], terms: list[list[tuple[cp_model.IntVar, int]]]
    ) -> None:
        """P[e, t] over the Maximum Useful Lifetime of ``e`` (eq. 11)."""
        src = self.graph.producer[e]
        is_output = self.graph.tensors[e].category is Category.OUTPUT
        sinks = [] if is_output else last_sinks(self.graph, reach, e)
        if not is_output and not sinks:
            return
        end = self.graph.num_ops - 1 if is_output else max(self.spans.hi[s] for s in sinks)
        for t in range(max(self.spans.lo[src] + 1, self.first), min(end, self.last) + 1):
            self._add_term(self._preserved(e, t, src, sinks, is_output), size, t, const, terms)

    def _preserved(self, e: int, t: int, src: int, sinks: list[int], is_output: bool) -> Term:
        """P[e, t] as a constant (eq. 12's PRES range gives 1), or a fresh variable bounded
        below by eq. (2)/(4): created by ``t - 1`` and some sink not run by ``t - 1``."""
        created = self.run_by(src, t - 1)
        if isinstance(created, int) and created == 0:
            return 0
        pending = [self.run_by(s, t - 1) for s in sinks]
        if is_output or any(isinstance(x, int) and x == 0 for x in pending):
            return created
        open_sinks = [s for s, x in zip(sinks, pending, strict=True) if not isinstance(x, int)]
        if not open_sinks:
            return 0
        p = self.model.NewBoolVar(f"P_{e}_{t}")
        for s in open_sinks:
            self.model.Add(p >= created - self.r[s, t - 1])
        self.p[e, t] = (p, src, open_sinks)
        return p

    def _add_term(
        self, term: Term, size: int, t: int, const: list[int], terms: list[list[tuple[cp_model.IntVar, int]]]
    ):
        if isinstance(term, int):
            const[t - self.first] += term * size
        else:
            terms[t - self.first].append((term, size))

    # ------------------------------------------------------------------ hint and decode

    def hint(self, order: Sequence[int]) -> None:
        """Warm start from an order: R from its positions, P from its exact lifetimes."""
        pos = positions(order)
        for (v, t), var in self.r.items():
            self.model.AddHint(var, int(pos[v] <= t))
        for (_, t), (var, src, open_sinks) in self.p.items():
            self.model.AddHint(var, int(pos[src] <= t - 1 and any(pos[s] > t - 1 for s in open_sinks)))

    def decode(self, solver: cp_model.CpSolver) -> list[OpId]:
        """Function 1: run each op at the first timestep where ``R`` is 1 (no duplicates)."""
        when: dict[int, int] = {}
        for v in self.segment.ops:
            lo, hi = self.spans.lo[v], self.spans.hi[v]
            when[v] = next((t for t in range(lo, hi) if solver.BooleanValue(self.r[v, t])), hi)
        return [OpId(v) for v in sorted(self.segment.ops, key=lambda v: (when[v], v))]


def _size_scale(graph: Graph) -> int:
    """Common divisor of all tensor sizes, so CP-SAT works on smaller coefficients."""
    g = 0
    for tensor in graph.tensors:
        g = math.gcd(g, tensor.size_bytes)
    return max(g, 1)


def _total_scaled(graph: Graph, scale: int) -> int:
    return 2 * sum(t.size_bytes for t in graph.tensors) // scale + 1


# ----------------------------------------------------------------------------- driver


@dataclass
class _Outcome:
    order: list[OpId]  # the segment's ops in their new order
    peak_bytes: int
    bound_bytes: int  # a lower bound on the segment's peak (0 if the model was restricted)
    status: SolveStatus | None


def segment_peak(graph: Graph, order: Sequence[int], first: int, last: int) -> int:
    return max(memory_timeline(graph, order)[first : last + 1], default=graph.persistent_bytes)


def combine_by_segments(graph: Graph, spans: Spans, orders: Sequence[Sequence[int]]) -> list[OpId]:
    """Per segment, the slice of whichever order is best there (segments are independent).
    Orders are first brought into the spans' convention (free sources hoisted)."""
    orders = [hoist_free_sources(graph, o) for o in orders]
    timelines = [memory_timeline(graph, o) for o in orders]
    combined: list[OpId] = []
    for first, last, _ in segments(spans):
        best = min(range(len(orders)), key=lambda i: (max(timelines[i][first : last + 1]), i))
        combined.extend(OpId(v) for v in orders[best][first : last + 1])
    return combined


class ReorderSolver:
    """Improves an order of one graph segment by segment, bottleneck first, within a deadline."""

    def __init__(self, problem: ScheduleProblem, report: Callable[[str], None]):
        self.problem = problem
        self.report = report
        self.deadline = time.perf_counter() + problem.time_limit_seconds

    def remaining_seconds(self) -> float:
        return self.deadline - time.perf_counter()

    def solve(
        self, graph: Graph, incumbent: Sequence[int], exact_for_original: bool, lower_bytes: int
    ) -> tuple[list[OpId], int]:
        """Return the improved order and a lower bound on its peak that holds for every order
        of the original graph (0 when the model was restricted by control edges). Segments
        whose incumbent peak is already at most ``lower_bytes`` cannot lower the peak and are
        left alone, as are those within the problem's relative gap limit of it."""
        reach = Reachability.of(graph)
        spans = Spans.of(graph, reach)
        self.resident_bytes = necessarily_resident_bytes(graph, reach)
        order = [OpId(v) for v in incumbent]
        parts = [seg for seg in split_segments(graph, spans) if spans.literal_count(seg.ops) > 0]
        timeline = memory_timeline(graph, order)
        peaks = [max(timeline[seg.first : seg.last + 1]) for seg in parts]
        todo = sorted(range(len(parts)), key=lambda i: -peaks[i])
        literals_left = sum(spans.literal_count(seg.ops) for seg in parts)
        bound_bytes, reached_bytes = 0, lower_bytes
        for i in todo:
            seg = parts[i]
            literals_left -= spans.literal_count(seg.ops)
            close = gap_met(peaks[i], lower_bytes, self.problem.relative_gap_limit)
            if peaks[i] <= reached_bytes or close or self.remaining_seconds() <= 0.05:
                reached_bytes = max(reached_bytes, peaks[i])
                continue  # cannot lower the overall peak, close enough to the bound, or out of time
            share = spans.literal_count(seg.ops) / (spans.literal_count(seg.ops) + literals_left)
            limit = self.remaining_seconds() * max(share, 0.5)
            outcome = self._solve_segment(graph, reach, spans, order, seg, limit)
            order[seg.first : seg.last + 1] = outcome.order
            reached_bytes = max(reached_bytes, outcome.peak_bytes)
            if exact_for_original:
                bound_bytes = max(bound_bytes, outcome.bound_bytes)
        return order, bound_bytes

    def _solve_segment(
        self, graph: Graph, reach: Reachability, spans: Spans, order: list[OpId], seg: Segment, limit_seconds: float
    ) -> _Outcome:
        if spans.literal_count(seg.ops) <= self.problem.max_model_literals:
            return self._solve_model(graph, reach, spans, order, seg, limit_seconds, windowed=False)
        return self._solve_windows(graph, reach, spans, order, seg, limit_seconds)

    def _solve_model(
        self,
        graph: Graph,
        reach: Reachability,
        spans: Spans,
        order: list[OpId],
        seg: Segment,
        limit_seconds: float,
        windowed: bool,
    ) -> _Outcome:
        incumbent_bytes = segment_peak(graph, order, seg.first, seg.last)
        if spans.literal_count(seg.ops) > BUILD_LITERALS_PER_SECOND * min(limit_seconds, self.remaining_seconds()) / 2:
            # Building the model alone would take most of the time left: keep the incumbent.
            return _Outcome(order[seg.first : seg.last + 1], incumbent_bytes, 0, None)
        built_at = time.perf_counter()
        model = SegmentModel(graph, reach, spans, seg)
        limit_seconds = min(limit_seconds - (time.perf_counter() - built_at), self.remaining_seconds())
        model.model.Add(model.peak * model.scale <= incumbent_bytes)
        # Every op of the segment runs inside it, with at least its necessarily resident bytes.
        floor_bytes = max(self.resident_bytes[v] for v in seg.ops)
        model.model.Add(model.peak * model.scale >= floor_bytes)
        model.hint(order)
        label = f"ops {seg.first}-{seg.last}: {len(model.r)} R + {len(model.p)} P literals" + (
            " (window)" if windowed else ""
        )

        def progress(objective: float, bound: float) -> None:
            self.report(f"{label}: peak {int(objective) * model.scale:,} B, bound {int(bound) * model.scale:,} B")

        gap_limit = self.problem.relative_gap_limit  # CP-SAT's own relative gap stop, on the segment's peak
        solver, status = solve_cp_sat(
            model.model,
            limit_seconds,
            workers=self.problem.workers,
            progress=progress if self.problem.progress else None,
            stall_seconds=max(1.0, STALL_FRACTION * limit_seconds),
            parameters={"relative_gap_limit": gap_limit} if gap_limit else None,
        )
        self.report(f"{label}: {status.status} in {status.seconds:.2f} s")
        keep = order[seg.first : seg.last + 1]
        if status.status not in ("optimal", "feasible"):
            return _Outcome(keep, incumbent_bytes, 0, status)
        decoded = model.decode(solver)
        trial = order[: seg.first] + decoded + order[seg.last + 1 :]
        decoded_bytes = segment_peak(graph, trial, seg.first, seg.last)
        objective_bytes = round(status.objective or 0) * model.scale
        # The solver's peak bounds the decoded order's; at an optimum P is tight and they agree.
        if decoded_bytes > objective_bytes or (status.status == "optimal" and decoded_bytes != objective_bytes):
            raise SolverError(
                f"internal: ILP objective {objective_bytes} B disagrees with the estimator's {decoded_bytes} B"
            )
        bound_bytes = 0 if windowed else math.ceil(status.bound or 0) * model.scale
        if decoded_bytes > incumbent_bytes:
            return _Outcome(keep, incumbent_bytes, bound_bytes, status)
        return _Outcome(decoded, decoded_bytes, bound_bytes, status)

    def _solve_windows(
        self, graph: Graph, reach: Reachability, spans: Spans, order: list[OpId], seg: Segment, limit_seconds: float
    ) -> _Outcome:
        """A segment too big for one model: each op may move at most ``width`` positions from
        the incumbent; re-centre on the improved order and repeat while it helps."""
        stop = time.perf_counter() + limit_seconds
        current = list(order)
        best_bytes = segment_peak(graph, current, seg.first, seg.last)
        width = max(2, self.problem.max_model_literals // max(2 * len(seg.ops), 1))
        while (left := stop - time.perf_counter()) > 0.1:
            narrow = spans.windowed(current, width)
            outcome = self._solve_model(
                graph, reach, narrow, current, seg, min(left, max(left / 3, 1.0)), windowed=True
            )
            current[seg.first : seg.last + 1] = outcome.order
            if outcome.status is None:
                break  # no time left to build a window's model
            if outcome.peak_bytes >= best_bytes and outcome.status.status == "optimal":
                break  # a local optimum for this window width
            best_bytes = min(best_bytes, outcome.peak_bytes)
        return _Outcome(current[seg.first : seg.last + 1], best_bytes, 0, None)


def optimize_ilp(problem: ScheduleProblem, report: Callable[[str], None] | None = None) -> ScheduleResult:
    """Minimise the peak (eq. 14) over the topological orders of ``problem.graph``; never
    worse than the best heuristic of the portfolio."""
    start = time.perf_counter()
    say = report or (lambda _msg: None)
    graph = problem.graph
    candidates = portfolio(graph)
    reach = Reachability.of(graph)
    spans = Spans.of(graph, reach)
    lower_bytes = peak_lower_bound(graph, reach)
    gap_limit = problem.relative_gap_limit
    if problem.ideal_search and candidates[0].peak_bytes > lower_bytes:  # the bound is probed even within the gap
        candidates, lower_bytes = _search_ideals(problem, candidates, lower_bytes, start, say)
    if candidates[0].peak_bytes <= lower_bytes:  # at a proven bound: the ILP has nothing to add
        best = candidates[0]
        seconds = time.perf_counter() - start
        return ScheduleResult(best.order, best.peak_bytes, "ilp", "optimal", seconds, 0.0, best.peak_bytes)
    stop = gap_met(candidates[0].peak_bytes, lower_bytes, gap_limit)  # close enough to the bound: stop here
    if stop or start + problem.time_limit_seconds - time.perf_counter() < MIN_ILP_SECONDS:
        best = candidates[0]  # or too little time left to build the CP-SAT model of anything
        gap = relative_gap(best.peak_bytes, lower_bytes)
        seconds = time.perf_counter() - start
        return ScheduleResult(best.order, best.peak_bytes, "ilp", "feasible", seconds, gap, lower_bytes)
    work, exact = graph, True
    if _use_early_updates(problem, graph, spans):
        work, edges = enforce_early_weight_updates(graph)
        exact = not edges
        say(f"early weight updates (OLLA 4.3): {len(edges)} control edges")
    work_orders = [map_order(c.order, graph, work) for c in candidates]
    if not exact:
        work_orders = [o for o in work_orders if _is_topological(work, o)] + [list(c.order) for c in portfolio(work)]
    work_spans = spans if exact else Spans.of(work, Reachability.of(work))
    incumbent = combine_by_segments(work, work_spans, work_orders)
    order, bound_bytes = ReorderSolver(problem, say).solve(work, incumbent, exact, lower_bytes)
    final = map_order(order, work, graph)
    validate_order(graph, final)
    final_bytes = peak_bytes(graph, final)
    if final_bytes > candidates[0].peak_bytes:
        final, final_bytes = list(candidates[0].order), candidates[0].peak_bytes
    lower_bytes = min(max(lower_bytes, bound_bytes), final_bytes)
    gap = relative_gap(final_bytes, lower_bytes)
    status = "optimal" if final_bytes == lower_bytes else "feasible"
    return ScheduleResult(tuple(final), final_bytes, "ilp", status, time.perf_counter() - start, gap, lower_bytes)


# Share of the time limit given to the search over ideals (memplan.schedule.ideals) before the
# CP-SAT model; then, if a gap is left, up to this share of what is left to the cut bound.
IDEAL_SHARE = 0.5
CUT_SHARE = 0.4
# Then up to this share of what is left to the ordering bound over the ops with the highest
# floors, and, where the bound rose, this share of the time then left to a second search over
# ideals from the raised bound.
ORDERING_SHARE = 0.2
SEARCH_AGAIN_SHARE = 0.6
# The CP-SAT stage is not started with less time than this left.
MIN_ILP_SECONDS = 1.0


def _search_ideals(
    problem: ScheduleProblem,
    candidates: list[Candidate],
    lower_bytes: int,
    start: float,
    say: Callable[[str], None],
) -> tuple[list[Candidate], int]:
    """The exact search over ideals (cap bisection from the lower bound), then the cut and
    ordering bounds on its best order and, where they rose, the search again from the raised
    bound: returns the candidates (the best order first) and the bound. With a relative gap
    limit the bounds are raised early (:func:`_close_in`) and every stage stops once the gap
    is met."""
    graph, gap_limit = problem.graph, problem.relative_gap_limit
    deadline = start + IDEAL_SHARE * problem.time_limit_seconds
    reach = Reachability.of(graph)
    parts = segments(Spans.of(graph, reach))
    if gap_limit:
        candidates, lower_bytes, raised_on = _close_in(problem, candidates, lower_bytes, start, reach, parts, say)
        if gap_met(candidates[0].peak_bytes, lower_bytes, gap_limit):
            return candidates, min(lower_bytes, candidates[0].peak_bytes)
    else:
        raised_on = None
    start_order = hoist_free_sources(graph, candidates[0].order)  # the spans' convention
    found = minimise_peak(graph, lower_bytes, start_order, deadline, parts=parts, stop_gap=gap_limit)
    lower_bytes = max(lower_bytes, found.proven_lower_bytes)
    say(f"search over ideals: peak {found.peak_bytes:,} B, proven >= {lower_bytes:,} B ({len(found.probes)} probes)")
    if found.order is not None and found.peak_bytes < candidates[0].peak_bytes:
        candidates = [Candidate("ideal-search", found.order, found.peak_bytes), *candidates]
    best = candidates[0]
    if best.peak_bytes > lower_bytes and not gap_met(best.peak_bytes, lower_bytes, gap_limit):
        left = max(0.0, start + problem.time_limit_seconds - time.perf_counter())
        raised = lower_bytes if best.order == raised_on else _raise_bound(graph, reach, best.order, lower_bytes, left)
        if raised > lower_bytes and best.peak_bytes > raised and not gap_met(best.peak_bytes, raised, gap_limit):
            # A probe at the new bound either meets it or, exhausted, proves the next one up.
            again = minimise_peak(
                graph,
                raised,
                hoist_free_sources(graph, best.order),
                _deadline(SEARCH_AGAIN_SHARE, start, problem),
                parts=parts,
                stop_gap=gap_limit,
            )
            raised = max(raised, again.proven_lower_bytes)
            say(f"search over ideals at the raised bound {raised:,} B: peak {again.peak_bytes:,} B")
            if again.order is not None and again.peak_bytes < best.peak_bytes:
                best = Candidate("ideal-search", again.order, again.peak_bytes)
                candidates = [best, *candidates]
        lower_bytes = max(lower_bytes, raised)
    return candidates, min(lower_bytes, best.peak_bytes)


# With a relative gap limit, the probe at the lower bound gets this share of the search's time
# (it meets the bound at once on most training steps, or not in any time), and the bounds are
# raised after the first two probes, not after the whole bisection.
GAP_FIRST_PROBE_SHARE = 0.1


def _close_in(
    problem: ScheduleProblem,
    candidates: list[Candidate],
    lower_bytes: int,
    start: float,
    reach: Reachability,
    parts: list[tuple[int, int, list[int]]],
    say: Callable[[str], None],
) -> tuple[list[Candidate], int, tuple[OpId, ...] | None]:
    """The quick way to a small gap: probe the lower bound (briefly) and one below the best
    order known, then raise the bound (cut and ordering bounds) on the best order: on an
    unrolled LSTM the cut bound proves, in half a second, what the bisection between a weak
    bound and a good order never does. Returns the candidates (the best first), the bound,
    and the order the bound was raised on (``None`` if it was not)."""
    graph, gap_limit = problem.graph, problem.relative_gap_limit
    deadline = start + IDEAL_SHARE * problem.time_limit_seconds
    first = minimise_peak(
        graph,
        lower_bytes,
        hoist_free_sources(graph, candidates[0].order),
        deadline,
        parts=parts,
        stop_gap=gap_limit,
        first_share=GAP_FIRST_PROBE_SHARE,
        max_probes=2,
    )
    lower_bytes = max(lower_bytes, first.proven_lower_bytes)
    if first.order is not None and first.peak_bytes < candidates[0].peak_bytes:
        candidates = [Candidate("ideal-search", first.order, first.peak_bytes), *candidates]
    best = candidates[0]
    say(f"two probes: peak {best.peak_bytes:,} B, proven >= {lower_bytes:,} B")
    if gap_met(best.peak_bytes, lower_bytes, gap_limit):
        return candidates, lower_bytes, None
    left = max(0.0, start + problem.time_limit_seconds - time.perf_counter())
    lower_bytes = max(lower_bytes, _raise_bound(graph, reach, best.order, lower_bytes, left))
    say(f"cut and ordering bounds: proven >= {lower_bytes:,} B")
    return candidates, min(lower_bytes, best.peak_bytes), best.order


def _deadline(share: float, start: float, problem: ScheduleProblem) -> float:
    """``share`` of the time left of ``problem``'s limit, from now."""
    now = time.perf_counter()
    return now + share * max(0.0, start + problem.time_limit_seconds - now)


def _raise_bound(graph: Graph, reach: Reachability, order: Sequence[int], lower_bytes: int, left: float) -> int:
    """The cut bound on ``order`` (:func:`memplan.schedule.bounds.cut_lower_bound`), then the
    ordering bound over the :data:`memplan.schedule.bounds.ORDERING_OPS` ops with the highest
    floors (:func:`memplan.schedule.bounds.ordering_bound`), each within its share of ``left``."""
    t0 = time.perf_counter()
    cut = cut_lower_bound(graph, order, lower_bytes, t0 + CUT_SHARE * left, reach)
    bound = max(lower_bytes, cut.bound_bytes)
    if len(cut.floors) < 2 or bound >= peak_bytes(graph, order):
        return bound
    top = [v for v, _ in sorted(cut.floors, key=lambda f: -f[1])[:ORDERING_OPS]]
    ordered = ordering_bound(graph, top, t0 + (CUT_SHARE + ORDERING_SHARE) * left, reach)
    return bound if ordered is None else max(bound, ordered)


def _is_topological(graph: Graph, order: Sequence[int]) -> bool:
    pos = positions(order)
    return all(pos[p] < pos[v] for v in range(graph.num_ops) for p in graph.predecessors[v])


def _use_early_updates(problem: ScheduleProblem, graph: Graph, spans: Spans) -> bool:
    if problem.early_updates == "never" or not early_release_ops(graph):
        return False
    if problem.early_updates == "always":
        return True
    return any(spans.literal_count(ops) > problem.max_model_literals for _, _, ops in segments(spans))
