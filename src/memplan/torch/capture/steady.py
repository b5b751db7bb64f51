"""The steady state of a step, remembered across processes: capture traced once on a restart (issue 37).

Capture runs a training step twice on fakes: once untraced, which creates the optimizers'
state (the plan is for the steady state, which has it) and shows the literals the step makes
(:mod:`.literals`), then traced. When the plan cache is on, a capture whose optimizers had no
state keeps what that untraced run showed, in a :class:`SteadyRecord` next to the plans:
the optimizer state's keys, shapes and dtypes, the literals (dtype, shape, bits), the copies
recomputed (:mod:`.recompute`) and the captured step's fingerprint
(:func:`memplan.torch.run.plancache.graph_fingerprint`).

A restarted process (same step, same objects, same code) then skips the untraced run: the
fake optimizers are given their state by one ``step()`` of the optimizer itself on zero fake
gradients (the same code that makes it in the untraced run; fakes carry no values), which must
leave exactly the recorded keys, shapes and dtypes; the step is traced once, must make the
recorded literals, takes the recorded copies (:func:`.recompute.recompute_named`) and must
give the very fingerprint the full capture gave: every op, tensor, size, the fx program, its
values' shapes and strides, phases, regions and state. Where anything differs, the step is
captured in full as before, so a record can cost time, never bits. The record is looked up
by a key of what is known before capture (the step function's code, the model's and
optimizers' parameters and settings, the batch's shapes, memplan's code): only a hint.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

import torch
from memplan.torch.capture.literals import literal_key, step_literals


class NotSteady(Exception):
    """The record does not stand for this step's untraced run: capture it in full."""


@dataclass(frozen=True)
class SteadyRecord:
    """What a full capture's untraced run showed, as JSON-able values (see the module)."""

    state_meta: Any
    literals: Any
    recomputed: tuple[str, ...]
    fingerprint: str
    leaves_gradients: bool = False  # the full capture's two runs showed the next call clears them

    def to_json(self) -> dict[str, Any]:
        return {
            "state_meta": self.state_meta,
            "literals": self.literals,
            "recomputed": list(self.recomputed),
            "fingerprint": self.fingerprint,
            "leaves_gradients": self.leaves_gradients,
        }

    @classmethod
    def from_json(cls, data: Any) -> SteadyRecord:
        """Raises (KeyError, TypeError, ValueError) on a malformed entry."""
        recomputed = tuple(str(name) for name in data["recomputed"])
        leaves = data.get("leaves_gradients", False)
        if not isinstance(leaves, bool):
            raise TypeError(f"leaves_gradients must be true or false, not {leaves!r}")
        return cls(data["state_meta"], data["literals"], recomputed, str(data["fingerprint"]), leaves)


def jsonable(value: Any) -> Any:
    """``value`` as JSON gives it back (tuples as lists, dtypes as their names)."""
    return json.loads(json.dumps(value, default=str))


def literal_counts(gm: torch.fx.GraphModule, op_phase: dict[str, str]) -> list[list[Any]]:
    """The literals the step makes outside the optimizer (:func:`.literals.step_literals`) with
    how many of each, sorted: what :func:`.literals.check_literals_repeat` compares."""
    counts = Counter(repr(literal_key(t)) for t in step_literals(gm, op_phase))
    return [[key, n] for key, n in sorted(counts.items())]


def eligible(optimizers: Sequence[torch.optim.Optimizer], scaler: Any, schedulers: Sequence[Any]) -> bool:
    """A step a record may stand for: optimizers with no state yet (a fresh process), whose
    state one ``step()`` makes; no GradScaler (its scale and growth tracker are state the
    untraced run moves too) and no scheduler."""
    enabled_scaler = scaler is not None and scaler.is_enabled()
    return bool(optimizers) and not enabled_scaler and not schedulers and all(not opt.state for opt in optimizers)


def record_key_parts(
    fn: Any, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], batch: Any, recompute: bool
) -> list[Any]:
    """What is known of a step before it is captured: its function's code, the model's
    parameters, buffers and modes, the optimizers' kinds and settings, the batch's structure
    and tensors' shapes; the key a record is looked up by (a hint: the fingerprint decides)."""
    code = getattr(fn, "__code__", None)
    fn_parts = [
        getattr(fn, "__module__", ""),
        getattr(fn, "__qualname__", type(fn).__qualname__),
        hashlib.sha256(code.co_code).hexdigest() if code is not None else "",
        repr(code.co_consts) if code is not None else "",
    ]
    params = [(n, tuple(p.shape), str(p.dtype), str(p.device), p.requires_grad) for n, p in model.named_parameters()]
    buffers = [(n, tuple(b.shape), str(b.dtype), str(b.device)) for n, b in model.named_buffers()]
    modes = [m.training for m in model.modules()]
    settings = [
        (
            type(opt).__qualname__,
            [sorted((k, repr(v)) for k, v in g.items() if k != "params") for g in opt.param_groups],
        )
        for opt in optimizers
    ]
    leaves, spec = pytree.tree_flatten(batch)
    shapes = [(tuple(x.shape), str(x.dtype), str(x.device)) if isinstance(x, torch.Tensor) else repr(x) for x in leaves]
    return [fn_parts, type(model).__qualname__, params, buffers, modes, settings, str(spec), shapes, recompute]


def warm_optimizers(
    model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], mode: FakeTensorMode, record: SteadyRecord
) -> None:
    """Give the (fake, swapped-in) optimizers the state the untraced run would: one ``step()``
    of each, by its own class's code, with a zero fake gradient on every parameter the record
    says has state; raises :class:`NotSteady` unless the state is then what the record says."""
    from memplan.torch.capture.trace import optimizer_state_meta

    named = dict(model.named_parameters(remove_duplicate=True))
    wanted = record.state_meta
    if not isinstance(wanted, dict) or not set(wanted) <= set(named):
        raise NotSteady("the record's state is for other parameters")
    params = [named[name] for name in wanted]
    try:
        with mode:
            for p in params:
                p.grad = torch.zeros_like(p)
            for opt in optimizers:
                type(opt).step(opt)  # the class's step: not the capture's recorder around the instance's
    except Exception as error:  # e.g. a step that needs a closure (LBFGS)
        raise NotSteady(f"the optimizers' step() on fakes raised {type(error).__name__}") from error
    finally:
        for p in params:
            p.grad = None
    now = {k: v for opt in optimizers for k, v in optimizer_state_meta(model, opt).items()}
    if jsonable(now) != wanted:
        raise NotSteady("one step() of the optimizers makes another state than the record's")
