"""Measured op costs and workspace (memplan.torch.run.profile)."""

from __future__ import annotations

from memplan.graph.ir import Graph, Op, Tensor, TensorId
from memplan.torch.run.profile import SPAN_PREFIX, profile_model, workspace_from_trace


def _memory(ts: float, delta: int, total: int) -> dict:
    return {"name": "[memory]", "ph": "i", "ts": ts, "args": {"Bytes": delta, "Total Allocated": total}}


def _span(op: int, ts: float, dur: float) -> dict:
    return {"name": f"{SPAN_PREFIX}{op}", "ph": "X", "ts": ts, "dur": dur}


def test_workspace_is_the_peak_inside_the_span_beyond_the_outputs() -> None:
    tensors = (Tensor("a", 100), Tensor("b", 40))
    graph = Graph((Op("p", "mm", (), (TensorId(0),)), Op("q", "conv", (TensorId(0),), (TensorId(1),))), tensors)
    events = [
        _memory(1.0, 100, 1100),  # op 0 makes its 100 B output (1000 B were held before)
        _span(0, 0.5, 1.0),
        _span(1, 2.0, 10.0),
        _memory(3.0, 300, 1400),  # op 1's scratch
        _memory(4.0, 40, 1440),  # its output
        _memory(5.0, -300, 1140),  # scratch freed before it returns
        _memory(20.0, 999, 2139),  # after every span
    ]
    assert workspace_from_trace(events, graph) == (0, 300)


def test_profile_costs_are_measured_seconds() -> None:
    capture, profile = profile_model("mlp", 4, repeats=1)
    graph = capture.graph
    assert len(profile.seconds) == len(profile.workspace_bytes) == len(graph.ops)
    kernels = [v for v, op in enumerate(graph.ops) if op.flops and capture.op_phase[v] in ("forward", "backward")]
    assert kernels and all(profile.seconds[v] > 0 for v in kernels)
    updates = [v for v in range(len(graph.ops)) if capture.op_phase[v] == "optimizer"]
    assert sum(profile.seconds[v] for v in updates) > 0  # each update is charged to one of its ops
    assert all(s >= 0 for s in profile.seconds) and all(b >= 0 for b in profile.workspace_bytes)
