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
counting each op's kernel workspace measured on the model's parameters within the budget
(:mod:`memplan.torch.run.profile`), and :class:`memplan.torch.run.remat.RematRunner` runs it.
A recompute runs the same kernel on the same inputs, and random ops are never recomputed
(:data:`memplan.remat.problem.RANDOM_KIND_MARKERS`), so numerics equal eager's bit for bit.
A budget below every plan raises :class:`memplan.errors.InfeasibleBudget` in one line, with
the smallest peak there is; a step the remat runner cannot run is refused in one line.

Two things make the budget hold at LLM sizes (issue 33, ``bench/llama_budget.py``): every peak
is counted as the runtime holds memory, each gradient until its optimizer call ends
(:func:`memplan.torch.capture.trace.hold_update_inputs`; the Llama's 125 MiB lm_head gradient
was the whole gap between the reordered plan's 1.69 GiB and its placed 1.81 GiB), and remat keeps
the reordered plan's stage order (:func:`memplan.remat.portfolio.solve_remat_in_order`):
checkpoint-all is then the reordered plan, and the greedy at the peak
(:func:`memplan.remat.baselines.peak_greedy`) takes it down to the budget, where in program
order the search started from checkpoint-all's 1.99 GiB instead of 1.81 GiB.
``memory_budget="fit"`` is the limit of the process (:mod:`memplan.torch.run.fit`).

Order and recomputation together (issue 36): when the sequential plan (remat over the reordered
order) recomputes something and time is left of ``time_limit_seconds`` (never more), the joint
search (:func:`memplan.remat.joint.choose_joint`: reorder the plan's runs given its
recomputations, take out the re-runs the new order fits without, solve again) runs from it, each
optimizer update group kept contiguous as the runtime runs it (one call at its last op); its plan
is taken only when it computes less at a placed peak within the budget, or as much at a lower
placed peak. The report says which (``remat_plan``) and both costs (``sequential_overhead``,
``joint_overhead``, the placed peaks compared); the remat runner runs any such order (its first
runs are a topological order, each group's call at its last op).

The budget holds from the first call (issue 33), not only once the step replays: the kernels'
workspace is measured on the user's parameters (not a copy, never written) running a plan
within the budget, never in eager's order; a budget no plan reaches is refused before that;
the recording steps run the plan on the ordinary allocator with their large blocks mapped on
their own (:mod:`memplan.torch.run.heap`), so the C library's heap does not keep their pages.
GPT-2 (2 layers, AdamW, batch 16) at 1.85 GiB: every call peaks at 2392 MiB RSS, the first
calls included (3037 MiB before; eager 2860 MiB): under a 2600 MiB cgroup limit,
``python bench/fit_first_call.py``.

A budget in bytes is a bound on the step as the operating system measures it (issue 33): what
memplan itself keeps resident outside the step (capture's program and graphs, the plan; the
kernels' first-run caches, measured after the workspace runs) is read before capture and after,
and taken out of the budget the solver and the placement are held to (:class:`OwnBytes`,
``report["memplan_own_bytes"]``, ``first_runs_bytes``, ``outside_counted_bytes``), the C heap's
free bytes included (its pages, handed back before each reading, are touched again by the
step's small allocations); what the recording steps leave beyond that is read after each of
them, before the next runs (re-planned tighter if the plan no longer fits:
``report["recording_rounds"]``), and when the arena is placed (likewise). The remat plan's
generated function is written at the end of its first step, not inside the second (whose peak
its compilation's freed heap raised by 5.9 MiB). The Llama of ``bench/llama_budget.py``: at
batch 1, 50 MiB counted, so 1.7 GiB is refused (the reordered plan needs 1.68 GiB plus those
bytes) and 1.75 GiB measures 1.72 GiB; at batch 2, 1.95, 1.85 and 1.78 GiB measure within each
budget (1.96 and 1.86 GiB at the first two before).
"""

from __future__ import annotations

import copy
import re
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch.fx

import torch
from memplan.errors import InfeasibleBudget, MemplanError
from memplan.graph.ir import Category
from memplan.isolate import in_child
from memplan.report.format import format_bytes
from memplan.torch.capture import Capture
from memplan.torch.capture.trace import written_argument
from memplan.torch.run.allocator import AllocationTrace, NativeReplay
from memplan.torch.run.arena import SharedArena
from memplan.torch.run.heap import blocks_mapped
from memplan.torch.run.interpreter import _as_list, _resolve
from memplan.torch.run.profile import _measure_workspace, _ProfilingRunner
from memplan.torch.run.replay import MAX_RECORDINGS, ReplayedStep

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
    """Refuse, in one line, what :class:`RematRunner` does not run: it makes the optimizers'
    calls at their planned places (one or several, each as the step calls it), but no scaler's."""
    if capture.mode != "train":
        raise RematUnsupported("memory_budget plans a training step; an inference step keeps no activations to drop")
    if scaler is not None or capture.scaler is not None:
        raise RematUnsupported(
            "memory_budget with a GradScaler is not supported yet: drop memory_budget (reorder and placement still "
            "apply) or train without the scaler"
        )


@dataclass
class BudgetPlan:
    """What :func:`plan_budget` decided: ``schedule`` is the remat plan to run (``None``: the
    reordered and placed plan fits, nothing is recomputed) and ``report`` says why.
    ``solve_bytes``: the byte budget the remat solver was given (the user's, or one tightened
    by :func:`tighten_budget`); ``context``: what a re-solve needs."""

    schedule: Any
    report: dict[str, Any] = field(default_factory=dict)
    solve_bytes: int | None = None
    context: _SolveContext | None = None
    own: OwnBytes | None = None  # memplan's own resident bytes, as measured while planning


@dataclass(frozen=True)
class _SolveContext:
    graph: Any
    workspace: tuple[int, ...]
    reference: int
    reorder: bool
    time_limit_seconds: float
    max_overhead: float | None
    order: tuple[int, ...] | None = None  # the stage order of the remat solves (the reordered plan's)
    groups: tuple[tuple[int, ...], ...] = ()  # the update groups: ops the runtime runs as one call
    outside_bytes: int = 0  # memplan's own resident bytes taken out of the user's budget (OwnBytes)


def plan_budget(
    capture: Capture,
    plain_peak_bytes: int,
    model: torch.nn.Module,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    batch: Any,
    *,
    memory_budget: int | float | str | None,
    max_overhead: float | None,
    time_limit_seconds: float,
    joint_reorder: bool = False,
    measure_workspace: bool = True,
    plain_order: Sequence[int] | None = None,
    outside_before_bytes: int | None = None,
) -> BudgetPlan:
    """The plan for a budget (see the module docstring). ``plain_peak_bytes``: the planned peak
    of the reordered, placed step without recomputation, ``plain_order`` its order.
    ``outside_before_bytes``: what the process held outside the step just before capture
    (:func:`outside_step_bytes`); with it, what memplan holds resident beyond that is counted
    against a budget given in bytes (:class:`OwnBytes`).
    ``joint_reorder``: let the remat solver also move first runs later (only for steps without
    random ops: their draws keep program order). ``memory_budget="fit"``: the limit of this
    process (:mod:`memplan.torch.run.fit`), resolved now.

    The kernels' workspace is measured on the real model's parameters (never updated, never
    copied) running a plan within the budget, so the measurement stays within it too: the
    reordered plan where it fits, else the remat plan solved without workspace; a budget no
    plan reaches is refused before anything runs."""
    from memplan.torch.run.fit import fit_budget, is_fit

    check_max_overhead(max_overhead)
    optimizers = _as_list(optimizers)
    fit = fit_budget(model, optimizers, batch) if is_fit(memory_budget) else None
    own = OwnBytes(outside_before_bytes, counted=fit is None and is_byte_budget(memory_budget))
    own.measure_capture(model, optimizers, batch)
    try:
        decided = _plan_budget(
            capture,
            plain_peak_bytes,
            model,
            optimizers,
            batch,
            memory_budget=memory_budget,
            fit_bytes=None if fit is None else fit.budget_bytes,
            max_overhead=max_overhead,
            time_limit_seconds=time_limit_seconds,
            joint_reorder=joint_reorder,
            measure_workspace=measure_workspace,
            plain_order=plain_order,
            own=own,
        )
    except InfeasibleBudget as err:
        if fit is None:
            raise
        raise InfeasibleBudget(f"{fit.describe()}; {err}") from None
    decided.own = own
    if fit is not None:
        decided.report["limit"] = fit.as_report()
    elif memory_budget is not None and all(p.device.type == "cpu" for p in model.parameters()):
        planned = decided.report["planned_peak_bytes"]
        decided.report["process"] = check_process_room(planned, model, optimizers, batch, outside=own.last_outside)
    return decided


HEAP_TOUCH_BYTES = 8 * 2**20
"""The most of the C heap's free bytes counted as memplan's own: what a step's small
allocations may touch again (the Llama at batch 2: 2.5-3.9 MiB), twice over. A heap the
user's process fragmented before (tens of MiB free) must not lower a budget by all of it."""


def own_reading(model: torch.nn.Module, optimizers: Sequence[Any], batch: Any) -> int | None:
    """What the process may hold resident outside the step while it runs: the resident set
    less the step's tensors (:func:`outside_step_bytes`, the C heap's free pages handed back
    first) plus the bytes the C heap holds free (:func:`memplan.torch.run.heap.heap_free_bytes`)
    up to :data:`HEAP_TOUCH_BYTES`, since the step's small allocations (tensor and Python
    objects) land in those pages and make them resident again: the Llama at batch 2 measured
    2.5-3.9 MiB above its plan and memplan's own bytes when only the trimmed resident set was
    counted. Compared with :func:`outside_step_bytes` before capture. ``None`` off the CPU."""
    from memplan.torch.run.heap import heap_free_bytes

    outside = outside_step_bytes(model, optimizers, batch)
    return None if outside is None else outside + min(heap_free_bytes(), HEAP_TOUCH_BYTES)


def outside_step_bytes(model: torch.nn.Module, optimizers: Sequence[Any], batch: Any) -> int | None:
    """What this process holds resident outside the step's own tensors now (CPU; ``None``
    elsewhere): its resident set, the C heap's free pages handed back, less the parameters,
    buffers, gradients, optimizer state and batch (:func:`memplan.torch.run.fit.step_tensor_bytes`)."""
    from memplan.torch.rss import release_free_memory, rss_bytes
    from memplan.torch.run.fit import step_tensor_bytes

    if any(p.device.type != "cpu" for p in model.parameters()):
        return None
    release_free_memory()
    return max(0, rss_bytes() - step_tensor_bytes(model, optimizers, batch, torch.device("cpu")))


def is_byte_budget(value: Any) -> bool:
    """``memory_budget`` names bytes (``"1.7GiB"``, ``2_000_000_000``), not a fraction of the
    checkpoint-all peak, nor ``"fit"``: the same bytes whatever the reference."""
    from memplan.torch.run.fit import is_fit

    if value is None or is_fit(value):
        return False
    try:
        return parse_memory_budget(value, 10**12) == parse_memory_budget(value, 2 * 10**12)
    except MemplanError:
        return False


@dataclass
class OwnBytes:
    """What memplan holds resident outside the step, the account of issue 33 ("a budget is a
    bound"): the step as the operating system measures it is its peak resident set less what
    the process held outside the step's tensors just before capture (``before``), so what
    capture and planning keep resident (the captured program, its fx graph and fake tensors,
    the plan; measured after capture: ``capture_bytes``) and what the kernels' first runs leave
    (oneDNN's primitive cache, the thread pools, created while the workspace is measured, as
    eager's first step creates them too: ``first_runs_bytes``) are in that peak beside the
    plan's live bytes (OLLA eq. 1). With ``counted`` (a budget in bytes) the solver and the
    placement are given ``memory_budget - total``, so the step the OS measures stays within
    the user's budget; a fraction of the checkpoint-all peak is a ratio of plans and a
    ``"fit"`` budget already leaves the process's resident set (capture's included) and a
    margin out, so there the bytes are only reported. The Llama of ``bench/llama_budget.py``:
    21 MiB after capture, 24 MiB more after the workspace runs; eager's first step grows the
    same account by 27 MiB."""

    before: int | None
    counted: bool = False
    capture_bytes: int = 0
    first_runs_bytes: int = 0

    last_outside: int | None = None  # the latest reading (:meth:`reading`)

    def reading(self, model: torch.nn.Module, optimizers: Sequence[Any], batch: Any) -> int | None:
        """:func:`own_reading` now (``before``: :func:`outside_step_bytes` before capture)."""
        return own_reading(model, optimizers, batch)

    def _grown(self, model: torch.nn.Module, optimizers: Sequence[Any], batch: Any) -> int:
        now = None if self.before is None else self.reading(model, optimizers, batch)
        self.last_outside = now
        return 0 if now is None or self.before is None else max(0, now - self.before)

    def measure_capture(self, model: torch.nn.Module, optimizers: Sequence[Any], batch: Any) -> None:
        self.capture_bytes = self._grown(model, optimizers, batch)

    def measure_first_runs(self, model: torch.nn.Module, optimizers: Sequence[Any], batch: Any) -> None:
        self.first_runs_bytes = max(0, self._grown(model, optimizers, batch) - self.capture_bytes)

    @property
    def total(self) -> int:
        return self.capture_bytes + self.first_runs_bytes

    @property
    def subtracted(self) -> int:
        """The bytes the step's budget is lowered by (0 unless ``counted``)."""
        return self.total if self.counted else 0

    def growth_since(self, model: torch.nn.Module, optimizers: Sequence[Any], batch: Any) -> int:
        """What the process holds outside the step beyond what was counted (the recording steps'
        objects: the traces, the runner's first-run state), read now; 0 without a reading before."""
        now = None if self.before is None else self.reading(model, optimizers, batch)
        return 0 if now is None or self.before is None else max(0, now - self.before - self.total)

    def step_budget(self, budget_bytes: int | None) -> int | None:
        """The step's share of a budget of ``budget_bytes`` (at least 1 byte: a refusal then names
        the smallest peak there is, memplan's own bytes added)."""
        if budget_bytes is None or not self.counted:
            return budget_bytes
        return max(1, budget_bytes - self.total)  # none left: 1 byte, refused with the smallest peak there is

    def describe(self) -> str:
        return (
            f"{format_bytes(self.total)} ({format_bytes(self.capture_bytes)} from capture and planning, "
            f"{format_bytes(self.first_runs_bytes)} from the kernels' first runs)"
        )

    def as_report(self, user_bytes: int | None) -> dict[str, Any]:
        return {
            "memory_budget_bytes": user_bytes,
            "memplan_own_bytes": self.capture_bytes,
            "first_runs_bytes": self.first_runs_bytes,
            "outside_counted_bytes": self.subtracted,
        }


def check_process_room(
    planned_peak_bytes: int,
    model: torch.nn.Module,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    batch: Any,
    limit: tuple[int, str] | None = None,
    outside: int | None = None,
) -> dict[str, int | str]:
    """The step's peak as the operating system will measure it, checked before the step runs
    (CPU): what the process holds outside the step's tensors now (its resident set, the C
    heap's free pages handed back, less the parameters, state and batch it holds: the
    interpreter, the libraries, memplan's capture and plan) plus the planned peak. Above what
    the process may use (``limit``: ``(bytes, source)``, default the cgroup limit or the
    machine's available memory, :func:`memplan.torch.run.fit.cpu_limit`) the step could only be
    killed, so it is refused in one line naming the budget that fits; else the account is
    returned for the report. The Llama of ``bench/llama_budget.py`` (1.85 GiB) held 403 MiB
    outside its step before ``compile_step`` and 46 MiB more once planned (capture's objects,
    the kernels' first runs); its peak RSS less the 403 MiB was 1.72 GiB, its plan 1.68 GiB.
    ``outside``: that account read already (:func:`outside_step_bytes`, after planning)."""
    from memplan.torch.rss import rss_bytes
    from memplan.torch.run.fit import cpu_limit, margin_for

    if outside is None:
        outside = outside_step_bytes(model, _as_list(optimizers), batch) or 0
    rss = rss_bytes()
    predicted = outside + planned_peak_bytes
    try:
        limit_bytes, source = cpu_limit(rss) if limit is None else limit
    except InfeasibleBudget:  # no cgroup limit and no /proc/meminfo: nothing to check against
        return {"outside_bytes": outside, "predicted_peak_rss_bytes": predicted}
    if predicted > limit_bytes:
        room = limit_bytes - outside - margin_for(limit_bytes, "cpu")
        raise InfeasibleBudget(
            f"the planned peak {format_bytes(planned_peak_bytes)} and the {format_bytes(outside)} this process holds "
            f"outside the step need {format_bytes(predicted)}, above the {format_bytes(limit_bytes)} it may use "
            f"({source}): lower memory_budget to at most {format_bytes(max(0, room))} or give memory_budget='fit'"
        )
    account = {"outside_bytes": outside, "predicted_peak_rss_bytes": predicted}
    return {**account, "limit_bytes": limit_bytes, "source": source}


def _plan_budget(
    capture: Capture,
    plain_peak_bytes: int,
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    batch: Any,
    *,
    memory_budget: int | float | str | None,
    fit_bytes: int | None,
    max_overhead: float | None,
    time_limit_seconds: float,
    joint_reorder: bool,
    measure_workspace: bool,
    plain_order: Sequence[int] | None,
    own: OwnBytes | None = None,
) -> BudgetPlan:
    from memplan.remat.baselines import checkpoint_all
    from memplan.remat.problem import RematProblem, is_random

    graph = held_graph(capture)
    reorder = joint_reorder and not any(is_random(op.kind) for op in graph.ops)

    own = OwnBytes(None) if own is None else own

    def user_budget(reference_bytes: int) -> int | None:
        if fit_bytes is not None:
            return fit_bytes
        return parse_memory_budget(memory_budget, reference_bytes) if memory_budget is not None else None

    def budget_for(reference_bytes: int) -> int | None:  # the step's share: memplan's own bytes taken out
        return own.step_budget(user_budget(reference_bytes))

    probe: Any = None  # the plan the workspace is measured with (None: program order)
    if measure_workspace and any(p.device.type == "cpu" for p in model.parameters()):
        unmeasured = checkpoint_all(RematProblem(graph, 10**18)).peak_bytes
        probe = _probe_plan(
            graph,
            budget_for(unmeasured),
            plain_peak_bytes,
            plain_order,
            time_limit_seconds,
            reorder,
            own.subtracted,
            user_budget(unmeasured),
        )
    steps = None if probe is None else probe.steps
    workspace = measure_op_workspace(capture, model, optimizers, batch, steps=steps) if measure_workspace else ()
    own.measure_first_runs(model, optimizers, batch)
    reference = checkpoint_all(RematProblem(graph, 10**18, workspace=workspace)).peak_bytes
    budget_bytes = budget_for(reference)
    cache_cap = caching_allocator_cap(model, user_budget(reference))
    warn_unmeasured_device(model, cache_cap)
    scratch = max(workspace, default=0)
    order = None if plain_order is None else tuple(plain_order)
    groups = _update_groups(capture)
    context = _SolveContext(
        graph, tuple(workspace), reference, reorder, time_limit_seconds, max_overhead, order, groups, own.subtracted
    )
    report: dict[str, Any] = {
        "memory_budget": memory_budget,
        "budget_bytes": budget_bytes,  # the step's share (the plan's live bytes and placed arena are held to it)
        **own.as_report(user_budget(reference)),
        "max_overhead": max_overhead,
        "checkpoint_all_peak_bytes": reference,
        "plain_planned_peak_bytes": plain_peak_bytes + scratch,
        "workspace_bytes_max": scratch,
        "workspace_measured_within": None if probe is None else getattr(probe, "label", "remat plan"),
        "caching_allocator_cap_bytes": cache_cap,
    }
    if budget_bytes is not None and plain_peak_bytes + scratch <= budget_bytes:
        return BudgetPlan(None, {**report, **_reorder_only(plain_peak_bytes + scratch, "optimal")}, None, context)
    if budget_bytes is None:
        schedule = in_child(  # the solvers' memory stays out of the training process
            _solve_remat_within_overhead,
            graph,
            float(max_overhead),  # type: ignore[arg-type]
            time_limit_seconds,
            workspace=workspace,
        )
        return _decided(schedule, report, plain_peak_bytes + scratch, None, context)
    reuse = _still_within(graph, probe, workspace, budget_bytes)
    return _solve_within(context, report, budget_bytes, plain_peak_bytes + scratch, schedule=reuse)


def _solve_remat_in_order(*args: Any, **kwargs: Any) -> Any:
    """:func:`memplan.remat.portfolio.solve_remat_in_order`, imported where it runs (the solver's
    child): the solvers bring OR-Tools and pandas (about 57 MiB) the training process never needs."""
    from memplan.remat.portfolio import solve_remat_in_order

    return solve_remat_in_order(*args, **kwargs)


def _choose_joint(*args: Any, **kwargs: Any) -> Any:
    """:func:`memplan.remat.joint.choose_joint`, imported in the solver's child."""
    from memplan.remat.joint import choose_joint

    return choose_joint(*args, **kwargs)


def _update_groups(capture: Capture) -> tuple[tuple[int, ...], ...]:
    """The step's update groups (:func:`memplan.torch.run.interpreter.optimizer_update_groups`):
    the joint search keeps each contiguous, as the runtime runs it as one call."""
    from memplan.errors import UnsupportedOp
    from memplan.torch.run.interpreter import optimizer_update_groups

    if capture.mode != "train":
        return ()
    try:
        return tuple(tuple(int(v) for v in g) for g in optimizer_update_groups(capture))
    except UnsupportedOp:  # the runner refuses this step in one line with this very reason
        return ()


def _solve_remat_within_overhead(*args: Any, **kwargs: Any) -> Any:
    """:func:`memplan.remat.portfolio.solve_remat_within_overhead`, imported in the solver's child."""
    from memplan.remat.portfolio import solve_remat_within_overhead

    return solve_remat_within_overhead(*args, **kwargs)


def held_graph(capture: Capture) -> Any:
    """``capture.graph`` as the budget path plans it, as the runtime runs it. Each update
    group's gradients are held until the group's last op by capture itself
    (:func:`memplan.torch.capture.trace.hold_update_inputs`: the runtime holds them as ``.grad``
    for the whole optimizer call; the Llama of ``bench/llama_budget.py``: the lm_head's 125 MiB
    gradient beside AdamW's two temporaries as large), so the reordered plan's peak is already
    the runtime's. Here:

    * an op PyTorch tags ``nondeterministic_seeded`` (it may draw from the generator: CPU
      ``_scaled_dot_product_flash_attention_for_cpu``, for its dropout) is random to the
      self-check (:mod:`memplan.torch.run.selfcheck`), which refuses a step that runs it more
      often than eager; the remat core knows random ops by their kind
      (:data:`memplan.remat.problem.RANDOM_KIND_MARKERS`), so its kind is marked
      :data:`RANDOM_KIND_SUFFIX` here: it is never recomputed (the Llama at 1.75 GiB was refused
      after a plan recomputed its attention)."""
    from memplan.graph.ir import Graph
    from memplan.remat.problem import is_random
    from memplan.torch.tensors import is_random as seeded

    graph = capture.graph
    ops = list(graph.ops)
    targets = {node.name: node.target for node in capture.gm.graph.nodes if node.op == "call_function"}
    for v, name in enumerate(capture.node_of_op):
        if name in targets and seeded(targets[name]) and not is_random(ops[v].kind):
            ops[v] = replace(ops[v], kind=ops[v].kind + RANDOM_KIND_SUFFIX)
    if tuple(ops) == graph.ops:
        return graph
    return Graph(tuple(ops), graph.tensors, graph.name, dict(graph.meta))


RANDOM_KIND_SUFFIX = " (random: tagged nondeterministic_seeded)"
"""Appended by :func:`held_graph` to the kind of an op PyTorch tags ``nondeterministic_seeded``:
its "random" makes :func:`memplan.remat.problem.is_random` see it."""


@dataclass(frozen=True)
class _OrderProbe:
    """The reordered plan's steps, when it fits: the workspace is measured running it."""

    steps: list[Any]
    label: str = "reordered plan"


def _probe_plan(
    graph: Any,
    budget_bytes: int | None,
    plain_peak_bytes: int,
    plain_order: Sequence[int] | None,
    time_limit_seconds: float,
    reorder: bool,
    outside_bytes: int = 0,
    named_bytes: int | None = None,
) -> Any:
    """What the workspace is measured with, within ``budget_bytes`` (not counting the
    workspace): the reordered plan where it fits, else the remat portfolio's plan without
    workspace; ``None`` (program order) without a budget or an order. A budget that no plan
    reaches even without workspace raises :class:`InfeasibleBudget` now, before any step runs."""
    from memplan.remat.lower import steps_for_order

    if budget_bytes is None or (plain_order is not None and plain_peak_bytes <= budget_bytes):
        return None if plain_order is None else _OrderProbe(steps_for_order(graph, plain_order))
    schedule = in_child(
        _solve_remat_in_order, graph, plain_order, budget_bytes, time_limit_seconds, workspace=(), reorder=reorder
    )
    if not schedule.feasible:
        reference = _checkpoint_all_peak(graph)
        raise InfeasibleBudget(
            _infeasible_message(
                graph,
                budget_bytes,
                reference,
                schedule,
                (),
                reordered_bytes=plain_peak_bytes if plain_order is not None else None,
                time_limit_seconds=time_limit_seconds,
                outside_bytes=outside_bytes,
                named_bytes=named_bytes,
                workspace_unmeasured=True,
            )
        )
    return schedule


def _checkpoint_all_peak(graph: Any) -> int:
    from memplan.remat.baselines import checkpoint_all
    from memplan.remat.problem import RematProblem

    return checkpoint_all(RematProblem(graph, 10**18)).peak_bytes


def _still_within(graph: Any, probe: Any, workspace: Sequence[int], budget_bytes: int) -> Any:
    """The probe's remat plan when it stays within the budget with the measured workspace
    counted (the cheapest found without workspace, so the cheapest found with it): no second
    solve. ``None`` otherwise. Its peak is the one with the workspace (the probe's own left it
    out), its budget the one it is now held to."""
    from memplan.remat.lower import sequence_peak_bytes

    if probe is None or isinstance(probe, _OrderProbe) or not getattr(probe, "feasible", False):
        return None
    peak = sequence_peak_bytes(graph, probe.steps, workspace)
    return replace(probe, peak_bytes=peak, budget_bytes=budget_bytes) if peak <= budget_bytes else None


def _reorder_only(peak_bytes: int, status: str) -> dict[str, Any]:
    return {
        "method": "reorder",
        "planned_peak_bytes": peak_bytes,
        "overhead": 0.0,
        "status": status,
        "recomputed_ops": 0,
    }


def _solve_within(
    context: _SolveContext,
    report: dict[str, Any],
    solve_bytes: int,
    plain_peak: int | None,
    schedule: Any = None,
    runnable_bytes: int | None = None,
) -> BudgetPlan:
    """The portfolio's cheapest plan within ``solve_bytes``; ``plain_peak``: the reordered
    plan's peak, run instead when the plan recomputes nothing and it fits (``None``: never).
    ``schedule``: a plan already solved for this budget (then no solve). ``runnable_bytes``: a
    placed peak known to run, for a refusal's advice."""
    graph, budget_bytes = context.graph, report["budget_bytes"]
    began = time.perf_counter()
    if schedule is None:
        schedule = in_child(
            _solve_remat_in_order,
            graph,
            context.order,
            solve_bytes,
            context.time_limit_seconds,
            workspace=context.workspace,
            reorder=context.reorder,
        )
    spent = max(time.perf_counter() - began, schedule.seconds)
    if schedule.feasible:
        schedule, report = _joint_or_sequential(context, report, schedule, context.time_limit_seconds - spent)
    if not schedule.feasible:
        raise InfeasibleBudget(
            _infeasible_message(
                graph,
                solve_bytes,
                context.reference,
                schedule,
                context.workspace,
                budget_bytes,
                reordered_bytes=plain_peak,
                runnable_bytes=runnable_bytes,
                time_limit_seconds=context.time_limit_seconds,
                outside_bytes=context.outside_bytes,
            )
        )
    if context.max_overhead is not None and schedule.overhead > context.max_overhead + 1e-12:
        raise InfeasibleBudget(
            f"the cheapest plan within memory_budget {format_bytes(budget_bytes)} recomputes "
            f"+{100 * schedule.overhead:.1f}% compute, above max_overhead={context.max_overhead:g}: raise "
            "memory_budget or max_overhead"
        )
    fits = plain_peak is not None and plain_peak <= solve_bytes
    return _decided(schedule, report, plain_peak if fits else None, solve_bytes, context)


def _joint_or_sequential(
    context: _SolveContext, report: dict[str, Any], schedule: Any, seconds: float
) -> tuple[Any, dict[str, Any]]:
    """The sequential plan ``schedule`` (remat over the reordered order) or the joint one
    (order and recomputation together, :func:`memplan.remat.joint.choose_joint`, in the
    ``seconds`` left of ``time_limit_seconds``, in the solver's child), and the report with
    which was taken and both costs (``remat_plan``, ``sequential_overhead``, ``joint_overhead``,
    the placed peaks compared)."""
    from memplan.remat.joint import joint_skipped

    choice = joint_skipped(schedule, seconds) or in_child(
        _choose_joint,
        context.graph,
        schedule,
        seconds,
        limit_bytes=report["budget_bytes"],
        workspace=context.workspace,
        groups=context.groups,
    )
    return choice.plan, {**report, **choice.report}


def _decided(
    schedule: Any, report: dict[str, Any], plain_peak: int | None, solve_bytes: int | None, context: _SolveContext
) -> BudgetPlan:
    """The remat plan, or the reordered plan (``plain_peak`` given) when it recomputes nothing."""
    recomputed = len([s for s in schedule.steps if s[0] == "run"]) - len({i for k, i in schedule.steps if k == "run"})
    if not recomputed and plain_peak is not None:
        return BudgetPlan(None, {**report, **_reorder_only(plain_peak, schedule.status)}, solve_bytes, context)
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
            "joint_reorder": context.reorder,
            "stage_order": schedule.details.get("stage_order", "program"),
            "solve_seconds": round(schedule.seconds, 3),
            "recomputed_ops": recomputed,
        },
        solve_bytes,
        context,
    )


def tighten_budget(decided: BudgetPlan, excess_bytes: int, placed_bytes: int | None = None) -> BudgetPlan:
    """Re-plan with the solver's budget lowered by ``excess_bytes``: what the placed arena of
    ``decided``'s step needed beyond the budget (the arena's fragmentation above the live-bytes
    peak the solver counts, OLLA eq. 6 vs eq. 1). Raises :class:`InfeasibleBudget` in one line
    when no plan is found within the tighter budget; ``placed_bytes``, the placed step's peak
    (it ran, so it is a peak memplan can run), is the least its advice names."""
    if decided.context is None or decided.report.get("budget_bytes") is None:
        raise MemplanError("only a plan made for a memory_budget can be tightened")
    base = decided.solve_bytes if decided.solve_bytes is not None else decided.report["budget_bytes"]
    if base - max(1, excess_bytes) <= 0:  # the bytes beside the plan's tensors alone exceed the budget
        named = decided.report["budget_bytes"] + decided.context.outside_bytes
        advice = "" if placed_bytes is None else f" to at least {format_at_least(placed_bytes)}"
        raise InfeasibleBudget(
            f"memory_budget {format_bytes(named)} leaves no room for this step's tensors: once placed, it needs "
            f"{format_bytes(excess_bytes)} beyond them (the arena's layout, and on a GPU the device's own "
            f"workspace, such as cuBLAS'): raise memory_budget{advice}"
        )
    report = {k: v for k, v in decided.report.items() if k in _INPUT_KEYS}
    return _solve_within(decided.context, report, base - max(1, excess_bytes), None, runnable_bytes=placed_bytes)


_INPUT_KEYS = (
    "memory_budget",
    "budget_bytes",
    "max_overhead",
    "checkpoint_all_peak_bytes",
    "plain_planned_peak_bytes",
    "workspace_bytes_max",
    "memory_budget_bytes",
    "memplan_own_bytes",
    "first_runs_bytes",
    "outside_counted_bytes",
)


MAX_TIGHTENINGS = 3  # re-plans after the placed arena came out above the budget


class BudgetedReplay(ReplayedStep):
    """A :class:`ReplayedStep` that holds its placed step to ``memory_budget``.

    The remat solver bounds the live bytes at each moment (Checkmate's memory constraint);
    the planned allocator then places the recorded allocations in one arena, which may be
    larger than the most bytes live at once (fragmentation, OLLA eq. 6 vs eq. 1). Once a
    recording is placed, the step's peak as measured (persistent bytes, the arena, and the
    allocations outliving the step, served outside it) is checked against the budget; when
    over, the step is planned again with the solver's budget lowered by the excess
    (:func:`tighten_budget`) and recorded again, at most :data:`MAX_TIGHTENINGS` times, and
    refused in one line (:class:`InfeasibleBudget`) if still over. No step is replayed over
    the budget. ``make_runner(schedule)`` builds the runner of a plan; ``report`` (the plan's
    ``budget`` report) is updated in place with the plan that runs and each placement round.
    """

    max_recording_steps = MAX_RECORDINGS * (MAX_TIGHTENINGS + 1)
    max_branches = 1  # a branch placed later could grow the arena past the budget unchecked

    def __init__(
        self,
        decided: BudgetPlan,
        make_runner: Callable[[Any], Callable[[Any], Any]],
        persistent_bytes: int,
        report: dict[str, Any],
        *,
        time_limit_seconds: float = 5.0,
        arena: SharedArena | None = None,
        native: NativeReplay | None = None,
        schedulers: Sequence[Any] = (),
    ) -> None:
        super().__init__(
            make_runner(decided.schedule),
            time_limit_seconds=time_limit_seconds,
            arena=arena,
            native=native,
            schedulers=schedulers,
        )
        self.decided = decided
        self.make_runner = make_runner
        self.persistent_bytes = persistent_bytes
        self.report = report
        self.report["placement_rounds"] = []
        self.report["recording_rounds"] = []  # re-plans before a recording step (:meth:`_recheck`)
        self.own = decided.own
        self._batch: Any = None  # the batch of the recording step being placed
        # a refusal found once a recording step had run (its update applied): raised by the next
        # call, before anything runs, so that no call both updates the model and raises
        self.refusal: InfeasibleBudget | None = None
        if decided.report.get("budget_bytes") is not None:  # the device holds at most the budget from the first step
            self.native.hold_cache_within(decided.report["budget_bytes"], 0)

    def _outside_bytes(self) -> int:
        """memplan's own bytes the step's budget was lowered by (:class:`OwnBytes`)."""
        return 0 if self.decided.context is None else self.decided.context.outside_bytes

    def _step(self, batch: Any) -> Any:
        if self.refusal is not None:
            raise self.refusal
        return super()._step(batch)

    def _record(self, batch: Any) -> Any:
        """A recording step on the ordinary allocator, its large blocks mapped on their own so
        that the C library's heap does not hold their pages past their frees (:mod:`heap`).
        A plain plan's generated function is written before its first step
        (:meth:`_program_written`: the heap it freed handed back), so no step runs on top of
        that; when the step places nothing, what
        the recording steps left resident is counted before the next one runs
        (:meth:`_recheck`). A re-plan refused after the step ran is kept for the next call
        (:attr:`refusal`, said now in a warning): this call's update has been applied, as eager's."""
        self._batch = batch
        ran: tuple[Any] | None = None
        try:
            with blocks_mapped():
                result = super()._record(batch)
            ran = (result,)
            if self.plan is None:
                self._recheck()
            return result
        except InfeasibleBudget as error:
            ran = ran or self.recorded  # the step ran when placing (or the re-check after) refused
            if ran is None:  # refused before the step ran
                raise
            self.refusal = error
            warnings.warn(f"memplan: this step ran as eager would; the next is refused: {error}", stacklevel=7)
            return ran[0]
        finally:
            self._batch = None
            self.recorded = None

    def _program_written(self) -> None:
        """A plain plan's step was written as one function just now, before the step (a remat
        plan's is written at the end of its first, interpreted step:
        :class:`memplan.torch.run.remat.RematRunner`): the C heap's freed pages handed back, so
        compiling it leaves none under the step's peak."""
        self.native.release_free_memory()

    def _recheck(self) -> None:
        """After a recording step that placed nothing, the next runs the same plan on the
        ordinary allocator: its planned peak plus what the recording steps left resident beyond
        memplan's own bytes counted at planning (the generated function, the runner's first-run
        state, the C heap's free bytes: :meth:`OwnBytes.growth_since`) must stay within the
        budget; else the step is planned again now, the budget lowered by the excess, before a
        step runs over (issue 33)."""
        budget = self.decided.report.get("budget_bytes")
        grown = self._own_growth()
        self.report["own_growth_first_steps_bytes"] = grown
        planned = int(self.decided.report["planned_peak_bytes"])
        if budget is None or planned + grown <= budget:
            return
        self.report["recording_rounds"].append(
            {"solve_bytes": self.decided.solve_bytes, "planned_peak_bytes": planned, "own_growth_bytes": grown}
        )
        self._replan(planned + grown - budget, planned + grown, grown, planned, recording=True)

    def _own_growth(self) -> int:
        """What the recording steps left resident outside the step beyond memplan's own bytes
        counted at planning (issue 33), for a budget in bytes; read before the arena is placed."""
        if self.own is None or not self.own.counted or self._batch is None:
            return 0
        model, optimizers = getattr(self.run, "model", None), getattr(self.run, "optimizers", None)
        if model is None or optimizers is None:
            return 0
        return self.own.growth_since(model, optimizers, self._batch)

    def _plan(self, trace: AllocationTrace) -> None:
        grown = self._own_growth()
        super()._plan(trace)
        assert self.plan is not None and self.placement is not None
        budget = self.decided.report["budget_bytes"]
        kept = [size for size, end in zip(trace.sizes, trace.free_at, strict=True) if end is None]
        outside = sum(kept)
        # on a GPU, what the device holds in use besides the step (cuBLAS' workspace, rounding), if more
        device = self.native.persistent_in_use(self.shared.tensor.numel(), kept)
        placed = max(self.persistent_bytes, device or 0) + self.arena_block_bytes + outside
        self.report["own_growth_first_steps_bytes"] = grown  # counted beside the placed step (issue 33)
        rounds = self.report["placement_rounds"]
        rounds.append(
            {
                "solve_bytes": self.decided.solve_bytes,
                "planned_peak_bytes": self.decided.report["planned_peak_bytes"],
                "arena_bytes": self.plan.arena_bytes,
                "arena_lower_bound_bytes": self.placement.lower_bound_bytes,
                "placed_peak_bytes": placed,
            }
        )
        self.report["placed_peak_bytes"] = placed
        if budget is None or placed + grown <= budget:
            # what the allocator may keep cached beyond the placed step: the budget's headroom
            # (the planned CUDA allocator's cache bound; the CPU one caches nothing of its own)
            held = None if budget is None else self.native.hold_cache_within(budget, placed + grown)
            self.report["cache_bound_bytes"] = held
            return
        self.plan = self.placement = self._previous = None
        self.shared.release()
        self._replan(placed + grown - budget, placed + grown, grown, placed)

    def _excess_over_live(self, peak: int) -> int:
        """How far the solver's budget must come down for a plan as far above its live bytes as
        this one (``peak``, placed or on the ordinary allocator, over the plan's live-bytes peak)
        to fit: lowering it by the excess over the budget alone lets the next plan take up the
        slack this one left below its budget, and come out over again."""
        budget, solve = self.decided.report["budget_bytes"], self.decided.solve_bytes
        above_live = peak - int(self.decided.report["planned_peak_bytes"])
        return (budget if solve is None else solve) - (budget - above_live)

    def _replan(self, excess: int, runnable: int, grown: int, needed: int, *, recording: bool = False) -> None:
        """Plan the step again with the solver's budget lowered by ``excess`` (the placed arena's
        or the recording steps' own growth's, :func:`tighten_budget`) and record it anew; refused
        in one line after :data:`MAX_TIGHTENINGS` rounds. ``needed``: the step's peak that was
        over (placed, or planned for a recording step), ``runnable``: a peak that ran, with
        ``grown``, the growth of memplan's own bytes beyond those counted at planning;
        ``recording``: the excess is a recording step's (``report["recording_rounds"]``)."""
        rounds = self.report["recording_rounds" if recording else "placement_rounds"]
        if len(self.report["placement_rounds"]) + len(self.report["recording_rounds"]) > MAX_TIGHTENINGS:
            budget = self.decided.report["budget_bytes"]
            mine = self._outside_bytes() + grown
            own = f" beside memplan's own {format_bytes(mine)}" if mine else ""
            last = rounds[-1]
            how = (
                f"planned {format_bytes(last['planned_peak_bytes'])} on the ordinary allocator"
                if recording
                else f"persistent {format_bytes(self.persistent_bytes)}, arena {format_bytes(last['arena_bytes'])} "
                f"for {format_bytes(last['arena_lower_bound_bytes'])} live at most"
            )
            raise InfeasibleBudget(
                f"memory_budget {format_bytes(budget + self._outside_bytes())}: the step still needs "
                f"{format_bytes(needed)}{own} ({how}) after {MAX_TIGHTENINGS} re-plans with the budget lowered by "
                f"the excess: raise memory_budget to at least {format_at_least(runnable + self._outside_bytes())} or "
                "give more time_limit_seconds"
            )
        self.decided = tighten_budget(self.decided, max(excess, self._excess_over_live(needed + grown)), runnable)
        self.report.update(self.decided.report)
        self.run = self.make_runner(self.decided.schedule)
        self.recordings = 0
        self._previous = None


def _infeasible_message(
    graph: Any,
    budget_bytes: int,
    reference: int,
    schedule: Any,
    workspace: tuple,
    user_bytes: int | None = None,
    *,
    reordered_bytes: int | None = None,
    runnable_bytes: int | None = None,
    time_limit_seconds: float = 10.0,
    outside_bytes: int = 0,
    named_bytes: int | None = None,
    workspace_unmeasured: bool = False,
) -> str:
    """One line: the budget, the smallest peak known to be reachable, and what to do.
    ``workspace_unmeasured``: refused before the kernels' scratch was measured (no kernel has
    run yet), so the advice says the scratch comes on top of the bytes it names.
    ``user_bytes``: the user's budget when ``budget_bytes`` is one tightened for placement;
    ``reordered_bytes``: the reordered plan's peak (it runs with no recomputation), a peak memplan
    can run even where every remat plan found was larger (before placement); ``runnable_bytes``:
    a placed peak that ran (the advice never names more); ``outside_bytes``: memplan's own
    resident bytes taken out of the user's budget (:class:`OwnBytes`), added back to the budget
    named and to the advice; ``named_bytes``: the user's budget, named when given. The baselines that name the smallest
    peak run within a tenth of the time limit (at most 10 s): a refusal must not outlast the solve;
    a plan of theirs that re-runs an op inside an optimizer call (one update group, which the
    runtime runs as one call) is not named: memplan could not run it."""
    from memplan.remat.baselines import BASELINES, run_baselines
    from memplan.remat.problem import RematProblem
    from memplan.remat.stage_order import broken_group, call_groups

    problem = RematProblem(graph, budget_bytes, workspace=workspace)
    plans = run_baselines(problem, BASELINES, min(10.0, 0.1 * time_limit_seconds))
    groups = call_groups(graph)  # a plan that re-runs an op inside an optimizer call cannot run: not named
    reached = [p.peak_bytes for p in plans.values() if p.steps and broken_group(p.steps, groups) is None]
    found = schedule.details.get("lowest_peak_bytes")  # the solve's lowest plan (in its stage order)
    reached += [int(found)] if found else []
    lowest = min([reference, *reached, *([] if reordered_bytes is None else [reordered_bytes])])
    floor = int(schedule.details.get("floor_bytes") or 0)
    proof = "no plan exists (proven)" if schedule.status == "infeasible" else "no plan found in the time limit"
    runs = schedule.details.get("none_with_runs")
    if schedule.status != "infeasible" and runs:
        proof += f" (none that runs each op at most {runs} times, proven)"
    placing = 0 if user_bytes is None else max(0, user_bytes - budget_bytes)
    advice = lowest + placing if runnable_bytes is None else min(lowest + placing, runnable_bytes)
    named = budget_bytes if user_bytes is None else user_bytes
    own = ""
    if outside_bytes:
        own = f" less the {format_bytes(outside_bytes)} memplan holds outside the step"
        advice += outside_bytes
    given = budget_bytes + outside_bytes if named_bytes is None else named_bytes
    head = f"memory_budget {format_bytes(given)}{own} is below what this step can reach: {proof}"
    more_time = ", lower the batch size, or give more time_limit_seconds"
    if schedule.status == "infeasible":  # more time cannot help once no plan is proven to exist
        more_time = " or lower the batch size"
    if placing:
        head = (
            f"memory_budget {format_bytes(named + outside_bytes)}{own} is below what this step can reach once its "
            "arena is placed: "
            f"the placement needs {format_bytes(placing)} above the live bytes, and within "
            f"{format_bytes(budget_bytes)} of live bytes {proof}"
        )
    return (
        f"{head}; the smallest peak found is {format_bytes(lowest)} (no plan goes below {format_bytes(floor)}, "
        f"checkpoint-all needs {format_bytes(reference)}): raise memory_budget to at least "
        f"{format_at_least(advice)}"
        + (" plus the kernels' scratch (not measured yet: no kernel runs before a refusal)" * workspace_unmeasured)
        + more_time
        + (f" (memplan's own {format_bytes(outside_bytes)} included)" if outside_bytes else "")
    )


def format_at_least(nbytes: int) -> str:
    """``nbytes`` as :func:`format_bytes` writes it, rounded up, not to the nearest: advice to
    raise a budget to at least what is written never names less than it needs (the Llama at 1.78
    GiB was told "at least 1.78 GiB" for 1.7805 GiB)."""
    text = format_bytes(nbytes)
    number, unit = text.split(" ")
    if unit == "B" or float(number) * UNITS[unit.lower()] >= nbytes:
        return text
    return f"{float(number) + 0.01:.2f} {unit}"


def caching_allocator_cap(model: torch.nn.Module, budget_bytes: int | None) -> int | None:
    """The bytes PyTorch's caching allocator is held to while a budgeted step runs on CUDA without
    the planned CUDA allocator (:func:`caching_allocator_capped`): the user's budget. None off
    CUDA, without a byte budget, or with the planned allocator (it holds its own bound)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type != "cuda" or budget_bytes is None or _planned_cuda_allocator():
        return None
    return int(budget_bytes)


@contextmanager
def caching_allocator_capped(
    cap_bytes: int | None, state: Sequence[torch.Tensor] = (), device: Any = None
) -> Iterator[None]:
    """PyTorch's caching allocator held to ``cap_bytes`` for the block's duration
    (``torch.cuda.set_per_process_memory_fraction``, never raised above the fraction already
    set, put back after): before its reserved bytes would pass the cap it gives cached blocks
    back and retries, and a request that still does not fit is refused in one line
    (:class:`InfeasibleBudget`) rather than take more. Without it an H100 reserved 1.7% over the
    budget while the allocated peak stayed within (GPT-2 at batch 488, bench/results/gpu_suite.md):
    the cache kept blocks from the first steps. Scoped to memplan's step, so the user's other work
    is not capped. ``state``: the model's parameters and buffers (and the optimizer's state); the
    refusal says whether the step had written any of them (by their version counters)."""
    if cap_bytes is None:
        yield
        return
    device = torch.cuda.current_device() if device is None else device
    before = torch.cuda.get_per_process_memory_fraction(device)
    total = torch.cuda.get_device_properties(device).total_memory
    versions = [t._version for t in state]
    torch.cuda.set_per_process_memory_fraction(min(before, cap_bytes / total), device)
    try:
        yield
    except torch.OutOfMemoryError as error:
        written = sum(t._version != v for t, v in zip(state, versions, strict=True))
        left = (
            f"the step had already written {written} of the model's and optimizer's tensors: restore them "
            "from a checkpoint before training on"
            if written
            else "the step had written none of the model's parameters, buffers or optimizer state"
        )
        raise InfeasibleBudget(
            f"memory_budget {format_bytes(cap_bytes)} on cuda: the step needed more (PyTorch's caching allocator, "
            "held to the budget, ran out: the kernels' workspace and the allocator's rounding are not planned "
            f"with arena views; {left}): raise memory_budget, or install the planned CUDA allocator "
            "(allocator='replay'), whose recorded steps count them"
        ) from error
    finally:
        torch.cuda.set_per_process_memory_fraction(before, device)


def warn_unmeasured_device(model: torch.nn.Module, cache_cap: int | None = None) -> None:
    """One warning for a budget off the CPU, where memplan has not shown that it holds: the
    kernels' scratch is not measured there, and PyTorch's caching allocator, which serves the
    step unless the planned CUDA allocator is installed, is capped at the budget
    (``cache_cap``: :func:`caching_allocator_cap`) but not held to the plan."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "cuda" and _planned_cuda_allocator():
        warnings.warn(
            "memory_budget on cuda: planned without the kernels' workspace; the planned CUDA allocator's recorded "
            "steps carry it, so the replayed steps are held to the budget (placement re-planned with the excess, "
            "the cache bounded by the headroom), but the first, recording steps may exceed it",
            stacklevel=4,
        )
    elif device.type == "cuda" and cache_cap is not None:
        warnings.warn(
            f"memory_budget on cuda: planned without the kernels' workspace; PyTorch's caching allocator is capped "
            f"at {format_bytes(cache_cap)} while memplan's step runs (torch.cuda.set_per_process_memory_fraction), "
            "so a step that needs more than the budget is refused in one line rather than exceed it",
            stacklevel=4,
        )
    elif device.type != "cpu":
        warnings.warn(
            f"memory_budget on {device.type}: planned without the kernels' workspace, and PyTorch's caching "
            "allocator is not held to the plan; the measured peak can exceed the budget (an H100 measured "
            "MobileNet-v2 at 1.07x it allocated, 2.0x reserved: bench/results/cuda_budget.md)",
            stacklevel=4,
        )


def _planned_cuda_allocator() -> bool:
    """True when the planned CUDA allocator is installed (then a step on the GPU is replayed)."""
    from memplan.torch.run import cuda_allocator

    return cuda_allocator.installed()


def measure_op_workspace(
    capture: Capture,
    model: torch.nn.Module,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    batch: Any,
    steps: Sequence[Any] | None = None,
) -> tuple[int, ...]:
    """Each op's kernel scratch bytes (as :func:`memplan.torch.run.profile.profile_capture`
    measures them), running ``steps`` (a plan's step sequence; program order when ``None``)
    twice, the first as warm-up. The user's objects and random stream are left untouched, and
    the measurement holds no copy the budget does not count: the parameters are used as they
    are, never copied and never written (no optimizer or other call of the step is made, and no
    op that writes one in place, SAM's ``p.add_(e)``: a parameter written anyway is refused);
    the buffers on a copy; the random generator put back; the in-place writes into the other
    tensors the step writes (an EMA, a counter) not run either (elementwise, no scratch; one
    whose result cannot be told runs on a copy put back after). CPU only (elsewhere: none)."""
    if any(p.device.type != "cpu" for p in model.parameters()):
        return ()
    from memplan.torch.run.constants import written_outside_state_by_id

    params = list(model.parameters())
    shared = copy.deepcopy(model, memo={id(p): p for p in params})  # buffers copied, parameters shared
    versions = [p._version for p in params]
    outside = written_outside_state_by_id(capture, model)  # an EMA, a counter
    graph = capture.graph
    weights = {t for t, tensor in enumerate(graph.tensors) if tensor.category == Category.PARAMETER}
    runner = _WorkspaceRunner(capture, shared, _as_list(optimizers), steps, set(outside) | weights)
    kept: dict[int, torch.Tensor] = {id(t): t for i, t in outside.items() if i in runner.unskipped}
    others = [(t, t.detach().clone()) for t in kept.values()]
    try:
        with torch.random.fork_rng(devices=[]), blocks_mapped():
            runner(batch)  # warm-up: oneDNN primitives
            workspace = _measure_workspace(runner, batch)
    finally:
        with torch.no_grad():
            for tensor, before in others:
                tensor.copy_(before)
    if [p._version for p in params] != versions:
        raise MemplanError("measuring the kernels' workspace wrote a parameter; run without memory_budget")
    return workspace


class _WorkspaceRunner(_ProfilingRunner):
    """The step's ops without its calls: no optimizer update (its scratch is not measured
    anyway) and no other object's call, so the parameters it shares with the user's model are
    not written. Not a training step, so not held to the self-check."""

    def __init__(
        self, capture: Capture, model: torch.nn.Module, optimizers: Any, steps: Any, unwritten: set[int] = frozenset()
    ) -> None:
        """``unwritten``: graph tensors whose in-place writes are not run (the parameters, an
        EMA): an op writing one is skipped where its result is the written argument
        (``unskipped``: the tensors written by another op, which runs)."""
        super().__init__(capture, model, optimizers, steps)
        self._next_check = None
        self.skipped: dict[str, torch.fx.Node] = {}  # fx node -> the argument it writes and returns
        self.unskipped: set[int] = set()
        for op_id, op in enumerate(capture.graph.ops):
            hit = unwritten.intersection(op.mutates)
            if not hit:
                continue
            node = self.nodes[capture.node_of_op[op_id]]
            written = written_argument(node)
            if written is None:
                self.unskipped |= hit
            else:
                self.skipped[node.name] = written

    def _run(self, ins: Any, env: dict[str, Any], recompute: bool) -> Any:
        written = self.skipped.get(ins.node.name)
        if written is None:
            return super()._run(ins, env, recompute)
        return _resolve(written, env)

    def _update(self, ins: Any, env: dict[str, Any]) -> None:
        return None


__all__ = [
    "MAX_TIGHTENINGS",
    "BudgetPlan",
    "BudgetedReplay",
    "OwnBytes",
    "RematUnsupported",
    "caching_allocator_cap",
    "caching_allocator_capped",
    "check_process_room",
    "check_remat_supported",
    "is_byte_budget",
    "measure_op_workspace",
    "outside_step_bytes",
    "parse_memory_budget",
    "plan_budget",
    "tighten_budget",
    "warn_unmeasured_device",
]
