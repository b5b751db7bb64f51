"""DDP buckets on captured training steps: every parameter's gradient found, every bucket
waited for, the plan safe in every execution (the graph transform is core; capture needs torch)."""

from __future__ import annotations

import pytest

from memplan.graph import Category
from memplan.schedule.early_updates import enforce_early_weight_updates
from memplan.streams import (
    data_parallel_step,
    gradient_parameters,
    plan_stream_placement,
    validate_stream_placement,
    validate_streams,
)
from memplan.torch.zoo import build_workload, capture_graph


@pytest.mark.parametrize(("model", "optimizer"), [("mlp", "sgd"), ("mlp", "adam"), ("gpt2-2l", "adamw")])
def test_every_parameter_gets_its_gradient(model: str, optimizer: str) -> None:
    graph = capture_graph(model, 2, "train", optimizer)
    pairs = gradient_parameters(graph)
    params = list(build_workload(model, 2).model.parameters())
    assert len(pairs) == len(params)
    for p, g in pairs:
        assert graph.tensors[p].category is Category.PARAMETER
        assert graph.tensors[g].category is Category.GRADIENT
        assert graph.tensors[g].size_bytes == graph.tensors[p].size_bytes


def test_ddp_step_of_a_captured_model_is_planned_safely() -> None:
    graph = data_parallel_step(capture_graph("mlp", 2, "train", "sgd"), bucket_cap_bytes=8 << 20)
    validate_streams(graph)
    assert len(graph.meta["buckets"]) > 1
    for early in (graph, enforce_early_weight_updates(graph)[0]):
        validate_streams(early)
        plan = plan_stream_placement(early, time_limit_seconds=2.0)
        assert plan.interval_cover  # DDP's all-reduces never end a tensor's life: intervals cover
        assert validate_stream_placement(early, plan.offsets).safe
