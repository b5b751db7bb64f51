"""Where a graph comes from: a GRAPH.json file, or a zoo model captured on the fly."""

from __future__ import annotations

from pathlib import Path

from memplan.errors import MemplanError
from memplan.graph.io import read_graph_json
from memplan.graph.ir import Graph


def is_graph_file(source: str) -> bool:
    return source.endswith((".json", ".json.gz")) or Path(source).is_file()


def load_source(source: str, *, batch_size: int = 1, mode: str = "train", optimizer: str = "sgd") -> Graph:
    """Read ``source`` as a graph file, or capture the zoo model of that name.

    A captured graph carries ``meta`` with model, batch_size, mode, optimizer and
    capture_seconds.
    """
    if is_graph_file(source):
        return read_graph_json(source)
    try:
        from memplan.torch.zoo import capture_graph
    except ImportError as err:
        raise MemplanError(f"capturing {source!r} needs PyTorch ({err}); install memplan[torch]") from None
    graph = capture_graph(source, batch_size, mode, optimizer)
    graph.meta.update({"model": source, "batch_size": batch_size, "mode": mode})
    if mode == "train":
        graph.meta["optimizer"] = optimizer
    return graph
