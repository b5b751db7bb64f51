"""The rematerialisation problem (Checkmate section 4.1) and its solution, kept apart.

A :class:`RematProblem` is a graph in a fixed topological order (program order), a cost
``C_i`` per op (Checkmate 4.9: ``Op.flops`` by default) and a memory budget in bytes. A
:class:`RematSchedule` is one answer: a lowered step sequence (see :mod:`memplan.remat.lower`)
with its peak measured by :func:`memplan.remat.lower.sequence_peak_bytes`.

Which ops may run more than once (:func:`rerun_limits`): only pure ops. Not placeholders,
not ops that mutate an input, not ``memplan.release``, not random ops (no RNG replay is
attempted, so a second run would draw new numbers), not ops whose output some op mutates
(a recomputed value would be the pre-mutation one). An op that *reads* a tensor mutated
later in the step (a convolution reading a weight that the optimizer updates) may be
re-run, but only before that mutation runs: its window ends there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from memplan.graph.ir import Graph

Step = tuple[str, int]
"""``("run", op_id)`` runs an op (first run or recompute) and allocates its outputs;
``("free", tensor_id)`` releases the current instance of a tensor."""

RANDOM_KIND_MARKERS = ("bernoulli", "dropout", "rand", "normal_", "uniform_")


def is_random(kind: str) -> bool:
    return any(marker in kind for marker in RANDOM_KIND_MARKERS)


_LIMITS_CACHE: dict[int, tuple[Graph, list[int]]] = {}


def rerun_limits(graph: Graph) -> list[int]:
    """Cached :func:`compute_rerun_limits` (by graph identity)."""
    hit = _LIMITS_CACHE.get(id(graph))
    if hit is not None and hit[0] is graph:
        return hit[1]
    if len(_LIMITS_CACHE) > 16:
        _LIMITS_CACHE.clear()
    limits = compute_rerun_limits(graph)
    _LIMITS_CACHE[id(graph)] = (graph, limits)
    return limits


def compute_rerun_limits(graph: Graph) -> list[int]:
    """``limit[v]``: a re-run of op ``v`` must come before op ``limit[v]`` first runs.

    ``limit[v] == v`` marks an op that must run exactly once; ``len(graph.ops)`` means no
    limit. For a pure op reading a tensor that some later op ``m`` mutates, ``limit = m``.
    """
    n = len(graph.ops)
    mutated_by: dict[int, list[int]] = {}
    for op_id, op in enumerate(graph.ops):
        for t in op.mutates:
            mutated_by.setdefault(t, []).append(op_id)
    limits = []
    for v, op in enumerate(graph.ops):
        fixed = (
            op.kind == "placeholder"
            or op.kind == "memplan.release"
            or bool(op.mutates)
            or is_random(op.kind)
            or any(t in mutated_by for t in op.outputs)
        )
        if fixed:
            limits.append(v)
            continue
        later = [m for t in op.inputs for m in mutated_by.get(t, ()) if m > v]
        limits.append(min(later, default=n))
    return limits


def default_costs(graph: Graph) -> tuple[float, ...]:
    """Checkmate 4.9's additive cost model with ``Op.flops`` as ``C_i``."""
    return tuple(float(op.flops) for op in graph.ops)


@dataclass(frozen=True)
class RematProblem:
    """Run ``graph`` within ``budget_bytes`` at the least total cost ``sum C_i`` (Checkmate 4.5)."""

    graph: Graph
    budget_bytes: int
    cost: tuple[float, ...] = ()
    time_limit_seconds: float = 60.0
    workers: int = 2
    max_solver_nodes: int = 200

    def __post_init__(self) -> None:
        if not self.cost:
            object.__setattr__(self, "cost", default_costs(self.graph))
        if len(self.cost) != len(self.graph.ops):
            raise ValueError(f"cost has {len(self.cost)} entries, the graph has {len(self.graph.ops)} ops")

    @property
    def plain_cost(self) -> float:
        """Cost of one plain step: every op once."""
        return float(sum(self.cost))

    def with_budget(self, budget_bytes: int) -> RematProblem:
        return RematProblem(
            self.graph, int(budget_bytes), self.cost, self.time_limit_seconds, self.workers, self.max_solver_nodes
        )


@dataclass
class RematSchedule:
    """One strategy's answer. ``overhead = (compute_cost - plain cost) / plain cost``.

    ``status``: "optimal" | "feasible" (a solver's own answer), "heuristic" (a baseline),
    "fallback" (the MILP found nothing better than the best baseline, whose plan this is),
    "over-budget" (a plan exists but exceeds the budget), "not-applicable", "infeasible".
    """

    strategy: str
    budget_bytes: int
    steps: list[Step]
    peak_bytes: int
    compute_cost: float
    plain_cost: float
    status: str
    seconds: float = 0.0
    gap: float | None = None
    message: str = ""
    details: dict[str, object] = field(default_factory=dict)

    @property
    def feasible(self) -> bool:
        return bool(self.steps) and self.peak_bytes <= self.budget_bytes and self.status not in _NOT_A_PLAN

    @property
    def overhead(self) -> float:
        if self.plain_cost <= 0:
            return 0.0
        return (self.compute_cost - self.plain_cost) / self.plain_cost

    def summary(self) -> dict[str, object]:
        """The per-strategy JSON of ``memplan remat``."""
        return {
            "feasible": self.feasible,
            "peak_bytes": self.peak_bytes if self.steps else None,
            "overhead": round(self.overhead, 6) if self.feasible else None,
            "seconds": round(self.seconds, 3),
            "status": self.status,
            "gap": self.gap,
            "message": self.message,
        }


_NOT_A_PLAN = frozenset({"over-budget", "not-applicable", "infeasible"})


def run_cost(cost: Sequence[float], steps: Sequence[Step]) -> float:
    """Total cost of the runs in ``steps`` (Checkmate objective, 4.3)."""
    return float(sum(cost[i] for kind, i in steps if kind == "run"))
