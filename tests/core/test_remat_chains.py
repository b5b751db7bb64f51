"""In-place chains under rematerialisation (memplan.remat.problem.inplace_chain): every plan the
lowering accepts computes what program order computes.

The oracle here is written apart from the lowering and its validator: a symbolic run of the step
sequence where every value is the term of the op and the values it read (an in-place link's term
replaces its storage's value). Each run of an op, first or re-run, must read exactly the values
that op read in program order, and the step's outputs must end as program order leaves them.
"""

from __future__ import annotations

import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.errors import InfeasibleBudget
from memplan.graph.ir import Category, Graph, Op, Tensor, TensorId
from memplan.remat import rematerialize
from memplan.remat.baselines import checkpoint_all
from memplan.remat.coarsen import identity
from memplan.remat.lower import InvalidPlan, lower, steps_for_order, validate_sequence
from memplan.remat.problem import RematProblem, Step, rerun_limits
from tests.core.test_remat import fwd_bwd_chain


def with_chain(
    graph: Graph, op_name: str, links: int, intermediate_reader: bool = False, preview: bool = False
) -> Graph:
    """``graph`` with ``links`` in-place ops writing, one after the other, over the output of
    ``op_name`` right after it (each reads the handle of the one before; every other reader of
    that output reads the last handle). ``intermediate_reader``: a reader of the first link's
    value only, inserted after it (the chain may then not be re-run). ``preview``: the first link
    writes through a view of the output taken before it (the capture's ``add.out`` over an
    ``_unsafe_view`` of the bmm output in GPT-2's attention)."""
    tensors = list(graph.tensors)
    v = graph.op_index[op_name]
    (t,) = graph.ops[v].outputs
    handles = []
    for k in range(links):
        tensors.append(Tensor(f"{op_name}.h{k}", 0, Category.CONTROL))
        handles.append(TensorId(len(tensors) - 1))
    chain = []
    if preview:
        tensors.append(Tensor(f"{op_name}.view", 0, Category.CONTROL))
        view = (TensorId(len(tensors) - 1),)
        chain.append(Op(f"{op_name}.preview", "aten._unsafe_view.default", (t,), view, flops=0))
    for k, h in enumerate(handles):
        before = (handles[k - 1],) if k else (view if preview else ())
        chain.append(Op(f"{op_name}.link{k}", "aten.mul.out", (t, *before), (h,), mutates=(t,), flops=1))
    if intermediate_reader:
        tensors.append(Tensor(f"{op_name}.peek", 1))
        peek = Op(f"{op_name}.peek", "aten.sum.default", (t, handles[0]), (TensorId(len(tensors) - 1),), flops=1)
        chain.insert(1, peek)
    later = [
        Op(
            o.name,
            o.kind,
            (*o.inputs, handles[-1]) if t in o.inputs else o.inputs,
            o.outputs,
            o.stream,
            o.mutates,
            o.flops,
        )
        for o in graph.ops[v + 1 :]
    ]
    return Graph((*graph.ops[: v + 1], *chain, *later), tuple(tensors), f"{graph.name}+chain")


def _storage(graph: Graph, t: int, mutated: dict[int, int]) -> int:
    """The storage a tensor's value lives in: a link's handle is the storage it wrote."""
    return mutated.get(t, t)


def symbolic_reads(graph: Graph, steps: list[Step]) -> tuple[dict[int, list[Any]], dict[int, Any]]:
    """Per op, the values each of its runs read; and the values of the step's outputs at the end.
    A 0-byte handle (a view, a link's result) points into the storage instances it was made
    from; a run reading one whose storage has been made again since is a stale view (an
    AssertionError): its values could equal program order's only by accident."""
    mutated = {h: op.mutates[0] for op in graph.ops if op.mutates for h in op.outputs}
    value: dict[int, Any] = {}
    reads: dict[int, list[Any]] = {}
    instance: dict[int, int] = {}  # storage -> how many times it was made
    points: dict[int, tuple[tuple[int, int], ...]] = {}  # 0-byte handle -> (storage, instance) it views

    def refs(t: int) -> tuple[tuple[int, int], ...]:
        if t in points:
            return points[t]
        storage = _storage(graph, t, mutated)
        return ((storage, instance.get(storage, 0)),)

    for kind, v in steps:
        if kind != "run":
            continue
        op = graph.ops[v]
        for t in op.inputs:
            stale = [s for s, k in points.get(t, ()) if instance.get(s, 0) != k]
            assert not stale, f"{op.name} reads {graph.tensors[t].name}, a view of a storage made again since"
        seen = tuple(value.get(_storage(graph, t, mutated)) for t in op.inputs)
        reads.setdefault(v, []).append(seen)
        for t in op.mutates:
            value[t] = ("write", op.name, seen)
        handle_of = tuple(r for t in (op.mutates or op.inputs) for r in refs(t))
        for k, t in enumerate(op.outputs):
            if t not in mutated:
                value[t] = ("made", op.name, k, seen)
                if graph.tensors[t].size_bytes:
                    instance[t] = instance.get(t, 0) + 1
            if not graph.tensors[t].size_bytes:
                points[t] = handle_of
    outputs = {t: value.get(t) for t, x in enumerate(graph.tensors) if x.category is Category.OUTPUT}
    return reads, outputs


def assert_computes_as_program_order(graph: Graph, steps: list[Step]) -> None:
    expected, outputs = symbolic_reads(graph, steps_for_order(graph, range(len(graph.ops))))
    got, got_outputs = symbolic_reads(graph, steps)
    for v, runs in got.items():
        assert all(r == expected[v][0] for r in runs), f"{graph.ops[v].name} reads other values than in program order"
    assert set(got) == set(expected) and got_outputs == outputs


def chained_step(seed: int, links: int, intermediate_reader: bool = False, preview: bool = False) -> Graph:
    rng = random.Random(seed)
    graph = fwd_bwd_chain([rng.randint(2, 9) for _ in range(4)], [rng.randint(1, 9) for _ in range(4)])
    return with_chain(graph, f"f{rng.randint(0, 2)}", links, intermediate_reader, preview)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), links=st.integers(1, 3), picks=st.integers(0, 10**6), preview=st.booleans())
def test_every_lowered_decision_recomputes_the_chain_exactly(seed: int, links: int, picks: int, preview: bool) -> None:
    graph = chained_step(seed, links, preview=preview)
    sg = identity(RematProblem(graph, 10**9))
    cells = [(t, k) for t in range(sg.size) for k in range(t) if sg.may_run(t, k)]
    rng = random.Random(picks)
    rows = [[t] for t in range(sg.size)]
    for t, k in rng.sample(cells, rng.randint(0, min(6, len(cells)))):
        rows[t].append(k)
    try:
        steps = lower(sg, [sorted(r) for r in rows])
    except InvalidPlan:
        return
    validate_sequence(graph, steps)
    assert_computes_as_program_order(graph, steps)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), links=st.integers(1, 3), fraction=st.floats(0.5, 0.95), preview=st.booleans())
def test_the_solvers_plans_over_a_chain_compute_as_program_order(
    seed: int, links: int, fraction: float, preview: bool
) -> None:
    graph = chained_step(seed, links, preview=preview)
    top = checkpoint_all(RematProblem(graph, 10**9)).peak_bytes
    for strategy in ("checkmate", "moccasin"):
        try:
            plan = rematerialize(graph, int(top * fraction), strategy, 5.0, workers=1)
        except InfeasibleBudget:  # no plan within the budget: nothing to check
            continue
        validate_sequence(graph, plan.steps)
        assert_computes_as_program_order(graph, plan.steps)


def test_the_oracle_catches_a_chain_reapplied_out_of_order() -> None:
    graph = chained_step(0, 2)
    steps = steps_for_order(graph, range(len(graph.ops)))
    links = [graph.op_index[o.name] for o in graph.ops if ".link" in o.name]
    swapped = [
        ("run", links[1]) if s == ("run", links[0]) else ("run", links[0]) if s == ("run", links[1]) else s
        for s in steps
    ]
    try:
        assert_computes_as_program_order(graph, swapped)
    except AssertionError:
        return
    raise AssertionError("the oracle let a chain run out of order")


def test_a_chain_with_a_reader_of_an_intermediate_value_is_run_once() -> None:
    graph = chained_step(1, 2, intermediate_reader=True)
    limits = rerun_limits(graph)
    producer = graph.producer[
        graph.ops[graph.op_index[next(o.name for o in graph.ops if ".link0" in o.name)]].mutates[0]
    ]
    assert limits[producer] == producer
    free = chained_step(1, 2)
    producer = free.producer[free.ops[free.op_index[next(o.name for o in free.ops if ".link0" in o.name)]].mutates[0]]
    assert rerun_limits(free)[producer] > producer


def test_a_view_taken_for_the_chain_keeps_it_recomputable_and_a_stale_view_is_caught() -> None:
    graph = chained_step(3, 2, preview=True)
    view = next(v for v, o in enumerate(graph.ops) if o.name.endswith(".preview"))
    (t,) = graph.ops[view].inputs
    producer = graph.producer[t]
    limits = rerun_limits(graph)
    assert limits[producer] > producer and limits[view] > view + 1
    # a re-run of the producer whose links re-apply through the old view: the oracle refuses it
    steps = steps_for_order(graph, range(len(graph.ops)))
    links = [v for v, o in enumerate(graph.ops) if ".link" in o.name]
    runs = [v for kind, v in steps if kind == "run"]
    stale = [*runs[: runs.index(links[-1]) + 1], producer, *links, *runs[runs.index(links[-1]) + 1 :]]
    try:
        symbolic_reads(graph, [("run", v) for v in stale])
    except AssertionError as err:
        assert "a view of a storage made again" in str(err)
    else:
        raise AssertionError("the oracle let a link write through a stale view")
