"""Everything a training step may change, snapshotted and compared bit for bit.

A planned step equals eager when, after each step, the two runs agree on every parameter,
every gradient left on a parameter, every buffer (BatchNorm's running statistics and
``num_batches_tracked``), the whole optimizer ``state_dict`` (state tensors, step counts,
param-group hyper-parameters) and the random generator's state. :func:`snapshot` takes them,
:func:`differences` names each one that differs (bitwise: NaNs compare by their bits, and
``-0.0`` differs from ``0.0``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class StepState:
    """Copies of what a step may change."""

    params: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: torch.Tensor
    others: tuple[dict[str, Any], ...] = ()  # state_dict() of schedulers, scalers, more optimizers


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *others: Any) -> StepState:
    """Copy the model's parameters, gradients and buffers, the optimizer's ``state_dict``, the
    ``state_dict()`` of ``others`` (LR schedulers, a GradScaler, more optimizers) and the CPU
    random generator's state."""
    return StepState(
        params={n: p.detach().clone() for n, p in model.named_parameters()},
        grads={n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()},
        buffers={n: b.detach().clone() for n, b in model.named_buffers()},
        optimizer=_clone(optimizer.state_dict()) if optimizer is not None else {},
        rng=torch.get_rng_state(),
        others=tuple(_clone(o.state_dict()) for o in others),
    )


def differences(a: StepState, b: StepState) -> list[str]:
    """One line for each thing that differs between two snapshots (empty: bit-identical)."""
    out: list[str] = []
    out += _compare_dicts("parameter", a.params, b.params)
    out += _compare_dicts("gradient of", a.grads, b.grads)
    out += _compare_dicts("buffer", a.buffers, b.buffers)
    out += [f"optimizer {line}" for line in _compare_values("state_dict", a.optimizer, b.optimizer)]
    for i, (x, y) in enumerate(zip(a.others, b.others, strict=True)):
        out += [f"object {i}: {line}" for line in _compare_values("state_dict", x, y)]
    if not bitwise_equal(a.rng, b.rng):
        out.append("random generator state")
    return out


def bitwise_equal(a: Any, b: Any) -> bool:
    """Same dtype, shape and bits (tensors) or equal values (anything else)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(_bits(a), _bits(b))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN hyper-parameters compare equal to themselves
    return a == b


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype.itemsize else flat


def _compare_dicts(what: str, a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    out = [f"{what} {name!r} present on one side only" for name in sorted(set(a) ^ set(b))]
    for name in sorted(set(a) & set(b)):
        if not bitwise_equal(a[name], b[name]):
            out.append(f"{what} {name!r}{_magnitude(a[name], b[name])}")
    return out


def _compare_values(path: str, a: Any, b: Any) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))} on one side only"]
        return [line for k in a for line in _compare_values(f"{path}[{k!r}]", a[k], b[k])]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: lengths {len(a)} and {len(b)}"]
        return [
            line for i, (x, y) in enumerate(zip(a, b, strict=True)) for line in _compare_values(f"{path}[{i}]", x, y)
        ]
    return [] if bitwise_equal(a, b) else [f"{path}{_magnitude(a, b)}"]


def _magnitude(a: Any, b: Any) -> str:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.is_floating_point():
        return f" (max abs diff {float((a.double() - b.double()).abs().max()):.3g})" if a.numel() else ""
    return f" ({a!r} vs {b!r})" if not isinstance(a, torch.Tensor) else ""


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value
