"""Random and hand-made graphs for tests and benchmarks (no framework needed)."""

from __future__ import annotations

import random

from memplan.graph.ir import Category, Graph, Op, OpId, Tensor, TensorId


def random_dag(
    seed: int,
    num_ops: int,
    *,
    max_inputs: int = 3,
    max_outputs: int = 2,
    max_size: int = 100,
    persistent_fraction: float = 0.1,
    output_fraction: float = 0.05,
) -> Graph:
    """A random acyclic graph whose ops are listed in a topological (program) order.

    Op ``i`` reads up to ``max_inputs`` tensors made by earlier ops and makes 1 to
    ``max_outputs`` tensors of size 0 to ``max_size``; some tensors are persistent, some
    are outputs of the step.
    """
    rng = random.Random(seed)
    tensors: list[Tensor] = []
    ops: list[Op] = []
    for i in range(num_ops):
        inputs: tuple[TensorId, ...] = ()
        if tensors:
            k = rng.randint(0 if i < 2 else 1, max_inputs)
            inputs = tuple(sorted({TensorId(rng.randrange(len(tensors))) for _ in range(k)}))
        outputs = []
        for _ in range(rng.randint(1, max_outputs)):
            roll = rng.random()
            persistent = not inputs and roll < persistent_fraction
            category = Category.PARAMETER if persistent else Category.ACTIVATION
            if not persistent and roll > 1 - output_fraction:
                category = Category.OUTPUT
            tensors.append(Tensor(f"t{len(tensors)}", rng.randint(0, max_size), category, persistent))
            outputs.append(TensorId(len(tensors) - 1))
        ops.append(Op(f"op{i}", "random", inputs, tuple(outputs)))
    return Graph(tuple(ops), tuple(tensors), f"random-{seed}-{num_ops}")


def olla_figure3() -> tuple[Graph, list[OpId], int]:
    """The point of OLLA Figure 3: the order of two parallel branches decides the peak.

    v1 makes e1 (10) and e2 (30); v2 turns e2 into the small e3 (1); v3 turns e1 into
    e4 (20); v4 reads e3 and e4. Running v2 first frees e2 before e4 exists: peak 41.
    Running v3 first holds e1, e2 and e4 together: peak 60. Returns the graph, the best
    order and its peak.
    """
    tensors = (
        Tensor("e1", 10),
        Tensor("e2", 30),
        Tensor("e3", 1),
        Tensor("e4", 20),
        Tensor("e5", 1),
    )
    ops = (
        Op("v1", "src", (), (TensorId(0), TensorId(1))),
        Op("v2", "shrink", (TensorId(1),), (TensorId(2),)),
        Op("v3", "grow", (TensorId(0),), (TensorId(3),)),
        Op("v4", "sink", (TensorId(2), TensorId(3)), (TensorId(4),)),
    )
    graph = Graph(ops, tensors, "olla-figure-3")
    return graph, [OpId(0), OpId(1), OpId(2), OpId(3)], 41
