"""Run a rematerialised step: a :class:`memplan.remat.RematSchedule`'s step sequence on the
real model and optimizer (Checkmate section 4.7: the lowered schedule is executed as is).

``("run", op)`` interprets the op's fx node; a recompute reads the most recent instances of
its inputs, and the node's name in the environment gets the new instance (the lowering
re-runs the views and in-place followers of a recomputed tensor, so those names are
re-derived too). ``("free", tensor)`` drops every reference to the tensor's storage, so the
allocator takes it back. Optimizer ops run through the user's own optimizer, one parameter
at a time, exactly as :class:`memplan.torch.runtime.StepRunner` does; release ops are no-ops.

A recompute of a training-mode batch norm is given no running statistics: the output equals
the first run's bitwise and the statistics are updated once per step, as in eager PyTorch
(:func:`memplan.remat.problem.recompute_skips_mutation`). Random ops are never recomputed.

An op whose kernel returns a fresh output in a storage larger than the traced one (PyTorch's CPU
``mse_loss``, ``smooth_l1_loss``, ``binary_cross_entropy``, ``soft_margin_loss``: the 0-dim loss
in the 128 KiB storage of the unreduced loss) would hold more than the plan counts for as long as
the output lives (the step's loss: to the end of the step, one activation above the planned peak,
issue 33). Its output is copied to a storage of the traced size, same strides, same bits
(:class:`Shrink`), while the op runs: the larger storage is then its workspace, which the plan
counts (:mod:`memplan.torch.run.profile`). Every interpreted op is checked; the ops found doing it
on the first step are the ones the generated function copies.

What this interpreter decides per step is fixed by the sequence, so by default the sequence is
written once as one Python function (:mod:`memplan.torch.run.remat_codegen`, issue 33: the
budgeted step's host time); ``executor="interpreted"`` keeps this loop, the reference. It is
written at the end of the first (interpreted) step, when the step's tensors are freed, not at
the start of the second: compiling a function of thousands of lines leaves some MiB of freed
heap that the next step would otherwise run on top of (the Llama of ``bench/llama_budget.py``
at batch 2: 5.9 MiB above its steady steps); the recording step then hands them back as it ends
(:meth:`memplan.torch.run.replay.ReplayedStep._record`) and the function's own bytes are
counted before the next step (:class:`memplan.torch.run.budget.BudgetedReplay`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx
from torch.utils import _pytree as pytree

import torch
from memplan.errors import MemplanError, UnsupportedOp
from memplan.remat.problem import Step, recompute_skips_mutation
from memplan.torch.capture import Capture, call_model
from memplan.torch.run.interpreter import Plan, StepRunner, _Call, _resolve, _Update
from memplan.torch.tensors import storage_key

_NO_STATS = {
    "aten::native_batch_norm": lambda args: (*args[:3], None, None, *args[5:]),
    "aten::_native_batch_norm_legit": lambda args: (*args[:3], *args[5:]),
    # cuDNN takes null running statistics (cudnnBatchNormalizationForwardTraining allows it);
    # its outputs depend on the batch alone
    "aten::cudnn_batch_norm": lambda args: (*args[:3], None, None, *args[5:]),
}


def first_run_order(steps: Sequence[Step]) -> tuple[int, ...]:
    """The ops of ``steps`` in the order they first run (the plain order they extend)."""
    seen: dict[int, None] = {}
    for kind, i in steps:
        if kind == "run" and i not in seen:
            seen[i] = None
    return tuple(seen)


def batch_norm_recompute(target: Any, args: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    """The call that recomputes a training-mode batch norm without touching its running
    statistics: ``native_batch_norm`` (or cuDNN's ``cudnn_batch_norm``) with ``None`` for them,
    or ``_native_batch_norm_legit``'s ``no_stats`` overload."""
    name = target._schema.name
    if name not in _NO_STATS:
        raise UnsupportedOp(f"cannot recompute {target} without its side effect")
    func = torch.ops.aten._native_batch_norm_legit.no_stats if name == "aten::_native_batch_norm_legit" else target
    return func, _NO_STATS[name](tuple(args))


class RematRunner(StepRunner):
    """Executes a remat step sequence; ``runner(batch)`` runs one step and returns the loss."""

    # its first step runs interpreted (it learns which outputs to shrink), its later ones the
    # program written then: the first step's recording would not stand for theirs
    unobserved_first_check = False

    def __init__(
        self,
        capture: Capture,
        steps: Sequence[Step],
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        *,
        executor: str = "generated",
    ) -> None:
        super().__init__(
            capture, Plan(first_run_order(steps)), model, optimizer, reuse_dying_inputs=False, executor=executor
        )
        self.steps = list(steps)
        self.by_op = {self.plan.order[ins.position]: ins for ins in self.instructions}
        self.holders = self._holders()
        self.recomputes = 0
        self.shrinks = self._shrinks()
        self.learned = False  # an interpreted step has found which ops' outputs need shrinking

    def _shrinks(self) -> dict[str, Shrink]:
        """``fx node -> its Shrink``, for every op with a fresh output (one the graph says the
        op allocates, not persistent)."""
        graph, capture = self.graph, self.capture
        shrinks: dict[str, Shrink] = {}
        for node in capture.gm.graph.nodes:
            if node.op != "call_function":
                continue
            value = node.meta.get("val")
            leaves = pytree.tree_leaves(value)
            fresh = []
            for index, meta in enumerate(leaves):
                if not isinstance(meta, torch.Tensor):
                    continue
                t = capture.tensor_of_storage.get(storage_key(meta))
                if t is None or graph.tensors[t].persistent or not graph.tensors[t].size_bytes:
                    continue
                if capture.node_of_op[graph.producer[t]] == node.name:
                    fresh.append((index, meta.untyped_storage().nbytes()))
            if fresh:
                shrinks[node.name] = Shrink(tuple(fresh), isinstance(value, torch.Tensor))
        return shrinks

    def shrunk_nodes(self) -> list[str]:
        """The fx nodes whose outputs were found in larger storages than traced (and copied)."""
        return [name for name, shrink in self.shrinks.items() if shrink.hits]

    def _holders(self) -> dict[int, list[str]]:
        """``tensor -> fx nodes whose value holds its storage`` (its producer and its views)."""
        holders: dict[int, list[str]] = {}
        for node in self.capture.gm.graph.nodes:
            if node.op != "call_function":
                continue
            for leaf in _leaves(node.meta.get("val")):
                t = self.capture.tensor_of_storage.get(storage_key(leaf))
                if t is not None and not self.graph.tensors[t].persistent:
                    holders.setdefault(t, []).append(node.name)
        return holders

    @torch.no_grad()
    def run_step(self, batch: Any) -> Any:
        """One step: the sequence written once as one function (:mod:`memplan.torch.run.remat_codegen`)
        by default, else interpreted step by step (the reference; and for a subclass that times
        each op, whose own ``_run`` the generated function would not call)."""
        env: dict[str, Any] = {}
        self._bind_inputs(env, batch)
        if self.executor == "generated" and type(self)._run is RematRunner._run and self.learned:
            generated = self.generated_step()
            self.recomputes = generated.static_stats["recomputes"]
            return self._finish(generated.function(env, self))
        ran: set[int] = set()
        deferred: dict[str, list[int]] = {}  # grad node -> frees waiting for its parameter's update
        pending = {n.name for ins in self.instructions if isinstance(ins, _Update) for n in ins.grad_nodes}
        self.recomputes = 0
        for kind, i in self.steps:
            if kind == "free":
                self._free_or_defer(i, env, pending, deferred)
                continue
            ins = self.by_op.get(i)
            if isinstance(ins, _Update):
                self._update(ins, env)
                for grad_node in ins.grad_nodes:
                    pending.discard(grad_node.name)
                    for t in deferred.pop(grad_node.name, []):
                        self._free(t, env)
            elif isinstance(ins, _Call):
                env[ins.node.name] = self._run(ins, env, recompute=i in ran)
            ran.add(i)
        if not self.learned:  # the generated function copies what this step found to copy
            self.learned, self._generated = True, None
            if self.executor == "generated" and type(self)._run is RematRunner._run:
                self.generated_step()  # written now, at the end of this step, not inside the next one
        return self._result(env)

    def prepare(self) -> bool:
        """Nothing before the first step, which runs interpreted (its program is written at its
        end, :meth:`run_step`); later, as :class:`StepRunner`'s."""
        return super().prepare() if self.learned else False

    def generated_step(self) -> Any:
        """The step sequence written as one function (generated once, on first use)."""
        if self._generated is None:
            from memplan.torch.run.remat_codegen import generate_remat

            self._generated = generate_remat(self)
        return self._generated

    def _run(self, ins: _Call, env: dict[str, Any], recompute: bool) -> Any:
        args, kwargs = _resolve((ins.node.args, ins.node.kwargs), env)
        func = ins.node.target
        if recompute:
            self.recomputes += 1
            op_id = self.plan.order[ins.position]
            if recompute_skips_mutation(self.graph, op_id):
                func, args = batch_norm_recompute(func, args)
        result = func(*args, **kwargs)
        shrink = self.shrinks.get(ins.node.name)
        return result if shrink is None else shrink(result, (args, kwargs))

    def _free_or_defer(self, t: int, env: dict[str, Any], pending: set[str], deferred: dict[str, list[int]]) -> None:
        """The plan frees a gradient at its last traced read; the real optimizer reads it at
        the parameter's update, which may come later: hold it until then."""
        waiting = [name for name in self.holders.get(t, ()) if name in pending]
        if waiting:
            deferred.setdefault(waiting[0], []).append(t)
        else:
            self._free(t, env)

    def _free(self, t: int, env: dict[str, Any]) -> None:
        if not self.graph.tensors[t].size_bytes:
            return
        for name in self.holders.get(t, ()):
            if name in env:
                value = _without_storage(env[name], self.nodes[name].meta.get("val"), t, self.capture.tensor_of_storage)
                if value is None:
                    del env[name]
                else:
                    env[name] = value


class Shrink:
    """An op's fresh outputs, each copied to a storage of its traced size when the kernel returned
    it in a larger one (``hits`` counts the copies). ``leaves``: ``(index among the result's
    pytree leaves, traced storage bytes)``; ``single``: the result is one tensor. The copy has
    the output's sizes and strides and its bits (``empty_strided`` + ``copy_``); an output that
    shares its storage with an input (an alias the trace did not see) is kept as it is."""

    def __init__(self, leaves: tuple[tuple[int, int], ...], single: bool) -> None:
        self.leaves = leaves
        self.single = single
        self.hits = 0

    def __call__(self, value: Any, inputs: Any = None) -> Any:
        if self.single:
            return self._one(value, self.leaves[0][1], inputs) if isinstance(value, torch.Tensor) else value
        items, spec = pytree.tree_flatten(value)
        changed = False
        for index, nbytes in self.leaves:
            x = items[index] if index < len(items) else None
            if isinstance(x, torch.Tensor):
                y = self._one(x, nbytes, inputs)
                changed = changed or y is not x
                items[index] = y
        return pytree.tree_unflatten(items, spec) if changed else value

    def _one(self, x: torch.Tensor, nbytes: int, inputs: Any) -> torch.Tensor:
        storage = x.untyped_storage()
        if storage.nbytes() <= nbytes or (inputs is not None and _shares_storage(storage, inputs)):
            return x
        self.hits += 1
        if torch._debug_has_internal_overlap(x) == 1:  # elements that overlap: no strided copy of them
            return x.clone(memory_format=torch.contiguous_format)
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device).copy_(x)


def _shares_storage(storage: Any, inputs: Any) -> bool:
    ptr = storage.data_ptr()
    tensors = (a for a in pytree.tree_leaves(inputs) if isinstance(a, torch.Tensor))
    return any(a.untyped_storage().data_ptr() == ptr for a in tensors)


def _leaves(value: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]


def _without_storage(value: Any, meta: Any, t: int, tensor_of: dict[int, int]) -> Any:
    """``value`` with the tensors whose traced storage is ``t`` replaced by None; None when
    nothing else is left in it."""
    if isinstance(value, torch.Tensor):
        return None if tensor_of.get(storage_key(meta)) == t else value
    items, spec = pytree.tree_flatten(value)
    metas = pytree.tree_leaves(meta)
    if len(items) != len(metas):
        raise MemplanError("a value does not have the structure it was traced with")
    kept = [
        None if isinstance(m, torch.Tensor) and tensor_of.get(storage_key(m)) == t else x
        for x, m in zip(items, metas, strict=True)
    ]
    if not any(isinstance(x, torch.Tensor) for x in kept):
        return None
    return pytree.tree_unflatten(kept, spec)


# --------------------------------------------------------------------------- comparison


@dataclass
class _Measured:
    peak_bytes: int
    step_seconds: list[float]

    def median_seconds(self) -> float:
        times = sorted(self.step_seconds or [0.0])
        return times[len(times) // 2]


def _eager_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any, batch: Any) -> torch.Tensor:
    inputs, target = batch
    loss = loss_fn(call_model(model, inputs), target)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def plan_remat(
    graph_capture: Capture,
    budget: float,
    strategy: str,
    time_limit_seconds: float = 30.0,
    workspace: tuple[int, ...] = (),
) -> tuple[Any, int, int]:
    """``(schedule, budget bytes, checkpoint-all peak)`` for a budget in bytes, or a fraction
    (<= 1) of the checkpoint-all peak; ``strategy="best"`` takes the cheapest feasible of all.
    ``workspace``: per-op scratch bytes the plan must leave room for (see :mod:`memplan.torch.run.profile`)."""
    from memplan.remat import STRATEGIES, rematerialize
    from memplan.remat.baselines import checkpoint_all
    from memplan.remat.problem import RematProblem

    graph = graph_capture.graph
    top = checkpoint_all(RematProblem(graph, 10**18, workspace=workspace)).peak_bytes
    budget_bytes = int(budget * top) if budget <= 1 else int(budget)
    names = list(STRATEGIES) if strategy == "best" else [strategy]
    plans = [
        rematerialize(graph, budget_bytes, n, time_limit_seconds, strict=False, workspace=workspace) for n in names
    ]
    feasible = [p for p in plans if p.feasible]
    if not feasible:
        raise MemplanError(f"no strategy of {', '.join(names)} fits {budget_bytes} B (checkpoint-all: {top} B)")
    return min(feasible, key=lambda p: (p.compute_cost, p.peak_bytes)), budget_bytes, top


def compare_remat_with_eager(
    model_name: str,
    batch_size: int,
    budget: float,
    strategy: str = "best",
    steps: int = 3,
    optimizer_name: str = "sgd",
    *,
    time_limit_seconds: float = 30.0,
    seed: int = 0,
    schedule: Any = None,
    expected_graph: Any = None,
    workspace: bool | tuple[int, ...] = False,
) -> dict[str, Any]:
    """Train ``steps`` steps with the rematerialised plan and eagerly, from the same initial
    state and seed; report the largest difference in loss, parameters and buffers after every
    step, and the measured peak (resident parameters, buffers, optimizer state and batch plus
    the allocator's peak during one steady-state step) against ``sequence_peak_bytes``.

    ``schedule`` (with the ``expected_graph`` it was made for): run that plan instead of
    planning ``budget`` with ``strategy``. ``workspace``: per-op scratch bytes the plan and its
    planned peak count while each op runs; ``True`` measures them first
    (:func:`memplan.torch.profile.profile_model`, on a separate copy of the model)."""
    from memplan.remat import sequence_peak_bytes, validate_sequence
    from memplan.torch.compare import _max_abs_diff
    from memplan.torch.measure import optimizer_state_tensors, resident_bytes
    from memplan.torch.zoo import build_workload, capture_model, make_optimizer

    capture = capture_model(model_name, batch_size, "train", optimizer_name)
    scratch = _workspace(capture, model_name, batch_size, optimizer_name, workspace, seed)
    start = time.perf_counter()
    if schedule is None:
        schedule, budget_bytes, top = plan_remat(capture, budget, strategy, time_limit_seconds, scratch)
    else:
        budget_bytes, top = schedule.budget_bytes, None
    plan_seconds = time.perf_counter() - start
    if expected_graph is not None and _signature(expected_graph) != _signature(capture.graph):
        raise MemplanError("the plan was made for a different capture of this step: capture it again")
    validate_sequence(capture.graph, schedule.steps)

    w = build_workload(model_name, batch_size, seed=seed)
    eager_model, remat_model = w.model, copy.deepcopy(w.model)
    eager_model.train()
    remat_model.train()
    eager_opt = make_optimizer(optimizer_name, eager_model.parameters())
    remat_opt = make_optimizer(optimizer_name, remat_model.parameters())
    batch = (w.inputs, w.target)
    runner = RematRunner(capture, schedule.steps, remat_model, remat_opt)

    eager, remat = _Measured(0, []), _Measured(0, [])
    max_diff = 0.0
    for k in range(steps + 1):  # the last step runs under the profiler, in steady state
        measure = k == steps
        torch.manual_seed(seed + 1000 + k)
        out_eager, peak_eager, t_eager = _timed(lambda: _eager_step(eager_model, eager_opt, w.loss_fn, batch), measure)
        torch.manual_seed(seed + 1000 + k)
        out_remat, peak_remat, t_remat = _timed(lambda: runner(batch), measure)
        if measure:
            eager.peak_bytes, remat.peak_bytes = peak_eager, peak_remat
        else:
            eager.step_seconds.append(t_eager)
            remat.step_seconds.append(t_remat)
        state_diff = _max_abs_diff(_state(eager_model), _state(remat_model))
        max_diff = max(max_diff, _max_abs_diff(out_eager, out_remat), state_diff)

    planned = sequence_peak_bytes(capture.graph, schedule.steps, scratch)
    resident = resident_bytes(_state(remat_model), optimizer_state_tensors(remat_opt), batch)
    measured = resident + remat.peak_bytes
    eager_resident = resident_bytes(_state(eager_model), optimizer_state_tensors(eager_opt), batch)
    return {
        "model": model_name,
        "batch_size": batch_size,
        "optimizer": optimizer_name,
        "steps": steps,
        "strategy": schedule.strategy,
        "budget_bytes": budget_bytes,
        "checkpoint_all_peak_bytes": top,
        "planned_peak_bytes": planned,
        "measured_peak_bytes": measured,
        "peak_ratio": round(measured / planned, 4) if planned else None,
        "eager_peak_bytes": eager_resident + eager.peak_bytes,
        "workspace_bytes_max": max(scratch, default=0),
        "overhead": round(schedule.overhead, 4),
        "recomputed_ops": runner.recomputes,
        "max_abs_diff": max_diff,
        "plan_seconds": round(plan_seconds, 3),
        "remat_step_seconds": remat.median_seconds(),
        "eager_step_seconds": eager.median_seconds(),
    }


def _workspace(
    capture: Capture, model_name: str, batch_size: int, optimizer_name: str, workspace: Any, seed: int
) -> tuple[int, ...]:
    """Per-op scratch bytes: as given, none (``False``), or measured (``True``)."""
    if workspace is True:
        from memplan.torch.run.profile import profile_model

        _, profile = profile_model(model_name, batch_size, optimizer_name, repeats=0, seed=seed, capture=capture)
        return profile.workspace_bytes
    return tuple(workspace) if workspace else ()


def _signature(graph: Any) -> list[tuple[str, str, int]]:
    return [(op.name, op.kind, len(op.outputs)) for op in graph.ops]


def _state(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def _timed(fn: Any, measure_memory: bool) -> tuple[Any, int, float]:
    from memplan.torch.measure import allocator_peak_bytes

    start = time.perf_counter()
    result, peak = allocator_peak_bytes(fn) if measure_memory else (fn(), 0)
    return result, peak, time.perf_counter() - start


__all__ = ["RematRunner", "Shrink", "batch_norm_recompute", "compare_remat_with_eager", "first_run_order", "plan_remat"]
