"""The baselines' fast R against the naive one on a captured zoo step (batch norm, in-place
relu, SGD updates closing re-run windows)."""

from __future__ import annotations

import pytest

from memplan.remat.portfolio import WHOLE
from memplan.torch.zoo import capture_graph
from tests.core.test_remat_baselines import assert_same_baseline_plans


def test_vgg16_baselines_plan_alike_with_the_fast_and_the_naive_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    graph = capture_graph("vgg16", batch_size=32, mode="train", optimizer="sgd")
    fits = assert_same_baseline_plans(graph, monkeypatch, (0.95, 0.9), max_solver_nodes=WHOLE)
    assert fits > 0
