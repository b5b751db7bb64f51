"""The compile path's reorder gap (issue 37): the option reaches the solver, its report is honest,
and a bad value is refused in one line before anything runs."""

from __future__ import annotations

import pytest

import memplan
from memplan.errors import MemplanError
from memplan.pipeline import COMPILE_REORDER_GAP
from tests.torch.test_plancache import _batches, _model, _step


def test_a_bad_reorder_gap_is_refused_in_one_line():
    model, optimizer = _model()
    for gap in (-0.01, 1.0, "0.5%", True):
        with pytest.raises(MemplanError, match="reorder_gap must be a fraction"):
            memplan.compile(_step(model, optimizer), model=model, optimizer=optimizer, reorder_gap=gap)


@pytest.mark.parametrize("gap", [COMPILE_REORDER_GAP, pytest.param(0.0, marks=pytest.mark.slow)])
def test_the_plan_reports_the_gap_it_was_asked_for_and_met(gap):
    """A small step: its order is found within the limit in milliseconds (0: proven optimal)."""
    model, optimizer = _model()
    step = _step(model, optimizer)
    compiled = memplan.compile(step, model=model, optimizer=optimizer, allocator="views", reorder_gap=gap)
    compiled(_batches(1)[0])
    (plan,) = compiled.plans.values()
    schedule = plan.report["schedule"]
    assert schedule["gap_limit"] == gap
    assert schedule["gap"] <= gap
    assert (schedule["status"] == "optimal") == (schedule["gap"] == 0)
