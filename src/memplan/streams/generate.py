"""Multi-stream graphs for tests and benchmarks (no framework needed).

* :func:`somas_example`: the two-stream example of SOMAS (Lamprou et al. 2023, "Offset
  Calculation for Parallel"): in the recorded order ``a`` dies before ``f`` is born, but the
  op that reads ``a`` on the side stream may run after ``f``'s source, so they must not share.
* :func:`random_stream_graph`: random DAGs whose ops run on several streams, with cross-stream
  data edges and record/wait events, some outputs and some tensors nobody reads.
* :func:`prefetch_chain`: a layer-by-layer step whose parameters are all-gathered ahead of use
  on a communication stream (FSDP's prefetch), with or without FSDP's rate limit (an all-gather
  waits until the layer two before it is done). Without the limit the side stream may run
  arbitrarily far ahead, and reusing a gathered buffer on the strength of the recorded order is
  the race PyTorch's FSDP once had.
* :func:`ddp_like_graph`: a small framework-free training step (forward, backward, SGD
  updates, gradient releases) as capture makes them, for the data-parallel transformation.
"""

from __future__ import annotations

import random

from memplan.graph.ir import Category, Graph, Op, Tensor, TensorId
from memplan.streams.sync import WAIT_KIND


class _Builder:
    def __init__(self) -> None:
        self.tensors: list[Tensor] = []
        self.ops: list[Op] = []

    def tensor(
        self, name: str, size: int, category: Category = Category.ACTIVATION, persistent: bool = False
    ) -> TensorId:
        self.tensors.append(Tensor(name, size, category, persistent))
        return TensorId(len(self.tensors) - 1)

    def op(
        self,
        name: str,
        kind: str,
        inputs: list[TensorId],
        outputs: list[TensorId],
        stream: int = 0,
        mutates: tuple[TensorId, ...] = (),
    ) -> int:
        self.ops.append(Op(name, kind, tuple(inputs), tuple(outputs), stream, mutates))
        return len(self.ops) - 1

    def graph(self, name: str) -> Graph:
        return Graph(tuple(self.ops), tuple(self.tensors), name)


def somas_example(size_bytes: int = 64) -> Graph:
    """SOMAS's example: op1 makes ``a``; op2 (stream 0) and op3 (stream 1) read it; op4 makes
    ``f`` on stream 0, read by op5; op6 joins both streams. Recorded order op1..op6: ``a`` lives
    during [0, 3) and ``f`` during [3, 5), yet op3 may run after op4."""
    b = _Builder()
    a, x, y, f, z = (b.tensor(n, size_bytes) for n in ("a", "x", "y", "f", "z"))
    out = b.tensor("out", 4, Category.OUTPUT)
    b.op("op1", "make", [], [a])
    b.op("op2", "use", [a], [x])
    b.op("op3", "side", [a], [y], stream=1)
    b.op("op4", "make", [x], [f])
    b.op("op5", "use", [f], [z])
    b.op("op6", "join", [y, z], [out])
    return b.graph("somas-example")


def random_stream_graph(
    seed: int,
    num_ops: int,
    num_streams: int = 2,
    *,
    max_inputs: int = 3,
    max_size: int = 100,
    event_fraction: float = 0.2,
    output_fraction: float = 0.05,
) -> Graph:
    """A random multi-stream graph listed in a valid global order.

    Op ``i`` runs on a random stream, reads up to ``max_inputs`` earlier tensors (of any
    stream: a cross-stream read is a dependency), makes one or two tensors of 1 to
    ``max_size`` bytes (some outputs of the step), and with probability ``event_fraction``
    waits for an event recorded after an earlier op of another stream (a 0-byte control edge).
    """
    rng = random.Random(seed)
    b = _Builder()
    made: list[TensorId] = []
    for i in range(num_ops):
        stream = rng.randrange(num_streams)
        inputs = sorted({rng.choice(made) for _ in range(rng.randint(0, max_inputs))}) if made else []
        if b.ops and rng.random() < event_fraction:
            j = rng.randrange(len(b.ops))
            if b.ops[j].stream != stream:
                event = b.tensor(f"event{j}->{i}", 0, Category.CONTROL)
                old = b.ops[j]
                b.ops[j] = Op(old.name, old.kind, old.inputs, (*old.outputs, event), old.stream, old.mutates)
                inputs.append(event)
        outputs = []
        for k in range(rng.randint(1, 2)):
            category = Category.OUTPUT if rng.random() < output_fraction else Category.ACTIVATION
            outputs.append(b.tensor(f"t{i}.{k}", rng.randint(1, max_size), category))
        made.extend(outputs)
        b.op(f"op{i}", "random", inputs, outputs, stream)
    return b.graph(f"random-streams-{seed}-{num_ops}-{num_streams}")


def prefetch_chain(layers: int, param_bytes: int = 1000, act_bytes: int = 100, rate_limit: bool = False) -> Graph:
    """Layers ``0..layers-1``; layer ``i`` reads the full parameters ``W{i}`` all-gathered on
    stream 1 (a collective and its wait on stream 0) and the previous activation. The recorded
    order gathers one layer ahead. With ``rate_limit`` the gather of layer ``i + 2`` also waits
    for layer ``i`` to end (FSDP's ``limit_all_gathers``), so two gathered buffers suffice."""
    b = _Builder()
    x = b.tensor("x0", act_bytes)
    b.op("input", "make", [], [x])
    gathered = []
    done = []  # per layer, a control edge from its compute (for the rate limit)

    def gather(i: int) -> None:
        shard = b.tensor(f"shard{i}", param_bytes // 4, Category.PARAMETER, persistent=True)
        b.op(f"shard{i}", "placeholder", [], [shard], stream=1)
        full, work = b.tensor(f"W{i}", param_bytes), b.tensor(f"W{i}.work", 0, Category.CONTROL)
        limit = [done[i - 2]] if rate_limit and i >= 2 else []
        b.op(f"all_gather{i}", "memplan.all_gather", [shard, *limit], [full, work], stream=1)
        ready = b.tensor(f"W{i}.ready", 0, Category.CONTROL)
        b.op(f"wait{i}", WAIT_KIND, [work], [ready])
        gathered.append((full, ready))

    gather(0)
    for i in range(layers):
        if i + 1 < layers:
            gather(i + 1)
        full, ready = gathered[i]
        out = b.tensor(f"x{i + 1}", act_bytes, Category.OUTPUT if i == layers - 1 else Category.ACTIVATION)
        end = b.tensor(f"layer{i}.done", 0, Category.CONTROL)
        b.op(f"layer{i}", "linear", [x, full, ready], [out, end])
        done.append(end)
        x = out
    return b.graph(f"prefetch-{layers}{'-limited' if rate_limit else ''}")


def ddp_like_graph(layers: int = 4, width_bytes: int = 400, param_bytes: int = 1000) -> Graph:
    """A small training step shaped like a captured one: a chain of ``layers`` layers
    (forward), their backward in reverse producing one gradient per parameter, one SGD update
    per parameter (``mutates`` the parameter, reads its gradient) and each gradient's release."""
    b = _Builder()
    x = b.tensor("batch", width_bytes, Category.INPUT, persistent=True)
    b.op("batch", "placeholder", [], [x])
    params = []
    for i in range(layers):
        p = b.tensor(f"param:w{i}", param_bytes + 8 * i, Category.PARAMETER, persistent=True)
        b.op(f"w{i}", "placeholder", [], [p])
        params.append(p)
    acts = [x]
    for i, p in enumerate(params):
        h = b.tensor(f"h{i}", width_bytes)
        b.op(f"fwd{i}", "linear", [acts[-1], p], [h])
        acts.append(h)
    loss = b.tensor("loss", 4, Category.OUTPUT)
    b.op("loss", "loss", [acts[-1]], [loss])
    grad_in = b.tensor("dloss", width_bytes, Category.TEMPORARY)
    b.op("dloss", "loss_backward", [loss, acts[-1]], [grad_in])
    grads = {}
    for i in reversed(range(layers)):
        g = b.tensor(f"grad:w{i}", b.tensors[params[i]].size_bytes, Category.GRADIENT)
        dx = b.tensor(f"dx{i}", width_bytes, Category.TEMPORARY)
        b.op(f"bwd{i}", "linear_backward", [grad_in, acts[i], params[i]], [g, dx])
        grads[i] = g
        grad_in = dx
    for i, p in enumerate(params):
        b.op(f"sgd{i}", "aten.add_.Tensor", [p, grads[i]], [], mutates=(p,))
    for i in range(layers):
        b.op(f"release:grad:w{i}", "memplan.release", [grads[i]], [])
    return b.graph(f"ddp-like-{layers}")
