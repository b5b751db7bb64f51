"""A budgeted step run by the remat runner on PyTorch's ordinary allocator (``allocator="views"``)
peaks within the peak its plan claims (issue 33: a budget is a bound).

PyTorch's CPU ``mse_loss`` returns its 0-dim loss in the storage of the unreduced loss (here one
128 KiB activation); the step's loss lives to the end of the step, so the runner held one
activation more than the plan counted and peaked above it and above the budget. The runner now
copies such an output to a storage of its traced size (:class:`memplan.torch.run.remat.Shrink`).
"""

from __future__ import annotations

import copy

import pytest

import memplan
import torch
from memplan.torch.measure import allocator_peak_bytes, optimizer_state_tensors, resident_bytes
from memplan.torch.run.remat import RematRunner, Shrink


def _workload() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """6 x (Linear(64, 64), Tanh), batch 512: each activation 128 KiB."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(64, 64), torch.nn.Tanh())])
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(512, 64, generator=g), torch.randn(512, 64, generator=g))


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _eager_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: tuple) -> torch.Tensor:
    loss = torch.nn.functional.mse_loss(model(batch[0]), batch[1])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _measured(step, model, opt, batch) -> int:
    """Resident parameters, optimizer state and batch plus the allocator's peak in one step."""
    _, peak = allocator_peak_bytes(step, batch)
    return resident_bytes(list(model.parameters()), optimizer_state_tensors(opt), batch) + peak


@pytest.mark.parametrize("fraction", [0.8, 0.95])
def test_views_remat_step_peaks_within_its_planned_peak(fraction: float) -> None:
    """0.8: the loss's 128 KiB storage; 0.95: the plan solved before the workspace was measured
    and reused once it fits with it, whose claim left the workspace out (8 B under)."""
    model, batch = _workload()
    eager = copy.deepcopy(model)
    opt, eager_opt = _sgd(model), _sgd(eager)
    step = memplan.compile_step(
        model, opt, torch.nn.functional.mse_loss, batch, memory_budget=fraction, time_limit_seconds=1, allocator="views"
    )
    for _ in range(3):
        assert torch.equal(step(batch), _eager_step(eager, eager_opt, batch))
    runner = step.runner_for(batch)
    budget = step.report["budget"]
    assert isinstance(runner, RematRunner) and budget["method"] == "remat"
    assert runner.recomputes > 0 and runner.learned and runner.shrunk_nodes() == ["mse_loss"]
    planned = budget["planned_peak_bytes"]
    assert planned <= budget["budget_bytes"]
    assert _measured(step, model, opt, batch) <= planned  # the generated step (the default)
    runner.executor = "interpreted"  # the reference executor holds it too
    assert _measured(step, model, opt, batch) <= planned
    _eager_step(eager, eager_opt, batch)
    _eager_step(eager, eager_opt, batch)
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        assert torch.equal(p, q)


def test_replay_remat_step_places_within_the_budget() -> None:
    model, batch = _workload()
    opt = _sgd(model)
    step = memplan.compile_step(
        model, opt, torch.nn.functional.mse_loss, batch, memory_budget=0.8, time_limit_seconds=1, allocator="replay"
    )
    for _ in range(4):
        step(batch)
    budget = step.report["budget"]
    assert budget["method"] == "remat" and budget["placement_rounds"]
    # no re-plan needed: the recorded step holds what the plan counts (the loss no longer 128 KiB)
    assert len(budget["placement_rounds"]) == 1
    assert budget["placed_peak_bytes"] <= budget["budget_bytes"]


def test_shrink_copies_an_oversized_output_bit_for_bit() -> None:
    a, b = torch.randn(512, 64), torch.randn(512, 64)
    loss = torch.nn.functional.mse_loss(a, b)
    assert loss.untyped_storage().nbytes() > loss.element_size()  # the premise: PyTorch's CPU kernel
    shrink = Shrink(((0, 4),), single=True)
    small = shrink(loss, ((a, b), {}))
    assert small is not loss and shrink.hits == 1
    assert small.untyped_storage().nbytes() == 4 and torch.equal(small, loss)
    strided = torch.randn(8, 16).t()[::2]  # a non-contiguous output: same sizes and strides
    copied = Shrink(((0, 4 * strided.numel()),), single=True)(strided)
    assert copied.stride() == strided.stride() and torch.equal(copied, strided)
    assert copied.untyped_storage().nbytes() < strided.untyped_storage().nbytes()
    element = a[0, 0]
    alias = Shrink(((0, 4),), single=True)
    assert alias(element, ((a,), {})) is element and alias.hits == 0  # an input's alias is kept


@pytest.mark.parametrize("fits", [True, False])
def test_shrink_keeps_an_output_that_fits_and_tuples(fits: bool) -> None:
    x = torch.randn(4, 4)
    y = torch.randn(16)
    nbytes = y.untyped_storage().nbytes() if fits else 8
    head = y[:2]
    shrink = Shrink(((1, nbytes),), single=False)
    out = shrink((x, head))
    assert out[0] is x and torch.equal(out[1], head)
    assert (out[1] is not head and out[1].untyped_storage().nbytes() == 8) != fits
    assert shrink.hits == (0 if fits else 1)
