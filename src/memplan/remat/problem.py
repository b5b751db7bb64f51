"""The rematerialisation problem (Checkmate section 4.1) and its solution, kept apart.

A :class:`RematProblem` is a graph in a fixed topological order (program order), a cost
``C_i`` per op (Checkmate 4.9: ``Op.flops`` by default) and a memory budget in bytes. A
:class:`RematSchedule` is one answer: a lowered step sequence (see :mod:`memplan.remat.lower`)
with its peak measured by :func:`memplan.remat.lower.sequence_peak_bytes`.

Which ops may run more than once (:func:`rerun_limits`): only pure ops. Not placeholders,
not ops that mutate an input, not ``memplan.release``, not random ops (no RNG replay is
attempted, so a second run would draw new numbers), not ops whose output some op mutates
(a recomputed value would be the pre-mutation one). An op that *reads* a tensor mutated
later in the step (a convolution reading a weight that the optimizer updates) may be
re-run, but only before that mutation runs: its window ends there.

Two exceptions make convolutional networks' activations droppable (Checkmate 4.1 asks
only that a recompute yield the same value):

* a training-mode batch norm (:func:`recompute_skips_mutation`) writes only its running
  statistics, BUFFER tensors that its outputs do not depend on: a recompute re-runs it
  *without* that write (the runtime passes no running statistics), so it is pure;
* in-place ops that rewrite the fresh output of a re-runnable op one after the other, and
  that every other reader of that output reads after (``relu_`` after a batch norm; the
  capture's writes over dying inputs: :func:`inplace_chain`) are
  re-run together with their producer: the lowering never re-runs one on its own, only
  right after a recompute of the producer, in order, before the first reader (like a view).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from memplan.graph.ir import Category, Graph

Step = tuple[str, int]
"""``("run", op_id)`` runs an op (first run or recompute) and allocates its outputs;
``("free", tensor_id)`` releases the current instance of a tensor."""

RANDOM_KIND_MARKERS = (
    "bernoulli",
    "dropout",
    "rand",
    "normal",
    "uniform_",
    "multinomial",
    "exponential",
    "poisson",
    "cauchy",
    "geometric",
    "log_normal",
)
BATCH_NORM_KINDS = frozenset({"native_batch_norm", "_native_batch_norm_legit", "cudnn_batch_norm"})
"""Batch norms whose only side effect is the update of the running statistics they are given."""


def is_random(kind: str) -> bool:
    return any(marker in kind for marker in RANDOM_KIND_MARKERS)


def base_kind(kind: str) -> str:
    """``aten.native_batch_norm.default`` -> ``native_batch_norm`` (other kinds unchanged)."""
    for prefix in ("aten.", "aten::"):
        if kind.startswith(prefix):
            return kind[len(prefix) :].split(".")[0]
    return kind


def recompute_skips_mutation(graph: Graph, v: int) -> bool:
    """Op ``v`` is a batch norm whose only writes are to BUFFER tensors (running statistics):
    a recompute must skip those writes, and then yields the first run's outputs bitwise."""
    op = graph.ops[v]
    return (
        base_kind(op.kind) in BATCH_NORM_KINDS
        and bool(op.mutates)
        and all(graph.tensors[t].category is Category.BUFFER and graph.tensors[t].persistent for t in op.mutates)
    )


def inplace_chain(graph: Graph, t: int, writers: Sequence[int]) -> tuple[int, ...]:
    """The writers of fresh tensor ``t`` when together they form a chain the lowering can
    re-run after a recompute of ``t``'s producer, else ``()``.

    A chain ``m_1 < ... < m_K`` (``relu_`` after a batch norm; the capture's out= rewrites of
    Chen et al. 4.1, GELU's ``pow -> mul -> add -> mul -> tanh`` written into one storage): each
    link writes only ``t``, is not random, makes only 0-byte handles, and reads a handle of the
    link before it (so re-made links run in order); the handles of every link but the last are
    read by later links only; every other reader of ``t`` reads a handle of the last link
    (it wants the final value, the one a re-run of the whole chain leaves). Each link is re-run
    exactly once after every recompute of ``p``; its other inputs (the residual of an in-place
    ``+=``) are read again by the re-run: the lowering keeps them live until then."""
    writers = sorted(writers)
    p = graph.producer[t]
    if not writers or p < 0 or graph.tensors[t].persistent or p in writers:
        return ()
    handles: list[set[int]] = []
    for m in writers:
        op = graph.ops[m]
        if len(op.mutates) != 1 or is_random(op.kind) or not op.outputs:
            return ()
        if any(graph.tensors[u].size_bytes for u in op.outputs):
            return ()
        if handles and not handles[-1] & set(op.inputs):
            return ()
        handles.append(set(op.outputs))
    chain = set(writers)
    for made in handles[:-1]:
        if any(c not in chain for u in made for c in graph.consumers[u]):
            return ()
    last = handles[-1]
    previews = set(chain_previews(graph, t, writers))
    if any(c not in chain and c not in previews and not last & set(graph.ops[c].inputs) for c in graph.consumers[t]):
        return ()
    return tuple(writers)


def chain_previews(graph: Graph, t: int, writers: Sequence[int]) -> tuple[int, ...]:
    """The views of ``t`` taken before its first writer for the writers only: pure ops reading
    ``t`` before ``writers[0]``, making only 0-byte handles, each read by writers alone (the
    capture's ``add.out`` writes through an ``_unsafe_view`` of the bmm output it overwrites:
    GPT-2's attention projection plus residual). A re-run of ``t``'s producer makes them again
    before the writers are re-applied (:func:`memplan.remat.lower._refresh_views`), so they
    do not keep the chain run-once (on GPT-2, 12 layers, batch 26: 24 x 20 MB held to the loss)."""
    if not writers:
        return ()
    first, chain = min(writers), set(writers)
    found = []
    for c in graph.consumers[t]:
        op = graph.ops[c]
        if c >= first or op.mutates or is_random(op.kind) or not op.outputs:
            continue
        if any(graph.tensors[u].size_bytes for u in op.outputs):
            continue
        if all(r in chain for u in op.outputs for r in graph.consumers[u]):
            found.append(c)
    return tuple(found)


T = TypeVar("T")


def per_graph(cache: dict[int, tuple[Graph, T]], graph: Graph, make: Callable[[Graph], T]) -> T:
    """``make(graph)``, cached in ``cache`` by graph identity (at most 17 graphs kept)."""
    hit = cache.get(id(graph))
    if hit is not None and hit[0] is graph:
        return hit[1]
    if len(cache) > 16:
        cache.clear()
    value = make(graph)
    cache[id(graph)] = (graph, value)
    return value


_LIMITS_CACHE: dict[int, tuple[Graph, list[int]]] = {}


def rerun_limits(graph: Graph) -> list[int]:
    """Cached :func:`compute_rerun_limits` (by graph identity)."""
    return per_graph(_LIMITS_CACHE, graph, compute_rerun_limits)


def compute_rerun_limits(graph: Graph) -> list[int]:
    """``limit[v]``: a re-run of op ``v`` must come before op ``limit[v]`` first runs.

    ``limit[v] == v`` marks an op that must run exactly once; ``len(graph.ops)`` means no
    limit. For a pure op reading a tensor that some later op ``m`` mutates, ``limit = m``
    (not for the later links of an in-place chain over what it writes: they re-run after it);
    a chain's producer ends its window where one of its links must.
    """
    n = len(graph.ops)
    mutated_by: dict[int, list[int]] = {}
    for op_id, op in enumerate(graph.ops):
        for t in op.mutates:
            mutated_by.setdefault(t, []).append(op_id)
    chains = {t: inplace_chain(graph, t, writers) for t, writers in mutated_by.items()}
    followers = {m for chain in chains.values() for m in chain}
    viewed = {c: t for t, chain in chains.items() for c in chain_previews(graph, t, chain)}  # re-made before it
    limits = []
    for v, op in enumerate(graph.ops):
        fixed = (
            op.kind == "placeholder"
            or op.kind == "memplan.release"
            or (bool(op.mutates) and v not in followers and not recompute_skips_mutation(graph, v))
            or is_random(op.kind)
            or any(m not in followers for t in op.outputs for m in mutated_by.get(t, ()))
            or (v in followers and limits[graph.producer[op.mutates[0]]] <= graph.producer[op.mutates[0]])
        )
        if fixed:
            limits.append(v)
            continue
        # the chain's later links re-run after this one (after a view taken for them: all its links)
        own = op.mutates[0] if v in followers else viewed.get(v, -1)
        later = [m for t in op.inputs for m in mutated_by.get(t, ()) if m > v and t != own]
        limits.append(min(later, default=n))
    for m in sorted(followers):  # a producer re-run after a link's window closed could not re-make the chain
        p = graph.producer[graph.ops[m].mutates[0]]
        if limits[p] > p and limits[m] > m:
            limits[p] = min(limits[p], limits[m])
    return limits


def loss_op(graph: Graph) -> int | None:
    """The op that makes the first output of the step (the loss): the end of the forward pass."""
    for t, tensor in enumerate(graph.tensors):
        if tensor.category is Category.OUTPUT:
            return graph.producer[t]
    return None


@dataclass(frozen=True)
class ForwardEnd:
    """Where the forward pass ends: ``op`` (None: no split) and ``how`` it was found, or why not."""

    op: int | None
    how: str


NO_SPLIT = (
    "no forward/backward split: no value made by a re-runnable op is read again after the op right after it, "
    "so nothing can be dropped and recomputed later"
)


def forward_end(graph: Graph) -> ForwardEnd:
    """The loss op when the graph marks it (an output of the step); else found from the
    graph's structure, as Checkmate's baselines need for any graph (its own graphs come with
    their forward nodes): the point of program order where the most bytes are *kept for
    later*, i.e. made by re-runnable ops before it and read again by re-runnable ops after
    it, not right after being made (the last such op where several tie). In a training step
    that is where the forward pass ends (every saved activation waits for its backward op);
    gradients waiting for a run-once optimizer update do not count. A graph where no such
    value exists has no split."""
    marked = loss_op(graph)
    if marked is not None:
        return ForwardEnd(marked, "marked loss")
    limits = rerun_limits(graph)
    n = len(graph.ops)
    change = [0] * (n + 1)
    for t, tensor in enumerate(graph.tensors):
        u = graph.producer[t]
        if tensor.persistent or tensor.size_bytes == 0 or u < 0 or limits[u] <= u:
            continue
        last = max((c for c in graph.consumers[t] if limits[c] > c), default=-1)
        if last > u + 1:
            change[u] += tensor.size_bytes
            change[last] -= tensor.size_bytes
    best_bytes, best_op, kept = 0, None, 0
    for v in range(n):
        kept += change[v]
        if kept >= best_bytes and kept > 0:  # the last op of the highest plateau
            best_bytes, best_op = kept, v
    if best_op is None:
        return ForwardEnd(None, NO_SPLIT)
    return ForwardEnd(best_op, f"structure ({best_bytes} B kept for later at op {graph.ops[best_op].name!r})")


def default_costs(graph: Graph) -> tuple[float, ...]:
    """Checkmate 4.9's additive cost model with ``Op.flops`` as ``C_i``."""
    return tuple(float(op.flops) for op in graph.ops)


@dataclass(frozen=True)
class RematProblem:
    """Run ``graph`` within ``budget_bytes`` at the least total cost ``sum C_i`` (Checkmate 4.5).

    ``workspace[i]``: bytes op ``i`` holds only while it runs, beyond its outputs (a kernel's
    scratch, e.g. oneDNN's reorders inside ``convolution_backward``; measured by
    :func:`memplan.torch.profile.profile_model`). Every estimator adds it at the op's run, so
    plans budget for it; empty means none.
    """

    graph: Graph
    budget_bytes: int
    cost: tuple[float, ...] = ()
    time_limit_seconds: float = 60.0
    workers: int = 2
    max_solver_nodes: int = 200
    workspace: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.cost:
            object.__setattr__(self, "cost", default_costs(self.graph))
        if len(self.cost) != len(self.graph.ops):
            raise ValueError(f"cost has {len(self.cost)} entries, the graph has {len(self.graph.ops)} ops")
        if self.workspace and len(self.workspace) != len(self.graph.ops):
            raise ValueError(f"workspace has {len(self.workspace)} entries, the graph has {len(self.graph.ops)} ops")

    @property
    def plain_cost(self) -> float:
        """Cost of one plain step: every op once."""
        return float(sum(self.cost))

    def with_budget(self, budget_bytes: int) -> RematProblem:
        return replace(self, budget_bytes=int(budget_bytes))

    def with_time_limit(self, seconds: float) -> RematProblem:
        return replace(self, time_limit_seconds=float(seconds))

    @property
    def forward_fraction(self) -> float:
        """Cost of the forward pass (up to the loss) over the cost of the whole step: the
        overhead of one extra forward pass (Checkmate 6.3's limit for the largest batch)."""
        loss = forward_end(self.graph).op
        if loss is None or self.plain_cost <= 0:
            return 1.0
        return float(sum(self.cost[: loss + 1])) / self.plain_cost


@dataclass
class RematSchedule:
    """One strategy's answer. ``overhead = (compute_cost - plain cost) / plain cost``.

    ``status`` says what was proven. A solver ("checkmate", "moccasin", "portfolio"):
    "optimal", "feasible" (a plan within the budget; ``gap`` is its distance to the solver's
    bound, relative to the whole step's compute), "infeasible" (proven: no plan exists, see
    :func:`memplan.remat.problem.memory_floor`), "unknown" (no plan found in the time limit;
    plans may exist). A baseline: "heuristic" (its plan), "over-budget" (its plans exceed the
    budget), "not-applicable" (with the reason in ``message``). ``details["from"]``: which
    strategy made the plan a solver returns (a baseline's, when the solver found no cheaper).
    """

    strategy: str
    budget_bytes: int
    steps: list[Step]
    peak_bytes: int
    compute_cost: float
    plain_cost: float
    status: str
    seconds: float = 0.0
    gap: float | None = None
    message: str = ""
    details: dict[str, object] = field(default_factory=dict)

    @property
    def feasible(self) -> bool:
        return bool(self.steps) and self.peak_bytes <= self.budget_bytes and self.status not in _NOT_A_PLAN

    @property
    def overhead(self) -> float:
        if self.plain_cost <= 0:
            return 0.0
        return (self.compute_cost - self.plain_cost) / self.plain_cost

    def summary(self) -> dict[str, object]:
        """The per-strategy JSON of ``memplan remat``."""
        out: dict[str, object] = {
            "feasible": self.feasible,
            "peak_bytes": self.peak_bytes if self.steps else None,
            "overhead": round(self.overhead, 6) if self.feasible else None,
            "seconds": round(self.seconds, 3),
            "status": self.status,
            "gap": self.gap,
            "message": self.message,
        }
        for key in ("from", "scope", "nodes_before", "nodes_after", "coarsened", "solver_status", "floor_bytes"):
            if key in self.details:
                out[key] = self.details[key]
        if "attempts" in self.details:
            out["attempts"] = self.details["attempts"]
        return out


_NOT_A_PLAN = frozenset({"over-budget", "not-applicable", "infeasible", "unknown"})


def run_cost(cost: Sequence[float], steps: Sequence[Step]) -> float:
    """Total cost of the runs in ``steps`` (Checkmate objective, 4.3)."""
    return float(sum(cost[i] for kind, i in steps if kind == "run"))


@dataclass(frozen=True)
class MemoryFloor:
    """A lower bound on the peak of every plan memplan can make (first runs in program order,
    any recomputation): at ``op``'s first run, ``bytes`` are resident whatever is recomputed."""

    bytes: int
    op: int


def memory_floor(problem: RematProblem) -> MemoryFloor:
    """The largest, over ops ``v``, of what must be resident at ``v``'s first run.

    That is the persistent bytes, ``v``'s workspace, its inputs and outputs, the outputs of
    the step made before it (kept to the end), and every tensor made before ``v`` by an op
    that may no longer run again at ``v`` (run-once ops, or ops whose re-run window closed:
    :func:`rerun_limits`) and read after ``v``: nothing can make that tensor again, so it is
    resident from its only instance to its last read. A budget below the floor has no plan:
    this is the proof behind the status "infeasible".
    """
    best = MemoryFloor(problem.graph.persistent_bytes, 0)
    for v, need in enumerate(floor_by_op(problem)):
        if need > best.bytes:
            best = MemoryFloor(need, v)
    return best


def floor_by_op(problem: RematProblem) -> list[int]:
    """Per op ``v``, the bytes resident at ``v``'s first run in every plan (see :func:`memory_floor`)."""
    graph = problem.graph
    n = len(graph.ops)
    limits = rerun_limits(graph)
    forced = [0] * (n + 1)
    forced_at: list[list[tuple[int, int]]] = [[] for _ in range(n + 1)]  # (from, to) per tensor, by start
    for t, tensor in enumerate(graph.tensors):
        u = graph.producer[t]
        if tensor.persistent or tensor.size_bytes == 0 or u < 0:
            continue
        if tensor.category is Category.OUTPUT:
            begin, end = u + 1, n
        else:
            last = max(graph.consumers[t], default=-1)
            begin, end = max(u + 1, limits[u]), last
        if begin < end:
            forced[begin] += tensor.size_bytes
            forced[end] -= tensor.size_bytes
            forced_at[begin].append((t, end))
    needs = []
    resident = 0
    intervals: dict[int, int] = {}
    for v, op in enumerate(graph.ops):
        resident += forced[v]
        for t, end in forced_at[v]:
            intervals[t] = end
        own = {t for t in (*op.inputs, *op.outputs) if not graph.tensors[t].persistent}
        extra = sum(graph.tensors[t].size_bytes for t in own if not (t in intervals and intervals[t] > v))
        scratch = problem.workspace[v] if problem.workspace else 0
        needs.append(graph.persistent_bytes + resident + extra + scratch)
    return needs
