"""Every ``torch.optim`` optimizer and its variants, planned and eager, compared bit for bit.

Each case trains a small model (a frozen layer, a layer that gets no gradient, BatchNorm,
dropout, two param groups with different hyper-parameters) for ``steps`` steps through
:func:`memplan.compile_step` and eagerly from the same weights, optimizer state and seed, and
compares everything a step may change after every step (:mod:`memplan.torch.equivalence`).
The outcome is "equal" or "refused" (a one-line error at compile time); "different" is a bug.

``python bench/optimizers.py`` prints the table; ``tests/torch/test_optimizer_matrix.py`` runs it.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from memplan.errors import MemplanError
from memplan.torch.equivalence import differences, snapshot

BATCH_SIZE = 8
FEATURES = 16
CLASSES = 8


class MatrixNet(torch.nn.Module):
    """Small, but with everything an update can get wrong: a frozen layer, a layer that gets
    no gradient in the step, BatchNorm's running statistics and dropout's random draws."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = torch.nn.Linear(FEATURES, FEATURES)
        self.frozen.requires_grad_(False)
        self.fc1 = torch.nn.Linear(FEATURES, 32)
        self.bn = torch.nn.BatchNorm1d(32)
        self.drop = torch.nn.Dropout(0.25)
        self.fc2 = torch.nn.Linear(32, CLASSES)
        self.unused = torch.nn.Linear(4, 4)  # in the optimizer, never in the forward: no gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.frozen(x) + x
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(h)))))


@dataclass(frozen=True)
class OptimizerCase:
    """One optimizer with one set of options; ``second_group`` overrides hyper-parameters of
    the second param group (``fc2``); ``warm`` runs one eager step on both sides before
    compiling, so the plan starts from existing optimizer state."""

    optimizer: str
    variant: str
    options: dict[str, Any] = field(default_factory=dict)
    second_group: dict[str, Any] = field(default_factory=dict)
    warm: bool = False

    @property
    def label(self) -> str:
        return f"{self.optimizer}[{self.variant}]"


@dataclass(frozen=True)
class CaseResult:
    case: OptimizerCase
    outcome: str  # "equal", "refused" (at compile time), "refused at run", "different", "not in torch"
    detail: str = ""
    steps: int = 0


_LR = {"SGD": 0.05, "Adadelta": 1.0, "Rprop": 0.01, "ASGD": 0.05, "Adagrad": 0.05, "Adafactor": 0.01}

# (variant label, options); options a class does not take are dropped with the case
_VARIANTS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "SGD": [
        ("plain", {}),
        ("momentum", {"momentum": 0.9}),
        ("nesterov", {"momentum": 0.9, "nesterov": True}),
        ("dampening+weight_decay", {"momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-2}),
        ("maximize", {"momentum": 0.5, "maximize": True}),
        ("foreach", {"foreach": True}),
        ("foreach+momentum", {"foreach": True, "momentum": 0.9}),
        (
            "foreach+nesterov+wd+maximize",
            {"foreach": True, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2, "maximize": True},
        ),
        ("fused", {"fused": True}),
        ("fused+momentum", {"fused": True, "momentum": 0.9, "weight_decay": 1e-2}),
    ],
    "Adam": [
        ("plain", {}),
        ("amsgrad", {"amsgrad": True}),
        ("weight_decay", {"weight_decay": 1e-2}),
        ("decoupled_weight_decay", {"weight_decay": 1e-2, "decoupled_weight_decay": True}),
        ("maximize", {"maximize": True}),
        ("foreach", {"foreach": True}),
        ("foreach+amsgrad+wd", {"foreach": True, "amsgrad": True, "weight_decay": 1e-2}),
        ("fused", {"fused": True}),
        ("fused+amsgrad+maximize", {"fused": True, "amsgrad": True, "maximize": True}),
    ],
    "AdamW": [
        ("plain", {}),
        ("amsgrad", {"amsgrad": True}),
        ("maximize", {"maximize": True}),
        ("foreach", {"foreach": True}),
        ("foreach+amsgrad", {"foreach": True, "amsgrad": True}),
        ("fused", {"fused": True}),
        ("fused+amsgrad", {"fused": True, "amsgrad": True}),
    ],
    "Adamax": [
        ("plain", {}),
        ("weight_decay", {"weight_decay": 1e-2}),
        ("maximize", {"maximize": True}),
        ("foreach", {"foreach": True}),
        ("foreach+wd+maximize", {"foreach": True, "weight_decay": 1e-2, "maximize": True}),
    ],
    "NAdam": [
        ("plain", {}),
        ("weight_decay", {"weight_decay": 1e-2}),
        ("decoupled_weight_decay", {"weight_decay": 1e-2, "decoupled_weight_decay": True}),
        ("momentum_decay+maximize", {"momentum_decay": 1e-2, "maximize": True}),
        ("foreach", {"foreach": True}),
        ("foreach+decoupled_wd", {"foreach": True, "weight_decay": 1e-2, "decoupled_weight_decay": True}),
    ],
    "RAdam": [
        ("plain", {}),
        ("weight_decay", {"weight_decay": 1e-2}),
        ("decoupled_weight_decay", {"weight_decay": 1e-2, "decoupled_weight_decay": True}),
        ("maximize", {"maximize": True}),
        ("foreach", {"foreach": True}),
        ("foreach+wd", {"foreach": True, "weight_decay": 1e-2}),
    ],
    "Adagrad": [
        ("plain", {}),
        ("lr_decay", {"lr_decay": 1e-2}),
        ("weight_decay+initial_accumulator", {"weight_decay": 1e-2, "initial_accumulator_value": 0.1}),
        ("maximize", {"maximize": True}),
        ("foreach", {"foreach": True}),
        ("fused", {"fused": True}),
    ],
    "Adadelta": [
        ("plain", {}),
        ("weight_decay", {"weight_decay": 1e-2, "rho": 0.8}),
        ("maximize", {"maximize": True}),
        ("foreach", {"foreach": True}),
    ],
    "RMSprop": [
        ("plain", {}),
        ("momentum", {"momentum": 0.9}),
        ("centered", {"centered": True}),
        ("centered+momentum+wd", {"centered": True, "momentum": 0.9, "weight_decay": 1e-2}),
        ("maximize", {"maximize": True}),
        ("foreach", {"foreach": True}),
        ("foreach+centered+momentum", {"foreach": True, "centered": True, "momentum": 0.9}),
    ],
    "Rprop": [
        ("plain", {}),
        ("etas+step_sizes", {"etas": (0.4, 1.3), "step_sizes": (1e-5, 10.0)}),
        ("maximize", {"maximize": True}),
        ("foreach", {"foreach": True}),
    ],
    "ASGD": [
        ("plain", {}),
        ("averaging from step 0", {"t0": 0.0, "lambd": 1e-3}),
        ("weight_decay+maximize", {"weight_decay": 1e-2, "maximize": True}),
        ("foreach", {"foreach": True}),
        ("foreach+averaging", {"foreach": True, "t0": 0.0}),
    ],
    "Adafactor": [
        ("plain", {}),
        ("weight_decay+maximize", {"weight_decay": 1e-2, "maximize": True}),
        ("foreach", {"foreach": True}),
    ],
    "LBFGS": [("plain", {})],
    "SparseAdam": [("plain", {})],
}
_WARM = [("SGD", "momentum"), ("Adam", "foreach"), ("AdamW", "fused"), ("ASGD", "foreach+averaging")]


def optimizer_cases() -> list[OptimizerCase]:
    """Every optimizer of ``torch.optim`` this torch has, with each variant it supports."""
    cases = []
    for name, variants in _VARIANTS.items():
        cls = getattr(torch.optim, name, None)
        if cls is None:
            continue
        accepted = set(inspect.signature(cls).parameters)
        for variant, options in variants:
            if not set(options) <= accepted:
                continue
            second = {"lr": _LR.get(name, 1e-2) * 0.5}
            if "weight_decay" in accepted:
                second["weight_decay"] = 0.05 if name != "Adafactor" else 0.0
            cases.append(OptimizerCase(name, variant, options, second))
            if (name, variant) in _WARM:
                cases.append(OptimizerCase(name, f"{variant}, warm state", options, second, warm=True))
    return cases


def make_optimizer(case: OptimizerCase, model: MatrixNet) -> torch.optim.Optimizer:
    cls = getattr(torch.optim, case.optimizer)
    first = [p for n, p in model.named_parameters() if not n.startswith("fc2.")]
    groups = [{"params": first}, {"params": list(model.fc2.parameters()), **case.second_group}]
    if case.optimizer == "LBFGS":  # takes one param group only
        groups = [{"params": list(model.parameters())}]
    return cls(groups, lr=_LR.get(case.optimizer, 1e-2), **case.options)


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH_SIZE, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (BATCH_SIZE,), generator=generator)
    return x, y


def _eager_step(model, optimizer, loss_fn, batch) -> torch.Tensor:
    loss = loss_fn(model(batch[0]), batch[1])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def run_case(
    case: OptimizerCase, steps: int = 4, *, allocator: str = "auto", seed: int = 0, time_limit_seconds: float = 2.0
) -> CaseResult:
    """Train ``steps`` steps planned and eagerly; compare after every step."""
    import memplan

    torch.manual_seed(seed)
    eager_model = MatrixNet()
    planned_model = copy.deepcopy(eager_model)
    loss_fn = torch.nn.functional.cross_entropy
    try:
        eager_opt = make_optimizer(case, eager_model)
        planned_opt = make_optimizer(case, planned_model)
    except (ValueError, RuntimeError, TypeError) as err:  # torch itself refuses the combination
        return CaseResult(case, "not in torch", str(err).splitlines()[0])
    batches = [_batch(seed + k) for k in range(steps + 1)]
    if case.warm:
        for model, opt in ((eager_model, eager_opt), (planned_model, planned_opt)):
            torch.manual_seed(seed + 99)
            _eager_step(model, opt, loss_fn, batches[-1])
    try:
        step = memplan.compile_step(
            planned_model, planned_opt, loss_fn, batches[0], allocator=allocator, time_limit_seconds=time_limit_seconds
        )
    except MemplanError as err:
        return CaseResult(case, "refused", str(err))
    for k in range(steps):
        torch.manual_seed(seed + 1000 + k)
        eager_loss = _eager_step(eager_model, eager_opt, loss_fn, batches[k])
        eager_state = snapshot(eager_model, eager_opt)
        torch.manual_seed(seed + 1000 + k)
        try:
            planned_loss = step(batches[k])
        except MemplanError as err:
            return CaseResult(case, "refused at run", f"step {k}: {err}", k)
        found = differences(eager_state, snapshot(planned_model, planned_opt))
        if not torch.equal(eager_loss, planned_loss):
            found.insert(0, "loss")
        if found:
            return CaseResult(case, "different", f"step {k}: " + "; ".join(found[:4]), k + 1)
    return CaseResult(case, "equal", "", steps)
