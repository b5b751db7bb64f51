"""Lifetimes and resident memory for a given order: THE one peak-memory estimator.

OLLA section 2.2: the resident set RS(t) at timestep t holds the fanin and fanout of the op
running at t plus every tensor created earlier and still needed later. A tensor created at
timestep ``s`` and last read at timestep ``u`` is resident during ``[s, u + 1)``; a tensor
nobody reads is resident during its producer's timestep only; an output of the step stays
until the end; a persistent tensor is resident throughout. Every solver in memplan reports
peaks computed here.

``alignment`` (bytes, default 1) counts every tensor at its size rounded up to a multiple of
it, as an allocator that aligns its blocks holds it (PyTorch's CUDA caching allocator rounds
to 512 bytes, its CPU allocator to 64): the placement problem
(:mod:`memplan.placement.problem`) pads sizes the same way, so its lower bound is this peak
minus the padded persistent bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from memplan.graph.ir import Category, Graph, TensorId


@dataclass(frozen=True)
class Lifetime:
    """Tensor ``tensor`` is resident during timesteps ``[start, end)``."""

    tensor: TensorId
    start: int
    end: int


def padded(size: int, alignment: int = 1) -> int:
    """``size`` rounded up to a multiple of ``alignment`` (0 stays 0)."""
    if alignment < 1:
        raise ValueError(f"alignment must be at least 1 byte, got {alignment}")
    return -(-size // alignment) * alignment


def persistent_bytes(graph: Graph, alignment: int = 1) -> int:
    """Bytes of the persistent tensors, each padded to ``alignment``."""
    return sum(padded(t.size_bytes, alignment) for t in graph.tensors if t.persistent)


def positions(order: Sequence[int]) -> list[int]:
    """``positions(order)[op] == t`` where ``order[t] == op``."""
    pos = [0] * len(order)
    for t, op in enumerate(order):
        pos[op] = t
    return pos


def lifetimes(graph: Graph, order: Sequence[int]) -> list[Lifetime]:
    """Lifetime of every tensor in ``order``; persistent ones span ``[0, len(order))``."""
    pos = positions(order)
    n = len(order)
    result = []
    for t_id, tensor in enumerate(graph.tensors):
        if tensor.persistent:
            result.append(Lifetime(TensorId(t_id), 0, n))
            continue
        start = pos[graph.producer[t_id]]
        if tensor.category is Category.OUTPUT:
            end = n
        else:
            end = max((pos[c] for c in graph.consumers[t_id]), default=start) + 1
        result.append(Lifetime(TensorId(t_id), start, end))
    return result


def memory_timeline(graph: Graph, order: Sequence[int], alignment: int = 1) -> list[int]:
    """Resident bytes at every timestep of ``order`` (persistent bytes included), every
    tensor counted at its size padded to ``alignment``."""
    n = len(order)
    delta = [0] * (n + 1)
    for life in lifetimes(graph, order):
        size = padded(graph.tensors[life.tensor].size_bytes, alignment)
        if size and not graph.tensors[life.tensor].persistent:
            delta[life.start] += size
            delta[life.end] -= size
    timeline = []
    resident = persistent_bytes(graph, alignment)
    for t in range(n):
        resident += delta[t]
        timeline.append(resident)
    return timeline


def peak_bytes(graph: Graph, order: Sequence[int], alignment: int = 1) -> int:
    """The peak resident set of ``order`` (OLLA 2.2): max over :func:`memory_timeline`."""
    return max(memory_timeline(graph, order, alignment), default=persistent_bytes(graph, alignment))


def peak_timestep(graph: Graph, order: Sequence[int]) -> int:
    """The first timestep at which the peak is reached."""
    timeline = memory_timeline(graph, order)
    return max(range(len(timeline)), key=timeline.__getitem__, default=0)
