"""Fake copies of a user's model and optimizer, so capture allocates no real memory and never
touches the user's objects."""

from __future__ import annotations

import copy

from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode

import torch


def new_fake_mode() -> FakeTensorMode:
    """The mode capture traces in. Real tensors that the step creates itself are allowed as
    inputs (foreach Adam adds ``torch.tensor(1.0)`` to its CPU step counts): they become
    constants of the traced program."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def fake_mode_of(model: torch.nn.Module, *tensors: object) -> FakeTensorMode | None:
    """The FakeTensorMode the model's parameters (or ``tensors``) already live in, if any."""
    return detect_fake_mode([*model.parameters(), *model.buffers(), *tensors])


def fake_clone_module(model: torch.nn.Module, mode: FakeTensorMode) -> tuple[torch.nn.Module, dict[int, torch.Tensor]]:
    """A structural copy of ``model`` whose parameters and buffers are fake.

    Submodules are copied shallowly (their plain attributes are shared), parameters and
    buffers are replaced by fakes of the same shape, dtype and ``requires_grad``; a tensor
    used in two places (tied weights) maps to one fake. Returns the clone and a map
    ``id(real tensor) -> fake tensor``.
    """
    fakes: dict[int, torch.Tensor] = {}
    clones: dict[int, torch.nn.Module] = {}

    def fake_of(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fakes:
            fake = mode.from_tensor(t.detach())
            if isinstance(t, torch.nn.Parameter):
                fake = torch.nn.Parameter(fake, requires_grad=t.requires_grad)
            fakes[id(t)] = fake
        return fakes[id(t)]

    def clone(module: torch.nn.Module) -> torch.nn.Module:
        if id(module) in clones:
            return clones[id(module)]
        new = copy.copy(module)
        clones[id(module)] = new
        new._parameters = {k: None if p is None else fake_of(p) for k, p in module._parameters.items()}
        new._buffers = {k: None if b is None else fake_of(b) for k, b in module._buffers.items()}
        new._modules = {k: None if m is None else clone(m) for k, m in module._modules.items()}
        return new

    return clone(model), fakes


def fake_clone_optimizer(
    optimizer: torch.optim.Optimizer, fakes: dict[int, torch.Tensor], mode: FakeTensorMode
) -> torch.optim.Optimizer:
    """The same optimizer class and hyper-parameters over the fake parameters, with the
    existing state (if any) copied as fakes."""
    groups = []
    for group in optimizer.param_groups:
        params = [fakes[id(p)] for p in group["params"]]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    with mode:
        try:
            fake_opt = type(optimizer)(groups, **optimizer.defaults)
        except TypeError:
            fake_opt = type(optimizer)(groups)
    for p, state in optimizer.state.items():
        fake_opt.state[fakes[id(p)]] = {k: _fake_state_value(v, mode) for k, v in state.items()}
    return fake_opt


def _fake_state_value(value: object, mode: FakeTensorMode) -> object:
    """Scalars such as Adam's ``step`` are rebuilt inside the mode so the fake keeps its
    value: the optimizer reads it with ``.item()`` to compute its bias corrections."""
    if not isinstance(value, torch.Tensor):
        return copy.copy(value)
    if value.dim() == 0 and value.device.type == "cpu":
        number = value.item()
        with mode:
            return torch.tensor(number, dtype=value.dtype)
    return mode.from_tensor(value)
