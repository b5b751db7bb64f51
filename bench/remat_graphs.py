"""GRAPH.json files for the rematerialisation benchmark, as a user without memplan's capture has them.

* the zoo's training steps with memplan's marks stripped: no loss marked as an output of the
  step, every tensor that is not resident for the whole step an "activation" (persistent
  tensors keep their category: parameters, buffers, optimizer state, the batch);
* random layered DAGs after Moccasin's benchmark (Bartan et al. 2023, whose graphs follow
  Gagrani et al. 2022, "Neural Topological Ordering for Computation Graphs", Appendix A; this
  generator is our own reading of it): layers of random width, local edges between adjacent
  layers, a skip edge from about one node in seven, one source and one sink, random output
  sizes and durations (the cost).

Write them: ``python bench/remat_graphs.py --out DIR`` (deterministic).
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

from memplan.graph.io import write_graph_json
from memplan.graph.ir import Category, Graph, Op, Tensor, TensorId

ZOO = ("vgg16", "mobilenet-v2", "unet", "resnet50", "gpt2-2l")
LAYERED = ((100, 0), (250, 1), (500, 2))
"""(nodes, seed) of the random layered DAGs (Moccasin used 100, 250, 500 and 1000 nodes)."""


def without_marks(graph: Graph) -> Graph:
    """``graph`` without memplan's marks: no output of the step, non-persistent tensors all activations."""
    tensors = tuple(
        t if t.persistent else Tensor(t.name, t.size_bytes, Category.ACTIVATION, False) for t in graph.tensors
    )
    return Graph(graph.ops, tensors, f"{graph.name or 'graph'}-nomarks", {})


def layered_dag(
    seed: int, num_ops: int, *, edge_density: float = 0.2, skip_density: float = 0.14, unit_bytes: int = 1024
) -> Graph:
    """A random layered DAG in a layer-by-layer program order (see the module docstring).

    About ``2 sqrt(n)`` layers of random width between one source and one sink, as in
    Moccasin's 100-node graph. Each node feeds the nodes of the next layer near its own
    position (the nearest always, its neighbours with probability ``0.5 + edge_density``)
    and, with probability ``skip_density``, one random node two or more layers on. Node
    ``v`` makes one tensor of 1..64 ``unit_bytes`` and costs 1..1000 (``Op.flops``)."""
    rng = random.Random(seed)
    num_layers = max(3, round(2 * math.sqrt(num_ops)))
    inner = num_ops - 2
    cuts = sorted(rng.sample(range(1, inner), num_layers - 3)) if inner > num_layers else list(range(1, inner))
    widths = [b - a for a, b in zip([0, *cuts], [*cuts, inner], strict=True)]
    layers: list[list[int]] = [[0]]
    for width in widths:
        start = sum(len(layer) for layer in layers)
        layers.append(list(range(start, start + width)))
    layers.append([num_ops - 1])
    preds: list[set[int]] = [set() for _ in range(num_ops)]
    for j in range(len(layers) - 1):
        here, there = layers[j], layers[j + 1]
        for n, u in enumerate(here):
            center = round(n / max(1, len(here) - 1) * (len(there) - 1))
            for m in (center - 1, center, center + 1):
                if 0 <= m < len(there) and (m == center or rng.random() < 0.5 + edge_density):
                    preds[there[m]].add(u)
            if j + 2 < len(layers) and rng.random() < skip_density:
                preds[rng.choice([v for layer in layers[j + 2 :] for v in layer])].add(u)
        for m, v in enumerate(there):
            if not preds[v]:
                preds[v].add(here[round(m / max(1, len(there) - 1) * (len(here) - 1))])
    tensors = [Tensor(f"t{v}", rng.randint(1, 64) * unit_bytes) for v in range(num_ops)]
    ops = [
        Op(f"n{v}", "layered", tuple(TensorId(u) for u in sorted(preds[v])), (TensorId(v),), flops=rng.randint(1, 1000))
        for v in range(num_ops)
    ]
    return Graph(tuple(ops), tuple(tensors), f"layered-n{num_ops}-s{seed}")


def write_all(out: Path, batch_size: int = 32) -> list[Path]:
    """Write the marks-free zoo graphs and the layered DAGs to ``out``; return their paths."""
    from memplan.torch.zoo import capture_graph

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in ZOO:
        path = out / f"{name}-b{batch_size}-nomarks.json"
        if not path.exists():
            graph = capture_graph(name, batch_size=batch_size, mode="train", optimizer="sgd")
            write_graph_json(without_marks(graph), path)
        paths.append(path)
    for nodes, seed in LAYERED:
        path = out / f"layered-n{nodes}-s{seed}.json"
        write_graph_json(layered_dag(seed, nodes), path)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/memplan-remat-graphs")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    for path in write_all(Path(args.out), args.batch_size):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
