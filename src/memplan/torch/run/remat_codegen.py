"""A remat step sequence as one generated Python function (issue 33: the budgeted step's host time).

:class:`memplan.torch.run.remat.RematRunner` interprets a lowered remat plan (Checkmate section
4.7: the step sequence is executed as is) one step at a time: per op it walks the argument tree
with pytree, looks names up in a dict and calls ``OpOverload.__call__``; per free it looks up
the tensor's holders, walks their values with pytree to drop the freed storage, and checks
whether the freed tensor is a gradient that must wait for its parameter's update. Everything it
decides there is fixed by the sequence, so it is decided once here, and the sequence is written
out as straight-line source, as :mod:`memplan.torch.run.codegen` writes a plain plan:

* ``("run", op)``: one call of the op's kernel (its proven Python binding where there is one,
  :func:`memplan.torch.run.codegen._kernel`) with its arguments as locals; a recompute is the
  same call assigned to the same locals (a training-mode batch norm without its running
  statistics, :func:`memplan.torch.run.remat.batch_norm_recompute`); an op the interpreted first
  step found returning an output in a larger storage than traced has it copied to one of the
  traced size (:class:`memplan.torch.run.remat.Shrink`, issue 33);
* ``("free", tensor)``: ``del`` of the locals holding the tensor's storage (its producer's value
  and its views), at the place the interpreter frees it, or after the update that reads it when
  it is a gradient (the interpreter's deferred frees, resolved here);
* an update: the runner's own ``_update_with`` (or a subclass's ``_update``), as the interpreter
  makes it. Updates with no op run between them (frees only) are one ``optimizer.step()``
  over their parameters, as :func:`memplan.torch.run.codegen._merged_updates` merges a plain
  plan's (MobileNet-v2's remat plan: 158 calls a step, ~50 us of the optimizer's own overhead
  each), but only while the gradients the merged call holds past their own update fit under
  the sequence's peak at every step they are held through (:func:`_holds`): merging never
  raises the step's modeled peak, which the budget holds (each group's gradients are counted
  for its own call, :func:`memplan.torch.run.budget.held_graph`).

A tuple result read only through ``getitem`` is kept element by element (codegen's rule), so an
element is dropped by deleting its local where the interpreter puts ``None`` in the tuple; an
element no ``getitem`` reads is dropped right after the op instead of at its free (never
later). The kernels, their order and their arguments are the interpreter's, so the bits are
(tested in tests/torch/test_remat_codegen.py).
"""

from __future__ import annotations

from typing import Any

import torch.fx

import torch
from memplan.torch.run.codegen import (
    GeneratedStep,
    _env_names,
    _grad_bytes,
    _kernel,
    _mergeable,
    _merged,
    _store,
    _Writer,
)
from memplan.torch.tensors import storage_key, tensor_leaves


class _Remat:
    """The static state of the sequence while it is written: which fx values are held in
    locals, and the gradient frees waiting for their updates (the interpreter's ``pending`` and
    ``deferred``)."""

    def __init__(self, runner: Any) -> None:
        from memplan.torch.run.interpreter import _Update

        self.runner = runner
        self.w = _Writer(runner)
        self.held: set[str] = set()  # fx node names whose value a local holds now
        self.whole: dict[str, set[Any]] = {}  # held values kept whole (not split): the storages still in them
        self.pending = {n.name for ins in runner.instructions if isinstance(ins, _Update) for n in ins.grad_nodes}
        self.deferred: dict[str, list[int]] = {}
        self.recomputes = 0
        self.calls = 0  # optimizer calls written

    # ------------------------------------------------------------------ values
    def store(self, node: torch.fx.Node, expr: str) -> None:
        """``node``'s result held as the codegen's ``_store`` holds it (split by getitem)."""
        _store(self.w, node, expr, hold=self._hold)

    def _hold(self, node: torch.fx.Node) -> None:
        """``node``'s value is in its local now; a value that is not one tensor (a tuple kept
        whole) is tracked with its storages, each dropped from it at its own free."""
        self.held.add(node.name)
        self.whole.pop(node.name, None)
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            tensor_of = self.runner.capture.tensor_of_storage
            self.whole[node.name] = {tensor_of.get(storage_key(m)) for m in tensor_leaves(value)}

    def free(self, t: int) -> None:
        """The interpreter's ``RematRunner._free``: every local holding tensor ``t``'s storage."""
        runner = self.runner
        if not runner.graph.tensors[t].size_bytes:
            return
        dropped = []
        for name in runner.holders.get(t, ()):
            if name not in self.held:
                continue
            if name in self.whole and self.whole[name] - {t}:  # the value keeps other tensors
                self.whole[name].discard(t)
                local = self.w.var(name)
                meta = runner.nodes[name].meta.get("val")
                without = self.w.constant(_drop_storage(meta, t, runner.capture.tensor_of_storage), "drop")
                self.w.emit(f"{local} = {without}({local})")
                continue
            self.held.discard(name)
            self.whole.pop(name, None)
            dropped.append(self.w.var(name))
        if dropped:
            self.w.emit("del " + ", ".join(dropped))

    def free_or_defer(self, t: int) -> None:
        waiting = [name for name in self.runner.holders.get(t, ()) if name in self.pending]
        if waiting:
            self.deferred.setdefault(waiting[0], []).append(t)
        else:
            self.free(t)

    # ------------------------------------------------------------------ steps
    def run(self, ins: Any, recompute: bool) -> None:
        from memplan.remat.problem import recompute_skips_mutation
        from memplan.torch.run.remat import batch_norm_recompute

        w, node = self.w, ins.node
        if not recompute:
            self.store(node, self._shrunk(node, f"{_kernel(w, node.target, node)}({w.call_args(node)})"))
            return
        self.recomputes += 1
        op_id = self.runner.plan.order[ins.position]
        if not recompute_skips_mutation(self.runner.graph, op_id):
            self.store(node, self._shrunk(node, f"{_kernel(w, node.target, node)}({w.call_args(node)})"))
            return
        func, args = batch_norm_recompute(node.target, tuple(node.args))
        parts = [w.expr(a) for a in args] + [f"{k}={w.expr(v)}" for k, v in node.kwargs.items()]
        self.store(node, self._shrunk(node, f"{w.constant(getattr(func, '_op', func), 'op')}({', '.join(parts)})"))

    def _shrunk(self, node: torch.fx.Node, expr: str) -> str:
        """``expr`` with its fresh outputs copied to storages of their traced size, for an op the
        interpreted step found returning them in larger ones (:class:`memplan.torch.run.remat.Shrink`)."""
        shrink = self.runner.shrinks.get(node.name)
        if shrink is None or not shrink.hits:
            return expr
        return f"{self.w.constant(shrink, 'shrink')}({expr})"

    def update(self, run: list[Any]) -> None:
        """One call of the optimizer for the updates of ``run`` (merged as codegen merges
        consecutive updates, :func:`memplan.torch.run.codegen._merged`), then the frees that
        waited for them."""
        from memplan.torch.run.interpreter import StepRunner

        if not run:
            return
        w = self.w
        ins = run[0] if len(run) == 1 else _merged(run)
        self.calls += 1
        if type(self.runner)._update is StepRunner._update:
            grads = "".join(f"{w.expr(n)}, " for n in ins.grad_nodes)
            w.emit(f"runner._update_with({w.constant(ins, 'update')}, ({grads}))")
        else:  # a subclass's own update (it reads the gradients from an env)
            grads = ", ".join(f"{n.name!r}: {w.expr(n)}" for n in ins.grad_nodes)
            w.emit(f"runner._update({w.constant(ins, 'update')}, {{{grads}}})")
        for grad_node in ins.grad_nodes:
            self.pending.discard(grad_node.name)
            for t in self.deferred.pop(grad_node.name, []):
                self.free(t)


def generate_remat(runner: Any) -> GeneratedStep:
    """Write ``runner``'s step sequence (a :class:`memplan.torch.run.remat.RematRunner`'s) as one
    function ``step(env, runner) -> result`` (see the module docstring); ``static_stats`` holds
    ``recomputes``, the ops the sequence runs again, and ``optimizer_calls``, the update calls."""
    from memplan.torch.run.interpreter import _Call, _Update

    r = _Remat(runner)
    w = r.w
    for name in _env_names(runner):
        w.emit(f"{w.var(name)} = env[{name!r}]")
    resident, peak = _modeled_resident(runner)
    reach = _group_ends(runner)
    ran: set[int] = set()
    merging: list[Any] = []  # updates not written yet: one optimizer.step() over their parameters
    start = 0  # the step of the first of them
    for k, (kind, i) in enumerate(runner.steps):
        if kind == "free":
            r.free_or_defer(i)
            continue
        ins = runner.by_op.get(i)
        if isinstance(ins, _Update):
            window = resident[start : reach[k]]
            if merging and _mergeable(runner, merging[-1], ins) and _holds(r, [*merging, ins], window, peak):
                merging.append(ins)
            else:
                r.update(merging)
                merging, start = [ins], k
        elif isinstance(ins, _Call):
            r.update(merging)
            merging = []
            r.run(ins, recompute=i in ran)
        ran.add(i)
    r.update(merging)
    output = next(n for n in runner.capture.gm.graph.nodes if n.op == "output")
    w.emit(f"return {w.expr(output.args[0])}")
    source = "def step(env, runner):\n" + "\n".join(w.lines) + "\n"
    namespace = dict(w.globals)
    exec(compile(source, f"<memplan remat step {id(runner):x}>", "exec"), namespace)
    return GeneratedStep(source, namespace["step"], {"recomputes": r.recomputes, "optimizer_calls": r.calls})


def _group_ends(runner: Any) -> list[int]:
    """Per step, the index of the next step that runs an instruction (a call or an update), or
    the sequence's end: an update's group runs its other ops (the optimizer's temporaries) and
    frees before it, so a merged call holds its gradients through all of them."""
    ends = [len(runner.steps)] * len(runner.steps)
    nxt = len(runner.steps)
    for k in range(len(runner.steps) - 1, -1, -1):
        ends[k] = nxt
        kind, i = runner.steps[k]
        if kind == "run" and i in runner.by_op:
            nxt = k
    return ends


def _holds(r: _Remat, run: list[Any], resident: list[int], peak: int) -> bool:
    """The last update of ``run`` may join the call of the others: the gradients that call then
    holds past the place each would be freed without it (every tensor waiting for one of their
    updates), and the largest gradient's size once more, fit under the sequence's modeled peak
    at every step they are held through, the joining update's own ops (its temporaries)
    included, so merging never raises the step's peak (:func:`_modeled_resident`). The extra
    gradient's size: one call loops over its parameters, and a local of one parameter's update
    (AdamW's ``denom``, the parameter's size) lives on while the next one's temporaries are
    made, where separate calls would have dropped it (the Llama of ``bench/llama_budget.py`` at
    batch 2: 11 MiB above its plan, an MLP weight's ``denom`` beside the lm_head's update)."""
    names = [n.name for ins in run[:-1] for n in ins.grad_nodes]
    tensors = r.runner.graph.tensors
    held = sum(tensors[t].size_bytes for name in names for t in r.deferred.get(name, ()))
    linger = max(_grad_bytes(ins) for ins in run)
    return max(resident, default=0) + held + linger <= peak


def _modeled_resident(runner: Any) -> tuple[list[int], int]:
    """The bytes resident after each step of the sequence as the generated step holds them
    without merged updates (a run adds its fresh outputs, a free drops its tensor, a gradient at
    its update), persistent tensors aside, and their peak (:func:`memplan.remat.lower.sequence_peak_bytes`'s
    model with the runtime's deferred gradient frees)."""
    from memplan.torch.run.interpreter import _Update

    graph = runner.graph
    pending = {n.name for ins in runner.instructions if isinstance(ins, _Update) for n in ins.grad_nodes}
    deferred: dict[str, list[int]] = {}
    live: set[int] = set()
    resident, timeline = 0, []

    def drop(t: int) -> int:
        if t not in live:
            return 0
        live.discard(t)
        return graph.tensors[t].size_bytes

    for kind, i in runner.steps:
        if kind == "free":
            waiting = [name for name in runner.holders.get(i, ()) if name in pending]
            if waiting:
                deferred.setdefault(waiting[0], []).append(i)
            else:
                resident -= drop(i)
        else:
            for t in graph.ops[i].outputs:
                x = graph.tensors[t]
                if graph.producer[t] == i and x.size_bytes and not x.persistent and t not in live:
                    live.add(t)
                    resident += x.size_bytes
            ins = runner.by_op.get(i)
            for grad_node in ins.grad_nodes if isinstance(ins, _Update) else ():
                pending.discard(grad_node.name)
                resident -= sum(drop(t) for t in deferred.pop(grad_node.name, []))
        timeline.append(resident)
    return timeline, max(timeline, default=0)


def _drop_storage(meta: Any, t: int, tensor_of: dict[int, int]) -> Any:
    """``value -> value`` with the tensors whose traced storage is ``t`` replaced by None (the
    interpreter's ``_without_storage``, for a value that keeps other tensors)."""
    from memplan.torch.run.remat import _without_storage

    return lambda value: _without_storage(value, meta, t, tensor_of)


__all__ = ["generate_remat"]
