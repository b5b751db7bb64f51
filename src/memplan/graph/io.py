"""JSON read/write of graphs, with a format version, so the core runs without a framework.

Format (version 1)::

    {"format": "memplan-graph", "version": 1, "name": "...", "meta": {...},
     "tensors": [{"name": "a", "size_bytes": 4, "category": "activation", "persistent": false}],
     "ops": [{"name": "f", "kind": "aten.relu.default", "inputs": ["a"], "outputs": ["b"],
              "stream": 0}]}

Ops are listed in program order; they refer to tensors by name.

Multi-stream graphs (see :mod:`memplan.graph.multistream`): each op's ``"stream"`` says where it
runs; each stream runs its ops in the order listed, and ops on different streams are ordered only
by their data and control edges (record/wait events, a collective's wait). The list as a whole
may then interleave the streams in any way that runs every op after its inputs' producers; if it
does not, memplan relists it (keeping each stream's order), and a cycle through the waits is an
error. ``"meta": {"contiguous": [["g1", "g2"], ...]}`` lists groups of tensors to lay out back to
back in the arena (an all-reduce bucket).
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import Any

from memplan.errors import CycleError, GraphFormatError, InvalidOrder
from memplan.graph.check import validate_graph
from memplan.graph.ir import Category, Graph, Op, Tensor, TensorId
from memplan.graph.multistream import contiguous_groups, is_multi_stream, relist_streams

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
    if is_multi_stream(graph):
        try:
            validate_graph(graph)
        except (InvalidOrder, CycleError):  # the streams were listed one after another
            graph = relist_streams(graph)
    validate_graph(graph)
    contiguous_groups(graph)
    return graph


def _lookup(index: dict[str, TensorId], name: str, op_name: str) -> TensorId:
    if name not in index:
        raise GraphFormatError(f"op {op_name!r} refers to unknown tensor {name!r}")
    return index[name]


def write_graph_json(graph: Graph, path: str | Path) -> None:
    Path(path).write_text(json.dumps(graph_to_dict(graph)))


def read_graph_json(path: str | Path) -> Graph:
    """A GRAPH.json file (gzip-compressed when its name ends in ``.gz``)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        data = json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)
    except FileNotFoundError:
        raise GraphFormatError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise GraphFormatError(f"{path}: not valid JSON ({err})") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise GraphFormatError(f"{path}: not a gzip file ({err})") from None
    return graph_from_dict(data, str(path))


save_graph = write_graph_json
load_graph = read_graph_json
