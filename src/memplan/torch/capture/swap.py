"""Fakes swapped into the user's own objects for the time of capture, everything restored after.

A step function closes over the user's model, optimizer and scaler, so capture cannot hand it
copies: it traces the user's objects with their tensors replaced by FakeTensors of the same
shapes (no memory is allocated, no value is changed). Swapped: every module's parameters and
buffers (tied tensors stay tied), every optimizer's parameter lists and state, the scaler's
scale and growth tracker, and the optimizers' step hooks (a user's hook must not see fakes).
On exit, even after an error, every dict, list and attribute is put back as it was, and every
module's and optimizer's attributes are what they were before capture (a counter the forward
increments, a cache it leaves behind, a custom optimizer's step count: the capture's fake runs
leave no trace on the user's objects).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

import torch
from memplan.errors import UnsupportedOp

SCALER_TENSORS = ("_scale", "_growth_tracker")


class FakeSwap:
    """``with FakeSwap(mode, model, optimizers, scaler):`` the objects hold fakes."""

    def __init__(
        self,
        mode: FakeTensorMode,
        model: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        scaler: Any = None,
    ) -> None:
        self.mode = mode
        self.model = model
        self.optimizers = list(optimizers)
        self.scaler = scaler
        self.fakes: dict[int, torch.Tensor] = {}
        self._restore: list[tuple[Any, str, Any]] = []
        self._attribute_dicts: list[tuple[Any, dict[str, Any]]] = []  # modules and optimizers, their attributes
        self._swapped: list[tuple[str, torch.nn.Module, dict[str, Any], dict[str, Any]]] = []

    def fake_of(self, t: torch.Tensor) -> torch.Tensor:
        """The fake standing in for ``t`` (one per real tensor; fakes stay as they are)."""
        if is_fake(t):
            return t
        if id(t) not in self.fakes:
            fake = self.mode.from_tensor(t.detach())
            if isinstance(t, torch.nn.Parameter):
                fake = torch.nn.Parameter(fake, requires_grad=t.requires_grad)
            self.fakes[id(t)] = fake
        return self.fakes[id(t)]

    def __enter__(self) -> FakeSwap:
        try:
            self._swap_model()
            for opt in self.optimizers:
                self._swap_optimizer(opt)
            if self.scaler is not None:
                self._swap_scaler()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, key, value in reversed(self._restore):
            if isinstance(owner, dict):
                owner[key] = value
            else:
                setattr(owner, key, value)
        self._restore = []
        for owner, saved in self._attribute_dicts:
            owner.__dict__.clear()
            owner.__dict__.update(saved)
        self._attribute_dicts = []

    def _set(self, owner: Any, key: str, value: Any) -> None:
        self._restore.append((owner, key, owner[key] if isinstance(owner, dict) else getattr(owner, key)))
        if isinstance(owner, dict):
            owner[key] = value
        else:
            setattr(owner, key, value)

    def _swap_model(self) -> None:
        for path, module in self.model.named_modules(remove_duplicate=False):
            self._attribute_dicts.append((module, dict(module.__dict__)))
            params = {k: None if p is None else self.fake_of(p) for k, p in module._parameters.items()}
            buffers = {k: None if b is None else self.fake_of(b) for k, b in module._buffers.items()}
            self._set(module, "_parameters", params)
            self._set(module, "_buffers", buffers)
            self._swapped.append((path, module, dict(params), dict(buffers)))

    def refuse_rebound_tensors(self) -> None:
        """Raise :class:`UnsupportedOp` if the step assigned a new tensor to a parameter or a
        buffer of the model (``self.avg = 0.9 * self.avg + ...``): the plan writes the step's
        results into the tensors the model holds and never rebinds them, so the buffer would
        keep its first value while eager's moves on."""
        for path, module, params, buffers in self._swapped:
            for kind, swapped, now in (("parameter", params, module._parameters), ("buffer", buffers, module._buffers)):
                for name in now:
                    if name not in swapped or now[name] is not swapped[name]:
                        where = f"{path}.{name}" if path else name
                        raise UnsupportedOp(
                            f"the step assigns a new tensor to the {kind} {where!r} of {type(module).__name__} "
                            f"(self.{name} = ...); memplan writes the step's results into the tensors the model "
                            f"holds and does not rebind them: update it in place (self.{name}.copy_(...), or "
                            "mul_/add_)"
                        )

    def _swap_optimizer(self, opt: torch.optim.Optimizer) -> None:
        # its attributes as they were (a custom optimizer's step counter in Python: capture's
        # runs call its step, and the planned step calls it for real, once per call)
        self._attribute_dicts.append((opt, dict(opt.__dict__)))
        for group in opt.param_groups:
            self._set(group, "params", [self.fake_of(p) for p in group["params"]])
        state: defaultdict = defaultdict(dict)
        for p, values in opt.state.items():
            state[self.fake_of(p)] = {k: self._fake_state_value(v) for k, v in values.items()}
        self._set(opt, "state", state)
        self._set(opt, "_optimizer_step_pre_hooks", type(opt._optimizer_step_pre_hooks)())
        self._set(opt, "_optimizer_step_post_hooks", type(opt._optimizer_step_post_hooks)())

    def _fake_state_value(self, value: Any) -> Any:
        """Scalars such as Adam's ``step`` are rebuilt inside the mode so the fake keeps its
        value: the optimizer reads it with ``.item()`` to compute its bias corrections."""
        if not isinstance(value, torch.Tensor):
            return copy.copy(value)
        if value.dim() == 0 and value.device.type == "cpu" and not is_fake(value):
            number = value.item()
            with self.mode:
                return torch.tensor(number, dtype=value.dtype)
        return self.fake_of(value)

    def _swap_scaler(self) -> None:
        scaler = self.scaler
        if not scaler.is_enabled():
            return
        for name in SCALER_TENSORS:
            value = getattr(scaler, name)
            if isinstance(value, torch.Tensor):
                self._set(scaler, name, self._fake_state_value(value) if value.dim() == 0 else self.fake_of(value))
        self._set(scaler, "_per_optimizer_states", copy.deepcopy(scaler._per_optimizer_states))
