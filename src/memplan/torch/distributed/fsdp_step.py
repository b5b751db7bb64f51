"""The FSDP2 step API: :func:`compile_fsdp_step` (see :mod:`memplan.torch.distributed.fsdp`).

Every rank captures the step of its shard model; the captures must have the same structure
(checked). Rank 0 orders the ops (solvers are not deterministic under time limits, and every
rank must run the collectives in the same order) and broadcasts the order; each rank places
its own tensors for that order (its shards may be smaller than rank 0's) and runs the plan on
its own arena with memplan's runtime (:class:`memplan.torch.run.interpreter.StepRunner`). With
``streams`` (the default), rank 0 also makes the step a two-stream plan and picks its prefetch
depth and wait policy (:func:`memplan.torch.distributed.fsdp_plan.choose_streams`), every rank
places that order safely for every interleaving of the two streams, and
:class:`memplan.torch.distributed.fsdp_runner.FsdpStreamRunner` launches each all-gather and
reduce-scatter asynchronously and waits for it where the plan says; without, each collective
calls gloo synchronously at its planned place.

``memory_budget`` (remat on top of sharding): rank 0 also solves the cheapest recomputation within
the budget with the remat portfolio (:func:`memplan.remat.portfolio.solve_remat_in_order`, its stages
in the reordered plan's order), a fraction being of the checkpoint-all peak of rank 0's step; every
rank runs that one step sequence (:class:`memplan.torch.run.remat.RematRunner`, the ordinary
allocator), so the collectives stay matched across ranks. An all-gather may be run again (a unit
gathered a second time, as FSDP2's reshard-after-forward does, where the plan decides); a
reduce-scatter never is, nor a random op (:func:`remat_graph`). Where the reordered plan already
fits, it runs as without a budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch.distributed as dist

import torch
from memplan.api import shape_key
from memplan.errors import MemplanError
from memplan.torch.capture import Capture
from memplan.torch.distributed.fsdp import (
    capture_fsdp_step,
    link_state,
    read_layout,
    refuse_foreign_collectives,
    shard_model,
    structure_fingerprint,
    twin_optimizer,
)
from memplan.torch.distributed.fsdp_plan import (
    PREFETCH_DEPTHS,
    choose_streams,
    movable_ops,
    staging_tensors,
    stream_step,
)
from memplan.torch.distributed.fsdp_plan import place as place_streams
from memplan.torch.distributed.fsdp_runner import FsdpStreamRunner
from memplan.torch.distributed.step import require_process_group
from memplan.torch.rss import release_free_memory
from memplan.torch.run.interpreter import Plan, StepRunner, allocator_tensors, optimizer_update_groups
from memplan.torch.run.remat import RematRunner


class FsdpStep:
    """A planned FSDP2 training step of one rank; call it with this rank's batch."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        time_limit_seconds: float = 10.0,
        reorder: bool = True,
        recompute_copies: bool = True,
        memory_budget: int | float | str | None = None,
        streams: bool = True,
        prefetch: int | None = None,
        record_times: bool = False,
    ) -> None:
        require_process_group()
        if prefetch is not None and not streams:
            raise MemplanError("prefetch needs the communication stream: drop prefetch= or streams=False")
        if prefetch is not None and prefetch not in PREFETCH_DEPTHS:
            raise MemplanError(
                f"prefetch must be one of {PREFETCH_DEPTHS} or None (the plan decides), not {prefetch!r}"
            )
        if memory_budget is not None:
            check_fsdp_budget(memory_budget)
        self.memory_budget = memory_budget
        if any(t.device.type != "cpu" for t in [*model.parameters(), *model.buffers()]):
            raise MemplanError("memplan's FSDP2 step runs on CPU (gloo) for now; shard the model on a 'cpu' mesh")
        self.layout = read_layout(model)
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.time_limit_seconds = time_limit_seconds
        self.reorder = reorder
        self.recompute_copies = recompute_copies
        self.streams = streams
        self.prefetch = prefetch
        self.record_times = record_times
        self.shards = shard_model(model, self.layout)
        self.twin = twin_optimizer(optimizer, self.shards, self.layout)
        self.process_group = self.layout.group
        self.rank, self.world_size = self.layout.rank, self.layout.world
        self.runners: dict[tuple, StepRunner] = {}
        self.reports: dict[tuple, dict[str, Any]] = {}

    def __call__(self, batch: Any) -> Any:
        for user, twin in zip(self.optimizer.param_groups, self.twin.param_groups, strict=True):
            twin.update({k: v for k, v in user.items() if k != "params"})  # a scheduler's lr, set on the user's
        loss = self.runner_for(batch)(batch)
        link_state(self.optimizer, self.twin, self.layout)  # the state the first step created
        return loss

    def runner_for(self, batch: Any) -> StepRunner:
        """The runner for this batch's shapes, planned on first use."""
        key = shape_key(batch)
        if key not in self.runners:
            capture = capture_fsdp_step(
                self.shards, self.twin, self.loss_fn, batch, self.layout, recompute_copies=self.recompute_copies
            )
            refuse_foreign_collectives(capture)
            plan, report = self._shared_plan(capture)
            self.reports[key] = report
            steps = report.pop("remat_steps", None)
            stream_plan = report.pop("stream_plan", None)
            if steps is not None:
                self.runners[key] = RematRunner(capture, steps, self.shards, self.twin)
            elif stream_plan is not None:
                step_graph, order = stream_plan
                self.runners[key] = FsdpStreamRunner(
                    capture,
                    step_graph,
                    order,
                    plan.offsets,
                    plan.arena_bytes,
                    self.shards,
                    self.twin,
                    record_times=self.record_times,
                )
            else:
                self.runners[key] = StepRunner(capture, plan, self.shards, [self.twin])
            release_free_memory()
        return self.runners[key]

    @property
    def report(self) -> dict[str, Any]:
        """The report of the most recent plan."""
        return list(self.reports.values())[-1] if self.reports else {}

    def _shared_plan(self, capture: Capture) -> tuple[Plan, dict[str, Any]]:
        from memplan.isolate import in_child
        from memplan.pipeline import _resident_peak, make_plan, place_order

        fingerprints: list[Any] = [None] * self.world_size
        dist.all_gather_object(fingerprints, structure_fingerprint(capture), group=self.process_group)
        differ = [r for r, f in enumerate(fingerprints) if f != fingerprints[0]]
        if differ:
            raise MemplanError(
                f"rank(s) {differ} captured another step than rank 0: every rank needs the same model, optimizer "
                "and batch shapes (as FSDP2 does)"
            )
        exclude = allocator_tensors(capture)
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                plan = in_child(
                    make_plan,
                    capture.graph,
                    time_limit_seconds=self.time_limit_seconds,
                    reorder=self.reorder,
                    atomic_groups=optimizer_update_groups(capture),
                    allocator_tensors=exclude,
                )
                report = plan.report
                if self.memory_budget is not None:
                    report = {
                        **report,
                        **solve_fsdp_budget(capture, plan.order, self.memory_budget, self.time_limit_seconds),
                    }
                stream_order = None
                if self.streams and report.get("remat_steps") is None:
                    choice = self._choose_streams(capture, plan.order, exclude, report.get("budget_bytes"))
                    report, stream_order = {**report, "streams": choice.report()}, list(choice.chosen.order)
                box[0] = (list(plan.order), report, stream_order)
            except MemplanError as err:
                box[0] = err
        dist.broadcast_object_list(box, group=self.process_group, group_src=0)
        if isinstance(box[0], MemplanError):
            raise type(box[0])(f"rank 0 could not plan the step: {box[0]}")
        order, report, stream_order = box[0]
        if stream_order is not None:
            return self._place_streams(capture, order, stream_order, report, exclude)
        offsets, placement = place_order(capture.graph, order, self.time_limit_seconds, exclude)
        report = {**report, "rank": self.rank, "arena_bytes": placement.arena_bytes}
        report["allocator_peak_bytes"] = _resident_peak(capture.graph, order, exclude)
        report["planned_peak_bytes"] = (
            capture.graph.persistent_bytes + placement.arena_bytes + report["allocator_peak_bytes"]
        )
        return Plan(tuple(order), offsets, placement.arena_bytes), report

    def _choose_streams(self, capture: Capture, order: Sequence[int], exclude: set, budget: int | None) -> Any:
        """Rank 0: the two-stream order (prefetch depth, wait policy) for ``order``, decided in a
        forked child (:func:`memplan.torch.distributed.fsdp_plan.choose_streams`)."""
        from memplan.isolate import in_child

        unit_of_param = {p.name: k for k, u in enumerate(self.layout.units) for p in u.params}
        groups = optimizer_update_groups(capture)
        args = (capture.graph, list(order), unit_of_param, groups, movable_ops(capture), exclude)
        return in_child(choose_streams, *args, self.time_limit_seconds, budget, self.prefetch)

    def _place_streams(
        self, capture: Capture, order: list[int], stream_order: list[int], report: dict[str, Any], exclude: set
    ) -> tuple[Plan, dict[str, Any]]:
        """Every rank: its own offsets for rank 0's two-stream order, safe in every execution."""
        from memplan.pipeline import _resident_peak

        step_graph = stream_step(capture.graph)
        offsets, arena_bytes, checked = place_streams(step_graph, stream_order, exclude, self.time_limit_seconds)
        report = {**report, "rank": self.rank, "arena_bytes": arena_bytes, "stream_placement": checked}
        outside = frozenset(exclude) | staging_tensors(step_graph)
        report["allocator_peak_bytes"] = _resident_peak(step_graph, stream_order, outside)
        report["planned_peak_bytes"] = step_graph.persistent_bytes + arena_bytes + report["allocator_peak_bytes"]
        report["stream_plan"] = (step_graph, tuple(stream_order))
        return Plan(tuple(order), offsets, arena_bytes), report


def check_fsdp_budget(memory_budget: int | float | str) -> None:
    """Refuse, in one line, a budget the FSDP2 step does not take: a malformed one, or ``"fit"``."""
    from memplan.torch.run.budget import parse_memory_budget
    from memplan.torch.run.fit import is_fit

    if is_fit(memory_budget):
        raise MemplanError(
            "memory_budget='fit' is not planned for an FSDP2 step yet (every rank would need the same limit): "
            "give bytes or a fraction"
        )
    parse_memory_budget(memory_budget, 1)


REDUCE_SCATTER_KIND_SUFFIX = " (a reduce-scatter: never run twice, as a random op)"
"""Appended to the kind of a reduce-scatter in :func:`remat_graph`: its "random" makes
:func:`memplan.remat.problem.is_random` keep the remat core from recomputing it."""


def remat_graph(capture: Capture) -> Any:
    """The graph the budget is solved on: :func:`memplan.torch.run.budget.held_graph` (seeded ops
    are random: never recomputed) with every reduce-scatter marked the same way. All-gathers stay
    recomputable: gathering a unit again is what FSDP2's reshard-after-forward does."""
    from memplan.graph.ir import Graph
    from memplan.torch.run.budget import held_graph

    graph = held_graph(capture)
    ops = tuple(
        replace(op, kind=op.kind + REDUCE_SCATTER_KIND_SUFFIX) if "reduce_scatter" in op.kind else op
        for op in graph.ops
    )
    return Graph(ops, graph.tensors, graph.name, dict(graph.meta))


def staging_workspace(graph: Any) -> tuple[int, ...]:
    """Per op of the budget's graph, the bytes gloo holds beyond its inputs and outputs while it
    runs: a synchronous collective's staging buffer (its output's size for an all-gather, its
    input's for a reduce-scatter, as :func:`memplan.torch.distributed.fsdp_plan.stream_step` counts
    it on the communication stream); 0 for every other op. The remat solve counts it as the op's
    workspace: without it the root unit's reduce-scatter (its input, gloo's copy of it and its
    output) ran above the plan (``python bench/fsdp.py --models llama-b8 --budget 0.8`` on 2 ranks:
    534 MiB planned, 819 MiB measured; that budget is now refused, its floor proven at 579 MiB)."""
    from memplan.torch.distributed.fsdp_plan import fsdp_kind, staging_bytes

    return tuple(staging_bytes(graph, op) if fsdp_kind(op) else 0 for op in graph.ops)


def solve_fsdp_budget(
    capture: Capture, order: Sequence[int], memory_budget: int | float | str, time_limit_seconds: float
) -> dict[str, Any]:
    """The budget's part of rank 0's report: ``remat_steps`` (the step sequence every rank runs,
    ``None`` when the reordered plan fits) and what was decided. A fraction is of the
    checkpoint-all peak (every activation kept, in program order). Raises
    :class:`memplan.errors.InfeasibleBudget` in one line when no plan fits."""
    from memplan.errors import InfeasibleBudget
    from memplan.isolate import in_child
    from memplan.remat.baselines import checkpoint_all
    from memplan.remat.lower import sequence_peak_bytes, steps_for_order
    from memplan.remat.problem import RematProblem
    from memplan.torch.run.budget import _infeasible_message, _solve_remat_in_order, parse_memory_budget

    graph = remat_graph(capture)
    workspace = staging_workspace(graph)
    reference = checkpoint_all(RematProblem(graph, 10**18, workspace=workspace)).peak_bytes
    budget_bytes = parse_memory_budget(memory_budget, reference)
    reordered = sequence_peak_bytes(graph, steps_for_order(graph, list(order)), workspace)
    report: dict[str, Any] = {
        "memory_budget": memory_budget,
        "budget_bytes": budget_bytes,
        "checkpoint_all_peak_bytes": reference,
        "reordered_peak_bytes": reordered,
    }
    if reordered <= budget_bytes:
        return {**report, "method": "reorder", "remat_steps": None, "recomputed_ops": 0, "overhead": 0.0}
    # imported in the solver's child: OR-Tools stays out of the rank's process, as in the budget path
    schedule = in_child(
        _solve_remat_in_order, graph, tuple(order), budget_bytes, time_limit_seconds, reorder=False, workspace=workspace
    )
    if not schedule.feasible:
        message = _infeasible_message(
            graph,
            budget_bytes,
            reference,
            schedule,
            workspace,
            reordered_bytes=reordered,
            time_limit_seconds=time_limit_seconds,
        )
        raise InfeasibleBudget(message)
    runs = [i for kind, i in schedule.steps if kind == "run"]
    return {
        **report,
        "method": "remat",
        "remat_steps": [tuple(s) for s in schedule.steps],
        "recomputed_ops": len(runs) - len(set(runs)),
        "regathered": sum(1 for i in runs if "all_gather" in graph.ops[i].kind)
        - sum(1 for i in set(runs) if "all_gather" in graph.ops[i].kind),
        "overhead": round(schedule.overhead, 6),
        "remat_peak_bytes": schedule.peak_bytes,
        "status": schedule.status,
        "from": schedule.details.get("from"),
    }


def compile_fsdp_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    example_batch: Any,
    *,
    time_limit_seconds: float = 10.0,
    reorder: bool = True,
    recompute_copies: bool = True,
    memory_budget: int | float | str | None = None,
    streams: bool = True,
    prefetch: int | None = None,
    record_times: bool = False,
) -> FsdpStep:
    """Plan one rank's FSDP2 training step ``loss = loss_fn(model(inputs), target);
    loss.backward(); optimizer.step(); optimizer.zero_grad()`` and return it as a callable
    ``step(batch)``; every rank of the model's mesh must call this together. ``memory_budget``
    (bytes, ``"2GiB"``, or a fraction of the checkpoint-all peak): recompute activations (and
    gather units again) where the reordered plan does not fit (module docstring). ``streams``:
    the collectives asynchronous on a communication stream, their waits and the prefetch depth
    planned (:mod:`memplan.torch.distributed.fsdp_plan`; False: each runs synchronously at its
    place); ``prefetch``: a fixed depth (0, 1, 2) instead of the plan's choice; ``record_times``:
    keep each collective's launch, done and wait times of the latest step."""
    step = FsdpStep(
        model,
        optimizer,
        loss_fn,
        time_limit_seconds=time_limit_seconds,
        reorder=reorder,
        recompute_copies=recompute_copies,
        memory_budget=memory_budget,
        streams=streams,
        prefetch=prefetch,
        record_times=record_times,
    )
    step.runner_for(example_batch)
    return step
