"""A memory budget for the main path: ``memplan.compile(..., memory_budget=..., max_overhead=...)``.

The user states what the step may use, in the words of PyTorch's own knobs
(``torch._functorch.config.activation_memory_budget``: a fraction, 1.0 = keep every
activation; ``torch.utils.checkpoint``: recompute in the backward what the forward dropped):

* ``memory_budget``: the step's whole peak (parameters, gradients, optimizer state, batch and
  activations) as bytes (``int``, or a string such as ``"2GiB"``, ``"512MB"``), or as a fraction
  of the checkpoint-all peak, the peak of the step that keeps every activation (``float`` in
  (0, 1], or ``"50%"``);
* ``max_overhead``: the compute it may add, as a fraction of the step's compute (0.1: "at most
  10% slower"): the lowest peak within that allowance, or, with a ``memory_budget`` too, a
  check that the cheapest plan within the budget stays within it.

:func:`plan_budget` decides: when the reordered and placed plan (OLLA) already fits, nothing
is recomputed; otherwise the remat portfolio (:func:`memplan.remat.solve_remat`: the baselines,
Moccasin's CP model, Checkmate's MILP) plans the cheapest recomputation within the budget,
counting each op's kernel workspace measured on a copy of the model
(:mod:`memplan.torch.run.profile`), and :class:`memplan.torch.run.remat.RematRunner` runs it.
A recompute runs the same kernel on the same inputs, and random ops are never recomputed
(:data:`memplan.remat.problem.RANDOM_KIND_MARKERS`), so numerics equal eager's bit for bit.
A budget below every plan raises :class:`memplan.errors.InfeasibleBudget` in one line, with
the smallest peak there is; a step the remat runner cannot run is refused in one line.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from memplan.errors import InfeasibleBudget, MemplanError
from memplan.report.format import format_bytes
from memplan.torch.capture import Capture
from memplan.torch.run.profile import _measure_workspace, _ProfilingRunner

UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BUDGET = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(%|[kmgt]i?b|b)?\s*$", re.IGNORECASE)


class RematUnsupported(MemplanError):
    """The step uses something the rematerialising runner cannot run."""


def parse_memory_budget(value: int | float | str, reference_bytes: int) -> int:
    """Budget bytes for ``value``: an ``int`` is bytes; a ``float`` in (0, 1] a fraction of
    ``reference_bytes`` (an integral float above 1, such as ``2e9``, bytes); a string
    ``"2GiB"``, ``"512 MB"``, ``"1e9"`` bytes, ``"50%"`` or ``"0.5"`` a fraction."""
    if isinstance(value, bool):
        raise MemplanError(f"memory_budget={value!r} is not a size: give bytes, a fraction such as 0.5, or '2GiB'")
    if isinstance(value, str):
        match = _BUDGET.match(value)
        if match is None:
            raise MemplanError(f"memory_budget {value!r} is not a size: write e.g. 2GiB, 512MB, 50% or 0.5")
        number, unit = float(match.group(1)), (match.group(2) or "").lower()
        if unit == "%":
            return _fraction(number / 100, value, reference_bytes)
        if unit == "" and number <= 1:
            return _fraction(number, value, reference_bytes)
        return _positive(int(number * UNITS[unit]), value)
    if isinstance(value, int):
        return _positive(value, value)
    if isinstance(value, float):
        if value <= 1:
            return _fraction(value, value, reference_bytes)
        if value.is_integer():
            return _positive(int(value), value)
        raise MemplanError(f"memory_budget={value} is neither bytes (an integer) nor a fraction in (0, 1]")
    raise MemplanError(
        f"memory_budget must be bytes, a fraction or a string such as '2GiB', not {type(value).__name__}"
    )


def _fraction(fraction: float, given: Any, reference_bytes: int) -> int:
    if not 0 < fraction <= 1:
        raise MemplanError(f"memory_budget {given!r} is not a fraction in (0, 1] of the checkpoint-all peak")
    return int(fraction * reference_bytes)


def _positive(budget_bytes: int, given: Any) -> int:
    if budget_bytes <= 0:
        raise MemplanError(f"memory_budget {given!r} must be a positive number of bytes")
    return budget_bytes


def check_max_overhead(max_overhead: float | None) -> None:
    if max_overhead is not None and not (isinstance(max_overhead, (int, float)) and max_overhead >= 0):
        raise MemplanError(f"max_overhead={max_overhead!r} must be a fraction >= 0 of the step's compute (0.1: 10%)")


def check_remat_supported(capture: Capture, optimizers: list[Any], scaler: Any) -> None:
    """Refuse, in one line, what :class:`RematRunner` does not run: it makes one optimizer's
    calls at their planned places, and no scaler's."""
    if capture.mode != "train":
        raise RematUnsupported("memory_budget plans a training step; an inference step keeps no activations to drop")
    if scaler is not None or capture.scaler is not None:
        raise RematUnsupported(
            "memory_budget with a GradScaler is not supported yet: drop memory_budget (reorder and placement still "
            "apply) or train without the scaler"
        )
    if len(optimizers) != 1:
        raise RematUnsupported(
            f"memory_budget supports a step with one optimizer, this one has {len(optimizers)}: drop memory_budget "
            "or use one optimizer with several param groups"
        )


@dataclass
class BudgetPlan:
    """What :func:`plan_budget` decided: ``schedule`` is the remat plan to run (``None``: the
    reordered and placed plan fits, nothing is recomputed) and ``report`` says why."""

    schedule: Any
    report: dict[str, Any] = field(default_factory=dict)


def plan_budget(
    capture: Capture,
    plain_peak_bytes: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    *,
    memory_budget: int | float | str | None,
    max_overhead: float | None,
    time_limit_seconds: float,
    joint_reorder: bool = False,
    measure_workspace: bool = True,
) -> BudgetPlan:
    """The plan for a budget (see the module docstring). ``plain_peak_bytes``: the planned peak
    of the reordered, placed step without recomputation. ``joint_reorder``: let the remat
    solver also move first runs later (only for steps without random ops: their draws keep
    program order)."""
    from memplan.remat import solve_remat, solve_remat_within_overhead
    from memplan.remat.baselines import checkpoint_all
    from memplan.remat.problem import RematProblem, is_random

    check_max_overhead(max_overhead)
    graph = capture.graph
    workspace = measure_op_workspace(capture, model, optimizer, batch) if measure_workspace else ()
    reference = checkpoint_all(RematProblem(graph, 10**18, workspace=workspace)).peak_bytes
    budget_bytes = parse_memory_budget(memory_budget, reference) if memory_budget is not None else None
    scratch = max(workspace, default=0)
    report: dict[str, Any] = {
        "memory_budget": memory_budget,
        "budget_bytes": budget_bytes,
        "max_overhead": max_overhead,
        "checkpoint_all_peak_bytes": reference,
        "plain_planned_peak_bytes": plain_peak_bytes + scratch,
        "workspace_bytes_max": scratch,
    }
    if budget_bytes is not None and plain_peak_bytes + scratch <= budget_bytes:
        return BudgetPlan(
            None,
            {
                **report,
                "method": "reorder",
                "planned_peak_bytes": plain_peak_bytes + scratch,
                "overhead": 0.0,
                "status": "optimal",
                "recomputed_ops": 0,
            },
        )
    reorder = joint_reorder and not any(is_random(op.kind) for op in graph.ops)
    if budget_bytes is None:
        schedule = solve_remat_within_overhead(graph, float(max_overhead), time_limit_seconds, workspace=workspace)  # type: ignore[arg-type]
    else:
        schedule = solve_remat(graph, budget_bytes, time_limit_seconds, workspace=workspace, reorder=reorder)
        if not schedule.feasible:
            raise InfeasibleBudget(_infeasible_message(graph, budget_bytes, reference, schedule, workspace))
        if max_overhead is not None and schedule.overhead > max_overhead + 1e-12:
            raise InfeasibleBudget(
                f"the cheapest plan within memory_budget {format_bytes(budget_bytes)} recomputes "
                f"+{100 * schedule.overhead:.1f}% compute, above max_overhead={max_overhead:g}: raise memory_budget "
                "or max_overhead"
            )
    recomputed = len([s for s in schedule.steps if s[0] == "run"]) - len({i for k, i in schedule.steps if k == "run"})
    if not recomputed and (budget_bytes is None or plain_peak_bytes + scratch <= budget_bytes):
        return BudgetPlan(
            None,
            {
                **report,
                "method": "reorder",
                "planned_peak_bytes": plain_peak_bytes + scratch,
                "overhead": 0.0,
                "status": schedule.status,
                "recomputed_ops": 0,
            },
        )
    return BudgetPlan(
        schedule,
        {
            **report,
            "method": "remat" if recomputed else "reorder",
            "planned_peak_bytes": schedule.peak_bytes,
            "overhead": round(schedule.overhead, 6),
            "status": schedule.status,
            "gap": schedule.gap,
            "from": schedule.details.get("from"),
            "joint_reorder": reorder,
            "solve_seconds": round(schedule.seconds, 3),
            "recomputed_ops": recomputed,
        },
    )


def _infeasible_message(graph: Any, budget_bytes: int, reference: int, schedule: Any, workspace: tuple) -> str:
    """One line: the budget, the smallest peak known to be reachable, and what to do."""
    from memplan.remat.baselines import BASELINES
    from memplan.remat.problem import RematProblem

    problem = RematProblem(graph, budget_bytes, workspace=workspace)
    reached = [p.peak_bytes for p in (BASELINES[n](problem) for n in BASELINES) if p.steps]
    lowest = min([reference, *reached])
    floor = int(schedule.details.get("floor_bytes") or 0)
    proof = "no plan exists (proven)" if schedule.status == "infeasible" else "no plan found in the time limit"
    return (
        f"memory_budget {format_bytes(budget_bytes)} is below what this step can reach: {proof}; the smallest peak "
        f"found is {format_bytes(lowest)} (no plan goes below {format_bytes(floor)}, checkpoint-all needs "
        f"{format_bytes(reference)}): raise memory_budget to at least {format_bytes(lowest)}, lower the batch size, "
        "or give more time_limit_seconds"
    )


def measure_op_workspace(
    capture: Capture, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Any
) -> tuple[int, ...]:
    """Each op's kernel scratch bytes (as :func:`memplan.torch.run.profile.profile_capture`
    measures them), on a copy of the model and optimizer with the random generator put back;
    calls of the step's other objects (an LR scheduler) are not made, so the user's objects
    and random stream are untouched. CPU only (elsewhere: none)."""
    if any(p.device.type != "cpu" for p in model.parameters()):
        return ()
    model_copy, optimizer_copy = copy.deepcopy((model, optimizer))
    with torch.random.fork_rng(devices=[]):
        runner = _WorkspaceRunner(capture, model_copy, optimizer_copy)
        runner(batch)  # warm-up: optimizer state, oneDNN primitives
        return _measure_workspace(runner, batch)


class _WorkspaceRunner(_ProfilingRunner):
    """Makes only the optimizer's calls: another object's (a scheduler's) is the user's own."""

    def _update(self, ins: Any, env: dict[str, Any]) -> None:
        if self.capture.regions[ins.region].owner in self.capture.optimizers:
            super()._update(ins, env)


__all__ = [
    "BudgetPlan",
    "RematUnsupported",
    "check_remat_supported",
    "measure_op_workspace",
    "parse_memory_budget",
    "plan_budget",
]
