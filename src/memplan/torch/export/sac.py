"""memplan's recompute decision as a selective-activation-checkpointing policy for the user's
own eager loop: ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` with a policy
that answers ``MUST_SAVE`` or ``PREFER_RECOMPUTE`` for every ATen op of the forward (under
``torch.compile``, :mod:`memplan.torch.export.backend` puts the same decision into AOTAutograd's
partitioner instead).

A remat plan (:func:`memplan.remat.rematerialize`, Checkmate section 4) decides, op by op, which
forward values stay resident until the backward reads them and which are dropped and computed
again. SAC asks the same question of every op that runs inside a checkpointed region:

* an op the plan runs again (``("run", v)`` more than once) -> ``PREFER_RECOMPUTE``;
* an op with a fresh output that a backward or optimizer op reads, run once -> ``MUST_SAVE``;
* a random op -> ``PREFER_RECOMPUTE``: checkpointing saves the generator state at the region's
  start and replays the region from it, so every random op of the region draws the same
  numbers again as long as all of them are replayed (a saved one would shift the others);
* an op whose value dies in the forward, a view, a scalar -> ``PREFER_RECOMPUTE`` (saving it
  would hold memory the plan frees; a view is recomputed from its base for free);
* an op that writes a parameter or buffer (batch norm's running statistics) -> ``MUST_SAVE``
  (a second run would write twice);
* a fresh tensor written in place later in the forward (dropout's ``empty_like``,
  ``bernoulli_``, ``div_``): all its ops -> ``PREFER_RECOMPUTE``, since SAC cannot cache the
  value of an in-place chain (see :func:`_in_place_chains`).

Which captured op an ATen call is: the capture (``make_fx`` on fake tensors) recorded the
forward's ATen calls in order. :meth:`SACPolicy.attach` records the calls of one real forward
(a dispatch mode; the random stream and the buffers are left as they were) and aligns the
two sequences (:func:`align_calls`: they differ where Python reads a tensor's value, which a
fake tensor cannot give), then counts the calls of every forward with hooks on the model, so
the policy knows where in the forward each call is (SAC's own mode only sees the calls inside
checkpointed regions). A call aligned with no captured op is counted in
:attr:`SACPolicy.stats` and recomputed (saved if it writes running statistics). Detaches are
ignored on both sides, as SAC ignores them. Only ops inside checkpointed regions are
affected: choose the
regions with :meth:`SACPolicy.apply` (default: the repeated layers, every module held in an
``nn.ModuleList``), with HF's ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=
{"use_reentrant": False, "context_fn": policy.context_fn})``, or with your own ``checkpoint`` calls.
"""

from __future__ import annotations

import collections
import difflib
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import torch
from memplan.errors import MemplanError
from memplan.graph.ir import Graph
from memplan.torch.capture import Capture

FORMAT = "memplan-sac-policy"
VERSION = 1
_LATER_PHASES = frozenset({"backward", "optimizer"})


class PolicyMismatch(MemplanError):
    """A SAC policy file does not fit the model or the calls it is applied to."""


@dataclass(frozen=True)
class SACDecision:
    """One ATen call of the captured forward and what the policy answers for it."""

    op: str  # the OpOverload as str(): "aten.mm.default"
    node: str  # the fx node of the capture
    save: bool  # MUST_SAVE, else PREFER_RECOMPUTE
    reason: str


@dataclass
class SACStats:
    """What the policy answered during the forwards it saw since the last :meth:`reset`."""

    forwards: int = 0
    calls: int = 0  # forward ATen calls counted
    saved: int = 0  # policy answers MUST_SAVE (inside checkpointed regions)
    recomputed: int = 0  # policy answers PREFER_RECOMPUTE
    unaligned: collections.Counter = field(default_factory=collections.Counter)  # calls in regions, no plan


def decisions_from_steps(capture: Capture, steps: Sequence[tuple[str, int]]) -> list[SACDecision]:
    """The policy's answer for every forward op of ``capture`` under the remat plan ``steps``
    (see the module docstring for the rules)."""
    graph = capture.graph
    runs = collections.Counter(i for kind, i in steps if kind == "run")
    forward = [v for v, phase in enumerate(capture.op_phase) if phase == "forward"]
    answers = _in_place_chains(capture, forward)
    decisions = []
    for v in forward:
        save, reason = answers.get(v) or _decide(capture, v, runs[v] > 1)
        decisions.append(SACDecision(graph.ops[v].kind, capture.node_of_op[v], save, reason))
    return decisions


def _decide(capture: Capture, v: int, recomputed: bool) -> tuple[bool, str]:
    graph = capture.graph
    op = graph.ops[v]
    if _is_random_kind(op.kind):
        return False, "random: replayed from the generator state checkpoint keeps"
    if any(graph.tensors[t].persistent for t in op.mutates):
        return True, "writes a parameter or buffer: a second run would write twice"
    if recomputed:
        return False, "recomputed by the plan"
    fresh = _fresh_outputs(graph, v)
    if not fresh:
        return False, "no new memory (view, in-place or scalar)"
    if _read_later(capture, fresh):
        return True, "kept for the backward by the plan"
    return False, "dies in the forward"


def _in_place_chains(capture: Capture, forward: Sequence[int]) -> dict[int, tuple[bool, str]]:
    """``PREFER_RECOMPUTE`` for every op of an in-place chain of the forward: a fresh tensor and
    the ops that rewrite it in place (dropout's ``empty_like``, ``bernoulli_``, ``div_``). SAC
    cannot cache such a value: the producer's would be written afterwards, and an in-place op's
    output is cached before autograd bumps its version, so either is refused as mutated."""
    graph = capture.graph
    in_forward = set(forward)
    answers: dict[int, tuple[bool, str]] = {}
    for v in forward:
        for t in graph.ops[v].mutates:
            if not graph.tensors[t].persistent and graph.producer[t] in in_forward:
                for u in (graph.producer[t], v):
                    answers[u] = (False, "in-place chain: SAC cannot cache it")
    return answers


def _fresh_outputs(graph: Graph, v: int) -> list[int]:
    return [t for t in graph.ops[v].outputs if graph.tensors[t].size_bytes > 0 and not graph.tensors[t].persistent]


def _read_later(capture: Capture, tensors: Iterable[int]) -> bool:
    """Some backward or optimizer op reads one of ``tensors``."""
    graph = capture.graph
    return any(capture.op_phase[c] in _LATER_PHASES for t in tensors for c in graph.consumers[t])


def _is_random_kind(kind: str) -> bool:
    from memplan.remat.problem import is_random

    return is_random(kind)


class _CallRecorder(TorchDispatchMode):
    """Records the ATen calls of a forward, or counts them and points at the captured forward op
    each one was aligned with (:meth:`SACPolicy.attach`)."""

    def __init__(self, mapping: Sequence[int | None] | None = None) -> None:
        super().__init__()
        self.mapping = mapping
        self.calls: list[str] = []
        self.position = 0
        self.current: int | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SAC_IGNORED_OPS:  # SAC adds detaches of its own and never asks the policy about them
            return func(*args, **(kwargs or {}))
        if self.mapping is None:
            self.calls.append(str(func))
        else:
            self.current = self.mapping[self.position] if self.position < len(self.mapping) else None
            self.position += 1
        return func(*args, **(kwargs or {}))


def align_calls(calls: Sequence[str], decisions: Sequence[SACDecision]) -> list[int | None]:
    """For each recorded call, the captured forward op it is (None: not in the capture), by the
    longest matching blocks of the two op sequences (``difflib``): the capture and a real
    forward differ where Python reads tensor values (a mask check eager can make and a fake
    tensor cannot), and agree elsewhere."""
    matcher = difflib.SequenceMatcher(None, list(calls), [d.op for d in decisions], autojunk=False)
    mapping: list[int | None] = [None] * len(calls)
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            mapping[block.a + k] = block.b + k
    return mapping


class SACPolicy:
    """A selective-activation-checkpointing policy made from a memplan remat plan.

    ``policy.apply(model, example_inputs)`` checkpoints the repeated layers with it;
    ``policy.context_fn`` is the ``context_fn`` for your own
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` calls (call
    ``policy.attach(model, example_inputs)`` once first, so the forward's calls are counted).
    """

    def __init__(self, decisions: Sequence[SACDecision], meta: dict[str, Any] | None = None) -> None:
        self.decisions = tuple(decisions)
        self.meta = dict(meta or {})
        self.stats = SACStats()
        self.mapping: list[int | None] | None = None
        self._counter: _CallRecorder | None = None
        self._attached: set[int] = set()

    # ------------------------------------------------------------------ building
    @classmethod
    def from_schedule(cls, capture: Capture, schedule: Any, **meta: Any) -> SACPolicy:
        """From a :class:`memplan.remat.RematSchedule` of ``capture.graph``."""
        info = {
            "strategy": schedule.strategy,
            "budget_bytes": schedule.budget_bytes,
            "planned_peak_bytes": schedule.peak_bytes,
            "overhead": schedule.overhead,
            "graph": capture.graph.name,
            **meta,
        }
        return cls(decisions_from_steps(capture, schedule.steps), info)

    def save(self, path: str | Path) -> None:
        """Write the policy as JSON (the ``--sac-policy`` file of ``memplan remat``)."""
        data = {"format": FORMAT, "version": VERSION, "meta": self.meta, "ops": [asdict(d) for d in self.decisions]}
        Path(path).write_text(json.dumps(data, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> SACPolicy:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise PolicyMismatch(f"cannot read SAC policy {path}: {err}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
            raise PolicyMismatch(f"{path} is not a memplan SAC policy (format {FORMAT} v{VERSION})")
        return cls([SACDecision(**d) for d in data["ops"]], data.get("meta", {}))

    # ------------------------------------------------------------------ summary
    @property
    def num_saved(self) -> int:
        return sum(d.save for d in self.decisions)

    def summary(self) -> dict[str, Any]:
        reasons = collections.Counter(d.reason for d in self.decisions)
        aligned = None if self.mapping is None else sum(m is not None for m in self.mapping)
        return {
            "forward_ops": len(self.decisions),
            "must_save": self.num_saved,
            "reasons": dict(reasons),
            "calls_per_forward": None if self.mapping is None else len(self.mapping),
            "calls_aligned": aligned,
            **self.meta,
        }

    # ------------------------------------------------------------------ use
    def context_fn(self) -> tuple[Any, Any]:
        """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``."""
        return create_selective_checkpoint_contexts(self.policy_fn)

    def policy_fn(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        """SAC's policy: the plan's answer for the forward op this call was aligned with."""
        counter = self._counter
        if counter is None:
            raise PolicyMismatch("the SAC policy is not attached to the model: call policy.attach(model, inputs) first")
        index = counter.current
        if index is None or self.decisions[index].op != str(func):
            self.stats.unaligned[str(func)] += 1
            save = _writes_hidden_state(func, args, kwargs)
        else:
            save = self.decisions[index].save
        if save:
            self.stats.saved += 1
            return CheckpointPolicy.MUST_SAVE
        self.stats.recomputed += 1
        return CheckpointPolicy.PREFER_RECOMPUTE

    def attach(self, model: torch.nn.Module, example_inputs: Any) -> None:
        """Align the ATen calls of one real forward of ``model`` on ``example_inputs`` with the
        captured forward (:func:`align_calls`), then count the calls of every forward (hooks on
        ``model``). The aligning forward draws no random numbers from the user's stream and
        leaves the model's buffers as they were. Call it before checkpointing regions."""
        self.mapping = align_calls(record_forward_calls(model, example_inputs), self.decisions)
        if id(model) in self._attached:
            return
        self._attached.add(id(model))
        model.register_forward_pre_hook(lambda module, args: self._begin_forward())
        model.register_forward_hook(lambda module, args, out: self._end_forward(), always_call=True)

    def apply(self, model: torch.nn.Module, example_inputs: Any, regions: Iterable[str] | None = None) -> list[str]:
        """Attach to ``model``, then checkpoint the submodules named in ``regions`` (default
        :func:`repeated_layers`) with this policy; returns the names of the regions."""
        names = list(regions) if regions is not None else repeated_layers(model)
        modules = dict(model.named_modules())
        missing = [n for n in names if n not in modules]
        if missing:
            raise PolicyMismatch(f"no submodule named {missing[0]!r} in the model to checkpoint")
        self.attach(model, example_inputs)
        for name in names:
            _checkpoint_module(modules[name], self.context_fn)
        return names

    def reset_stats(self) -> None:
        self.stats = SACStats()

    # ------------------------------------------------------------------ counting
    def _begin_forward(self) -> None:
        if self._counter is not None:  # a nested call of the same model: keep counting
            return
        self.stats.forwards += 1
        self._counter = _CallRecorder(self.mapping or [])
        self._counter.__enter__()

    def _end_forward(self) -> None:
        counter, self._counter = self._counter, None
        if counter is not None:
            counter.__exit__(None, None, None)
            self.stats.calls += counter.position


def _writes_hidden_state(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """A call the capture does not know that writes a running statistic (batch norm in
    training): running it again would write twice, so it is saved."""
    from memplan.torch.tensors import HIDDEN_WRITES, written_arguments

    schema = getattr(func, "_schema", None)
    return schema is not None and schema.name in HIDDEN_WRITES and bool(written_arguments(func, args, kwargs))


def record_forward_calls(model: torch.nn.Module, example_inputs: Any) -> list[str]:
    """The ATen calls of one forward of ``model`` on ``example_inputs``, with autograd on (the
    path training takes), under a forked random generator, the buffers restored afterwards."""
    from memplan.torch.capture import call_model

    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    recorder = _CallRecorder()
    with torch.random.fork_rng(devices=[]), recorder:
        out = call_model(model, example_inputs)
    del out
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)
    return recorder.calls


def repeated_layers(model: torch.nn.Module) -> list[str]:
    """The submodules held in an ``nn.ModuleList`` (a transformer's blocks), outermost lists
    only: the natural checkpoint regions. Raises if there are none."""
    names: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and not any(name.startswith(f"{n}.") for n in names):
            names.extend(f"{name}.{child}" if name else child for child, _ in module.named_children())
    if not names:
        raise PolicyMismatch("the model has no nn.ModuleList of layers: name the regions to checkpoint")
    return names


def _checkpoint_module(module: torch.nn.Module, context_fn: Any) -> None:
    """Run ``module``'s forward under non-reentrant checkpointing with ``context_fn``."""
    if getattr(module, "_memplan_sac", False):
        return
    forward = module.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    module.forward = checkpointed
    module._memplan_sac = True


__all__ = ["PolicyMismatch", "SACDecision", "SACPolicy", "SACStats", "decisions_from_steps", "repeated_layers"]
