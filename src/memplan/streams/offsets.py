"""Offset assignment for a multi-stream step (SOMAS section 4), on memplan's placement problem.

:func:`stream_problem` states it: one buffer per placed tensor, the unsafe pairs of
:mod:`memplan.streams.safety` as the conflict relation, the graph's contiguous groups, and as
known cliques the tensors live together at the fullest moment of a few executions (each such
set is pairwise unsafe, so its total size bounds the arena from below).

:func:`plan_stream_placement` solves it with, in turn:

* SOMAS single object and many objects (:mod:`memplan.placement.somas`), then memplan's own
  heuristic portfolio (:func:`memplan.placement.heuristics.portfolio`);
* *interval cover*: when every unsafe pair also overlaps in the recorded order (true when
  every side-stream op's tensors are read again later on their own stream, as for DDP's
  all-reduces), a placement valid for the recorded order's lifetimes is valid for every
  execution, and memplan's interval placement applies; it is used only after checking that
  inclusion. Contiguous groups are tried first as single buffers spanning their members'
  lifetimes (SOMAS's "union": fast, may overprotect), then as groups: CP-SAT at capacity =
  lower bound, then minimising. (memplan's exact window solvers, which close the zoo's
  single-stream graphs to the bound, take single buffers only, so groups leave a small gap);
* CP-SAT on the pair problem (:func:`memplan.placement.exact.solve_exact`, OLLA eq. 7a/7b per
  unsafe pair), warm-started with the best so far, when the model is small enough;

and keeps the smallest arena, checked by the placement validator against the unsafe pairs.
:func:`interval_claim` is what single-stream planning would do: place the recorded order's
lifetimes, blind to the streams.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from memplan.errors import ContiguityConflict
from memplan.graph.ir import Graph, TensorId
from memplan.graph.liveness import lifetimes
from memplan.graph.multistream import contiguous_groups
from memplan.placement.check import validate_placement
from memplan.placement.heuristics import portfolio
from memplan.placement.problem import ConflictRelation, Placement, PlacementProblem, arena_bytes, group_prefixes
from memplan.placement.somas import many_objects, single_object
from memplan.streams.interleave import executions, lifetimes_in
from memplan.streams.safety import SafePairs, safe_pairs

ARENA_ALIGNMENT_BYTES = 64  # memplan.pipeline.ARENA_ALIGNMENT_BYTES
EXACT_MAX_PAIRS = 50_000  # CP-SAT gets one disjunction per unsafe pair: beyond this, too slow to load


class MatrixConflicts(ConflictRelation):
    """A conflict relation held as a dense symmetric boolean matrix (the unsafe pairs)."""

    def __init__(self, matrix: np.ndarray) -> None:
        self.matrix = np.asarray(matrix, dtype=bool)
        self.num_buffers = len(self.matrix)
        self._neighbors: dict[int, np.ndarray] = {}

    def conflict(self, i: int, j: int) -> bool:
        return i != j and bool(self.matrix[i, j])

    def neighbors(self, i: int) -> np.ndarray:
        if i not in self._neighbors:
            row = self.matrix[i].copy()
            row[i] = False
            self._neighbors[i] = np.flatnonzero(row)
        return self._neighbors[i]


@dataclass(frozen=True)
class StreamProblem:
    """The placement problem of ``graph`` run in ``order``: buffer ``i`` is ``tensors[i]``."""

    graph: Graph
    order: tuple[int, ...]
    tensors: tuple[TensorId, ...]
    problem: PlacementProblem
    safety: SafePairs
    recorded_lifetimes: tuple[tuple[int, int], ...]  # [start, end) in the recorded order


def stream_problem(
    graph: Graph,
    order: Sequence[int] | None = None,
    *,
    alignment_bytes: int = ARENA_ALIGNMENT_BYTES,
    exclude: Collection[int] = frozenset(),
    safety_method: str = "stream",
    clique_executions: int = 8,
) -> StreamProblem:
    """State the arena problem of a multi-stream ``graph`` (module docstring)."""
    order = tuple(graph.program_order() if order is None else order)
    safety = safe_pairs(graph, order, exclude, safety_method)
    tensors = safety.tensors
    index = {t: i for i, t in enumerate(tensors)}
    lives = {life.tensor: (life.start, life.end) for life in lifetimes(graph, order)}
    recorded = tuple(lives[t] for t in tensors)
    groups = tuple(tuple(index[t] for t in g if t in index) for g in _arena_groups(graph, index))
    conflicts = MatrixConflicts(safety.unsafe)
    sizes = [graph.tensors[t].size_bytes for t in tensors]
    padded = [-(-s // alignment_bytes) * alignment_bytes for s in sizes]
    cliques = _fullest_moments(graph, order, tensors, padded, clique_executions)
    problem = PlacementProblem(
        tuple(sizes),
        conflicts,
        alignment_bytes=alignment_bytes,
        names=tuple(graph.tensors[t].name for t in tensors),
        lifetimes=recorded,
        contiguous=tuple(g for g in groups if g),
        cliques=cliques,
    )
    return StreamProblem(graph, order, tensors, problem, safety, recorded)


def _arena_groups(graph: Graph, index: dict[TensorId, int]) -> tuple[tuple[TensorId, ...], ...]:
    """The contiguous groups; a member with bytes left out of the arena breaks its group."""
    groups = contiguous_groups(graph)
    for g, members in enumerate(groups):
        for t in members:
            if t not in index and graph.tensors[t].size_bytes > 0:
                raise ContiguityConflict(
                    f"tensor {graph.tensors[t].name!r} of contiguous group {g} is not placed in the arena "
                    "(persistent or excluded), so the group cannot lie back to back there"
                )
    return groups


def _fullest_moments(
    graph: Graph, order: Sequence[int], tensors: Sequence[TensorId], sizes: Sequence[int], count: int
) -> tuple[tuple[int, ...], ...]:
    """For each of the first ``count`` executions, the tensors live at its fullest moment."""
    if not tensors:
        return ()
    weights = np.asarray(sizes, dtype=np.int64)
    cliques = []
    for k, (_, events) in enumerate(executions(graph, order, samples=max(0, count - 4))):
        if k >= count:
            break
        first, last = lifetimes_in(graph, tensors, events)
        delta = np.zeros(len(events) + 2, dtype=np.int64)
        np.add.at(delta, first, weights)
        np.add.at(delta, last + 1, -weights)
        moment = int(np.argmax(np.cumsum(delta)))
        live = np.flatnonzero((first <= moment) & (last >= moment))
        cliques.append(tuple(int(i) for i in live))
    return tuple(dict.fromkeys(cliques))


def covered_by_recorded_order(sp: StreamProblem) -> bool:
    """True if every unsafe pair also overlaps in the recorded order's lifetimes, so that a
    placement valid for those lifetimes is valid for every execution."""
    lives = np.array(sp.recorded_lifetimes, dtype=np.int64).reshape(-1, 2)
    s, e = lives[:, 0], lives[:, 1]
    overlap = (s[:, None] < e[None, :]) & (s[None, :] < e[:, None])
    return not bool((sp.safety.unsafe & ~overlap).any())


@dataclass(frozen=True)
class StreamPlan:
    """The chosen placement of a :class:`StreamProblem`, and every candidate tried."""

    stream_problem: StreamProblem
    placement: Placement
    candidates: dict[str, Placement] = field(default_factory=dict)
    interval_cover: bool = False

    @property
    def offsets(self) -> dict[TensorId, int]:
        """Arena offset of every placed tensor."""
        return dict(zip(self.stream_problem.tensors, self.placement.offsets_bytes, strict=True))

    @property
    def arena_bytes(self) -> int:
        return self.placement.arena_bytes

    @property
    def lower_bound_bytes(self) -> int:
        return self.stream_problem.problem.lower_bound_bytes


def plan_stream_placement(
    graph: Graph,
    order: Sequence[int] | None = None,
    *,
    alignment_bytes: int = ARENA_ALIGNMENT_BYTES,
    exclude: Collection[int] = frozenset(),
    time_limit_seconds: float = 10.0,
    workers: int = 2,
    exact_max_pairs: int = EXACT_MAX_PAIRS,
) -> StreamPlan:
    """Offsets for every placed tensor of a multi-stream ``graph`` run in ``order`` that are
    safe in every execution and honour its contiguous groups (module docstring)."""
    t0 = time.perf_counter()
    sp = stream_problem(graph, order, alignment_bytes=alignment_bytes, exclude=exclude)
    problem = sp.problem
    bound = problem.lower_bound_bytes
    candidates: dict[str, Placement] = {"single-object": single_object(problem)}
    many = many_objects(problem)
    if many is not None:
        candidates["many-objects"] = many
    if _best(candidates).arena_bytes > bound:
        candidates["portfolio"] = portfolio(problem)
    cover = covered_by_recorded_order(sp)
    left = lambda: time_limit_seconds - (time.perf_counter() - t0)  # noqa: E731
    if _best(candidates).arena_bytes > bound and cover:
        candidates["interval-cover-union"] = _interval_cover_union(sp, min(max(left() / 4, 0.1), 2.0), workers)
    if _best(candidates).arena_bytes > bound and cover and problem.contiguous:
        candidates["interval-cover"] = _interval_cover(sp, max(left(), 0.1), workers)
    if _best(candidates).arena_bytes > bound and sp.safety.num_unsafe <= exact_max_pairs and left() > 0.5:
        from memplan.placement.exact import solve_exact

        candidates["exact"] = solve_exact(problem, left(), workers=workers, start=_best(candidates))
    chosen = _best(candidates)
    validate_placement(problem, chosen)
    status = "optimal" if chosen.arena_bytes <= bound else chosen.status
    gap = 0.0 if status == "optimal" else max(0.0, (chosen.arena_bytes - bound) / chosen.arena_bytes)
    chosen = Placement(
        chosen.offsets_bytes, chosen.arena_bytes, chosen.method, status, time.perf_counter() - t0, gap, bound
    )
    return StreamPlan(sp, chosen, candidates, cover)


def _best(candidates: dict[str, Placement]) -> Placement:
    return min(candidates.values(), key=lambda p: p.arena_bytes)


def _interval_cover(sp: StreamProblem, seconds: float, workers: int) -> Placement:
    """memplan's interval placement of the recorded lifetimes, re-stated on the pair problem.

    With contiguous groups the interval solvers that need free single buffers do not apply,
    so CP-SAT is first asked for an arena of exactly the lower bound (its bottom-left search
    finds such tight packings fastest), then, if it finds none, to minimise the arena."""
    from memplan.placement import solve_exact

    t0 = time.perf_counter()
    problem = sp.problem
    bound = problem.lower_bound_bytes
    interval = PlacementProblem.from_intervals(
        problem.sizes_bytes,
        sp.recorded_lifetimes,
        names=problem.names,
        alignment_bytes=problem.alignment_bytes,
        contiguous=problem.contiguous,
    )
    capped = solve_exact(replace(interval, capacity_bytes=bound), 0.6 * seconds, workers=workers, pyramid=False)
    found = capped
    if not capped.fits:
        left = max(0.1, seconds - (time.perf_counter() - t0))
        found = solve_exact(interval, left, workers=workers, start=capped)
    validate_placement(interval, found)
    arena = found.arena_bytes
    status = "optimal" if arena <= bound else "feasible"
    gap = 0.0 if arena <= bound else (arena - bound) / arena
    seconds_used = time.perf_counter() - t0
    return Placement(found.offsets_bytes, arena, f"interval-cover({found.method})", status, seconds_used, gap, bound)


def _interval_cover_union(sp: StreamProblem, seconds: float, workers: int) -> Placement:
    """As :func:`_interval_cover`, each contiguous group placed as one buffer that lives from its
    first member's birth to its last member's death (SOMAS's "union": it may overprotect, but
    then the interval solvers that need free single buffers apply)."""
    from memplan.placement import place

    problem = sp.problem
    grouped = set(problem.group_of)
    singles = [b for b in range(problem.num_buffers) if b not in grouped]
    pad = problem.padded_sizes_bytes
    lives = sp.recorded_lifetimes
    sizes = [pad[b] for b in singles] + [sum(pad[b] for b in g) for g in problem.contiguous]
    hulls = [lives[b] for b in singles] + [
        (min(lives[b][0] for b in g), max(lives[b][1] for b in g)) for g in problem.contiguous
    ]
    union = PlacementProblem.from_intervals(sizes, hulls, alignment_bytes=problem.alignment_bytes)
    found = place(union, time_limit_seconds=seconds, workers=workers)
    validate_placement(union, found)
    offsets = [0] * problem.num_buffers
    for k, b in enumerate(singles):
        offsets[b] = found.offsets_bytes[k]
    for k, members in enumerate(problem.contiguous):
        start = found.offsets_bytes[len(singles) + k]
        for b, pre in zip(members, group_prefixes(problem, members), strict=True):
            offsets[b] = start + pre
    arena = arena_bytes(problem, offsets)
    bound = problem.lower_bound_bytes
    status = "optimal" if arena <= bound else "feasible"
    gap = 0.0 if arena <= bound else (arena - bound) / arena
    return Placement(tuple(offsets), arena, f"interval-cover-union({found.method})", status, found.seconds, gap, bound)


@dataclass(frozen=True)
class IntervalClaim:
    """What single-stream planning of the recorded order claims, and whether it is safe."""

    placement: Placement
    offsets: dict[TensorId, int]
    unsafe_overlaps: list[tuple[TensorId, TensorId]]  # unsafe pairs it lets share bytes

    @property
    def safe(self) -> bool:
        return not self.unsafe_overlaps


def interval_claim(sp: StreamProblem, time_limit_seconds: float = 10.0, workers: int = 2) -> IntervalClaim:
    """Place the recorded order's lifetimes as if there were one stream (no contiguous groups,
    as single-stream planning has none), and list the unsafe pairs that placement overlaps."""
    from memplan.placement import place

    problem = sp.problem
    interval = PlacementProblem.from_intervals(
        problem.sizes_bytes, sp.recorded_lifetimes, names=problem.names, alignment_bytes=problem.alignment_bytes
    )
    found = place(interval, time_limit_seconds=time_limit_seconds, workers=workers)
    off = np.array(found.offsets_bytes, dtype=np.int64)
    end = off + np.array(problem.padded_sizes_bytes, dtype=np.int64)
    share = (off[:, None] < end[None, :]) & (off[None, :] < end[:, None])
    i, j = np.nonzero(np.triu(share & sp.safety.unsafe, 1))
    pairs = [(sp.tensors[a], sp.tensors[b]) for a, b in zip(i.tolist(), j.tolist(), strict=True)]
    return IntervalClaim(found, dict(zip(sp.tensors, found.offsets_bytes, strict=True)), pairs)
