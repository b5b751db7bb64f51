"""Module casts and moves (``.to``, ``.float()``, ``.cpu()``, ...) that the step calls while it
is captured.

Some models cast a submodule inside ``forward``: HF's Switch-Transformers router runs
``self.classifier = self.classifier.to(self.dtype)`` on every call, a cast that changes nothing
when the classifier already has that dtype. PyTorch's ``Module._apply`` swaps every parameter
for its converted self (``torch.utils.swap_tensors``) whenever the parameter is a FakeTensor,
which is what capture puts in the user's modules; the swap fails ("Couldn't swap
Linear.weight") because capture, the optimizer and autograd hold references to the fake.

While the step is captured every module's ``_apply`` is replaced (in the instance's
``__dict__``, put back afterwards) by a check: a cast that leaves every parameter and buffer
as it is (same tensor, or same storage, dtype, device and layout) does nothing, as eager's does
nothing either; one that changes a tensor is refused in one line naming the module and the
call, since a planned step cannot change the model's parameters behind the plan.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from memplan.errors import ModuleCast
from memplan.torch.tensors import storage_key

# The public methods of nn.Module that end in ``_apply``: wrapped only to name the call.
CAST_METHODS = tuple(
    m
    for m in ("to", "float", "double", "half", "bfloat16", "cpu", "cuda", "xpu", "ipu", "mtia", "type", "to_empty")
    if hasattr(torch.nn.Module, m)
)


class _Calls:
    """The cast calls being made, innermost last (``to`` of an HF model calls ``nn.Module.to``)."""

    def __init__(self) -> None:
        self.stack: list[str] = []


@contextlib.contextmanager
def guarded_casts(model: torch.nn.Module) -> Iterator[None]:
    """``with guarded_casts(model):`` casts of ``model``'s modules are checked (see module doc);
    every module's ``__dict__`` is as it was afterwards, even after an error."""
    names: dict[int, str] = {}
    for name, module in model.named_modules():
        names.setdefault(id(module), name or type(model).__name__)
    calls = _Calls()
    saved: list[tuple[torch.nn.Module, str, Any]] = []
    missing = object()
    try:
        for module in {id(m): m for m in model.modules()}.values():
            name = names[id(module)]
            for attr in ("_apply", *CAST_METHODS):
                saved.append((module, attr, module.__dict__.get(attr, missing)))
            module.__dict__["_apply"] = functools.partial(_checked_apply, module, name, calls)
            for method in CAST_METHODS:
                module.__dict__[method] = functools.partial(_named_call, module, name, method, calls)
        yield
    finally:
        for module, attr, value in reversed(saved):
            if value is missing:
                module.__dict__.pop(attr, None)
            else:
                module.__dict__[attr] = value


def _named_call(module: torch.nn.Module, name: str, method: str, calls: _Calls, *args: Any, **kwargs: Any) -> Any:
    """``module.<method>(*args, **kwargs)`` as its class defines it, the call's text remembered
    for the refusal :func:`_checked_apply` may raise."""
    calls.stack.append(f"{name}.{method}({_arguments(args, kwargs)})")
    try:
        return getattr(type(module), method)(module, *args, **kwargs)
    finally:
        calls.stack.pop()


def _checked_apply(
    module: torch.nn.Module, name: str, calls: _Calls, fn: Callable[[torch.Tensor], Any], recurse: bool = True
) -> torch.nn.Module:
    """``module._apply(fn)`` during capture: nothing if ``fn`` changes no tensor, else a refusal."""
    params = module.named_parameters(recurse=recurse, remove_duplicate=False)
    buffers = module.named_buffers(recurse=recurse, remove_duplicate=False)
    tensors = [("parameter", n, t) for n, t in params] + [("buffer", n, t) for n, t in buffers]
    with torch.no_grad():
        for kind, tensor_name, t in tensors:
            applied = fn(t)
            if not _unchanged(t, applied):
                call = calls.stack[0] if calls.stack else f"{name}._apply(...)"
                raise ModuleCast(
                    f"`{call}` inside the step changes the module's {kind}s ({tensor_name}: "
                    f"{_describe(t)} -> {_describe(applied)}); memplan plans steps that leave the model as it is: "
                    "cast or move the model before memplan.compile"
                )
    return module


def _unchanged(t: torch.Tensor, applied: Any) -> bool:
    """``applied`` is ``t`` itself, or the same storage seen the same way."""
    if applied is t:
        return True
    return (
        isinstance(applied, torch.Tensor)
        and applied.dtype == t.dtype
        and applied.device == t.device
        and applied.shape == t.shape
        and applied.stride() == t.stride()
        and applied.storage_offset() == t.storage_offset()
        and storage_key(applied) == storage_key(t)
    )


def _describe(t: Any) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{str(t.dtype).removeprefix('torch.')} on {t.device}"


def _arguments(args: tuple, kwargs: dict[str, Any]) -> str:
    def text(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"<{_describe(value)} tensor>"
        if isinstance(value, (torch.dtype, torch.device)):
            return repr(value) if isinstance(value, torch.dtype) else repr(str(value))
        return repr(value)

    return ", ".join([*(text(a) for a in args), *(f"{k}={text(v)}" for k, v in kwargs.items())])
