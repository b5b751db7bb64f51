"""The Python API.

The step-function form, as one writes a step for ``torch.compile`` or ``jax.jit``::

    @memplan.compile(model=model, optimizer=optimizer)
    def train_step(batch):
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    for batch in loader:
        loss = train_step(batch)

and its short form for the classic loop::

    step = memplan.compile_step(model, optimizer, loss_fn, example_batch)
    loss = step(batch)        # loss_fn(model(x), y); backward; optimizer.step(); zero_grad()

The first call for a batch shape captures the step on fakes swapped into the user's objects
(nothing allocated, nothing changed), plans it (order, then one arena with a static offset for
every tensor) and runs the plan on the real model; later calls of that shape run the plan.
Numerics equal eager PyTorch's; the model, optimizers, scaler and schedulers stay the user's
ordinary objects.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch.utils import _pytree as pytree

import torch
from memplan.errors import MemplanError
from memplan.isolate import in_child
from memplan.pipeline import COMPILE_REORDER_GAP, MemoryPlan, make_plan
from memplan.torch.capture import Capture, capture_infer_step, capture_step
from memplan.torch.capture.symbolic import NotSymbolic, SymbolicStep, state_meta, trace_symbolic
from memplan.torch.capture.trace import outside_modes_hold, standard_step
from memplan.torch.capture.wrappers import refuse_unplanned_wrappers
from memplan.torch.rss import release_free_memory
from memplan.torch.run.allocator import alignment_for
from memplan.torch.run.arena import LruCache, SharedArena
from memplan.torch.run.budget import caching_allocator_capped
from memplan.torch.run.first_state import state_step_within_eager
from memplan.torch.run.interpreter import Plan, StepRunner, allocator_tensors, optimizer_update_groups
from memplan.torch.run.plancache import StepCache, account_first_steps, open_plan_cache
from memplan.torch.run.replay import ReplayedStep
from memplan.torch.run.shapes import ShapeReplay, Template, check_dynamic, first_reuse, largest_batch, reuse_plan
from memplan.torch.run.updates import check_optimizers

if TYPE_CHECKING:
    from memplan.torch.distributed.fsdp_step import FsdpStep

StepFn = Callable[[Any], Any]


def plan_step(
    fn: StepFn | None,
    batch: Any,
    *,
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    scaler: Any = None,
    schedulers: Sequence[Any] = (),
    time_limit_seconds: float = 10.0,
    reorder: bool = True,
    allocator: str = "views",
    recompute_copies: bool = True,
    reorder_gap: float = COMPILE_REORDER_GAP,
) -> tuple[Capture, MemoryPlan]:
    """Capture and plan one step ``fn(batch)``; returns the capture and the plan (with its
    report). ``fn=None`` with no optimizer plans inference: ``with torch.no_grad(): model(batch)``.

    ``allocator="views"`` keeps the outputs of ops without an arena kernel out of the arena
    (the allocator holds them); ``"replay"`` plans one pool, as the planned allocator serves
    every allocation. ``recompute_copies`` runs a forward copy (``cat``, ``clone``) again in
    the backward where that lowers the peak: same bits, a copy's worth of time.
    """
    capture = capture_for(
        fn,
        batch,
        model=model,
        optimizers=optimizers,
        scaler=scaler,
        schedulers=schedulers,
        recompute_copies=recompute_copies,
    )
    return capture, plan_capture(
        capture,
        model,
        time_limit_seconds=time_limit_seconds,
        reorder=reorder,
        allocator=allocator,
        reorder_gap=reorder_gap,
    )


def capture_for(
    fn: StepFn | None,
    batch: Any,
    *,
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    scaler: Any = None,
    schedulers: Sequence[Any] = (),
    recompute_copies: bool = True,
    like: Capture | None = None,
    steady: StepCache | None = None,
) -> Capture:
    """The capture of :func:`plan_step` (``fn=None``: inference), not planned; ``like``: a
    capture of this step at another shape (one fake run where it holds, :func:`capture_step`);
    ``steady``: the plan cache, whose record of an earlier process's capture lets a restarted
    one trace its step once (:mod:`memplan.torch.capture.steady`)."""
    if fn is None:
        return capture_infer_step(model, batch)
    check_optimizers(optimizers, model)
    return capture_step(
        fn,
        batch,
        model=model,
        optimizers=optimizers,
        scaler=scaler,
        schedulers=schedulers,
        recompute_copies=recompute_copies,
        like=like,
        steady=steady,
    )


def plan_capture(
    capture: Capture,
    model: torch.nn.Module,
    *,
    time_limit_seconds: float = 10.0,
    reorder: bool = True,
    allocator: str = "views",
    plan_cache: StepCache | None = None,
    cache_options: dict[str, Any] | None = None,
    reorder_gap: float = COMPILE_REORDER_GAP,
) -> MemoryPlan:
    """The plan of :func:`plan_step` for a capture: order and placement, solved in a child;
    with ``plan_cache`` (:mod:`memplan.torch.run.plancache`) a valid plan stored for this very
    step is used instead (``cache_options``: what else its key holds). ``reorder_gap``: the
    reorder stops once its order is within that fraction of a proven bound (0: prove it)."""
    groups = optimizer_update_groups(capture) if capture.mode == "train" else []
    exclude = allocator_tensors(capture) if allocator == "views" else frozenset()
    alignment = alignment_for(model_device(model))

    def make() -> MemoryPlan:
        return in_child(  # the solvers' memory stays out of the training process
            make_plan,
            capture.graph,
            time_limit_seconds=time_limit_seconds,
            reorder=reorder,
            atomic_groups=groups,
            allocator_tensors=exclude,
            alignment_bytes=alignment,
            reorder_gap=reorder_gap,
        )

    if plan_cache is None:
        plan = make()
    else:
        options = {"time_limit_seconds": time_limit_seconds, "reorder": reorder, "allocator": allocator}
        options["reorder_gap"] = reorder_gap
        options |= {"device": str(model_device(model)), **(cache_options or {})}
        plan = plan_cache.plan(capture, options, make, groups, exclude, alignment)
    plan.report["recomputed_copies"] = list(capture.recomputed)
    plan.report["calls"] = [region.kind for region in capture.regions]
    return plan


def optimize(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    example_batch: Any,
    *,
    time_limit_seconds: float = 10.0,
    reorder: bool = True,
    allocator: str = "views",
    recompute_copies: bool = True,
) -> tuple[Capture, MemoryPlan]:
    """:func:`plan_step` for the classic loop: with an optimizer and a loss function a training
    step on ``example_batch = (inputs, target)``; without, an inference step."""
    if optimizer is not None and loss_fn is None:
        raise TypeError("a training step needs loss_fn(output, target)")
    fn = standard_step(model, optimizer, loss_fn) if optimizer is not None else None
    return plan_step(
        fn,
        example_batch,
        model=model,
        optimizers=[optimizer] if optimizer is not None else [],
        time_limit_seconds=time_limit_seconds,
        reorder=reorder,
        allocator=allocator,
        recompute_copies=recompute_copies,
    )


ALLOCATORS = ("auto", "replay", "views")


def check_reorder_gap(gap: float) -> float:
    """``gap`` if it is a relative gap limit (0 <= gap < 1), else a one-line error."""
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not 0 <= gap < 1:
        raise MemplanError(f"reorder_gap must be a fraction in [0, 1) (0.005 = 0.5%, 0 proves), not {gap!r}")
    return float(gap)


def resolve_allocator(name: str) -> str:
    """ "auto" is "replay" where the planned CPU allocator builds here, else "views"."""
    if name not in ALLOCATORS:
        raise MemplanError(f"unknown allocator {name!r}; choose one of {', '.join(ALLOCATORS)}")
    if name != "auto":
        return name
    from memplan.torch.run import allocator

    return "replay" if allocator.available() else "views"


def choose_allocator(name: str, device: torch.device) -> tuple[str, str]:
    """The allocator mode of a step on ``device`` and one line saying why: the planned CPU
    allocator on the CPU, the planned CUDA allocator on a GPU where it was installed
    (:mod:`memplan.torch.run.cuda_allocator`), else arena views."""
    if name not in ALLOCATORS:
        raise MemplanError(f"unknown allocator {name!r}; choose one of {', '.join(ALLOCATORS)}")
    if device.type == "cuda":
        from memplan.torch.run import cuda_allocator

        return cuda_allocator.runtime_choice(name)
    if device.type != "cpu":
        if name == "replay":
            raise MemplanError(f"allocator='replay' serves CPU and CUDA memory only; use allocator='views' on {device}")
        return "views", f"no planned allocator for {device.type}: arena views"
    chosen = resolve_allocator(name)
    if chosen == "replay":
        return chosen, "the planned CPU allocator records and replays the step"
    return chosen, "allocator='views' requested" if name == "views" else "the planned CPU allocator did not build here"


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model's first parameter or buffer lives (the CPU for a model with none)."""
    return next(iter([*model.parameters(), *model.buffers()]), torch.empty(0)).device


def _on_one_device(model: torch.nn.Module) -> bool:
    return len({t.device for t in [*model.parameters(), *model.buffers()]}) <= 1


DEFAULT_MAX_PLANS = 8


class CompiledStep:
    """A planned training (or inference) step function; call it with a batch.

    Each batch shape (and model mode) gets its own plan; all of them share one arena, sized for
    the largest kept plan, and at most ``max_plans`` plans are kept, the least recently used
    evicted (Sekiyama et al. 4.3), so memory does not grow with the number of distinct shapes.
    ``plans_made`` and ``planning_seconds`` say what re-planning cost.
    """

    def __init__(
        self,
        fn: StepFn | None,
        model: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        *,
        scaler: Any = None,
        schedulers: Sequence[Any] = (),
        time_limit_seconds: float = 10.0,
        reorder: bool = True,
        allocator: str = "auto",
        recompute_copies: bool = True,
        memory_budget: int | float | str | None = None,
        max_overhead: float | None = None,
        executor: str = "generated",
        max_plans: int = DEFAULT_MAX_PLANS,
        dynamic: dict[int, int] | None = None,
        plan_cache: bool | str | os.PathLike | None = None,
        reorder_gap: float = COMPILE_REORDER_GAP,
    ) -> None:
        refuse_unplanned_wrappers(model)  # FSDP, DDP, torch.compile: refused by name, before anything else
        self.executor = executor
        device = model_device(model)
        if _on_one_device(model):
            self.allocator, self.allocator_reason = choose_allocator(allocator, device)
        elif allocator == "replay":
            raise MemplanError("allocator='replay' needs the model on one device; use allocator='views'")
        else:
            self.allocator, self.allocator_reason = "views", "the model spans several devices: arena views"
        self._native = None  # the CPU allocator by default; the CUDA one on a GPU
        if self.allocator == "replay" and device.type == "cuda":
            from memplan.torch.run import cuda_allocator

            self._native = cuda_allocator.native()
        self.fn = fn
        self.model = model
        self.optimizers = list(optimizers)
        self.optimizer = self.optimizers[0] if self.optimizers else None
        self.scaler = scaler
        self.schedulers = list(schedulers)
        self.time_limit_seconds = time_limit_seconds
        self.reorder = reorder
        self.reorder_gap = check_reorder_gap(reorder_gap)
        self.recompute_copies = recompute_copies
        self.memory_budget = memory_budget
        self.max_overhead = max_overhead
        if memory_budget is not None or max_overhead is not None:
            from memplan.torch.run.budget import check_max_overhead, parse_memory_budget
            from memplan.torch.run.fit import is_fit

            check_max_overhead(max_overhead)
            if memory_budget is not None and not is_fit(memory_budget):
                parse_memory_budget(memory_budget, 1)  # a malformed budget is refused now, not at the first call
        self._own_arena: set[int] = set()  # runners (views-mode budget plans) that keep their own arena
        self.arena = SharedArena(device)  # one arena for every shape (Sekiyama 4.3)
        self._kept: LruCache[tuple[StepRunner | ReplayedStep, MemoryPlan]] = LruCache(max_plans)
        self._outside_of: dict[tuple, list] = {}  # key -> its capture's modules outside the model, and their modes
        self.plans_made = 0
        self.planning_seconds = 0.0  # capture and graph plan, for every shape (the placement of recorded steps too)
        # plans on disk (memplan.torch.run.plancache); not under a budget, which depends on this machine's memory
        budgeted = memory_budget is not None or max_overhead is not None
        self.plan_cache: StepCache | None = None if budgeted else open_plan_cache(plan_cache)
        # issue 37: shapes reuse a kept plan made for larger ones (run/shapes.py); ``dynamic``
        # ({dimension: largest size}) plans the largest declared shape first
        self.dynamic = check_dynamic(dynamic) if dynamic is not None else None
        self._templates: list[Template] = []
        # issue 37: the declared largest shape's step captured with a symbolic length (or why it
        # could not be), by template key: a new length is checked by its guards, not traced
        self._symbolic: dict[tuple, SymbolicStep | str] = {}
        self._quiet = False  # the latest new shape was neither traced nor solved: nothing to give back
        self._matched: Template | None = None  # the template the latest new shape's program matched
        self._checked: set[tuple] = set()  # templates whose program ran a full self-check
        self._first_checks: dict[int, tuple[Any, tuple]] = {}  # runner -> (runner, template key)
        self.plans_reused = 0
        self._cache_caps: dict[int, int | None] = {}  # runner -> PyTorch's cache held to the budget (CUDA)
        self.shape_log: list[dict[str, Any]] = []  # per new (shape, mode): which plan, what it cost

    @property
    def max_plans(self) -> int:
        return self._kept.max_entries

    @property
    def runners(self) -> dict[tuple, StepRunner | ReplayedStep]:
        """The kept runners by (shape, mode) key, least recently used first."""
        return {key: self._kept[key][0] for key in self._kept}

    @property
    def plans(self) -> dict[tuple, MemoryPlan]:
        """The kept plans by (shape, mode) key, least recently used first."""
        return {key: self._kept[key][1] for key in self._kept}

    @property
    def evictions(self) -> int:
        return self._kept.evictions

    @classmethod
    def of_loss(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        **options: Any,
    ) -> CompiledStep:
        """The classic step ``loss_fn(model(inputs), target)``, backward, ``optimizer.step()``,
        ``zero_grad`` on batches ``(inputs, target)``; with no optimizer, inference on ``inputs``."""
        if optimizer is None:
            return cls(None, model, **options)
        return cls(standard_step(model, optimizer, loss_fn), model, [optimizer], **options)

    def __call__(self, batch: Any) -> Any:
        runner = self.runner_for(batch)
        result = self._run(runner, batch)
        first = self._first_checks.pop(id(runner), None)
        if first is not None and first[0] is runner:  # its program passed the full self-check (issue 37)
            self._checked.add(first[1])
        return result

    def _run(self, runner: StepRunner | ReplayedStep, batch: Any) -> Any:
        if not isinstance(runner, ReplayedStep):
            if id(runner) in self._own_arena:
                cap = self._cache_caps.get(id(runner))
                if cap is None:
                    return runner(batch)
                with caching_allocator_capped(cap, self._written_state()):  # issue 33: held on CUDA too
                    return runner(batch)
            with state_step_within_eager(runner, self.model, self.optimizers):  # issue 37: run/first_state.py
                return runner(batch)
        was_replaying, placing_seconds = runner.replaying, runner.planning_seconds
        result = runner(batch)
        self.planning_seconds += runner.planning_seconds - placing_seconds
        if runner.refused is not None:
            self._fall_back_to_views(runner.refused)
            return result
        if runner.replaying and not was_replaying:
            self._fit_arena()  # placed: the arena at the size the kept plans need
        return result

    def _written_state(self) -> list[torch.Tensor]:
        """The tensors a training step writes: the model's parameters and buffers, the optimizers' state."""
        state = [*self.model.parameters(), *self.model.buffers()]
        for optimizer in self.optimizers:
            state += [v for per in optimizer.state.values() for v in per.values() if isinstance(v, torch.Tensor)]
        return state

    def runner_for(self, batch: Any) -> StepRunner | ReplayedStep:
        """The runner for this batch's shapes and the model's modes, planned on first use; the
        least recently used plan is dropped when more than ``max_plans`` are kept."""
        key = (shape_key(batch), mode_key(self.model))
        kept = self._kept.get(key)
        if kept is not None and not outside_modes_hold(self._outside_of.get(key, [])):
            kept = None  # a module outside the model changed mode (a teacher put in train mode): capture again
            self._templates = [t for t in self._templates if t.key != key]
        if kept is None:
            start = time.perf_counter()
            budgeted = self.memory_budget is not None or self.max_overhead is not None
            outside = self._outside_step(batch) if budgeted else None  # before capture (issue 33: OwnBytes)
            capture, plan = self._plan_shape(batch, key)
            if budgeted:
                runner: StepRunner | ReplayedStep = self._budget_runner(capture, plan, batch, outside)
            elif self.allocator == "replay":
                runner = ShapeReplay(
                    StepRunner(
                        capture,
                        Plan(tuple(plan.order)),
                        self.model,
                        self.optimizers,
                        scaler=self.scaler,
                        executor=self.executor,
                    ),
                    time_limit_seconds=self.time_limit_seconds,
                    arena=self.arena,
                    native=self._native,
                    schedulers=self.schedulers,
                    candidates=lambda: self._replay_candidates(key),
                    place_after=1,  # the first step recorded unobserved is placed (memplan.torch.run.replay)
                    keep_observed=self.plan_cache is not None and self._native is None,
                )
                if self.plan_cache is not None and self._native is None:  # CUDA traces name streams by address
                    self.plan_cache.attach(runner, plan)
            else:
                self._unbind_views()  # the old block must have no other holder when it grows
                arena = self.arena.reserve(plan.arena_bytes)
                runner = StepRunner(
                    capture,
                    Plan(tuple(plan.order), plan.offsets, plan.arena_bytes),
                    self.model,
                    self.optimizers,
                    scaler=self.scaler,
                    arena=arena,
                    executor=self.executor,
                )
            plan.report["allocator"] = self.allocator
            plan.report["allocator_reason"] = self.allocator_reason
            self._check_once_per_program(runner)
            self._kept.put(key, (runner, plan))  # the evicted plans are dropped here
            self._outside_of[key] = capture.outside_modules
            self._fit_arena()
            if not self._quiet:
                release_free_memory()  # what capture and the solvers freed goes back to the OS
            self.planning_seconds += time.perf_counter() - start
            account_first_steps(runner, plan, time.perf_counter() - start, capture.capture_seconds)
            kept = self._kept[key]
        return kept[0]

    def _capture(self, batch: Any, like: Capture | None = None) -> Capture:
        return capture_for(
            self.fn,
            batch,
            model=self.model,
            optimizers=self.optimizers,
            scaler=self.scaler,
            schedulers=self.schedulers,
            recompute_copies=self.recompute_copies,
            like=like,
            steady=self.plan_cache,
        )

    def _solve(self, capture: Capture, key: tuple) -> MemoryPlan:
        """The solvers' plan for ``capture``, kept as a template other shapes may reuse."""
        plan = plan_capture(
            capture,
            self.model,
            time_limit_seconds=self.time_limit_seconds,
            reorder=self.reorder,
            reorder_gap=self.reorder_gap,
            allocator=self.allocator,
            plan_cache=self.plan_cache,
            cache_options={"recompute_copies": self.recompute_copies, "executor": self.executor, "key": key},
        )
        self.plans_made += 1
        if self.memory_budget is None and self.max_overhead is None:
            self._add_template(Template(capture, plan, *self._reuse_terms(capture), key))
        return plan

    def _reuse_terms(self, capture: Capture) -> tuple[frozenset[int], int]:
        exclude = allocator_tensors(capture) if self.allocator == "views" else frozenset()
        return frozenset(exclude), alignment_for(model_device(self.model))

    def _plan_shape(self, batch: Any, key: tuple) -> tuple[Capture, MemoryPlan]:
        """Capture this shape; reuse a template's plan where it is proven valid for it (issue 37,
        :mod:`memplan.torch.run.shapes`), else plan it (first planning the declared largest shape
        when ``dynamic`` was given and no template of this mode exists)."""
        start = time.perf_counter()
        self._quiet = False
        budgeted = self.memory_budget is not None or self.max_overhead is not None
        if self.dynamic is not None and not budgeted and not any(t.key[1] == key[1] for t in self._templates):
            largest = largest_batch(batch, self.dynamic)
            if largest is not None and shape_key(largest) != key[0]:
                self._solve(self._capture(largest), (shape_key(largest), key[1]))
        same = next((t for t in self._templates if t.key == key), None)
        if same is not None and not budgeted:  # planned already (the declared largest shape): its capture holds
            self._matched = same
            self.plans_reused += 1
            self._log(key, "the plan made for it", start, "traced: the declared largest shape")
            return same.capture, same.plan
        templates = [] if budgeted else [t for t in reversed(self._templates) if t.key[1] == key[1]]
        checked = None
        if templates and self.dynamic is not None:
            found = self._by_guards(batch, key, start)
            if not isinstance(found, str):
                return found
            checked = f"traced: {found}"
        # a kept template's capture stands for the untraced run (one fake run); a program it
        # does not give a plan for is captured again in full before it is planned (issue 37)
        for like in [templates[0].capture, None] if templates else [None]:
            capture = self._capture(batch, like)
            found = first_reuse(templates, capture, lambda c: self._reuse_terms(c)[0])
            if not isinstance(found, list):
                self._matched, reused = found
                self.plans_reused += 1
                self._log(key, f"reused the plan of {_shape_text(self._matched.key)}", start, checked)
                self.shape_log[-1]["fake_runs"] = capture.fake_runs
                return capture, reused
            if capture.fake_runs > 1:
                break
        reasons = found
        plan = self._solve(capture, key)
        self._matched = next((t for t in self._templates if t.capture is capture), None)
        why = "a memory budget" if budgeted else reasons[0] if reasons else "no plan of this mode yet"
        self._log(key, f"planned ({why})", start, checked)
        return capture, plan

    def _by_guards(self, batch: Any, key: tuple, start: float) -> tuple[Capture, MemoryPlan] | str:
        """This shape's capture made, without tracing, from the declared largest shape's step
        captured with a symbolic length, when that capture's guards hold here
        (:mod:`memplan.torch.capture.symbolic`), with the largest plan reused for it; else why
        not (then the shape is traced). The symbolic capture is made on the first call that needs it
        once the optimizers' state exists (one fake run instead of two: the first step stays short)."""
        largest = largest_batch(batch, self.dynamic)
        if largest is None:
            return "larger than the declared largest shape"
        template_key = (shape_key(largest), key[1])
        template = next((t for t in self._templates if t.key == template_key), None)
        if template is None:
            return "the declared largest shape has no plan of this mode"
        step = self._symbolic.get(template_key)
        traced = step is None
        if step is None and state_meta(self.model, self.optimizers) != template.capture.optimizer_state_meta:
            return "the symbolic capture waits for the optimizers' state (the first step makes it)"
        if step is None:
            try:
                step = trace_symbolic(
                    self.fn,
                    largest,
                    self.dynamic,
                    template.capture,
                    model=self.model,
                    optimizers=self.optimizers,
                    scaler=self.scaler,
                    schedulers=self.schedulers,
                )
            except NotSymbolic as err:
                step = str(err)
            self._symbolic[template_key] = step
        if isinstance(step, str):
            return f"no symbolic capture ({step})"
        capture = step.instantiate(batch, self.model, self.optimizers)
        if isinstance(capture, str):
            return capture
        reused = reuse_plan(template, capture, self._reuse_terms(capture)[0])
        if isinstance(reused, str):
            return reused
        self._quiet = not traced  # nothing traced or solved: no heap to give back
        self._matched = template
        self.plans_reused += 1
        self._log(key, f"reused the plan of {_shape_text(template.key)}", start, "guards")
        self.shape_log[-1]["fake_runs"] = 0
        return capture, reused

    def _add_template(self, template: Template) -> None:
        """Keep ``template``; drop the templates it covers (same program, no larger tensors)."""
        self._templates = [
            t
            for t in self._templates
            if t.key[1] != template.key[1]
            or not isinstance(reuse_plan(template, t.capture, t.allocator_tensors), MemoryPlan)
        ]
        self._templates.append(template)
        del self._templates[: -self.max_plans]
        kept = {t.key for t in self._templates}
        self._symbolic = {k: v for k, v in self._symbolic.items() if k in kept}

    def _check_once_per_program(self, runner: StepRunner | ReplayedStep) -> None:
        """The full self-check (writes and random draws observed) once per program: a shape that
        reused the plan of a program that passed it runs its first step under the light one
        (optimizer state and gradients), which leaves its allocations alone, so the planned
        allocator can record that step and replay from the next (issue 37)."""
        template, step = self._matched, runner.run if isinstance(runner, ReplayedStep) else runner
        if template is None or not isinstance(step, StepRunner):
            return
        if template.key in self._checked and getattr(step, "_next_check", None) == "full":
            step._next_check = "light"
        else:
            self._first_checks[id(runner)] = (runner, template.key)

    def _replay_candidates(self, key: tuple) -> list[ReplayedStep]:
        """The kept replayed steps of this mode whose placement a new shape may reuse, largest first."""
        steps = [self._kept[k][0] for k in self._kept if k[1] == key[1] and k != key]
        steps = [r for r in steps if isinstance(r, ReplayedStep)]
        return sorted((r for r in steps if r.plan is not None), key=lambda r: -r.plan.arena_bytes)

    def _log(self, key: tuple, how: str, start: float, checked: str | None = None) -> None:
        entry = {"shape": _shape_text(key), "plan": how, "seconds": time.perf_counter() - start}
        if self.dynamic is not None:  # issue 37: how the shape was checked against the kept program
            entry["checked"] = checked or "traced"
        self.shape_log.append(entry)

    def _fall_back_to_views(self, reason: str) -> None:
        """Give the planned allocator up (the step that found why ran on the ordinary allocator
        and was right): every plan is dropped, the next step plans with arena views."""
        self.allocator, self.allocator_reason, self._native = "views", f"{reason}; arena views from now on", None
        self._kept = LruCache(self.max_plans)
        self._outside_of = {}
        self._templates = []  # made for the planned allocator: other tensors in the arena
        self._symbolic = {}
        self.arena.release()

    def _needed_arena_bytes(self) -> int:
        """The largest arena a kept plan uses (0 for a replayed step still recording)."""
        sizes = [
            r.arena_block_bytes if isinstance(r, ReplayedStep) else r.plan.arena_bytes
            for r, _ in self._kept.values()
            if id(r) not in self._own_arena
        ]
        return max(sizes, default=0)

    def _unbind_views(self) -> None:
        for runner, _ in self._kept.values():
            if isinstance(runner, StepRunner) and id(runner) not in self._own_arena:
                runner.arena = torch.empty(0, dtype=torch.uint8, device=self.arena.device)

    def _fit_arena(self) -> None:
        """The shared arena at the size the kept plans need: smaller once the plans that needed
        more were evicted, never one block per shape."""
        self._unbind_views()
        arena = self.arena.fit(self._needed_arena_bytes())
        for runner, _ in self._kept.values():
            if isinstance(runner, StepRunner) and id(runner) not in self._own_arena:
                runner.arena = arena

    def _outside_step(self, batch: Any) -> int | None:
        from memplan.torch.run.budget import outside_step_bytes

        return outside_step_bytes(self.model, self.optimizers, batch)

    def _budget_runner(
        self, capture: Capture, plan: MemoryPlan, batch: Any, outside_before: int | None = None
    ) -> StepRunner | ReplayedStep:
        """The runner within ``memory_budget``/``max_overhead`` (:mod:`memplan.torch.run.budget`):
        the reordered, placed plan when it fits, else the remat portfolio's plan run by
        :class:`RematRunner` (with the planned allocator, every allocation at a static offset)."""
        from memplan.torch.run.budget import BudgetedReplay, check_remat_supported, plan_budget
        from memplan.torch.run.remat import RematRunner

        check_remat_supported(capture, self.optimizers, self.scaler)
        decided = plan_budget(
            capture,
            int(plan.report["planned_peak_bytes"]),
            self.model,
            self.optimizers,
            batch,
            memory_budget=self.memory_budget,
            max_overhead=self.max_overhead,
            time_limit_seconds=self.time_limit_seconds,
            joint_reorder=self.reorder,
            plain_order=plan.order,
            outside_before_bytes=outside_before,
        )
        plan.report["budget"] = decided.report

        def make_runner(schedule: Any) -> StepRunner:
            if schedule is not None:
                return RematRunner(capture, schedule.steps, self.model, self.optimizers, executor=self.executor)
            return StepRunner(
                capture,
                Plan(tuple(plan.order))
                if self.allocator == "replay"
                else Plan(tuple(plan.order), plan.offsets, plan.arena_bytes),
                self.model,
                self.optimizers,
                executor=self.executor,
            )

        if self.allocator == "replay":  # the placed arena is held to the budget
            persistent = int(plan.report["persistent_bytes"])
            return BudgetedReplay(
                decided,
                make_runner,
                persistent,
                decided.report,
                time_limit_seconds=self.time_limit_seconds,
                arena=self.arena,
                native=self._native,
                schedulers=self.schedulers,
            )
        runner = make_runner(decided.schedule)
        self._own_arena.add(id(runner))
        self._cache_caps[id(runner)] = decided.report.get("caching_allocator_cap_bytes")
        return runner

    @property
    def report(self) -> dict[str, Any]:
        """The report of the most recent plan."""
        if not self.plans:
            return {}
        return list(self.plans.values())[-1].report


def _shape_text(key: tuple) -> str:
    """A shape key as the shapes of its tensors, for reports."""
    shapes = key[0][1] if isinstance(key[0], tuple) and len(key[0]) == 2 else ()
    return " ".join("x".join(map(str, s[0])) for s in shapes if isinstance(s, tuple) and isinstance(s[0], tuple))


def shape_key(batch: Any) -> tuple:
    """What a plan is made for: the batch's structure, each tensor's shape and dtype, and each
    other leaf's value (``None``, a flag), which the traced step has fixed."""
    leaves, spec = pytree.tree_flatten(batch)
    shapes = tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else _leaf_key(x) for x in leaves)
    return (str(spec), shapes)


def mode_key(model: torch.nn.Module) -> tuple:
    """What the traced step fixed about the model that a training loop changes between steps:
    each module's ``training`` flag (``model.eval()``) and each parameter's ``requires_grad``
    (freezing, unfreezing). Another mode gets another plan, never a stale one."""
    training: list[bool] = []
    requires_grad: list[bool] = []
    seen: set[int] = set()
    stack = [model]
    while stack:  # model.modules() and .parameters() walk the tree twice, building every name
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        training.append(module.training)
        for p in module._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                requires_grad.append(p.requires_grad)
        stack.extend(reversed([m for m in module._modules.values() if m is not None]))
    return tuple(training), tuple(requires_grad)


def _leaf_key(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value), value)
    return type(value)


def compile(  # the name PyTorch users know (torch.compile)
    fn: StepFn | None = None,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
    scaler: Any = None,
    scheduler: Any | Sequence[Any] = (),
    time_limit_seconds: float = 10.0,
    reorder: bool = True,
    allocator: str = "auto",
    recompute_copies: bool = True,
    memory_budget: int | float | str | None = None,
    max_overhead: float | None = None,
    executor: str = "generated",
    max_plans: int = DEFAULT_MAX_PLANS,
    dynamic: dict[int, int] | None = None,
    plan_cache: bool | str | os.PathLike | None = None,
    reorder_gap: float = COMPILE_REORDER_GAP,
) -> CompiledStep | Callable[[StepFn], CompiledStep]:
    """Plan the whole step ``fn(batch)`` the user wrote: forward(s), ``backward()``, gradient
    clipping, gradient accumulation over micro-batches, autocast, ``optimizer.step()``,
    ``scaler.scale/step/update``, ``scheduler.step()``, ``optimizer.zero_grad()``.

    ``model``, ``optimizer`` (one or a list), ``scaler`` (a ``torch.amp.GradScaler``) and
    ``scheduler`` (one or a list of LR schedulers) are the objects ``fn`` uses; memplan swaps
    fakes into them while it captures and makes their calls for real at run time. Used as a
    decorator when ``fn`` is omitted. A step is planned on its first call for each batch
    shape (at most ``max_plans`` kept, least recently used evicted; one arena for all).
    The tensor ops of ``fn`` are what runs afterwards: Python side effects other than
    those calls (a print) happen at capture only, and Python values the step reads (a
    global the caller changes between calls) are frozen there: pass them in the batch as
    tensors. A step that reads a tensor's value to decide what to do, passes its ops other
    numbers from one call to the next (a counter it keeps), or sets the random generator
    (a seed, ``torch.utils.checkpoint`` around dropout) is refused. ``executor="interpreted"`` walks the
    planned program op by op (the reference) instead of running it as one generated function.

    ``memory_budget`` trades compute for memory, as ``torch.utils.checkpoint`` and
    ``torch._functorch.config.activation_memory_budget`` do, but planned: the step's whole
    peak (parameters, gradients, optimizer state, batch, activations) stays within it. Give
    bytes (``2_000_000_000``, ``"2GiB"``, ``"512MB"``) or a fraction of the checkpoint-all peak,
    the peak of the step that keeps every activation (``0.5``, ``"50%"``; 1.0 recomputes
    nothing), or ``"fit"``: whatever this process may use (the cgroup limit or the available
    memory, less what it holds outside the step and a margin; on CUDA the device's free memory),
    resolved at the first call and reported. The budget holds from the first call on.
    ``max_overhead`` (0.1: "at most 10% more compute") alone asks for the lowest
    peak within that much recomputation; with ``memory_budget`` it caps the cheapest plan's.
    The plan reorders and places first; only if that does not fit does it recompute
    activations in the backward (a portfolio of Moccasin's CP model, Checkmate's MILP and the
    baselines, with each kernel's workspace measured within the budget). A recompute runs
    the same kernel on the same inputs and random ops are never recomputed, so numerics stay
    eager's bit for bit. A budget no plan reaches raises ``InfeasibleBudget`` with the smallest
    peak there is; a step with a GradScaler is refused with a budget (several optimizers are not).
    ``train_step.report["budget"]`` says what was decided (method, planned peak, overhead).

    A shape whose step runs the same ops as a kept plan's on tensors no larger reuses that
    plan's order and placement, validated for it, instead of being planned again (issue 37;
    ``shape_log`` says which plan each shape used); ``dynamic={1: 512}`` declares that batch
    tensors grow up to 512 along dimension 1 and plans that largest shape first, so every
    length up to it reuses one plan (the arena is sized once). Without a budget only.

    ``plan_cache=True`` keeps plans on disk (``$MEMPLAN_CACHE_DIR``, else ``~/.cache/memplan``;
    or give a folder), keyed by a hash of the captured step, the options and the code, so a
    restarted process skips the solvers and the recordings: its first step replays. Entries are
    validated on load and a replayed step is checked allocation by allocation; a stale or
    corrupt entry is ignored with a warning and rewritten. ``report["first_steps"]`` says which
    plan each shape used and what its first steps cost. Not under a memory budget.

    ``reorder_gap`` (default 0.005) stops the reorder's solvers once their order's peak is
    within that fraction of a proven lower bound (the MIP solvers' relative gap), instead of
    spending the time limit to prove the last bytes; ``reorder_gap=0`` proves the order optimal
    (or runs to ``time_limit_seconds``). The report's ``schedule`` says its status and gap.
    """
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    schedulers = list(scheduler) if isinstance(scheduler, (list, tuple)) else [scheduler] if scheduler else []
    from memplan.torch.integrations.accelerate import adapt

    model, optimizers, schedulers = adapt(model, optimizers, schedulers)  # accelerator.prepare()'s wrappers

    def build(step_fn: StepFn) -> CompiledStep:
        return CompiledStep(
            step_fn,
            model,
            optimizers,
            scaler=scaler,
            schedulers=schedulers,
            time_limit_seconds=time_limit_seconds,
            reorder=reorder,
            allocator=allocator,
            recompute_copies=recompute_copies,
            memory_budget=memory_budget,
            max_overhead=max_overhead,
            executor=executor,
            max_plans=max_plans,
            dynamic=dynamic,
            plan_cache=plan_cache,
            reorder_gap=reorder_gap,
        )

    return build if fn is None else build(fn)


def compile_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    example_batch: Any,
    *,
    time_limit_seconds: float = 10.0,
    reorder: bool = True,
    allocator: str = "auto",
    recompute_copies: bool = True,
    memory_budget: int | float | str | None = None,
    max_overhead: float | None = None,
    max_plans: int = DEFAULT_MAX_PLANS,
    dynamic: dict[int, int] | None = None,
    plan_cache: bool | str | os.PathLike | None = None,
    reorder_gap: float = COMPILE_REORDER_GAP,
) -> CompiledStep | FsdpStep:
    """Plan ``loss = loss_fn(model(inputs), target); loss.backward(); optimizer.step();
    optimizer.zero_grad(set_to_none=True)`` for ``example_batch = (inputs, target)`` and return
    it as a callable ``step(batch)``: the short form of :func:`compile`.
    ``recompute_copies=False`` keeps every forward copy instead of running it again in the
    backward (:mod:`memplan.torch.capture.recompute`). ``memory_budget`` (bytes, ``"2GiB"``, or
    a fraction of the checkpoint-all peak such as ``0.5``) and ``max_overhead`` (0.1: at most
    10% more compute) rematerialise activations to fit, as in :func:`compile`.
    A model sharded with FSDP2's ``fully_shard`` is planned by
    :func:`memplan.torch.distributed.compile_fsdp_step` (every rank calls this together)."""
    if _is_fsdp2(model):
        return _compile_fsdp2_step(
            model,
            optimizer,
            loss_fn,
            example_batch,
            time_limit_seconds=time_limit_seconds,
            reorder=reorder,
            recompute_copies=recompute_copies,
            memory_budget=memory_budget,
            unsupported={
                "allocator": allocator != "auto",
                "max_overhead": max_overhead is not None,
                "dynamic": dynamic is not None,
                "plan_cache": bool(plan_cache),
                "reorder_gap": reorder_gap != COMPILE_REORDER_GAP,
            },
        )
    step = CompiledStep.of_loss(
        model,
        optimizer,
        loss_fn,
        time_limit_seconds=time_limit_seconds,
        reorder=reorder,
        allocator=allocator,
        recompute_copies=recompute_copies,
        memory_budget=memory_budget,
        max_overhead=max_overhead,
        max_plans=max_plans,
        dynamic=dynamic,
        plan_cache=plan_cache,
        reorder_gap=reorder_gap,
    )
    step.runner_for(example_batch)
    return step


def _is_fsdp2(model: torch.nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")  # imported by whoever sharded the model
    return fsdp is not None and isinstance(model, getattr(fsdp, "FSDPModule", ()))


def _compile_fsdp2_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    example_batch: Any,
    *,
    unsupported: dict[str, bool],
    **options: Any,
) -> Any:
    """An FSDP2 model's step, refused in one line for the options its planner does not take yet."""
    given = [name for name, is_given in unsupported.items() if is_given]
    if given:
        raise MemplanError(
            f"an FSDP2-sharded model's step does not take {', '.join(given)} yet; "
            "call compile_step without it (on an FSDP2 step, memory_budget trades compute for memory)"
        )
    from memplan.torch.distributed import compile_fsdp_step

    return compile_fsdp_step(model, optimizer, loss_fn, example_batch, **options)


def compile_inference(
    model: torch.nn.Module, example_inputs: Any, *, time_limit_seconds: float = 10.0, allocator: str = "auto"
) -> CompiledStep:
    """Plan ``with torch.no_grad(): model(inputs)`` and return it as a callable."""
    step = CompiledStep(None, model, time_limit_seconds=time_limit_seconds, allocator=allocator)
    step.runner_for(example_inputs)
    return step
