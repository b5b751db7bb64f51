"""Fake copies of a user's model and optimizer, so capture allocates no real memory and never
touches the user's objects."""

from __future__ import annotations

import contextlib
import copy
import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

import torch
from memplan.torch.tensors import tensor_leaves, written_arguments


class CaptureFakeMode(FakeTensorMode):
    """The FakeTensorMode of capture. It differs from PyTorch's in this class only (no other
    fake mode of the process changes):

    - fake kernels for the ops whose meta function is narrower than their CPU kernel:
      ``aten._grouped_mm``, which HF's mixture-of-experts layers (Mixtral, Qwen-MoE, ...)
      call on CPU in float32, while its meta accepts bfloat16 only (it checks the CUDA
      kernel's rules);
    - every literal the step makes from Python values (``torch.tensor(0)``: a real tensor
      lifted into the mode) is recorded in ``literals``, so capture can check that two runs of
      the step make the same ones (:mod:`memplan.torch.capture.literals`);
    - every random op is reported to capture's ``generator_watch``, which refuses one drawn after
      the step set the generator (:mod:`memplan.torch.capture.generator`);
    - while ``scalar_log`` is a list, each op outside the optimizers' calls is logged with the
      Python numbers it was given, so capture can check that two runs of the step pass the same
      ones (:func:`memplan.torch.capture.literals.check_scalars_repeat`);
    - while ``real_writes`` is a dict, a real tensor an op writes is copied first, so capture can
      put it back (:func:`real_writes_undone`);
    - while ``made`` is a list, a weak reference to each op's outputs is kept, so capture can
      tell which ones the step left where its caller sees them (:mod:`memplan.torch.capture.escape`).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.literals: list[torch.Tensor] = []
        self.generator_watch: Any = None  # capture's GeneratorWatch (memplan.torch.capture.generator)
        self.scalar_log: list[tuple[Any, tuple]] | None = None  # (op, its Python numbers) per op, while logging
        self.logging: Callable[[], bool] = lambda: True  # capture: outside the optimizers' calls
        self._depth = 0  # dispatches in progress: an op a decomposition makes inside another is not logged
        self.real_writes: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # id -> (tensor, before)
        self.made: list[weakref.ref] | None = None  # while a list: each op's outputs (see .escape)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.generator_watch is not None and torch.Tag.nondeterministic_seeded in func.tags:
            self.generator_watch.drew(func)
        if self.scalar_log is not None and not self._depth and self.logging():
            self.scalar_log.append((func, op_scalars(args, kwargs)))  # the step's own ops, not a kernel's decomposition
        self._depth += 1
        try:
            out = self._dispatch(func, types, args, kwargs)
        finally:
            self._depth -= 1
        if self.made is not None and not self._depth:
            self.made += [weakref.ref(t) for t in tensor_leaves(out) if is_fake(t)]
        return out

    def _dispatch(self, func, types, args, kwargs):
        if self.real_writes is not None and func._schema.is_mutable:
            self._save_real_writes(func, args, kwargs)
        if func in _LIFTS and args and isinstance(args[0], torch.Tensor) and not is_fake(args[0]):
            self.literals.append(args[0].detach().clone())
        if func is torch.ops.aten._grouped_mm.default:
            shape = _cpu_grouped_mm_shape(*args, **kwargs)
            if shape is not None:
                dtype = kwargs.get("out_dtype") or args[0].dtype
                empty = torch.ops.aten.empty.memory_format
                return super().__torch_dispatch__(empty, types, (shape,), {"dtype": dtype, "device": args[0].device})
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _save_real_writes(self, func, args, kwargs) -> None:
        """Keep a copy of each real tensor ``func`` is about to write (a closure tensor: an EMA's
        parameters, a counter): with non-fake inputs only, the mode runs the real kernel, so a
        fake run of the step would change the user's tensor (:func:`real_writes_undone`)."""
        for value in written_arguments(func, args, kwargs):
            for t in tensor_leaves(value):
                if not is_fake(t) and id(t) not in self.real_writes:
                    with torch.utils._python_dispatch._disable_current_modes():
                        self.real_writes[id(t)] = (t, t.detach().clone())


@contextlib.contextmanager
def real_writes_undone(mode: FakeTensorMode) -> Iterator[None]:
    """While capture runs the step on fakes, note the real tensors it writes, and put back
    their values afterwards: the user's tensors end the capture as they began it."""
    if not isinstance(mode, CaptureFakeMode):
        yield
        return
    mode.real_writes = {}
    try:
        yield
    finally:
        saved, mode.real_writes = mode.real_writes, None
        with torch.utils._python_dispatch._disable_current_modes(), torch.no_grad():
            for tensor, before in saved.values():
                tensor.copy_(before)


_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


def op_scalars(args: tuple, kwargs: dict[str, Any]) -> tuple:
    """The Python numbers an op is given: its int, float and bool arguments (sizes included)
    and the 0-dim real tensors a call wraps a number in (``h * 2``); NaN as a string, so a NaN
    argument compares equal to itself."""
    out: list[Any] = []
    _numbers(args, out)
    _numbers(tuple(kwargs.values()), out)
    return tuple(out)


def _numbers(values: tuple | list, out: list[Any]) -> None:
    for value in values:
        if isinstance(value, tuple | list):
            _numbers(value, out)
        elif isinstance(value, torch.Tensor):
            if value.dim() == 0 and not is_fake(value) and value.device.type != "meta":
                out.append(_number(value.item()))
        elif isinstance(value, bool | int | float):
            out.append(_number(value))


def _number(value: Any) -> Any:
    return "nan" if isinstance(value, float) and math.isnan(value) else value


def take_literals(mode: FakeTensorMode) -> list[torch.Tensor] | None:
    """The literals recorded since the last call (None: ``mode`` does not record them)."""
    if not isinstance(mode, CaptureFakeMode):
        return None
    literals, mode.literals = mode.literals, []
    return literals


def _cpu_grouped_mm_shape(mat_a, mat_b, offs=None, bias=None, out_dtype=None) -> tuple[int, ...] | None:
    """The output shape of ``_grouped_mm`` on a CPU tensor that is not bfloat16 (its CPU
    kernel returns a contiguous tensor); None where PyTorch's own meta decides."""
    if mat_a.device.type != "cpu" or mat_a.dtype == torch.bfloat16:
        return None
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if a_2d and b_2d:
        return (offs.shape[0], mat_a.shape[0], mat_b.shape[1])
    if a_2d:
        return (mat_a.shape[0], mat_b.shape[-1])
    if b_2d:
        return (mat_a.shape[1], mat_b.shape[1])
    return (mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1])


def new_fake_mode() -> FakeTensorMode:
    """The mode capture traces in. Real tensors that the step creates itself are allowed as
    inputs (foreach Adam adds ``torch.tensor(1.0)`` to its CPU step counts): they become
    constants of the traced program."""
    return CaptureFakeMode(allow_non_fake_inputs=True)


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
        new = _shallow_copy(module)
        clones[id(module)] = new
        new._parameters = {k: None if p is None else fake_of(p) for k, p in module._parameters.items()}
        new._buffers = {k: None if b is None else fake_of(b) for k, b in module._buffers.items()}
        new._modules = {k: None if m is None else clone(m) for k, m in module._modules.items()}
        return new

    return clone(model), fakes


def _shallow_copy(module: torch.nn.Module) -> torch.nn.Module:
    """``copy.copy`` without ``__getstate__``, which a parametrized module (weight norm, as in
    wav2vec2's positional convolution) refuses to run."""
    new = object.__new__(type(module))
    new.__dict__.update(module.__dict__)
    return new


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
