"""``torch.compile(model, backend=memplan_backend(budget=0.7))``: memplan's remat decision
inside ``torch.compile``.

The seam: AOTAutograd's partitioner. ``torch.compile`` traces forward and backward into one
joint graph, and the ``partition_fn`` of ``aot_autograd`` splits it into a forward and a
backward graph. That split *is* the rematerialisation decision: a forward value is either
saved for the backward (an output of the forward graph) or computed again inside the
backward graph. So memplan plans there: the joint graph becomes a memplan graph
(:func:`joint_capture`: the capture's fx-to-graph builder, storages and views included, with
tangents made where the backward starts and forward outputs dying at their last read, as
they do when the two graphs run), memplan solves the remat problem on it within the budget
(:func:`memplan.remat.rematerialize`; a fraction of the joint graph's checkpoint-all peak, or
bytes), every forward node the plan runs more than once is tagged
``CheckpointPolicy.MUST_RECOMPUTE`` (the tag SAC puts on nodes under ``torch.compile``), and
PyTorch's own ``default_partition`` makes the split, honouring the tags: inputs of
recomputed nodes that are not recomputed themselves are saved, recomputed nodes move into
the backward graph, which is reordered the way the autograd engine would run it. When no
plan fits the budget, nothing is tagged and PyTorch's min-cut partitioner splits (as in
``aot_eager``); the report says so.

Why not a backend that plans the joint graph's memory, or a partitioner of our own: placing
tensors needs the runtime's allocator (memplan's planned allocator does that for eager
steps), and a partitioner of our own would redo what ``default_partition`` already does
right (symbolic sizes, RNG state, mutations, collectives). Tagging keeps memplan to the one
decision it adds.

Forward and backward graphs run as traced (``boxed_nop``, as ``aot_eager`` does): the same
ATen kernels on the same values, so training is bit-identical to
``torch.compile(backend="aot_eager")`` by construction (a recompute gives the same bits, and
random ops are never recomputed); the tests check it, and check it against eager too, which
held on every model tried. ``backend.last_report`` says what was decided.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch.fx

import torch
from memplan.errors import MemplanError
from memplan.graph.check import validate_graph
from memplan.graph.ir import Category, Graph


@dataclass
class PartitionReport:
    """What the memplan partitioner decided for one compiled graph."""

    num_ops: int = 0
    forward_ops: int = 0
    budget_bytes: int = 0
    checkpoint_all_peak_bytes: int = 0
    planned_peak_bytes: int = 0
    strategy: str = ""
    feasible: bool = True
    recomputed_nodes: list[str] = field(default_factory=list)
    overhead: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {k: (len(v) if isinstance(v, list) else v) for k, v in self.__dict__.items()}


class MemplanBackend:
    """A ``torch.compile`` backend; ``reports`` holds one :class:`PartitionReport` per graph."""

    def __init__(self, budget: float = 0.8, strategy: str = "best", time_limit_seconds: float = 30.0) -> None:
        if budget <= 0:
            raise MemplanError(f"the budget must be positive, not {budget}")
        self.budget = budget
        self.strategy = strategy
        self.time_limit_seconds = time_limit_seconds
        self.reports: list[PartitionReport] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Callable:
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop

        partition = functools.partial(memplan_partition, backend=self)
        compiler = aot_autograd(
            fw_compiler=boxed_nop,
            bw_compiler=boxed_nop,
            partition_fn=partition,
            keep_inference_input_mutations=True,
        )
        return compiler(gm, example_inputs, **kwargs)

    @property
    def last_report(self) -> PartitionReport | None:
        return self.reports[-1] if self.reports else None


def memplan_backend(budget: float = 0.8, strategy: str = "best", time_limit_seconds: float = 30.0) -> MemplanBackend:
    """The backend: ``torch.compile(model, backend=memplan_backend(budget=0.7))``. ``budget``:
    bytes, or a fraction (<= 1) of each joint graph's checkpoint-all peak; ``strategy``: a
    :data:`memplan.remat.STRATEGIES` name, or "best" (the cheapest feasible of all)."""
    return MemplanBackend(budget, strategy, time_limit_seconds)


def memplan_partition(
    joint_module: torch.fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, backend: MemplanBackend, **kwargs
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """Tag the forward nodes memplan recomputes, then split with PyTorch's ``default_partition``.
    When no plan fits the budget nothing is tagged and PyTorch's min-cut partitioner (what
    ``aot_eager`` uses) splits instead, so the backend is never worse than ``aot_eager``."""
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    report = tag_recomputed_nodes(joint_module, backend.budget, backend.strategy, backend.time_limit_seconds)
    backend.reports.append(report)
    partition = default_partition if report.feasible else min_cut_rematerialization_partition
    return partition(joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)


def tag_recomputed_nodes(
    joint_module: torch.fx.GraphModule, budget: float, strategy: str, time_limit_seconds: float
) -> PartitionReport:
    """Plan the joint graph's remat within ``budget`` and tag the forward nodes the plan runs
    again with ``MUST_RECOMPUTE``. An infeasible budget tags nothing (the report says so)."""
    from torch.utils.checkpoint import CheckpointPolicy

    from memplan.torch.run.remat import plan_remat

    forward = forward_nodes(joint_module)
    capture = joint_capture(joint_module, forward)
    report = PartitionReport(num_ops=capture.graph.num_ops, forward_ops=len(forward))
    try:
        schedule, budget_bytes, top = plan_remat(capture, budget, strategy, time_limit_seconds)
    except MemplanError:
        report.feasible = False
        return report
    runs = collections.Counter(i for kind, i in schedule.steps if kind == "run")
    nodes = {n.name: n for n in joint_module.graph.nodes}
    for op_id, count in runs.items():
        name = capture.node_of_op[op_id]
        if count > 1 and name in forward:
            nodes[name].meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            report.recomputed_nodes.append(name)
    report.budget_bytes, report.checkpoint_all_peak_bytes = budget_bytes, top
    report.planned_peak_bytes, report.strategy = schedule.peak_bytes, schedule.strategy
    report.overhead = round(schedule.overhead, 4)
    return report


@dataclass(frozen=True)
class JointCapture:
    """The joint graph as memplan plans it, and the fx node of each of its ops."""

    graph: Graph
    node_of_op: list[str]


def joint_capture(joint_module: torch.fx.GraphModule, forward: set[str] | None = None) -> JointCapture:
    """The joint graph as the step it stands for: the capture's fx-to-graph builder (storages,
    views) on it, then two corrections, since forward and backward graphs run at different
    times with the user's code in between: a tangent (the gradient the backward receives) is
    made where the backward starts, not held from the start; and a forward output (the
    logits the user's loss reads) dies at its last read in the joint graph, not at its end.
    Primals (parameters, inputs) are persistent; gradients are kept to the end."""
    from memplan.torch.capture.trace import _to_capture

    forward = forward_nodes(joint_module) if forward is None else forward
    capture = _to_capture(joint_module, {}, set(), "infer", 0.0, "joint")
    graph = capture.graph
    tangents = {
        v for v, name in enumerate(capture.node_of_op) if graph.ops[v].kind == "placeholder" and _is_tangent(name)
    }
    tensors = list(graph.tensors)
    for t, tensor in enumerate(tensors):
        producer = graph.producer[t]
        if producer in tangents:
            tensors[t] = replace(tensor, category=Category.ACTIVATION, persistent=False)
        elif tensor.category is Category.OUTPUT and capture.node_of_op[producer] in forward:
            tensors[t] = replace(tensor, category=Category.ACTIVATION)
    order = _tangents_before_their_readers(graph, tangents)
    ops = tuple(graph.ops[v] for v in order)
    rebuilt = Graph(ops, tuple(tensors), graph.name, dict(graph.meta))
    validate_graph(rebuilt)
    return JointCapture(rebuilt, [capture.node_of_op[v] for v in order])


def _is_tangent(node_name: str) -> bool:
    return node_name.startswith("tangents")


def _tangents_before_their_readers(graph: Graph, tangents: set[int]) -> list[int]:
    """Program order with each tangent placeholder moved to just before its first reader."""
    first_reader: dict[int, int] = {}
    for v in tangents:
        readers = [c for t in graph.ops[v].outputs for c in graph.consumers[t]]
        first_reader[v] = min(readers, default=graph.num_ops)
    order: list[int] = []
    for v in range(graph.num_ops):
        if v in tangents:
            continue
        order.extend(sorted(t for t in tangents if first_reader[t] == v))
        order.append(v)
    order.extend(sorted(t for t in tangents if first_reader[t] >= graph.num_ops))
    return order


def forward_nodes(joint_module: torch.fx.GraphModule) -> set[str]:
    """Names of the joint graph's call_function nodes that do not depend on a tangent."""
    backward: set[str] = set()
    forward: set[str] = set()
    for node in joint_module.graph.nodes:
        if node.op == "placeholder" and _is_tangent(node.name):
            backward.add(node.name)
        elif node.op == "call_function":
            if any(a.name in backward for a in node.all_input_nodes):
                backward.add(node.name)
            else:
                forward.add(node.name)
    return forward


__all__ = ["JointCapture", "MemplanBackend", "PartitionReport", "joint_capture", "memplan_backend", "memplan_partition"]
