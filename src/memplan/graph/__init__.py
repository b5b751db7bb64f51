"""The framework-free graph core: IR, JSON I/O, validation, analysis, the one estimator."""

from memplan.graph.analysis import (
    Reachability,
    alap_levels,
    asap_levels,
    peak_lower_bound,
    topological_order,
)
from memplan.graph.check import validate_graph, validate_order
from memplan.graph.io import load_graph, read_graph_json, save_graph, write_graph_json
from memplan.graph.ir import Category, Graph, Op, OpId, Tensor, TensorId, make_graph
from memplan.graph.liveness import Lifetime, lifetimes, memory_timeline, peak_bytes

__all__ = [
    "Category",
    "Graph",
    "Lifetime",
    "Op",
    "OpId",
    "Reachability",
    "Tensor",
    "TensorId",
    "alap_levels",
    "asap_levels",
    "lifetimes",
    "load_graph",
    "make_graph",
    "memory_timeline",
    "peak_bytes",
    "peak_lower_bound",
    "read_graph_json",
    "save_graph",
    "topological_order",
    "validate_graph",
    "validate_order",
    "write_graph_json",
]
