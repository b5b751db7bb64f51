"""Chrome/Perfetto traces of plans: one lane per stream, a counter of resident bytes, ops
timed from FLOPs or from measurement, checked by :func:`check_trace` and against the
estimator."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import torch
from memplan.graph.liveness import peak_bytes
from memplan.pipeline import make_plan
from memplan.streams import data_parallel_step
from memplan.streams.generate import ddp_like_graph, random_stream_graph
from memplan.torch.capture import capture_train_step
from memplan.torch.export.chrome_trace import check_trace, plan_trace, write_trace
from memplan.torch.run.profile import profile_capture


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), num_ops=st.integers(1, 40), streams=st.integers(1, 3))
def test_trace_of_a_multi_stream_order_is_consistent(seed: int, num_ops: int, streams: int) -> None:
    graph = random_stream_graph(seed, num_ops, streams)
    order = graph.program_order()
    trace = plan_trace(graph, order)
    check_trace(trace, graph, order)
    lanes = {e["tid"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert lanes == {op.stream for op in graph.ops}
    assert trace["otherData"]["peak_bytes"] == peak_bytes(graph, order)


def test_streams_overlap_where_the_graph_allows_it(tmp_path) -> None:
    graph = data_parallel_step(ddp_like_graph(layers=4), bucket_cap_bytes=1000)  # all-reduces on stream 1
    order = graph.program_order()
    trace = plan_trace(graph, order)
    check_trace(trace, graph, order)
    ops = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["dur"] > 0]
    overlapping = any(
        a["tid"] != b["tid"] and a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"] for a in ops for b in ops
    )
    assert overlapping  # communication runs beside compute
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert names == {f"stream {s}" for s in {op.stream for op in graph.ops}}
    path = write_trace(trace, tmp_path / "t.json")
    assert json.loads(path.read_text())["traceEvents"] == trace["traceEvents"]


def test_measured_op_times_lay_out_the_planned_order() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(16, 32), torch.randint(0, 4, (16,)))
    capture = capture_train_step(model, optimizer, torch.nn.functional.cross_entropy, batch)
    plan = make_plan(capture.graph, time_limit_seconds=1.0)
    profile = profile_capture(capture, model, optimizer, batch, repeats=1, workspace=False)
    trace = plan_trace(capture.graph, plan.order, op_seconds=profile.seconds, phases=capture.op_phase)
    check_trace(trace, capture.graph, plan.order)
    assert trace["otherData"]["op_times"] == "measured"
    ops = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert {e["cat"] for e in ops} >= {"forward", "backward", "optimizer"}
    expected = sum(profile.seconds) * 1e6
    assert max(e["ts"] + e["dur"] for e in ops) == pytest.approx(expected, rel=1e-6)  # one stream: back to back
