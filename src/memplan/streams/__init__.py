"""Multi-stream safety and offset assignment (SOMAS, Lamprou et al. 2023), data-parallel steps.

A multi-stream step is a memplan graph whose ops carry a ``stream`` and whose cross-stream
synchronisation is explicit (:mod:`memplan.graph.multistream`). Typical use::

    graph = data_parallel_step(captured, bucket_cap_bytes=25 << 20)   # DDP buckets, stream 1
    validate_streams(graph)                                             # waits, groups, cycles
    plan = plan_stream_placement(graph, order)                          # safe offsets
    check = validate_stream_placement(graph, plan.offsets, order)       # executions, not trust

Nothing here imports a framework.
"""

from memplan.streams.ddp import (
    Bucket,
    GradientMismatch,
    add_gradient_buckets,
    assign_buckets,
    data_parallel_step,
    ddp_buckets,
    gradient_parameters,
)
from memplan.streams.interleave import (
    StreamCheck,
    UnsafeStreamPlacement,
    executions,
    validate_stream_placement,
)
from memplan.streams.offsets import (
    IntervalClaim,
    MatrixConflicts,
    StreamPlan,
    StreamProblem,
    covered_by_recorded_order,
    interval_claim,
    plan_stream_placement,
    stream_problem,
)
from memplan.streams.safety import (
    SafePairs,
    graph_based_safe_pairs,
    placed_tensors,
    safe_pairs,
    stream_based_safe_pairs,
)
from memplan.streams.sync import (
    ALL_REDUCE_KIND,
    WAIT_KIND,
    collectives,
    is_collective,
    is_wait,
    validate_contiguous_groups,
    validate_streams,
    waits_of,
)

__all__ = [
    "ALL_REDUCE_KIND",
    "WAIT_KIND",
    "Bucket",
    "GradientMismatch",
    "IntervalClaim",
    "MatrixConflicts",
    "SafePairs",
    "StreamCheck",
    "StreamPlan",
    "StreamProblem",
    "UnsafeStreamPlacement",
    "add_gradient_buckets",
    "assign_buckets",
    "collectives",
    "covered_by_recorded_order",
    "data_parallel_step",
    "ddp_buckets",
    "executions",
    "gradient_parameters",
    "graph_based_safe_pairs",
    "interval_claim",
    "is_collective",
    "is_wait",
    "placed_tensors",
    "plan_stream_placement",
    "safe_pairs",
    "stream_based_safe_pairs",
    "stream_problem",
    "validate_contiguous_groups",
    "validate_stream_placement",
    "validate_streams",
    "waits_of",
]
