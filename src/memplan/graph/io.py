"""JSON read/write of graphs, with a format version, so the core runs without a framework.

Format (version 1)::

    {"format": "memplan-graph", "version": 1, "name": "...", "meta": {...},
     "tensors": [{"name": "a", "size_bytes": 4, "category": "activation", "persistent": false}],
     "ops": [{"name": "f", "kind": "aten.relu.default", "inputs": ["a"], "outputs": ["b"],
              "stream": 0}]}

Ops are listed in program order; they refer to tensors by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memplan.errors import GraphFormatError
from memplan.graph.check import validate_graph
from memplan.graph.ir import Category, Graph, Op, Tensor, TensorId

FORMAT_NAME = "memplan-graph"
FORMAT_VERSION = 1


def graph_to_dict(graph: Graph) -> dict[str, Any]:
    names = [t.name for t in graph.tensors]
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "name": graph.name,
        "meta": graph.meta,
        "tensors": [
            {"name": t.name, "size_bytes": t.size_bytes, "category": t.category.value, "persistent": t.persistent}
            for t in graph.tensors
        ],
        "ops": [
            {
                "name": op.name,
                "kind": op.kind,
                "inputs": [names[t] for t in op.inputs],
                "outputs": [names[t] for t in op.outputs],
                "stream": op.stream,
                **({"mutates": [names[t] for t in op.mutates]} if op.mutates else {}),
                **({"flops": op.flops} if op.flops else {}),
            }
            for op in graph.ops
        ],
    }


def graph_from_dict(data: Any, source: str = "graph") -> Graph:
    """Build and validate a graph; raise :class:`GraphFormatError` with one line on bad input."""
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise GraphFormatError(f'{source}: not a memplan graph (expected "format": "{FORMAT_NAME}")')
    if data.get("version") != FORMAT_VERSION:
        raise GraphFormatError(
            f"{source}: graph format version {data.get('version')!r} is not supported "
            f"(this memplan reads version {FORMAT_VERSION})"
        )
    try:
        tensors = tuple(
            Tensor(
                str(t["name"]),
                int(t["size_bytes"]),
                Category(t.get("category", "activation")),
                bool(t.get("persistent", False)),
            )
            for t in data["tensors"]
        )
        index = {t.name: TensorId(i) for i, t in enumerate(tensors)}
        ops = tuple(
            Op(
                str(o["name"]),
                str(o.get("kind", "")),
                tuple(_lookup(index, n, o["name"]) for n in o.get("inputs", [])),
                tuple(_lookup(index, n, o["name"]) for n in o.get("outputs", [])),
                int(o.get("stream", 0)),
                tuple(_lookup(index, n, o["name"]) for n in o.get("mutates", [])),
                int(o.get("flops", 0)),
            )
            for o in data["ops"]
        )
    except GraphFormatError:
        raise
    except (KeyError, TypeError, ValueError) as err:
        raise GraphFormatError(f"{source}: malformed graph entry ({type(err).__name__}: {err})") from None
    graph = Graph(ops, tensors, str(data.get("name", "")), dict(data.get("meta", {})))
    validate_graph(graph)
    return graph


def _lookup(index: dict[str, TensorId], name: str, op_name: str) -> TensorId:
    if name not in index:
        raise GraphFormatError(f"op {op_name!r} refers to unknown tensor {name!r}")
    return index[name]


def write_graph_json(graph: Graph, path: str | Path) -> None:
    Path(path).write_text(json.dumps(graph_to_dict(graph)))


def read_graph_json(path: str | Path) -> Graph:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise GraphFormatError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise GraphFormatError(f"{path}: not valid JSON ({err})") from None
    return graph_from_dict(data, str(path))


save_graph = write_graph_json
load_graph = read_graph_json
