"""Lower bounds on the peak of every order: the cut bound (what must be resident while an op runs).

While op ``v`` runs, the ops that ran before it form an *ideal* ``D`` of the graph (closed
under predecessors) that holds every ancestor of ``v`` and none of its descendants; and any
such ideal is what some order runs before ``v``. The bytes resident at that moment depend on
``D`` only (OLLA 2.2's resident set, the estimator's rule): a tensor is resident if its
producer is ``v`` or in ``D`` and some reader is not in ``D`` (outputs of the step: always once
produced; persistent tensors: always). So

    resident(v) >= min over such ideals D of RS(D, v),

and the peak of every order is at least the largest of these minima over ``v``. This is
never weaker than :func:`memplan.graph.analysis.peak_lower_bound`, which counts only what
every ideal shares.

Each minimum is a maximum-weight closure problem (Picard 1976), so one minimum cut: choosing
op ``u`` into ``D`` costs the bytes of its outputs; a tensor all of whose readers are in ``D``
gives its bytes back (it died before ``v``). Source side = ``D``.

Each op's minimum may come from a different ideal, which no single order can pass through.
:func:`ordering_bound` couples a few ops: it branches on the sequence in which an order runs
them, which forces the ops earlier in the sequence into each ideal and the later ones out.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from memplan.graph.analysis import Reachability, necessarily_resident_bytes
from memplan.graph.ir import Category, Graph
from memplan.graph.liveness import memory_timeline, positions
from memplan.solvers import min_cut_value


@dataclass(frozen=True)
class CutNetwork:
    """The part of the min-cut network that does not depend on ``v``.

    Nodes: source 0, sink 1, op ``u`` at ``2 + u``, tensor node ``k`` at ``2 + n + k`` for the
    ``k``-th tensor in ``tensors`` (those that may die before ``v``: non-persistent, not an
    output of the step, with bytes and readers)."""

    num_ops: int
    tensors: np.ndarray  # tensor ids with a node
    tails: np.ndarray
    heads: np.ndarray
    capacities: np.ndarray
    infinite: int

    @classmethod
    def of(cls, graph: Graph) -> CutNetwork:
        n = graph.num_ops
        counted = [
            e
            for e, t in enumerate(graph.tensors)
            if not t.persistent and t.size_bytes > 0 and (graph.consumers[e] or t.category is Category.OUTPUT)
        ]
        infinite = 2 * sum(graph.tensors[e].size_bytes for e in counted) + 1
        cost = np.zeros(n, dtype=np.int64)
        for e in counted:
            cost[graph.producer[e]] += graph.tensors[e].size_bytes
        refunded = [e for e in counted if graph.tensors[e].category is not Category.OUTPUT]
        tails: list[int] = []
        heads: list[int] = []
        caps: list[int] = []
        for u in range(n):
            if cost[u]:
                tails.append(2 + u), heads.append(1), caps.append(int(cost[u]))  # in D: pays its outputs
            for p in graph.predecessors[u]:
                tails.append(2 + u), heads.append(2 + p), caps.append(infinite)  # closed under predecessors
        for k, e in enumerate(refunded):
            node = 2 + n + k
            tails.append(0), heads.append(node), caps.append(graph.tensors[e].size_bytes)  # refund if dead
            for r in set(graph.consumers[e]):
                tails.append(node), heads.append(2 + r), caps.append(infinite)  # dead: every reader in D
        as_array = lambda xs: np.array(xs, dtype=np.int64)  # noqa: E731
        return cls(n, np.array(refunded, dtype=np.int64), as_array(tails), as_array(heads), as_array(caps), infinite)


def resident_floor(
    graph: Graph,
    reach: Reachability,
    network: CutNetwork,
    v: int,
    before: Sequence[int] = (),
    after: Sequence[int] = (),
) -> int | None:
    """The fewest bytes any order holds while ``v`` runs: ``min_D RS(D, v)`` (see module doc),
    over the ideals ``D`` that also hold the ops ``before`` and none of ``after`` (``None`` when
    no ideal does: an op of ``before`` needs ``v`` or an op of ``after``)."""
    n = graph.num_ops
    anc = _bits(reach.ancestors[v], n)
    out = _bits(reach.descendants[v], n)
    out[v] = True
    anc[list(before)] = True
    out[list(after)] = True
    forced_in, forced_out = np.flatnonzero(anc), np.flatnonzero(out)
    tails = np.concatenate([network.tails, np.zeros(len(forced_in), dtype=np.int64), 2 + forced_out])
    heads = np.concatenate([network.heads, 2 + forced_in, np.ones(len(forced_out), dtype=np.int64)])
    inf = network.infinite
    caps = np.concatenate([network.capacities, np.full(len(forced_in) + len(forced_out), inf, dtype=np.int64)])
    cut = min_cut_value(2 + n + len(network.tensors), tails, heads, caps)
    if cut >= inf:  # every cut severs a forced arc: the closure of ``before`` meets ``after``
        return None
    refundable = int(sum(graph.tensors[int(e)].size_bytes for e in network.tensors))
    # RS = persistent + what v makes + min over D of (paid - refunded), and the cut equals
    # refundable + min(paid - refunded): v is never in D, so its outputs are never paid.
    made = [graph.tensors[e] for e in dict.fromkeys(graph.ops[v].outputs)]
    own = sum(t.size_bytes for t in made if not t.persistent)
    return graph.persistent_bytes + own + cut - refundable


def _bits(bits: int, n: int) -> np.ndarray:
    raw = np.frombuffer(bits.to_bytes((n + 7) // 8 or 1, "little"), dtype=np.uint8)
    return np.unpackbits(raw, bitorder="little")[:n].astype(bool)


@dataclass(frozen=True)
class CutBound:
    """The cut bound reached: ``bound_bytes`` (valid for every order), the op it was found at,
    how many ops were tried and whether every op that could raise it was (``complete``);
    ``floors``: the floor found at each op tried."""

    bound_bytes: int
    op: int | None
    tried: int
    complete: bool
    floors: tuple[tuple[int, int], ...] = ()


def cut_lower_bound(
    graph: Graph,
    order: Sequence[int],
    floor_bytes: int,
    deadline: float,
    reach: Reachability | None = None,
) -> CutBound:
    """Raise ``floor_bytes`` (a known valid bound) with :func:`resident_floor`, trying ops by
    decreasing resident bytes in ``order`` until ``deadline``. An op whose resident bytes in
    ``order`` are at most the bound so far cannot raise it (``order`` is one of the ideals),
    so once those are all that is left the bound is as strong as this method gets."""
    reach = reach or Reachability.of(graph)
    timeline = memory_timeline(graph, order)
    pos = positions(order)
    necessary = necessarily_resident_bytes(graph, reach)
    peak = max(timeline, default=graph.persistent_bytes)
    best, at = floor_bytes, None
    floors: list[tuple[int, int]] = []
    network: CutNetwork | None = None
    candidates = sorted(range(graph.num_ops), key=lambda v: (-timeline[pos[v]], -necessary[v], v))
    complete = True
    for v in candidates:
        if timeline[pos[v]] <= best or best >= peak:
            break
        if time.perf_counter() > deadline:
            complete = False
            break
        network = network or CutNetwork.of(graph)
        value = resident_floor(graph, reach, network, v)
        assert value is not None  # nothing is forced beyond v's own ancestors and descendants
        floors.append((v, value))
        if value > best:
            best, at = value, v
    return CutBound(best, at, len(floors), complete, tuple(floors))


# The ordering bound branches over the relative orders of this many ops (2^(k-1) k cuts).
ORDERING_OPS = 4


def ordering_bound(
    graph: Graph,
    ops: Sequence[int],
    deadline: float,
    reach: Reachability | None = None,
    network: CutNetwork | None = None,
) -> int | None:
    """A lower bound on the peak of every order from the relative order of ``ops`` (a set
    ``S``), stronger than the largest :func:`resident_floor` among them; ``None`` past
    ``deadline``.

    Every order runs the ops of ``S`` in some sequence ``pi``. When ``pi_i`` runs, the ops run
    before it form an ideal that holds ``pi_1 .. pi_(i-1)`` and none of ``pi_(i+1) .. pi_k``, so
    the bytes resident then are at least ``F(pi_i, B)``: the floor at ``pi_i`` over the ideals
    that hold the set ``B = {pi_1 .. pi_(i-1)}`` and none of ``S - B - {pi_i}``. Hence

        peak >= min over sequences pi of  max_i F(pi_i, {pi_1 .. pi_(i-1)}),

    which is what this returns. ``F`` depends on the set before, not on its order, so the
    minimum is a bottleneck path over the subsets of ``S`` (``2^(k-1) k`` cuts, not
    ``k! k``): ``cost(B + v) = min over v of max(cost(B), F(v, B))``. Where each op's own
    floor comes from a different ideal (the cut bound's weakness), fixing which op runs
    first couples them: on an unrolled LSTM, whichever weight-gradient sum starts first finds
    every other sum's inputs resident.
    """
    s = list(dict.fromkeys(ops))
    if not s:
        raise ValueError("ordering_bound needs at least one op")
    reach = reach or Reachability.of(graph)
    network = network or CutNetwork.of(graph)
    k = len(s)
    unreachable = float("inf")
    cost: list[float] = [unreachable] * (1 << k)
    cost[0] = float("-inf")
    for mask in range(1, 1 << k):
        for i in range(k):
            if not mask >> i & 1 or cost[mask ^ (1 << i)] == unreachable:
                continue
            if time.perf_counter() > deadline:
                return None
            before = [s[j] for j in range(k) if (mask ^ (1 << i)) >> j & 1]
            after = [s[j] for j in range(k) if not mask >> j & 1]
            floor = resident_floor(graph, reach, network, s[i], before, after)
            if floor is not None:
                cost[mask] = min(cost[mask], max(cost[mask ^ (1 << i)], floor))
    full = cost[(1 << k) - 1]
    assert full != unreachable, "some order of the graph runs the ops in some sequence"
    return int(full)
