"""Data-parallel training as a graph transformation: DDP's gradient buckets on a communication stream.

PyTorch's ``DistributedDataParallel`` averages the gradients over the ranks in *buckets*: the
parameters, in reverse order (roughly the order their gradients become ready in the backward),
are cut into buckets of about ``bucket_cap_mb``; as soon as the last gradient of a bucket is
ready, an asynchronous all-reduce of the bucket starts, overlapping the rest of the backward;
the optimizer waits for it before reading those gradients. :func:`add_gradient_buckets` writes
exactly that into a training-step graph, without any framework:

* per bucket, one ``memplan.all_reduce`` op on the communication stream, reading and writing in
  place every gradient of the bucket (so the arena holds no second copy, as DDP's
  ``gradient_as_bucket_view=True``); it depends on each gradient's producer and on every op
  that reads a gradient before the reduction (views made by the backward, in-place
  accumulation), through new 0-byte control edges;
* per bucket, one ``memplan.wait`` op on the compute stream that reads the all-reduce's work
  handle; every op that reads a reduced gradient (the optimizer's update ops and the
  gradient's release) depends on it;
* each bucket's gradients form one contiguous group (``meta["contiguous"]``), in bucket order,
  so that the bucket is one flat block of the arena the collective works on in place.

What the all-reduce computes (DDP's mean: the sum over the ranks divided by their number) is
the runtime's business; the plan only needs who reads and writes which bytes when.

Apply it before :func:`memplan.schedule.early_updates.enforce_early_weight_updates` (OLLA 4.3):
the early-update edges then keep every update after its bucket's wait, as they only add
dependencies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from memplan.errors import CycleError, GraphError
from memplan.graph.analysis import Reachability, topological_order
from memplan.graph.ir import Category, Graph, Op, OpId, Tensor, TensorId
from memplan.graph.multistream import CONTIGUOUS_KEY
from memplan.streams.sync import ALL_REDUCE_KIND, WAIT_KIND

DEFAULT_BUCKET_CAP_BYTES = 25 * 1024 * 1024  # DDP's bucket_cap_mb=25
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
RELEASE_KIND = "memplan.release"  # what capture calls zero_grad(set_to_none=True)'s drop of a gradient
COMM_STREAM = 1


class GradientMismatch(GraphError):
    """The gradient of a parameter cannot be told from the graph."""


@dataclass(frozen=True)
class Bucket:
    """One all-reduce: ``gradients`` (of ``parameters``, same order) in the order laid out."""

    index: int
    parameters: tuple[TensorId, ...]
    gradients: tuple[TensorId, ...]
    size_bytes: int


def _is_memory(tensor: Tensor) -> bool:
    return tensor.category is not Category.CONTROL


def update_cone(graph: Graph, update: int, writers: dict[int, list[int]]) -> tuple[set[int], set[TensorId]]:
    """The ops of one parameter's optimizer update that lead to op ``update``, and the gradients
    they read: walk back from ``update`` through the optimizer state it reads (to the ops that
    write that state) and the temporaries it reads (to their producers), stopping at gradients."""
    ops: set[int] = set()
    grads: set[TensorId] = set()
    stack = [update]
    while stack:
        v = stack.pop()
        if v in ops:
            continue
        ops.add(v)
        for t in graph.ops[v].inputs:
            tensor = graph.tensors[t]
            if tensor.category is Category.GRADIENT:
                grads.add(t)
            elif tensor.category is Category.OPTIMIZER_STATE:
                stack.extend(w for w in writers.get(t, ()) if w != v)
            elif not tensor.persistent and _is_memory(tensor) and tensor.category is Category.TEMPORARY:
                stack.append(graph.producer[t])
    return ops, grads


def _writers(graph: Graph) -> dict[int, list[int]]:
    writers: dict[int, list[int]] = {}
    for v, op in enumerate(graph.ops):
        for t in op.mutates:
            writers.setdefault(t, []).append(v)
    return writers


def gradient_parameters(graph: Graph) -> list[tuple[TensorId, TensorId]]:
    """``(parameter, gradient)`` for every parameter an op updates, in parameter order (the
    order of the parameter tensors in the graph: capture lists them as the forward first uses
    them). Raises :class:`GradientMismatch` when an update reads no gradient or several."""
    writers = _writers(graph)
    found: dict[TensorId, set[TensorId]] = {}
    for v, op in enumerate(graph.ops):
        for p in op.mutates:
            if graph.tensors[p].category is Category.PARAMETER:
                found.setdefault(p, set()).update(update_cone(graph, v, writers)[1])
    pairs = []
    for p in sorted(found):
        if len(found[p]) != 1:
            names = sorted(graph.tensors[g].name for g in found[p])
            raise GradientMismatch(
                f"cannot tell which gradient updates parameter {graph.tensors[p].name!r} (its update reads "
                f"{names or 'no gradient'}); pass the (parameter, gradient) pairs explicitly"
            )
        pairs.append((p, next(iter(found[p]))))
    return pairs


def assign_buckets(
    sizes_bytes: Sequence[int], bucket_cap_bytes: int, first_bucket_cap_bytes: int | None = None
) -> list[list[int]]:
    """DDP's bucket assignment (``compute_bucket_assignment_by_size``, one dtype): fill buckets
    in the given order, closing one as soon as its size reaches its limit; the first limit is
    ``first_bucket_cap_bytes`` when given, every later one ``bucket_cap_bytes``."""
    if bucket_cap_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_cap_bytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, size in enumerate(sizes_bytes):
        current.append(i)
        filled += size
        limit = first_bucket_cap_bytes if first_bucket_cap_bytes is not None and not buckets else bucket_cap_bytes
        if filled >= limit:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


def ddp_buckets(
    graph: Graph,
    bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
    first_bucket_cap_bytes: int | None = None,
    pairs: Sequence[tuple[int, int]] | None = None,
) -> list[Bucket]:
    """The buckets DDP makes for ``graph``: ``(parameter, gradient)`` ``pairs`` (default
    :func:`gradient_parameters`) in reverse parameter order, cut by :func:`assign_buckets`.

    DDP's first iteration puts every gradient in one bucket, and from the second on rebuilds
    its buckets in the order gradients became ready with a first bucket of 1 MiB
    (:data:`DEFAULT_FIRST_BUCKET_BYTES`); pass ``first_bucket_cap_bytes`` for that."""
    pairs = list(gradient_parameters(graph) if pairs is None else pairs)[::-1]
    sizes = [graph.tensors[g].size_bytes for _, g in pairs]
    result = []
    for k, members in enumerate(assign_buckets(sizes, bucket_cap_bytes, first_bucket_cap_bytes)):
        params = tuple(TensorId(pairs[i][0]) for i in members)
        grads = tuple(TensorId(pairs[i][1]) for i in members)
        result.append(Bucket(k, params, grads, sum(sizes[i] for i in members)))
    return result


class _Editor:
    """Appends ops and tensors to a copy of a graph and adds inputs/outputs to its ops."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.ops = list(graph.ops)
        self.tensors = list(graph.tensors)
        self.names = {t.name for t in graph.tensors}
        self.priority = [float(v) for v in range(len(graph.ops))]

    def control(self, name: str) -> TensorId:
        while name in self.names:
            name += "'"
        self.names.add(name)
        self.tensors.append(Tensor(name, 0, Category.CONTROL))
        return TensorId(len(self.tensors) - 1)

    def add_input(self, v: int, t: TensorId) -> None:
        self.ops[v] = dataclasses.replace(self.ops[v], inputs=(*self.ops[v].inputs, t))

    def add_output(self, v: int, t: TensorId) -> None:
        self.ops[v] = dataclasses.replace(self.ops[v], outputs=(*self.ops[v].outputs, t))

    def append(self, op: Op, priority: float) -> OpId:
        self.ops.append(op)
        self.priority.append(priority)
        return OpId(len(self.ops) - 1)


def _post_reduction_readers(graph: Graph, reach: Reachability, cones: set[int]) -> set[int]:
    """Ops of an update cone, gradient releases, and their descendants read reduced gradients."""
    desc = 0
    for v in cones:
        desc |= reach.descendants[v] | (1 << v)
    return {v for v in range(len(graph.ops)) if (desc >> v) & 1 or graph.ops[v].kind == RELEASE_KIND}


def add_gradient_buckets(
    graph: Graph,
    buckets: Sequence[Bucket],
    *,
    comm_stream: int = COMM_STREAM,
    compute_stream: int = 0,
    waits_after_backward: bool = False,
) -> Graph:
    """``graph`` with an asynchronous all-reduce per bucket on ``comm_stream`` and its wait on
    ``compute_stream`` (module docstring); ops listed in a topological order that puts each
    all-reduce right after its last gradient is ready and each wait right before the first
    reader of a reduced gradient.

    A reordering may move a wait up to just after its all-reduce, which then stalls the
    compute stream; ``waits_after_backward`` pins every wait after the last gradient of the
    step is ready, as DDP waits for all buckets at the end of the backward (the optimizer can
    then update no parameter before the backward ends). Raises :class:`CycleError` if a
    gradient is read before its reduction by an op that itself needs a reduced gradient."""
    reach = Reachability.of(graph)
    writers = _writers(graph)
    cones: set[int] = set()
    for v, op in enumerate(graph.ops):
        if any(graph.tensors[p].category is Category.PARAMETER for p in op.mutates):
            cones |= update_cone(graph, v, writers)[0]
    post_all = _post_reduction_readers(graph, reach, cones)
    ed = _Editor(graph)
    groups = [list(g) for g in graph.meta.get(CONTIGUOUS_KEY, [])]  # type: ignore[union-attr]
    described = []
    plans = []
    for bucket in buckets:
        readers = {c for g in bucket.gradients for c in graph.consumers[g]}
        pre = sorted(readers - post_all)
        plans.append(
            (bucket, sorted(readers & post_all), pre, max([*(graph.producer[g] for g in bucket.gradients), *pre]))
        )
    backward_done: tuple[TensorId, ...] = ()
    if waits_after_backward and plans:
        last = max(ready_at for *_, ready_at in plans)
        backward_done = (ed.control(f"{graph.ops[last].name}->waits"),)
        ed.add_output(last, backward_done[0])
    for bucket, post, pre, ready_at in plans:
        name = f"bucket{bucket.index}"
        tokens = []
        for r in pre:
            token = ed.control(f"{graph.ops[r].name}->all_reduce:{name}")
            ed.add_output(r, token)
            tokens.append(token)
        work, ready = ed.control(f"{name}.work"), ed.control(f"{name}.ready")
        all_reduce = Op(
            f"all_reduce:{name}",
            ALL_REDUCE_KIND,
            (*bucket.gradients, *tokens),
            (work,),
            comm_stream,
            tuple(bucket.gradients),
        )
        ed.append(all_reduce, ready_at + 0.5)
        first_use = min(post, default=len(graph.ops))
        ed.append(
            Op(f"wait:{name}", WAIT_KIND, (work, *backward_done), (ready,), compute_stream),
            max(first_use - 0.5, ready_at + 0.6),
        )
        for r in post:
            ed.add_input(r, ready)
        groups.append([graph.tensors[g].name for g in bucket.gradients])
        described.append(
            {
                "name": name,
                "all_reduce": all_reduce.name,
                "wait": f"wait:{name}",
                "size_bytes": bucket.size_bytes,
                "parameters": [graph.tensors[p].name for p in bucket.parameters],
                "gradients": [graph.tensors[g].name for g in bucket.gradients],
            }
        )
    meta = {**graph.meta, CONTIGUOUS_KEY: groups, "buckets": described}
    edited = Graph(tuple(ed.ops), tuple(ed.tensors), graph.name, meta)
    try:
        listing = topological_order(edited, ed.priority)
    except CycleError:
        raise CycleError(
            "a gradient is read before its all-reduce by an op that needs a reduced gradient; "
            "add the buckets before enforcing early weight updates"
        ) from None
    return Graph(tuple(edited.ops[v] for v in listing), edited.tensors, edited.name, meta)


def data_parallel_step(
    graph: Graph,
    bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
    first_bucket_cap_bytes: int | None = None,
    pairs: Sequence[tuple[int, int]] | None = None,
    comm_stream: int = COMM_STREAM,
    waits_after_backward: bool = False,
) -> Graph:
    """One rank's data-parallel training step: :func:`ddp_buckets` then :func:`add_gradient_buckets`."""
    buckets = ddp_buckets(graph, bucket_cap_bytes, first_bucket_cap_bytes, pairs)
    stepped = add_gradient_buckets(graph, buckets, comm_stream=comm_stream, waits_after_backward=waits_after_backward)
    stepped.meta["bucket_cap_bytes"] = bucket_cap_bytes
    return stepped
