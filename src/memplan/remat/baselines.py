"""Checkmate's baselines (section 5.1, Table 1), all as ``solve(problem) -> RematSchedule``.

Each baseline picks which forward values to keep; the recomputation matrix ``R`` then
follows by one graph traversal per stage (Checkmate 5.1.1: "fills in entries when a needed
value is not in memory"), see :func:`rows_for_policy`. They all decide over the same
solver graph as the MILP (:mod:`memplan.remat.coarsen`) and are lowered and measured by
the same code (:mod:`memplan.remat.lower`).

* checkpoint all: no recomputation; its peak is the top of every budget sweep;
* Chen sqrt(n) / Chen greedy (Chen et al. 4.3, Algorithm 3 with the search over ``B`` of
  Appendix A): on linear forward graphs only;
* Griewank revolve (binomial checkpointing, uniform step cost): linear forward graphs only;
* AP sqrt(n) / AP greedy: Chen on the articulation points of the forward graph (5.1.1);
  AP greedy with small values kept (:func:`ap_kept_greedy`, not Checkmate's): the same on the
  points the graph has once its small values are set aside, kept resident;
* linearized sqrt(n) / linearized greedy: Chen on the forward nodes in topological order
  (5.1.2); on a linear graph these equal Chen's;
* DTR (Kirisame et al., "Dynamic Tensor Rematerialization", ICLR 2021): run the graph in
  program order; when the next run does not fit, evict the resident value with the lowest
  ``cost / (bytes * staleness)``, and recompute an evicted value (recursively) when it is
  read. It needs no forward/backward split: the baseline for any graph;
* DTR planned ahead: DTR's rule with what a planner that sees the whole step knows (the
  inputs of an evicted value are retained while its remake needs them, remakes run in
  program order, the next use may replace the staleness as in Belady's MIN) and, where
  nothing fits, lower internal budgets: plans near the memory floor where DTR gives up;
* Chen drop-cheap (Chen et al. 4.2, "drop the results of low cost operations"): drop the
  forward values that are cheapest to make per byte (batch norm, activations, pooling; a
  convolution's output is kept), recompute each once when the backward pass needs it; the
  share dropped is searched like Chen's B;
* the greedy at the peak (:func:`peak_greedy`, not in :data:`BASELINES`: the first member of
  :func:`memplan.remat.portfolio.solve_remat_in_order`): Chen's cost per byte applied only
  where the lowered plan is over the budget, from checkpoint-all in the stage order given
  (the reordered plan's), each move measured.

In Chen's scheme a segment between checkpoints is recomputed once in the backward pass and
then kept until its gradients are done (Chen Algorithm 1): here a segment "opens" the first
time a backward stage recomputes one of its nodes, and its values are kept from then on.
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from collections.abc import Callable, Iterable, Iterator, Set
from dataclasses import dataclass

from memplan.errors import InfeasibleBudget
from memplan.remat.coarsen import SolverGraph, coarsen
from memplan.remat.deadline import Deadline, TimeUp, cut_message, deadline_for, within
from memplan.remat.lower import InvalidPlan, schedule_from_decisions, validate_sequence
from memplan.remat.problem import RematProblem, RematSchedule, Step, memory_floor

Carry = Callable[[int, int], bool]
"""``carry(t, i)``: keep node ``i``'s value from stage ``t`` into stage ``t + 1``."""


def rows_for_policy(
    sg: SolverGraph,
    carry: Carry,
    required: Callable[[int], set[int]] | None = None,
    on_stage: Callable[[int, list[int]], None] | None = None,
    droppable: Set[int] | None = None,
) -> list[list[int]]:
    """The least ``R`` for a keep policy: per stage, compute what is needed and not resident.

    ``required(t)``: nodes that must be resident at the start of stage ``t + 1`` (computed in
    stage ``t`` if missing). Values that can never be recomputed again are always kept.
    ``droppable``: a promise that ``carry(t, i)`` is true unless ``i`` is in it and ``t + 1 >=
    sg.num_forward`` (every policy here drops only chosen forward values, after the forward
    pass); the policy may remove nodes from it (in ``on_stage``), never add them back. None
    promises nothing.

    The resident set is updated from what changed: a value that is pinned, outside
    ``droppable`` or past its re-run window stays resident for good, so only the others are
    asked ``carry`` again, and only from the stage where the promise allows a drop. The
    result equals the naive rebuild of every stage (``tests/core/naive.py``; a test checks it).
    """
    limit, pinned, byte_preds = sg.limit, sg.pinned, sg.byte_preds
    drops_from = 0 if droppable is None else sg.num_forward - 1
    available: set[int] = set()
    volatile: set[int] = set()  # resident, and carry may still drop it
    result = []
    for t in range(sg.size):
        wanted = [t, *sorted(i for i in (required(t) if required else ()) if i < t and i not in available)]
        row = set(wanted)
        stack = list(wanted)
        while stack:
            for p in byte_preds[stack.pop()]:
                if p in available or p in row:
                    continue
                if not sg.may_run(t, p):
                    raise InvalidPlan(f"stage {t} needs node {p}, which was dropped and may not be recomputed")
                row.add(p)
                stack.append(p)
        ordered = sorted(row)
        result.append(ordered)
        if on_stage:
            on_stage(t, ordered)
        nxt = t + 1
        for i in ordered:
            if i not in available:
                available.add(i)
                if i not in pinned and (droppable is None or i in droppable):
                    volatile.add(i)
        if t >= drops_from:
            for i in [i for i in volatile if nxt >= limit[i] or (droppable is not None and i not in droppable)]:
                volatile.discard(i)  # resident for good
            for i in [i for i in volatile if not carry(t, i)]:
                volatile.discard(i)
                available.discard(i)
    return result


def reads_bytes(sg: SolverGraph, p: int, j: int) -> bool:
    """Node ``j`` reads memory of node ``p``, not only 0-byte handles. A control token (the
    optimizer's write-after-read edge on a weight) orders ``j`` after ``p``'s first run,
    which every schedule keeps, so it needs ``p`` neither kept nor recomputed; a view
    handle comes with its base, which is read (and kept) as well."""
    return any(b > 0 and j in readers for b, readers in sg.parts[p])


def forward_nodes(sg: SolverGraph) -> list[int]:
    """Forward nodes that hold activations (not the prologue of placeholders)."""
    return [k for k in range(sg.num_forward) if not all(sg.graph.ops[v].kind == "placeholder" for v in sg.groups[k])]


def chain_nodes(sg: SolverGraph) -> list[int]:
    """Forward nodes worth dropping: re-runnable, with activation bytes to save."""
    return [k for k in forward_nodes(sg) if sg.recomputable(k) and sg.out_bytes[k] > 0]


def is_linear(sg: SolverGraph) -> bool:
    """Linear in the rematerialisation sense: every droppable forward node (see
    :func:`chain_nodes`) reads droppable values only from the one just before it. Run-once
    values (BatchNorm outputs, dropout masks) are always resident and are set aside."""
    chain = chain_nodes(sg)
    position = {k: n for n, k in enumerate(chain)}
    return all(position.get(p, n - 1) == n - 1 for n, k in enumerate(chain) for p in sg.preds[k])


def articulation_points(sg: SolverGraph, aside: Set[int] = frozenset()) -> list[int]:
    """Cut vertices of the undirected forward graph (iterative Hopcroft-Tarjan DFS), without
    the nodes ``aside`` (kept resident by the caller: their edges cut nothing)."""
    fwd = set(forward_nodes(sg)) - set(aside)
    adj: dict[int, set[int]] = {k: set() for k in fwd}
    for k in fwd:
        for p in sg.preds[k]:
            if p in fwd:
                adj[k].add(p)
                adj[p].add(k)
    disc: dict[int, int] = {}
    low: dict[int, int] = {}
    points: set[int] = set()
    for root in sorted(fwd):
        if root in disc:
            continue
        disc[root] = low[root] = len(disc)
        children = 0
        stack = [(root, -1, iter(sorted(adj[root])))]
        while stack:
            v, parent, it = stack[-1]
            child = next(it, None)
            if child is None:
                stack.pop()
                if parent >= 0:
                    low[parent] = min(low[parent], low[v])
                    if parent != root and low[v] >= disc[parent]:
                        points.add(parent)
                continue
            if child not in disc:
                disc[child] = low[child] = len(disc)
                if v == root:
                    children += 1
                stack.append((child, v, iter(sorted(adj[child]))))
            elif child != parent:
                low[v] = min(low[v], disc[child])
        if children > 1:
            points.add(root)
    return sorted(points)


def _chen_rows(sg: SolverGraph, checkpoints: set[int]) -> list[list[int]]:
    """R for Chen's scheme with ``checkpoints``: drop the rest after the forward pass and
    recompute each segment once when the backward pass first needs it."""
    fwd = [k for k in forward_nodes(sg) if sg.recomputable(k)]
    marks = sorted(checkpoints)
    dropped = set(fwd) - checkpoints
    members: dict[int, list[int]] = {}
    for k in sorted(dropped):
        members.setdefault(bisect.bisect_left(marks, k), []).append(k)
    segment = {k: s for s, ks in members.items() for k in ks}
    closed = set(dropped)  # dropped, and its segment not recomputed yet

    def carry(t: int, i: int) -> bool:
        return i not in closed or t + 1 < sg.num_forward

    def on_stage(t: int, row: list[int]) -> None:
        if t >= sg.num_forward:
            for i in row:
                if i in closed and i < t:
                    closed.difference_update(members[segment[i]])

    return rows_for_policy(sg, carry, on_stage=on_stage, droppable=closed)


def _drop_rows(sg: SolverGraph, dropped: set[int]) -> list[list[int]]:
    """R for Chen 4.2 (mirror count 1 on ``dropped``): drop them after the forward pass,
    recompute each when the backward pass first needs it, keep it from then on."""
    closed = set(dropped)  # dropped, and not recomputed yet

    def carry(t: int, i: int) -> bool:
        return i not in closed or t + 1 < sg.num_forward

    def on_stage(t: int, row: list[int]) -> None:
        if t >= sg.num_forward:
            closed.difference_update(i for i in row if i < t)

    return rows_for_policy(sg, carry, on_stage=on_stage, droppable=closed)


def cheapest_first(sg: SolverGraph, candidates: list[int]) -> list[int]:
    """Forward nodes by compute per byte kept, cheapest first (Chen 4.2's order of dropping)."""
    return sorted(candidates, key=lambda k: (sg.cost[k] / sg.out_bytes[k], k))


def drop_counts(length: int, points: int = 24) -> list[int]:
    """How many of the cheapest to drop: 0, every count up to 8, then a geometric grid to all."""
    counts = set(range(min(length, 8) + 1)) | {length}
    if length > 8:
        counts |= {round(8 * (length / 8) ** (i / points)) for i in range(points + 1)}
    return sorted(counts)


class _Evicted(Exception):
    """The DTR simulation cannot fit a run: nothing more can be evicted."""


Part = tuple[int, int]


class _Dtr:
    """DTR (Kirisame et al. 2021) over a solver graph; see :func:`dtr_rows`."""

    def __init__(
        self, sg: SolverGraph, budget_bytes: int, staleness_power: float, deadline: Deadline | None = None
    ) -> None:
        from memplan.remat.moccasin import node_reads

        self.sg, self.budget, self.power = sg, budget_bytes, staleness_power
        self.reads = node_reads(sg)
        self.last_reader: dict[Part, int] = {}
        for j in range(sg.size):
            for part in self.reads.first[j]:
                self.last_reader[part] = max(self.last_reader.get(part, -1), j)
        self.resident: dict[Part, int] = {}
        self.touched: dict[Part, int] = {}
        self.live = sg.graph.persistent_bytes
        self.clock = 0
        self.rows: list[list[int]] = [[t] for t in range(sg.size)]
        self.deadline = deadline
        self.costs: dict[int, float] = {}  # remake cost per node, for the resident set as it is now
        self.rereaders: dict[Part, list[int]] = {}  # part -> the nodes whose re-run reads it
        self.own_parts = [[(k, q) for q in range(len(sg.parts[k]))] for k in range(sg.size)]
        for k in range(sg.size):
            for part in self.reads.rerun[k]:
                self.rereaders.setdefault(part, []).append(k)

    def keep(self, part: Part, size: int) -> None:
        was = self.resident.get(part)
        self.live += size - (was or 0)
        self.resident[part] = size
        self.touched[part] = self.clock
        if was is None:
            self.forget(part)

    def drop(self, part: Part) -> None:
        self.live -= self.resident.pop(part)
        self.forget(part)

    def forget(self, part: Part) -> None:
        """``part`` was made resident or evicted: forget the remake costs that depended on that.

        A cached cost of ``k`` read the residency of every part its re-run reads, and the costs
        of the evicted ones' nodes; so it goes when one of those parts changes, and with it the
        cached costs that summed it (readers of an evicted part of ``k``), transitively."""
        costs, rereaders, resident = self.costs, self.rereaders, self.resident
        stack = list(rereaders.get(part, ()))
        while stack:
            k = stack.pop()
            if costs.pop(k, None) is None:
                continue
            for own in self.own_parts[k]:
                if own not in resident:
                    stack += rereaders.get(own, ())

    def remake(self, k: int) -> float:
        """Cost of making ``k`` again: itself and every evicted value it reads (DTR's e*),
        recursively; cached per node while the residency it depends on stays as it is (see
        :meth:`forget`), and summed in the order of the first, recursive version
        (``tests/core/dtr_reference.py``, recomputed at every eviction), so bit for bit its number."""
        costs, resident, rerun, cost = self.costs, self.resident, self.reads.rerun, self.sg.cost
        if k in costs:
            return costs[k]
        stack = [k]
        while stack:  # post-order over the evicted inputs (parts come from earlier nodes: no cycle)
            n = stack[-1]
            if n in costs:
                stack.pop()
                continue
            total, missing = 0.0, False  # sum()'s order: 0, then each evicted input's cost
            for part in rerun[n]:
                if part not in resident:
                    value = costs.get(part[0])
                    if value is None:
                        stack.append(part[0])
                        missing = True
                    elif not missing:
                        total += value
            if not missing:
                stack.pop()
                costs[n] = cost[n] + total
        return costs[k]

    def check(self) -> None:
        if self.deadline is not None:
            self.deadline.check()

    def evict(self, need: int, pinned: set[Part], t: int) -> None:
        """Evict the lowest ``e* / (bytes * staleness^power)`` until ``need`` more bytes fit."""
        sg = self.sg
        while self.live + need > self.budget:
            self.check()
            candidates = [
                p for p in self.resident if p not in pinned and sg.limit[p[0]] > t + 1 and sg.recomputable(p[0])
            ]
            if not candidates:
                raise _Evicted

            def score(part: Part) -> float:
                return (self.remake(part[0]) + 1e-9) / (self.resident[part] * self.weight(part, t))

            self.drop(min(candidates, key=score))

    def weight(self, part: Part, t: int) -> float:
        """DTR's staleness ``s(t)`` to the power: how long since ``part`` was last read."""
        return float(max(1, self.clock - self.touched[part]) ** self.power)

    def run(self, k: int, t: int, wanted: tuple[Part, ...], pinned: set[Part]) -> None:
        """Run node ``k`` in stage ``t``, first remaking what it reads that was evicted
        (recursively, as DTR does; driven by a stack, so any depth of remakes runs)."""
        frames: list[Iterator[Iterator[None]]] = [self.runs(k, t, wanted, pinned)]
        while frames:
            inner = next(frames[-1], None)
            if inner is None:
                frames.pop()
            else:
                frames.append(inner)

    def runs(self, k: int, t: int, wanted: tuple[Part, ...], pinned: set[Part]) -> Iterator[Iterator[None]]:
        """:meth:`run`'s body: yields the run of each evicted input (to be run before it goes on)."""
        sg = self.sg
        self.check()
        needs = self.reads.first[k] if k == t else self.reads.rerun[k]
        mine = set(pinned)
        for part in needs:
            if part not in self.resident:
                if not sg.may_run(t, part[0]):
                    raise _Evicted
                yield self.runs(part[0], t, (part,), mine)
            mine.add(part)
        self.evict(sg.peak_bytes[k], mine, t)
        self.clock += 1
        for part in needs:
            self.touched[part] = self.clock
        if k != t:
            self.rows[t].append(k)
        for q, (b, _) in enumerate(sg.parts[k]):
            part = (k, q)
            if b and (part in wanted or (k == t and self.last_reader.get(part, -1) > t)):
                self.keep(part, b)
        if k == t:
            self.live += sg.output_bytes[k]

    def simulate(self) -> list[list[int]] | None:
        try:
            for t in range(self.sg.size):
                self.run(t, t, (), set())
                for part in [p for p in self.resident if self.last_reader.get(p, -1) <= t]:
                    self.drop(part)
        except _Evicted:
            return None
        return [sorted(set(r)) for r in self.rows]


def dtr_rows(
    sg: SolverGraph, budget_bytes: int, staleness_power: float = 1.0, deadline: Deadline | None = None
) -> list[list[int]] | None:
    """Checkmate's ``R`` from a DTR simulation over ``sg`` (None if some run cannot fit).

    Memory is that of the lowering: a part of a node's outputs is resident from a run of the
    node until it is evicted or no later first run reads it; a run holds its inputs and its
    whole peak. Only values whose node may still be re-run are evicted. Raises
    :class:`memplan.remat.deadline.TimeUp` once ``deadline`` has passed: its remakes may
    thrash (on a random layered DAG of 1000 nodes at 0.9 of its peak it simulates about
    60,000 runs before it meets one that cannot fit)."""
    return _Dtr(sg, budget_bytes, staleness_power, deadline).simulate()


class _PlannedDtr(_Dtr):
    """DTR planned ahead (see :func:`dtr_planned_rows`)."""

    def __init__(
        self, sg: SolverGraph, budget_bytes: int, power: float, lookahead: bool, deadline: Deadline | None = None
    ) -> None:
        super().__init__(sg, budget_bytes, power, deadline)
        self.lookahead = lookahead
        self.first_readers: dict[Part, list[int]] = {}
        for j in range(sg.size):
            for part in self.reads.first[j]:
                self.first_readers.setdefault(part, []).append(j)
        self.next_use: dict[Part, int] = {}

    def needed(self, t: int) -> set[Part]:
        """Parts some later first run reads, and what the remakes of the evicted ones read, recursively."""
        need = {part for part, last in self.last_reader.items() if last > t}
        stack = [part for part in need if part[0] <= t and part not in self.resident]  # evicted
        while stack:
            for part in self.reads.rerun[stack.pop()[0]]:
                if part not in need:
                    need.add(part)
                    if part not in self.resident:
                        stack.append(part)
        return need

    def next_uses(self, t: int) -> dict[Part, int]:
        """Per part, the stage of its next read: its next first-run reader's, or the earliest
        next use of an evicted part whose remake reads it (Belady's MIN needs the future)."""
        uses: dict[Part, int] = {}
        for part, readers in self.first_readers.items():
            i = bisect.bisect_left(readers, t)
            if i < len(readers):
                uses[part] = readers[i]
        heap = [(stage, part) for part, stage in uses.items() if part[0] < t and part not in self.resident]
        heapq.heapify(heap)
        while heap:
            stage, part = heapq.heappop(heap)
            if uses.get(part, stage) < stage:
                continue
            for q in self.reads.rerun[part[0]]:
                if uses.get(q, self.sg.size + 1) > stage:
                    uses[q] = stage
                    if q not in self.resident:
                        heapq.heappush(heap, (stage, q))
        return uses

    def evict(self, need: int, pinned: set[Part], t: int) -> None:
        if self.lookahead and self.live + need > self.budget:
            self.next_use = self.next_uses(t)
        super().evict(need, pinned, t)

    def weight(self, part: Part, t: int) -> float:
        """Staleness (DTR), or with lookahead the distance to the next read (Belady)."""
        if not self.lookahead:
            return super().weight(part, t)
        return float(max(1, self.next_use.get(part, 2 * self.sg.size) - t) ** self.power)

    def cone(self, t: int) -> dict[int, set[Part]]:
        """The evicted values stage ``t`` needs, and theirs, recursively: node -> parts wanted."""
        want: dict[int, set[Part]] = {}
        stack = list(self.reads.first[t])
        while stack:
            part = stack.pop()
            if part in self.resident:
                continue
            if not self.sg.may_run(t, part[0]):
                raise _Evicted
            if part[0] not in want:
                stack.extend(self.reads.rerun[part[0]])
            want.setdefault(part[0], set()).add(part)
        return want

    def stage(self, t: int) -> None:
        """Remake the cone of stage ``t`` in program order, then run node ``t``; every part the
        stage reads (resident or remade) is pinned until its last read in the stage."""
        sg = self.sg
        self.check()
        want = self.cone(t)
        reads = {k: self.reads.rerun[k] for k in want} | {t: self.reads.first[t]}
        left: dict[Part, int] = {}
        for parts in reads.values():
            for part in parts:
                left[part] = left.get(part, 0) + 1
        pinned = {part for part in left if part in self.resident}
        for k in [*sorted(want), t]:
            self.evict(sg.peak_bytes[k], pinned, t)
            self.clock += 1
            for part in reads[k]:
                self.touched[part] = self.clock
                left[part] -= 1
                if not left[part]:
                    pinned.discard(part)
            if k != t:
                self.rows[t].append(k)
                for part in want[k]:
                    self.keep(part, sg.parts[k][part[1]][0])
                    pinned.add(part)
        for q, (b, _) in enumerate(sg.parts[t]):
            if b and self.last_reader.get((t, q), -1) > t:
                self.keep((t, q), b)
        self.live += sg.output_bytes[t]

    def simulate(self) -> list[list[int]] | None:
        try:
            for t in range(self.sg.size):
                self.stage(t)
                need = self.needed(t)
                for part in [p for p in self.resident if p not in need]:
                    self.drop(part)
        except _Evicted:
            return None
        return [sorted(set(r)) for r in self.rows]


def dtr_planned_rows(
    sg: SolverGraph, budget_bytes: int, power: float, lookahead: bool, deadline: Deadline | None = None
) -> list[list[int]] | None:
    """Checkmate's ``R`` from DTR planned ahead (None if some stage cannot fit).

    DTR's simulation (:func:`dtr_rows`) with what an ahead-of-time planner knows: (1) a
    value whose last reader has run stays resident, an eviction candidate like any other,
    while the remake of an evicted value still reads it (freeing it at once, as the online
    runtime does, turns the next remake into a recomputation from the graph's sources);
    (2) a stage's evicted inputs are remade as one cone in program order, each value the
    stage reads pinned until its last read there (DTR's recursion may evict a sibling it
    is about to read); (3) with ``lookahead``, the score divides by the distance to the next
    read instead of the staleness (Belady's MIN, "A study of replacement algorithms for a
    virtual-storage computer", 1966)."""
    return _PlannedDtr(sg, budget_bytes, power, lookahead, deadline).simulate()


def chen_sqrtn_checkpoints(candidates: list[int]) -> set[int]:
    """Chen 4.3: split into about sqrt(n) segments; checkpoint each segment's last node."""
    if not candidates:
        return set()
    stride = max(1, round(math.sqrt(len(candidates))))
    return set(candidates[stride - 1 :: stride])


def chen_greedy_checkpoints(sg: SolverGraph, candidates: set[int], budget: float) -> tuple[set[int], float, float]:
    """Chen Algorithm 3: close a segment at a candidate once its bytes exceed ``budget`` (B).

    Returns the checkpoints, x (bytes kept between segments) and y (largest segment)."""
    temp = x = y = 0.0
    chosen: set[int] = set()
    for v in forward_nodes(sg):
        if not sg.recomputable(v):
            continue
        temp += sg.out_bytes[v]
        if v in candidates and temp > budget:
            x += sg.out_bytes[v]
            y = max(y, temp)
            chosen.add(v)
            temp = 0.0
    return chosen, x, y


def greedy_budget_grid(sg: SolverGraph, candidates: set[int]) -> list[float]:
    """Appendix A: B = sqrt(xy) from a B = 0 run, a 6-point grid on [B/sqrt2, sqrt2 B];
    plus a log grid over all segment sizes to trace the trade-off (Checkmate 5.1)."""
    _, x, y = chen_greedy_checkpoints(sg, candidates, 0.0)
    grid = [0.0]
    center = math.sqrt(x * y)
    if center > 0:
        grid += [center * 2 ** (-0.5 + i / 5) for i in range(6)]
    sizes = [sg.out_bytes[v] for v in forward_nodes(sg) if sg.out_bytes[v] > 0]
    if sizes:
        low, high = min(sizes), sum(sizes)
        grid += [low * (high / low) ** (i / 23) for i in range(24)]
    return grid


def revolve_events(steps: int, slots: int, check: Callable[[], None] | None = None) -> list[tuple[int, frozenset[int]]]:
    """Binomial checkpointing (Griewank and Walther's revolve), uniform step cost.

    Returns, in reverse order, each step ``j`` (1..steps) with the states stored when it is
    reversed. ``F(l, c) = min_m m + F(l - m, c - 1) + F(m, c)``, ``F(l, 0) = l(l-1)/2``.
    The table is filled bottom-up and the reversal driven by a stack: no recursion deeper than
    one level, whatever the chain's length. ``check()`` is called as the table fills (a
    deadline's: it may raise to stop)."""
    best_split: dict[tuple[int, int], int] = {}
    memo: dict[tuple[int, int], int] = {}

    def cost(length: int, c: int) -> int:
        if length <= 1:
            return 0
        if c == 0:
            return length * (length - 1) // 2
        if (length, c) not in memo:
            value, split = min((m + cost(length - m, c - 1) + cost(m, c), m) for m in range(1, length))
            memo[length, c] = value
            best_split[length, c] = split
        return memo[length, c]

    for c in range(1, slots + 1):  # every entry's inputs are filled before it
        for length in range(2, steps + 1):
            cost(length, c)
            if check is not None:
                check()

    events: list[tuple[int, frozenset[int]]] = []
    stored: set[int] = set()
    todo: list[tuple[bool, int, int, int]] = [(True, 0, steps, slots)]  # (reverse?, start, length, slots) or a drop
    while todo:
        reverse, start, length, c = todo.pop()
        if not reverse:
            stored.discard(start)
            continue
        if length <= 1 or c == 0:
            events.extend((j, frozenset(stored)) for j in range(start + length, start, -1))
            continue
        cost(length, c)
        m = best_split[length, c]
        stored.add(start + m)
        todo += [(True, start, m, c), (False, start + m, 0, 0), (True, start + m, length - m, c - 1)]
    return events


def _revolve_rows(sg: SolverGraph, slots: int, check: Callable[[], None] | None = None) -> list[list[int]]:
    chain = chain_nodes(sg)
    index = {k: n + 1 for n, k in enumerate(chain)}
    stored_when = dict(revolve_events(len(chain), slots, check))
    reversing = [max((index[p] for p in sg.preds[t] if p in index), default=0) for t in range(sg.size)]
    upcoming: list[frozenset[int]] = [frozenset()] * (sg.size + 1)
    for t in range(sg.size - 1, -1, -1):
        j = reversing[t] if t >= sg.num_forward else 0
        upcoming[t] = frozenset(chain[s - 1] for s in stored_when.get(j, ())) if j else upcoming[t + 1]
    kept = set(chain)

    def carry(t: int, i: int) -> bool:
        return i not in kept or t + 1 < sg.num_forward or i in upcoming[t + 1]

    def required(t: int) -> set[int]:
        return set(upcoming[t + 1]) if t + 1 >= sg.num_forward else set()

    return rows_for_policy(sg, carry, required, droppable=kept)


def _attempt(make: Callable[[], list[list[int]]]) -> list[list[int]] | None:
    """A candidate R, or None where the policy needs a dropped value after its re-run window
    closed (possible on a split found from the structure, which may reach into the backward)."""
    try:
        return make()
    except InvalidPlan:
        return None


def _pick(
    problem: RematProblem,
    sg: SolverGraph,
    name: str,
    candidates: Iterable[list[list[int]] | None],
    validate: bool = False,
    clock: Deadline | None = None,
    total: int = 0,
    cut: bool = False,
    empty: tuple[str, str] | None = None,
) -> RematSchedule:
    """Lower every candidate R; the cheapest within budget wins, else the lowest peak. With
    ``validate``, a lowered sequence that fails :func:`validate_sequence` is dropped (DTR planned
    ahead can ask for a re-run while the first instance is still resident).

    ``candidates`` may be lazy (a generator, ``total`` of them): with ``clock``, no further one
    is made once it has passed and a plan is in hand, nor once making one raises
    :class:`TimeUp`; then (or with ``cut``: the caller stopped making them) the answer says it
    was cut (:func:`cut_message`, ``details["cut_seconds"]``), and without any plan its status
    is "unknown". ``empty``: (status, message) when no candidate was made at all (all None)."""
    start = clock.start if clock is not None else time.perf_counter()
    plans = []
    done = made = 0
    items = iter(candidates)
    while True:
        if clock is not None and plans and done < total and clock.expired():
            cut = True
            break
        try:
            rows_ = next(items)
        except StopIteration:
            break
        except TimeUp:
            cut = True
            break
        done += 1
        try:
            if rows_ is not None:
                made += 1
                plan = schedule_from_decisions(problem, sg, rows_, name, "heuristic")
                if validate:
                    validate_sequence(problem.graph, plan.steps)
                plans.append(plan)
        except InvalidPlan:
            continue
    seconds = time.perf_counter() - start
    note = cut_message(name, seconds, len(plans) and done, total) if cut else ""
    if not plans:
        if cut:
            return _no_plan(problem, name, "unknown", note, seconds)
        if empty is not None and not made:
            return _no_plan(problem, name, empty[0], empty[1], seconds)
        why = f"{name}: every plan it tried needs a dropped value after that value's re-run window closed"
        if validate:
            why = f"{name}: every plan it tried is invalid once lowered (see validate_sequence)"
        return _not_applicable(problem, name, why)
    fits = [p for p in plans if p.peak_bytes <= problem.budget_bytes]
    best = min(fits, key=lambda p: (p.compute_cost, p.peak_bytes)) if fits else min(plans, key=lambda p: p.peak_bytes)
    best.seconds = seconds
    if not fits:
        best.status = "over-budget"
        best.message = f"{name}: lowest peak {best.peak_bytes} B exceeds the budget {problem.budget_bytes} B"
    if cut:
        best.details["cut_seconds"] = round(seconds, 3)
        best.message = f"{best.message}; {note}" if best.message else note
    return best


def _no_plan(problem: RematProblem, name: str, status: str, why: str, seconds: float = 0.0) -> RematSchedule:
    plan = RematSchedule(name, problem.budget_bytes, [], 0, 0.0, problem.plain_cost, status, seconds, message=why)
    if status == "unknown":
        plan.details["cut_seconds"] = round(seconds, 3)
    return plan


def _not_applicable(problem: RematProblem, name: str, why: str) -> RematSchedule:
    return RematSchedule(name, problem.budget_bytes, [], 0, 0.0, problem.plain_cost, "not-applicable", message=why)


def solver_graph(problem: RematProblem) -> SolverGraph:
    """The solver graph every strategy of one problem shares (cached by problem identity)."""
    key = (id(problem.graph), problem.max_solver_nodes, hash(problem.cost), hash(problem.workspace))
    hit = _SG_CACHE.get(key)
    if hit is not None and hit.graph is problem.graph:
        return hit
    if len(_SG_CACHE) > 8:
        _SG_CACHE.clear()
    _SG_CACHE[key] = sg = coarsen(problem)
    return sg


_SG_CACHE: dict[tuple[int, int, int, int], SolverGraph] = {}


def checkpoint_all(problem: RematProblem) -> RematSchedule:
    """No rematerialisation (Checkmate's "checkpoint all"): every op once, program order."""
    sg = solver_graph(problem)
    return _pick(problem, sg, "checkpoint-all", [[[t] for t in range(sg.size)]])


def _without_split(problem: RematProblem, name: str) -> RematSchedule | None:
    """Not applicable, with the reason, when the graph has no forward/backward split: every
    baseline drops forward values and recomputes them in the backward pass."""
    sg = solver_graph(problem)
    if sg.has_split:
        return None
    if sg.split == "marked loss":
        return _not_applicable(problem, name, f"{name}: nothing runs after the marked loss (no backward pass)")
    return _not_applicable(problem, name, f"{name}: {sg.split}")


def _sqrtn(problem: RematProblem, name: str, candidates: list[int]) -> RematSchedule:
    clock = deadline_for(problem.time_limit_seconds)
    missing = _without_split(problem, name)
    if missing is not None:
        return missing
    sg = solver_graph(problem)
    rows_ = (_attempt(lambda: _chen_rows(sg, chen_sqrtn_checkpoints(candidates))) for _ in range(1))
    return _pick(problem, sg, name, rows_, clock=clock, total=1)


def _greedy(problem: RematProblem, name: str, candidates: list[int]) -> RematSchedule:
    clock = deadline_for(problem.time_limit_seconds)
    missing = _without_split(problem, name)
    if missing is not None:
        return missing
    sg = solver_graph(problem)
    cand = set(candidates)
    sets = sorted(
        {frozenset(chen_greedy_checkpoints(sg, cand, b)[0]) for b in greedy_budget_grid(sg, cand)}, key=sorted
    )
    rows_ = (_attempt(lambda c=c: _chen_rows(sg, set(c))) for c in sets)
    return _pick(problem, sg, name, rows_, clock=clock, total=len(sets))


def _linear_candidates(sg: SolverGraph) -> list[int]:
    return chain_nodes(sg)


def _ap_candidates(sg: SolverGraph) -> list[int]:
    chain = set(chain_nodes(sg))
    return [k for k in articulation_points(sg) if k in chain]


_NOT_LINEAR = "{}: the forward graph is not linear (use ap- or linearized-)"


def chen_sqrtn(problem: RematProblem) -> RematSchedule:
    sg = solver_graph(problem)
    if sg.has_split and not is_linear(sg):
        return _not_applicable(problem, "chen-sqrtn", _NOT_LINEAR.format("chen-sqrtn"))
    return _sqrtn(problem, "chen-sqrtn", _linear_candidates(sg))


def chen_greedy(problem: RematProblem) -> RematSchedule:
    sg = solver_graph(problem)
    if sg.has_split and not is_linear(sg):
        return _not_applicable(problem, "chen-greedy", _NOT_LINEAR.format("chen-greedy"))
    return _greedy(problem, "chen-greedy", _linear_candidates(sg))


def griewank(problem: RematProblem) -> RematSchedule:
    """Revolve with 1..l slots (the slot count is searched like Chen's B)."""
    missing = _without_split(problem, "griewank")
    if missing is not None:
        return missing
    sg = solver_graph(problem)
    if not is_linear(sg):
        return _not_applicable(problem, "griewank", "griewank: revolve needs a linear forward graph")
    clock = deadline_for(problem.time_limit_seconds)
    slots = range(1, max(2, len(_linear_candidates(sg)) + 1))
    rows_ = (_attempt(lambda c=c: _revolve_rows(sg, c, clock.check)) for c in slots)
    return _pick(problem, sg, "griewank", rows_, clock=clock, total=len(slots))


KEPT_SMALL_FRACTIONS = (1 / 8, 1 / 2)
""":func:`ap_kept_greedy` sets aside the forward values below these fractions of the median
droppable value (one candidate set each)."""


def _kept_small_candidates(sg: SolverGraph) -> list[tuple[set[int], list[int]]]:
    """Per fraction of :data:`KEPT_SMALL_FRACTIONS`: the small droppable nodes kept resident,
    and the articulation points (droppable ones) of the forward graph without them and
    without the run-once nodes (resident anyway)."""
    chain = chain_nodes(sg)
    if not chain:
        return []
    sizes = sorted(sg.out_bytes[k] for k in chain)
    median = sizes[len(sizes) // 2]
    run_once = {k for k in forward_nodes(sg) if not sg.recomputable(k)}
    out: list[tuple[set[int], list[int]]] = []
    for fraction in KEPT_SMALL_FRACTIONS:
        kept = {k for k in chain if sg.out_bytes[k] < median * fraction}
        droppable = set(chain) - kept
        points = [k for k in articulation_points(sg, kept | run_once) if k in droppable]
        if points and all(points != seen for _, seen in out):
            out.append((kept, points))
    return out


def ap_kept_greedy(problem: RematProblem) -> RematSchedule:
    """AP greedy over the cut vertices the small values hide: a transformer's forward graph has
    almost none (its attention mask and its norms' statistics reach across every block), but
    with the values under a fraction of the median kept resident, the residual stream between
    blocks cuts it. Chen's greedy (Algorithm 3, ``B`` searched as in Appendix A) over those
    points, the small values kept: per-block checkpointing, found from the graph alone (GPT-2,
    12 layers, batch 21 under 3.31 GiB: 2.99 GiB at +20% where AP greedy reaches 5.0 GiB)."""
    clock = deadline_for(problem.time_limit_seconds)
    missing = _without_split(problem, "ap-kept-greedy")
    if missing is not None:
        return missing
    sg = solver_graph(problem)
    sets = sorted(
        {
            (frozenset(chen_greedy_checkpoints(sg, set(points), b)[0]), frozenset(kept))
            for kept, points in _kept_small_candidates(sg)
            for b in greedy_budget_grid(sg, set(points))
        },
        key=lambda pair: (sorted(pair[0]), sorted(pair[1])),
    )
    rows_ = (_attempt(lambda c=c, k=k: _chen_rows(sg, set(c) | k)) for c, k in sets)
    return _pick(problem, sg, "ap-kept-greedy", rows_, clock=clock, total=len(sets))


def ap_sqrtn(problem: RematProblem) -> RematSchedule:
    return _sqrtn(problem, "ap-sqrtn", _ap_candidates(solver_graph(problem)))


def ap_greedy(problem: RematProblem) -> RematSchedule:
    return _greedy(problem, "ap-greedy", _ap_candidates(solver_graph(problem)))


def linearized_sqrtn(problem: RematProblem) -> RematSchedule:
    return _sqrtn(problem, "linearized-sqrtn", _linear_candidates(solver_graph(problem)))


def linearized_greedy(problem: RematProblem) -> RematSchedule:
    return _greedy(problem, "linearized-greedy", _linear_candidates(solver_graph(problem)))


def chen_drop_cheap(problem: RematProblem) -> RematSchedule:
    """Chen 4.2: drop the cheapest forward values (per byte), recompute them in the backward."""
    missing = _without_split(problem, "chen-drop-cheap")
    if missing is not None:
        return missing
    clock = deadline_for(problem.time_limit_seconds)
    sg = solver_graph(problem)
    order = cheapest_first(sg, chain_nodes(sg))
    counts = drop_counts(len(order))
    candidates = (_attempt(lambda m=m: _drop_rows(sg, set(order[:m]))) for m in counts)
    return _pick(problem, sg, "chen-drop-cheap", candidates, clock=clock, total=len(counts))


def dtr(problem: RematProblem) -> RematSchedule:
    """DTR's eviction heuristic with staleness weights 0, 1 and 2 (the cheapest plan wins),
    within the problem's time limit (or the caller's deadline): cut, and said so, when its
    simulation runs out of time."""
    clock = deadline_for(problem.time_limit_seconds)
    sg = solver_graph(problem)
    powers = (0.0, 1.0, 2.0)
    candidates = (dtr_rows(sg, problem.budget_bytes, power, clock) for power in powers)
    why = f"dtr: the simulation cannot fit some run within {problem.budget_bytes} B"
    return _pick(problem, sg, "dtr", candidates, clock=clock, total=len(powers), empty=("over-budget", why))


PLANNED_DTR_VARIANTS = ((0.0, False), (0.5, False), (1.0, False), (2.0, False), (0.5, True), (1.0, True), (2.0, True))
"""(power, lookahead) of :func:`dtr_planned`: staleness to the powers 0-2, next use to the powers 0.5-2."""
DESCENT_STEPS = 10
""":func:`dtr_planned` tries at most this many internal budgets, evenly from the budget to the memory floor."""
DESCENT_SHARE = 0.1
"""... and starts no lower one once this share of the problem's time limit is spent."""


def dtr_planned(problem: RematProblem) -> RematSchedule:
    """DTR planned ahead (:func:`dtr_planned_rows`), every variant of :data:`PLANNED_DTR_VARIANTS`;
    where none fits, the same at lower internal budgets, evenly spaced down to the memory floor
    (:data:`DESCENT_STEPS`, within :data:`DESCENT_SHARE` of the time limit), until a plan fits
    the real budget: the simulation is not monotone in its budget (evicting more early can
    leave room for a remake later). The cheapest plan that fits wins. Within the problem's time
    limit (or the caller's deadline): a simulation that runs out of time is cut, the plans made
    so far kept, and the answer says so."""
    clock = deadline_for(problem.time_limit_seconds)
    sg = solver_graph(problem)
    floor = memory_floor(problem).bytes
    budget = problem.budget_bytes
    first: RematSchedule | None = None
    for step in range(DESCENT_STEPS):
        inner = budget - step * max(0, budget - floor) // DESCENT_STEPS
        if step and (inner == budget or clock.elapsed() > DESCENT_SHARE * problem.time_limit_seconds):
            break
        plans: list[list[list[int]] | None] = []
        cut = False
        try:
            for power, ahead in PLANNED_DTR_VARIANTS:
                plans.append(dtr_planned_rows(sg, inner, power, ahead, clock))
        except TimeUp:
            cut = True
        total = len(PLANNED_DTR_VARIANTS)
        found = None
        if any(plans) or cut:
            found = _pick(problem, sg, "dtr-planned", plans, validate=True, clock=clock, total=total, cut=cut)
        if found is not None and found.feasible:
            return found
        if found is not None and (first is None or (not first.steps and found.steps)):
            first = found
        if cut:
            break
    if first is not None:
        return first  # over the budget: its lowest peak (a start for the CP model's phase 1), or cut
    why = f"dtr-planned: the simulation cannot fit some stage within {budget} B, nor at lower internal budgets"
    return RematSchedule("dtr-planned", budget, [], 0, 0.0, problem.plain_cost, "over-budget", message=why)


PEAK_GREEDY = "peak-greedy"
PEAK_GREEDY_SINGLES = 8
"""Single moves :func:`peak_greedy` tries at a peak when the batch and its halves lower nothing."""
PEAK_GREEDY_COVER = 0.5
"""A batch of moves is meant to take this share of the peak's excess off (their bytes there, as
estimated): moves interact, so the rest waits for the next lowering (the Llama of
``bench/llama_budget.py`` at 1.7 GiB, no pruning: +31.0% of compute covering it all, +13.96% half)."""
PEAK_GREEDY_SPREAD = 3.0
"""A batch of moves holds only those at most this many times the cheapest's cost per byte: the
dearer ones wait for the next peak, where cheaper ones may have come up."""
PEAK_GREEDY_CLOSURE = 8
"""At most this many nodes re-run together for one value (the value and the makers of its inputs)."""
PEAK_GREEDY_PRUNES = 64
"""Lowerings :func:`peak_greedy` spends at most taking needless re-runs out of its plan, within its
time (the Llama of ``bench/llama_budget.py``, gradients held, reordered, at 1.7 GiB: +13.96% of
compute without, +11.17% after 32 of them, +11.16% after 64)."""
PEAK_GREEDY_CHUNK = 8
"""... trying them in runs of this many."""
PEAK_GREEDY_SMALLEST = 64
"""Moves that take less than 1/this of the peak's excess off the peak are not made (they
would take many rounds, each a lowering)."""


@dataclass(slots=True)
class _Instance:
    """One instance of a tensor in a lowered plan: made by a run of ``node``, read by ``reads``."""

    tensor: int
    size: int
    node: int
    made: int
    reads: list[int]

    def last(self) -> int:
        return self.reads[-1] if self.reads else self.made


@dataclass
class _Profile:
    """A lowered plan's memory per run (with each op's workspace, as
    :func:`memplan.remat.lower.sequence_peak_bytes` counts it), the stage of each run (a re-run
    belongs to the stage of the next first run), and its tensor instances."""

    mem: list[int]
    stage: list[int]
    instances: list[_Instance]
    of_tensor: dict[int, list[_Instance]]

    def before(self, t: int, run: int) -> _Instance | None:
        """The instance of ``t`` made last before ``run``."""
        made = [inst for inst in self.of_tensor.get(t, ()) if inst.made < run]
        return made[-1] if made else None


def _profile(problem: RematProblem, node_of: list[int], steps: list[Step]) -> _Profile:
    graph, workspace = problem.graph, problem.workspace
    tensors = graph.tensors
    resident = graph.persistent_bytes
    live: dict[int, _Instance] = {}
    mem: list[int] = []
    ops: list[int] = []
    first: list[bool] = []
    seen: set[int] = set()
    instances: list[_Instance] = []
    of_tensor: dict[int, list[_Instance]] = {}
    for kind, i in steps:
        if kind == "free":
            gone = live.pop(i, None)
            resident -= gone.size if gone is not None else 0
            continue
        run = len(mem)
        for t in graph.ops[i].inputs:
            if t in live:
                live[t].reads.append(run)
        for t in graph.ops[i].outputs:
            if t not in live and not tensors[t].persistent:
                live[t] = inst = _Instance(t, tensors[t].size_bytes, node_of[i], run, [])
                instances.append(inst)
                of_tensor.setdefault(t, []).append(inst)
                resident += inst.size
        mem.append(resident + (workspace[i] if workspace else 0))
        ops.append(i)
        first.append(i not in seen)
        seen.add(i)
    latest = -1  # a first run of a node before the latest stage (an unread first run dropped) is not a stage's
    for run, v in enumerate(ops):
        first[run] = first[run] and node_of[v] >= latest
        latest = max(latest, node_of[v]) if first[run] else latest
    stage = [0] * len(mem)
    after = max(node_of, default=0)
    for run in range(len(mem) - 1, -1, -1):
        after = node_of[ops[run]] if first[run] else after
        stage[run] = after
    return _Profile(mem, stage, instances, of_tensor)


class _PeakGreedy:
    """:func:`peak_greedy`'s state: the decisions (Checkmate's ``R`` as rows) and the re-runs added."""

    def __init__(self, problem: RematProblem, sg: SolverGraph, clock: Deadline) -> None:
        self.problem, self.sg, self.clock = problem, sg, clock
        graph = problem.graph
        self.node_of = [0] * len(graph.ops)
        for k, group in enumerate(sg.groups):
            for v in group:
                self.node_of[v] = k
        self.needs: list[tuple[int, ...]] = []  # per node: the bytes its re-run reads from outside it
        for group in sg.groups:
            own = {t for v in group for t in graph.ops[v].outputs}
            reads = {t for v in group for t in graph.ops[v].inputs if t not in own}
            self.needs.append(
                tuple(t for t in sorted(reads) if graph.tensors[t].size_bytes and not graph.tensors[t].persistent)
            )
        self.rows: list[list[int]] = [[t] for t in range(sg.size)]
        self.added: list[tuple[int, int]] = []  # (stage, node), in the order added
        self.plan = self.measure()
        self.profile = _profile(problem, self.node_of, self.plan.steps)

    def measure(self) -> RematSchedule:
        return schedule_from_decisions(self.problem, self.sg, self.rows, PEAK_GREEDY, "heuristic")

    def excess(self, profile: _Profile) -> tuple[int, int]:
        """(peak, bytes over the budget summed over the runs): what each move must lower."""
        budget = self.problem.budget_bytes
        return max(profile.mem, default=0), sum(m - budget for m in profile.mem if m > budget)

    def candidates(self, profile: _Profile) -> list[tuple[float, int, int, tuple[int, ...]]]:
        """(compute per byte-run of excess removed, bytes removed at the peak, stage, node), the
        cheapest first: node ``k``'s values live across the peak run (not read there) dropped
        from their last read before it to the stage ``j`` of their next reader, where ``k``
        re-runs, less what keeping ``k``'s inputs until then adds (Chen et al.'s cost per byte,
        counted over the runs above the budget)."""
        sg, budget = self.sg, self.problem.budget_bytes
        mem, stage = profile.mem, profile.stage
        peak = max(range(len(mem)), key=mem.__getitem__)
        over = [max(0, m - budget) for m in mem]
        need = mem[peak] - budget
        moves: dict[tuple[int, int], list[_Instance]] = {}
        for inst in profile.instances:
            k = inst.node
            if not inst.size or inst.made >= peak or not sg.recomputable(k):
                continue
            later = bisect.bisect_right(inst.reads, peak)
            if later == len(inst.reads) or (later and inst.reads[later - 1] == peak):
                continue
            j = stage[inst.reads[later]]
            if j > stage[peak] and sg.may_run(j, k) and k not in self.rows[j]:
                moves.setdefault((j, k), []).append(inst)
        out = []
        for (j, k), dropped in moves.items():
            at = bisect.bisect_left(stage, j)  # where stage j's runs begin
            saved = at_peak = 0
            for inst in dropped:
                since = inst.reads[bisect.bisect_right(inst.reads, peak) - 1] if inst.reads[0] < peak else inst.made
                saved += sum(min(inst.size, x) for x in over[since + 1 : at])
                at_peak += inst.size
            nodes, lost, lost_at_peak = self.closure(profile, over, j, k, at, peak)
            saved -= lost
            at_peak -= lost_at_peak
            if saved > 0 and at_peak * PEAK_GREEDY_SMALLEST >= need:
                cost = sum(sg.cost[n] for n in nodes)
                out.append(((cost + 1e-9) / saved, at_peak, j, tuple(sorted(nodes))))
        return sorted(out)

    def closure(
        self, profile: _Profile, over: list[int], j: int, k: int, at: int, peak: int
    ) -> tuple[set[int], int, int]:
        """The nodes to re-run in stage ``j`` for ``k``'s re-run (``k``, and the makers of
        its inputs that are gone by then where keeping them until then would cost bytes
        over the budget and they may re-run then, recursively, as Checkmate's baselines fill
        ``R``), with what keeping the other inputs costs: byte-runs over the budget, bytes at the peak."""
        sg = self.sg
        nodes, stack = {k}, [k]
        lost = lost_at_peak = 0
        while stack:
            n = stack.pop()
            for t in self.needs[n]:
                kept = profile.before(t, at)
                if kept is None or kept.last() >= at or kept.node in nodes:
                    continue
                cost = sum(min(kept.size, x) for x in over[kept.last() + 1 : at])
                p = kept.node
                if cost and len(nodes) < PEAK_GREEDY_CLOSURE and sg.may_run(j, p) and p not in self.rows[j]:
                    nodes.add(p)
                    stack.append(p)
                    continue
                lost += cost
                lost_at_peak += kept.size if kept.last() < peak else 0
        return nodes, lost, lost_at_peak

    def apply(self, moves: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Add the re-runs ``moves`` (stage, node) not there yet; returns those added."""
        added = []
        for j, k in moves:
            if k not in self.rows[j]:
                self.rows[j] = sorted([*self.rows[j], k])
                self.added.append((j, k))
                added.append((j, k))
        return added

    def undo(self, moves: list[tuple[int, int]]) -> None:
        for j, k in moves:
            self.rows[j].remove(k)
            self.added.remove((j, k))

    def attempt(self, moves: list[tuple[int, int]], better: Callable[[RematSchedule, _Profile], bool]) -> bool:
        """Apply ``moves`` and keep them if ``better(plan, profile)``."""
        added = self.apply(moves)
        try:
            plan = self.measure()
        except InvalidPlan:
            self.undo(added)
            return False
        profile = _profile(self.problem, self.node_of, plan.steps)
        if better(plan, profile):
            self.plan, self.profile = plan, profile
            return True
        self.undo(added)
        return False

    def step(self) -> bool:
        """One move at the peak: the cheapest values that cover its excess at once (else the
        first half of them, and so on, else a few single ones) when that lowers (peak,
        excess); False when none does."""
        before = self.excess(self.profile)
        options = self.candidates(self.profile)
        need = before[0] - self.problem.budget_bytes
        batch: list[tuple[int, int]] = []
        covered = 0
        for score, at_peak, j, nodes in options:
            if covered >= PEAK_GREEDY_COVER * need or score > PEAK_GREEDY_SPREAD * options[0][0]:
                break
            batch += [(j, n) for n in nodes]
            covered += at_peak
        tries = []
        while batch:
            tries.append(batch)
            batch = batch[: len(batch) // 2]
        tries += [[(j, n) for n in nodes] for _s, _b, j, nodes in options[1 : 1 + PEAK_GREEDY_SINGLES]]
        for moves in tries:
            if self.clock.expired():
                return False
            if self.attempt(moves, lambda _plan, profile: self.excess(profile) < before):
                return True
        return False

    def prune(self) -> None:
        """Take out the re-runs the plan fits without, the dearest first: a run of them at
        once, else each half, and so on, at most :data:`PEAK_GREEDY_PRUNES` tries (each a lowering)."""
        budget = self.problem.budget_bytes
        dearest = sorted(self.added, key=lambda move: -self.sg.cost[move[1]])
        chunks = [dearest[n : n + PEAK_GREEDY_CHUNK] for n in range(0, len(dearest), PEAK_GREEDY_CHUNK)][::-1]
        for _ in range(PEAK_GREEDY_PRUNES):
            if not chunks or self.clock.expired():
                return
            chunk = chunks.pop()
            self.undo(chunk)
            if self.attempt([], lambda plan, _profile: plan.peak_bytes <= budget):
                continue
            self.apply(chunk)
            if len(chunk) > 1:
                chunks += [chunk[len(chunk) // 2 :], chunk[: len(chunk) // 2]]


def peak_greedy(problem: RematProblem) -> RematSchedule:
    """Chen et al.'s greedy (drop what is cheapest to make again per byte, 4.2-4.3) applied where
    the step is over the budget, in the stage order as it is: from checkpoint-all (over a graph
    listed in a reordered order, the reordered plan), while the lowered plan's peak is over the
    budget, the values live across the peak run that are cheapest per byte-run of excess they
    remove are dropped there and re-run at their next reader's stage (Checkmate's ``R``), as
    many at once as cover the peak's excess, each move measured by the one estimator; then the
    re-runs the plan fits without are taken out again. No split is needed: any graph. Near a
    reordered plan that is just over the budget it needs a few moves where the other baselines
    start from program order's peak."""
    clock = deadline_for(problem.time_limit_seconds)
    sg = solver_graph(problem)
    search = _PeakGreedy(problem, sg, clock)
    while search.plan.peak_bytes > problem.budget_bytes and not clock.expired():
        if not search.step():
            break
    cut = search.plan.peak_bytes > problem.budget_bytes and clock.expired()
    if search.plan.peak_bytes <= problem.budget_bytes:
        search.prune()
    return _pick(problem, sg, PEAK_GREEDY, [search.rows], clock=clock, total=1, cut=cut)


BASELINES: dict[str, Callable[[RematProblem], RematSchedule]] = {
    "checkpoint-all": checkpoint_all,
    "chen-sqrtn": chen_sqrtn,
    "chen-greedy": chen_greedy,
    "griewank": griewank,
    "ap-sqrtn": ap_sqrtn,
    "ap-greedy": ap_greedy,
    "ap-kept-greedy": ap_kept_greedy,
    "linearized-sqrtn": linearized_sqrtn,
    "linearized-greedy": linearized_greedy,
    "chen-drop-cheap": chen_drop_cheap,
    "dtr": dtr,
    "dtr-planned": dtr_planned,
}


ONE_BASELINE_SHARE = 0.5
"""Where baselines run one after another within a phase, one may use at most this share of the
time the phase has left (DTR's remakes can thrash for minutes on a large graph) ..."""
ONE_BASELINE_MIN_SHARE = 0.1
"""... but at least this share of the whole time limit (never past the phase's end)."""


def baseline_deadline(phase_end: float, hard_end: float, time_limit_seconds: float) -> Deadline:
    """The deadline of the next baseline of a phase that ends at ``phase_end`` (a
    ``time.perf_counter()`` value): :data:`ONE_BASELINE_SHARE` of the phase's time left, at least
    :data:`ONE_BASELINE_MIN_SHARE` of ``time_limit_seconds``, never past ``hard_end``."""
    now = time.perf_counter()
    allowance = max(ONE_BASELINE_SHARE * (phase_end - now), ONE_BASELINE_MIN_SHARE * time_limit_seconds)
    return Deadline(now, min(hard_end, now + allowance))


def run_baselines(
    problem: RematProblem, names: Iterable[str], phase_seconds: float, plans: dict[str, RematSchedule] | None = None
) -> dict[str, RematSchedule]:
    """The baselines ``names``, in that order, within ``phase_seconds`` (and the caller's
    deadline), each within :func:`baseline_deadline` (the last within what the phase has left);
    once the phase is spent the rest are not
    run and say so (status "unknown"). Each plan is put in ``plans`` (given: as it comes)."""
    phase = deadline_for(phase_seconds)
    plans = {} if plans is None else plans
    names = list(names)
    for n, name in enumerate(names):
        if phase.expired():
            why = f"{name}: not run: the baselines' share of the time limit ({phase_seconds:.1f} s) was spent"
            plans[name] = _no_plan(problem, name, "unknown", why)
            continue
        last = n == len(names) - 1  # the last one may use all the phase has left
        with within(phase if last else baseline_deadline(phase.end, phase.end, problem.time_limit_seconds)):
            plans[name] = BASELINES[name](problem)
    return plans


def require_feasible(schedule: RematSchedule) -> RematSchedule:
    """Raise :class:`InfeasibleBudget` unless ``schedule`` fits its budget."""
    if not schedule.feasible:
        raise InfeasibleBudget(schedule.message or f"{schedule.strategy}: no plan within {schedule.budget_bytes} B")
    return schedule
