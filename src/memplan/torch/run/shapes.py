"""One plan for a range of batch shapes (issue 37): reuse a kept plan's order and placement for
a step of another shape, proven valid for it first, instead of planning that shape again.

A step captured at a smaller sequence length usually runs the same ops as one captured at a
larger length, only on smaller tensors. Then the larger plan's order is an order of the smaller
graph (same ops, same dependences), every tensor lives over the same positions of that order
(OLLA's lifetimes, ``memplan.graph.liveness``, depend on the order and the uses only), and a
tensor no larger than its slot, placed at the slot's offset, overlaps no tensor it lives with,
since the slots did not (OLLA eq. 6 holds for any sizes at or below the placed ones). So the
plan is reused when, and only when:

* the two captures have the same structure: the same ops (name, kind, inputs, outputs,
  mutated tensors, stream), the same tensors (name, category, persistent or not), the same
  phases and calls of stateful objects, and the same tensors left to the allocator;
* every tensor of the new capture is at most as large as the same tensor of the plan's.

Both are checked here, and the reused offsets are then validated on the new graph by the
placement validator and the estimator's sweep (:func:`memplan.pipeline.place_order`'s checks),
written apart from this reasoning. Where the structure depends on the shape (a branch, a
kernel chosen by size, a mask shortcut) the check fails and the caller plans the shape as
before. :func:`pad_to_bucket` is the alternative a user may prefer: pad every batch to the next
of a few lengths, so that only that many shapes exist.

With ``dynamic=`` the new shape's capture need not be traced: the declared largest shape's step
is captured once with a symbolic length (:mod:`memplan.torch.capture.symbolic`), and a length
whose guards hold gets its capture from that program evaluated at it; the checks here run on
that capture as on a traced one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils import _pytree as pytree

import torch
from memplan.errors import MemplanError
from memplan.graph.ir import Graph
from memplan.pipeline import MemoryPlan, _check_no_overlap
from memplan.placement import Placement, PlacementProblem, validate_placement
from memplan.torch.capture import Capture
from memplan.torch.run.allocator import AllocationTrace
from memplan.torch.run.branches import branched_plan, build_trie
from memplan.torch.run.replay import ArenaPlacement, ReplayedStep


@dataclass(frozen=True)
class Template:
    """A plan made by the solvers for one capture, kept to be reused by other shapes."""

    capture: Capture
    plan: MemoryPlan
    allocator_tensors: frozenset[int]
    alignment_bytes: int
    key: tuple  # the batch shape it was planned for


def structure_mismatch(reference: Capture, capture: Capture) -> str | None:
    """Why ``capture`` does not run the same program as ``reference`` (None when it does):
    the first op, tensor, phase or call that differs."""
    a, b = reference.graph, capture.graph
    if (a.num_ops, a.num_tensors) != (b.num_ops, b.num_tensors):
        return f"{b.num_ops} ops and {b.num_tensors} tensors, the plan's graph has {a.num_ops} and {a.num_tensors}"
    for i, (x, y) in enumerate(zip(a.ops, b.ops, strict=True)):
        if (x.name, x.kind, x.inputs, x.outputs, x.mutates, x.stream) != (
            y.name,
            y.kind,
            y.inputs,
            y.outputs,
            y.mutates,
            y.stream,
        ):
            return f"op {i} is {y.name} ({y.kind}), the plan's is {x.name} ({x.kind})"
    for x, y in zip(a.tensors, b.tensors, strict=True):
        if (x.name, x.category, x.persistent) != (y.name, y.category, y.persistent):
            return f"tensor {y.name!r} differs from the plan's {x.name!r}"
    if reference.op_phase != capture.op_phase or reference.op_region != capture.op_region:
        return "the ops belong to other phases or calls"
    if [r.kind for r in reference.regions] != [r.kind for r in capture.regions]:
        return "the step makes other calls of its stateful objects"
    if reference.mode != capture.mode or reference.node_of_op != capture.node_of_op:
        return "the fx program differs"
    return None


def oversized(reference: Graph, graph: Graph) -> str | None:
    """The first tensor of ``graph`` larger than the same tensor of ``reference`` (None: all fit)."""
    for x, y in zip(reference.tensors, graph.tensors, strict=True):
        if y.size_bytes > x.size_bytes:
            return f"tensor {y.name!r} needs {y.size_bytes} bytes, its slot holds {x.size_bytes}"
    return None


def reuse_plan(template: Template, capture: Capture, allocator_tensors: Collection[int]) -> MemoryPlan | str:
    """The template's order and offsets as a plan for ``capture``, validated on its graph; or a
    one-line reason why they do not hold for it (then the caller plans ``capture`` itself)."""
    reason = structure_mismatch(template.capture, capture)
    if reason is None and frozenset(allocator_tensors) != template.allocator_tensors:
        reason = "other tensors are left to the allocator"
    if reason is None:
        reason = oversized(template.capture.graph, capture.graph)
    if reason is not None:
        return reason
    graph, plan = capture.graph, template.plan
    validate_reused(graph, plan.order, plan.offsets, plan.arena_bytes, allocator_tensors, template.alignment_bytes)
    report = dict(plan.report)
    report |= {
        "reused_from": repr(template.key),
        "num_ops": graph.num_ops,
        "persistent_bytes": graph.persistent_bytes,
        "placement": {**dict(plan.report.get("placement", {})), "method": "reused", "seconds": 0.0},
    }
    return MemoryPlan(list(plan.order), dict(plan.offsets), plan.arena_bytes, report)


def validate_reused(
    graph: Graph,
    order: Sequence[int],
    offsets: dict[int, int],
    arena_bytes: int,
    exclude: Collection[int],
    alignment_bytes: int,
) -> None:
    """Raise unless ``offsets`` are a valid placement of ``graph`` run in ``order`` within
    ``arena_bytes``: the order is valid, every planned tensor has an offset, and the placement
    validator and the estimator's sweep both accept it."""
    from memplan.graph.check import validate_order
    from memplan.placement.problem import problem_from_graph

    validate_order(graph, list(order))
    problem = problem_from_graph(graph, order, alignment=alignment_bytes, exclude=exclude)
    index = graph.tensor_index
    missing = [name for name in problem.names if index[name] not in offsets]
    if missing:
        raise MemplanError(f"the reused plan has no offset for {missing[0]!r}")
    reused = Placement(
        tuple(offsets[index[name]] for name in problem.names), arena_bytes, "reused", "feasible", 0.0, 0.0, 0
    )
    validate_placement(problem, reused)
    _check_no_overlap(graph, list(order), {index[name]: offsets[index[name]] for name in problem.names})


def largest_batch(batch: Any, dynamic: dict[int, int]) -> Any:
    """``batch`` grown to the largest declared shape: every tensor leaf with a dimension ``d`` in
    ``dynamic`` is extended to ``dynamic[d]`` along it by repeating its last slice (a mask of
    ones stays ones, token ids stay ids). Used to capture and plan, never to train on. None
    when a tensor is already larger than declared (that shape is then planned as it comes)."""
    leaves, spec = pytree.tree_flatten(batch)
    if any(
        isinstance(x, torch.Tensor) and d < x.dim() and x.shape[d] > size for x in leaves for d, size in dynamic.items()
    ):
        return None
    return pytree.tree_unflatten([_grown(x, dynamic) for x in leaves], spec)


def _grown(value: Any, dynamic: dict[int, int]) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    for dim, size in sorted(dynamic.items()):
        if dim >= value.dim():
            continue
        have = value.shape[dim]
        if have == 0:
            raise MemplanError(f"a batch tensor is empty along dimension {dim}: nothing to grow it from")
        if have < size:
            last = value.narrow(dim, have - 1, 1)
            value = torch.cat([value, last.expand(*[size - have if d == dim else -1 for d in range(value.dim())])], dim)
    return value


def check_dynamic(dynamic: Any) -> dict[int, int]:
    """``dynamic`` as ``{dimension: largest size}``, or a one-line error."""
    if not isinstance(dynamic, dict) or not dynamic:
        raise MemplanError("dynamic= takes {dimension: largest size}, e.g. {1: 512} for sequences up to 512 tokens")
    for dim, size in dynamic.items():
        if not isinstance(dim, int) or not isinstance(size, int) or dim < 0 or size < 1:
            raise MemplanError(f"dynamic={dynamic!r}: give non-negative int dimensions and positive int sizes")
    return dict(dynamic)


def bucket_length(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket at or above ``length``; a one-line error when none is."""
    fits = [b for b in buckets if b >= length]
    if not fits:
        raise MemplanError(f"length {length} is above the largest bucket {max(buckets, default=0)}; add a bucket")
    return min(fits)


def pad_to_bucket(
    tensor: torch.Tensor, buckets: Sequence[int], *, dim: int = 1, value: int | float = 0
) -> torch.Tensor:
    """``tensor`` padded with ``value`` along ``dim`` to the next of ``buckets`` (the XLA users'
    habit: a few shapes, so a few plans). Padding changes what the model sees: pad labels with
    the loss's ignore index (-100 for HF models) and attention masks with 0."""
    target = bucket_length(tensor.shape[dim], buckets)
    if target == tensor.shape[dim]:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = target - tensor.shape[dim]
    return torch.cat([tensor, tensor.new_full(shape, value)], dim)


class ShapeReplay(ReplayedStep):
    """A :class:`ReplayedStep` for one shape of a step whose other shapes were recorded and placed
    already (issue 37): the recorded step it would place is served at a kept plan's offsets when
    it makes the same allocations, in the same order, freed at the same events, none larger
    than the kept plan's (:func:`reused_offsets`, validated on this step's own lifetimes); then
    no solver runs and the arena does not grow. ``candidates()`` gives the kept replayed steps
    to try, largest first. A runner's first step makes a few allocations once (it matched no
    kept plan in GPT-2), so when it matches none the next step is recorded too before the
    solver places one. Otherwise it places as :class:`ReplayedStep` does."""

    def __init__(self, run: Any, *, candidates: Callable[[], Sequence[ReplayedStep]], **options: Any) -> None:
        super().__init__(run, **options)
        self.candidates = candidates
        self.reused_from: ReplayedStep | None = None

    def _plan(self, trace: AllocationTrace) -> None:
        candidates = [kept for kept in self.candidates() if kept is not self]
        if any(self._adopt(kept, trace) for kept in candidates):
            return
        if candidates and self.recordings < 2:
            return  # a runner's first step allocates a few things once: the next one may match a kept plan
        super()._plan(trace)

    def _adopt(self, kept: ReplayedStep, trace: AllocationTrace) -> bool:
        """Serve ``trace`` at ``kept``'s offsets (its first branch: a recorded step of its
        shape) when they are proven valid for it."""
        if kept.plan is None or not kept.traces:
            return False
        arena_bytes = kept.plan.arena_bytes
        offsets = reused_offsets(kept.traces[0], kept.plan.branches[0].offsets, trace, arena_bytes)
        if offsets is None:
            return False
        start = time.perf_counter()
        self._previous = None  # _record gave the recording's freed blocks back just before (_plan's only caller)
        self.shared.reserve(self.native.arena_block_bytes(arena_bytes))
        self.plan = branched_plan(build_trie([trace]), offsets, arena_bytes)
        self.traces = [trace]
        self._unverified = self.native.verify_first_replay
        self.placement = ArenaPlacement(  # the lower bound: the trace's own peak of live bytes
            arena_bytes, trace.peak_live_bytes(), "reused", "feasible", 0.0, trace.num_allocations, len(offsets)
        )
        self.reused_from = kept
        self.planning_seconds += time.perf_counter() - start
        if isinstance(getattr(self, "first_steps", None), dict):
            self.first_steps.setdefault("placement", "reused")
        return True


def reused_offsets(
    kept: AllocationTrace, kept_offsets: Sequence[int], trace: AllocationTrace, arena_bytes: int
) -> dict[int, int] | None:
    """``kept``'s arena offsets for ``trace``'s allocations, when ``trace`` makes the same
    allocations as ``kept`` (same events, same streams) with no size above ``kept``'s and the
    offsets pass the placement validator on ``trace``'s own lifetimes; else None."""
    if (kept.alloc_at, kept.free_at, kept.streams, kept.alignment_bytes) != (
        trace.alloc_at,
        trace.free_at,
        trace.streams,
        trace.alignment_bytes,
    ):
        return None
    if any(new > old for new, old in zip(trace.sizes, kept.sizes, strict=True)):
        return None
    offsets = {k: o for k, o in enumerate(kept_offsets) if o >= 0}
    if any(trace.free_at[k] is None for k in offsets):
        return None
    ks = sorted(offsets)
    problem = PlacementProblem.from_intervals(
        [trace.sizes[k] for k in ks],
        [(trace.alloc_at[k], trace.free_at[k]) for k in ks],
        alignment_bytes=trace.alignment_bytes,
    )
    validate_placement(problem, Placement(tuple(offsets[k] for k in ks), arena_bytes, "reused", "feasible", 0, 0, 0))
    return offsets


def first_reuse(
    templates: Sequence[Template], capture: Capture, allocator_tensors: Callable[[Capture], Collection[int]]
) -> tuple[Template, MemoryPlan] | list[str]:
    """The first of ``templates`` whose plan holds for ``capture`` (:func:`reuse_plan`) with
    that plan; else the reasons why none does, one per template."""
    reasons = []
    for template in templates:
        reused = reuse_plan(template, capture, allocator_tensors(capture))
        if isinstance(reused, MemoryPlan):
            return template, reused
        reasons.append(reused)
    return reasons
