"""The operator-reordering problem (OLLA 2.2, 3.2, 4.4 eq. 14) and its answer.

An *order* is a topological permutation of ``graph.ops``; its cost is the peak resident set
computed by :func:`memplan.graph.liveness.peak_bytes`, the one estimator of memplan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from memplan.errors import InvalidOrder, MemplanError
from memplan.graph.check import validate_order
from memplan.graph.ir import Graph, OpId
from memplan.graph.liveness import peak_bytes

Method = Literal["auto", "ilp", "heuristic"]
Status = Literal["optimal", "feasible", "heuristic"]
METHODS: tuple[str, ...] = ("auto", "ilp", "heuristic")


@dataclass(frozen=True)
class ScheduleProblem:
    """A graph to reorder and the options of the search.

    ``early_updates``: "auto" adds OLLA 4.3 control edges only when the exact model would be
    too large; "always" / "never" force the choice. ``max_model_literals`` caps the number of
    time-indexed booleans of one CP-SAT model; larger segments are solved in windows around
    the incumbent order (then the status is at best "feasible"). ``ideal_search`` runs the exact
    search over ideals (:mod:`memplan.schedule.ideals`) before the CP-SAT model.
    ``relative_gap_limit`` stops the search as soon as ``peak - bound <= limit * peak`` for
    the best order and the best proven lower bound (MIP solvers' relative gap: Gurobi's
    MIPGap, CP-SAT's relative_gap_limit); the result is then "feasible" with its gap, unless
    the bound was met. 0 proves to the end (or to the time limit).
    """

    graph: Graph
    time_limit_seconds: float = 30.0
    method: Method = "auto"
    workers: int = 2
    progress: bool = False
    early_updates: Literal["auto", "always", "never"] = "auto"
    max_model_literals: int = 150_000
    ideal_search: bool = True
    relative_gap_limit: float = 0.0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise MemplanError(f"unknown schedule method {self.method!r}; use one of {', '.join(METHODS)}")
        if self.time_limit_seconds <= 0:
            raise MemplanError(f"time limit must be positive, not {self.time_limit_seconds}")
        if self.workers < 1:
            raise MemplanError(f"CP-SAT needs at least one worker, not {self.workers}")
        if self.early_updates not in ("auto", "always", "never"):
            raise MemplanError(f"early_updates must be auto, always or never, not {self.early_updates!r}")
        if not 0 <= self.relative_gap_limit < 1:
            raise MemplanError(f"the relative gap limit must be in [0, 1), not {self.relative_gap_limit}")


@dataclass(frozen=True)
class ScheduleResult:
    """An order of the ops and its peak (the estimator's).

    ``status``: "optimal" (proven minimum over every topological order of the graph),
    "feasible" (a solver ran; ``gap`` = (peak - lower bound) / peak), or "heuristic" (no
    solver ran). ``lower_bound_bytes`` is a valid bound for every order of the input graph.
    """

    order: tuple[OpId, ...]
    peak_bytes: int
    method: str
    status: Status
    seconds: float
    gap: float | None
    lower_bound_bytes: int

    def to_dict(self) -> dict[str, object]:
        return {
            "method": self.method,
            "status": self.status,
            "seconds": round(self.seconds, 3),
            "gap": None if self.gap is None else round(self.gap, 6),
            "peak_bytes": self.peak_bytes,
            "lower_bound_bytes": self.lower_bound_bytes,
        }


def relative_gap(peak_bytes_value: int, lower_bound_bytes: int) -> float:
    """``(peak - bound) / peak``, clipped at 0; 0 for an empty step."""
    if peak_bytes_value <= 0:
        return 0.0
    return max(0.0, (peak_bytes_value - lower_bound_bytes) / peak_bytes_value)


def gap_met(peak_bytes_value: int, lower_bound_bytes: int, limit: float) -> bool:
    """The relative-gap stop: ``peak - bound <= limit * peak`` (``limit`` 0: the bound is met)."""
    return peak_bytes_value - lower_bound_bytes <= limit * peak_bytes_value


def validate_schedule(graph: Graph, result: ScheduleResult) -> None:
    """Raise :class:`InvalidOrder` unless ``result.order`` is a topological order of ``graph``
    whose estimator peak equals ``result.peak_bytes`` and respects the claimed lower bound."""
    order: Sequence[int] = result.order
    validate_order(graph, order)
    actual_bytes = peak_bytes(graph, order)
    if actual_bytes != result.peak_bytes:
        raise InvalidOrder(f"schedule claims a peak of {result.peak_bytes} bytes, the estimator says {actual_bytes}")
    if result.lower_bound_bytes > actual_bytes:
        raise InvalidOrder(f"schedule claims a lower bound {result.lower_bound_bytes} above its peak {actual_bytes}")
    if result.status == "optimal" and result.gap not in (0, 0.0):
        raise InvalidOrder(f"schedule is marked optimal with a gap of {result.gap}")
