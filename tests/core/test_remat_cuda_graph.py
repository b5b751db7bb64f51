"""The remat problem of a training step captured on a GPU (ResNet-50, batch 32, Adam, on an
H100: ``bench/graphs/resnet50-b32-h100.json.gz``), where PyTorch's batch norm is cuDNN's and
Adam's update alternates run-once and re-runnable ops for each of 161 parameters."""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.errors import GraphFormatError
from memplan.graph.io import read_graph_json
from memplan.remat.baselines import ap_greedy, checkpoint_all, dtr
from memplan.remat.coarsen import coarsen
from memplan.remat.problem import RematProblem, rerun_limits

GRAPH = Path(__file__).resolve().parents[2] / "bench" / "graphs" / "resnet50-b32-h100.json.gz"


@pytest.fixture(scope="module")
def graph():
    return read_graph_json(GRAPH)


def test_cudnn_batch_norms_may_be_recomputed(graph):
    limits = rerun_limits(graph)
    norms = [v for v, op in enumerate(graph.ops) if op.kind == "aten.cudnn_batch_norm.default"]
    assert len(norms) == 53
    assert all(limits[v] > v for v in norms)


def test_coarsening_keeps_the_backward_pass_apart_from_adams_update(graph):
    sg = coarsen(RematProblem(graph, 10**18), 200)
    assert sg.size <= 201
    backward = [
        k
        for k in range(sg.num_forward, sg.size)
        if any(graph.ops[v].kind.endswith("_backward.default") for v in sg.groups[k])
    ]
    assert len(backward) >= 20  # before: the whole backward pass was one node


def test_baselines_reduce_the_peak_of_the_gpu_step(graph):
    reference = checkpoint_all(RematProblem(graph, 10**18)).peak_bytes
    problem = RematProblem(graph, int(0.8 * reference))
    for plan in (ap_greedy(problem), dtr(problem)):
        assert plan.feasible and plan.peak_bytes <= problem.budget_bytes, plan.message


def test_a_gzip_graph_file_that_is_not_gzip_gets_one_line(tmp_path):
    bad = tmp_path / "g.json.gz"
    bad.write_text("{}")
    with pytest.raises(GraphFormatError, match="not a gzip file"):
        read_graph_json(bad)
