"""Rematerialisation: lowering, the sequence estimator, baselines and Checkmate's MILP."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.errors import InfeasibleBudget
from memplan.graph.analysis import topological_order
from memplan.graph.generate import random_dag
from memplan.graph.ir import Category, Graph, Op, Tensor, TensorId
from memplan.graph.liveness import peak_bytes
from memplan.remat import STRATEGIES, RematProblem, rematerialize
from memplan.remat.coarsen import build_solver_graph, identity
from memplan.remat.lower import InvalidPlan, lower, sequence_peak_bytes, steps_for_order, validate_sequence
from memplan.remat.maxbatch import largest_fitting, max_batches, within_overhead
from memplan.remat.problem import base_kind, memory_floor, recompute_skips_mutation, rerun_limits, run_cost


def fwd_bwd_chain(sizes: list[int], flops: list[int]) -> Graph:
    """f0..f{n-1} forward, a loss, then b{n-1}..b1 reading the gradient and x{i-1}."""
    n = len(sizes)
    tensors = [Tensor(f"x{i}", sizes[i]) for i in range(n)]
    tensors.append(Tensor("loss", 1, Category.OUTPUT))
    tensors += [Tensor(f"g{i}", sizes[i - 1]) for i in range(n - 1, 0, -1)]
    index = {t.name: TensorId(i) for i, t in enumerate(tensors)}
    ops = [Op("f0", "mm", (), (index["x0"],), flops=flops[0])]
    ops += [Op(f"f{i}", "mm", (index[f"x{i - 1}"],), (index[f"x{i}"],), flops=flops[i]) for i in range(1, n)]
    ops.append(Op("loss", "sum", (index[f"x{n - 1}"],), (index["loss"],), flops=1))
    grad = "loss"
    for i in range(n - 1, 0, -1):
        ops.append(Op(f"b{i}", "mm_backward", (index[grad], index[f"x{i - 1}"]), (index[f"g{i}"],), flops=2 * flops[i]))
        grad = f"g{i}"
    return Graph(tuple(ops), tuple(tensors), "chain")


def test_lowering_raises_on_a_read_of_a_tensor_that_is_not_live() -> None:
    graph = fwd_bwd_chain([4, 4, 4], [1, 1, 1])
    problem = RematProblem(graph, 10**6)
    swapped = [(1,), (0,), *[(v,) for v in range(2, len(graph.ops))]]
    sg = build_solver_graph(problem, swapped, rerun_limits(graph), None)
    with pytest.raises(InvalidPlan, match="not live"):
        lower(sg, [[t] for t in range(sg.size)])


def test_lowering_rejects_a_rerun_of_a_run_once_node() -> None:
    graph = fwd_bwd_chain([4, 4, 4], [1, 1, 1])
    sg = identity(RematProblem(graph, 10**6))
    rows = [[t] for t in range(sg.size)]
    rows[3] = [3]
    rows[4] = [0, 4]  # f0 is pure: allowed
    lower(sg, rows)
    rows[4] = [4, 4 + 1]  # a node from the future
    with pytest.raises(InvalidPlan):
        lower(sg, rows)


def test_validate_sequence_catches_a_read_after_free() -> None:
    graph = fwd_bwd_chain([4, 4, 4], [1, 1, 1])
    steps = steps_for_order(graph, graph.program_order())
    validate_sequence(graph, steps)
    bad = list(steps)
    bad.insert(1, ("free", 0))  # x0 freed before f1 reads it
    with pytest.raises(InvalidPlan, match="not live"):
        validate_sequence(graph, bad)
    with pytest.raises(InvalidPlan, match="never runs"):
        validate_sequence(graph, steps[: steps.index(("run", len(graph.ops) - 1))])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), num_ops=st.integers(1, 30), order_seed=st.integers(0, 10**6))
def test_sequence_estimator_equals_liveness_on_plain_orders(seed: int, num_ops: int, order_seed: int) -> None:
    graph = random_dag(seed, num_ops)
    rng = random.Random(order_seed)
    order = topological_order(graph, [rng.random() for _ in graph.ops])
    steps = steps_for_order(graph, order)
    validate_sequence(graph, steps)
    assert sequence_peak_bytes(graph, steps) == peak_bytes(graph, order)


def _fast(problem: RematProblem) -> RematProblem:
    return RematProblem(problem.graph, problem.budget_bytes, problem.cost, time_limit_seconds=3.0, workers=1)


@pytest.mark.parametrize("seed", [3, 7, 11])
def test_every_strategy_is_valid_and_checkmate_is_never_worse(seed: int) -> None:
    graph = random_dag(seed, 14, output_fraction=0.0)
    graph = _with_flops(graph, seed)
    top = STRATEGIES["checkpoint-all"](RematProblem(graph, 10**9)).peak_bytes
    for fraction in (1.0, 0.85, 0.7):
        problem = _fast(RematProblem(graph, int(top * fraction)))
        plans = {name: solve(problem) for name, solve in STRATEGIES.items()}
        for name, plan in plans.items():
            if plan.steps:
                validate_sequence(graph, plan.steps)
                assert plan.peak_bytes == sequence_peak_bytes(graph, plan.steps), name
                assert plan.compute_cost == run_cost(problem.cost, plan.steps)
        feasible = [p for p in plans.values() if p.feasible]
        if feasible:
            assert plans["checkmate"].feasible
            assert plans["checkmate"].compute_cost <= min(p.compute_cost for p in feasible)
            assert plans["checkmate"].peak_bytes <= problem.budget_bytes


def _with_flops(graph: Graph, seed: int) -> Graph:
    rng = random.Random(seed)
    ops = tuple(Op(o.name, o.kind, o.inputs, o.outputs, o.stream, o.mutates, rng.randint(1, 9)) for o in graph.ops)
    return Graph(ops, graph.tensors, graph.name)


def _brute_force_cost(graph: Graph, budget_bytes: int, workspace: tuple[int, ...] = ()) -> float | None:
    """The cheapest plan over every R (identity solver graph), by enumeration."""
    problem = RematProblem(graph, budget_bytes, workspace=workspace)
    sg = identity(problem)
    cells = [(t, i) for t in range(sg.size) for i in range(t) if sg.may_run(t, i)]
    best = None
    for bits in itertools.product((0, 1), repeat=len(cells)):
        rows = [[t] for t in range(sg.size)]
        for (t, i), bit in zip(cells, bits, strict=True):
            if bit:
                rows[t].append(i)
        try:
            steps = lower(sg, [sorted(r) for r in rows])
        except InvalidPlan:
            continue
        if sequence_peak_bytes(graph, steps, workspace) <= budget_bytes:
            cost = run_cost(problem.cost, steps)
            best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("budget", [14, 15, 17, 30])  # checkpoint-all peaks at 17
def test_checkmate_is_exact_on_a_tiny_chain(budget: int) -> None:
    graph = fwd_bwd_chain([4, 6, 5], [3, 1, 2])  # 6 ops: f0 f1 f2 loss b2 b1
    expected = _brute_force_cost(graph, budget)
    problem = RematProblem(graph, budget, time_limit_seconds=5.0, workers=1)
    plan = STRATEGIES["checkmate"](problem)
    if expected is None:
        assert not plan.feasible
    else:
        assert plan.feasible
        assert plan.compute_cost == expected
        validate_sequence(graph, plan.steps)


def test_tiny_chain_needs_recomputation_below_the_checkpoint_all_peak() -> None:
    graph = fwd_bwd_chain([4, 6, 5], [3, 1, 2])
    top = STRATEGIES["checkpoint-all"](RematProblem(graph, 10**6)).peak_bytes
    cheap = _brute_force_cost(graph, top)
    tight = _brute_force_cost(graph, top - 2)
    assert cheap == sum(op.flops for op in graph.ops)
    assert tight is not None and tight > cheap


def test_infeasible_budget_raises() -> None:
    graph = fwd_bwd_chain([4, 6, 5], [3, 1, 2])
    with pytest.raises(InfeasibleBudget):
        rematerialize(graph, 3, "checkmate", time_limit_seconds=2.0, workers=1)
    with pytest.raises(InfeasibleBudget):
        rematerialize(graph, 3, "linearized-greedy")


def bn_relu_graph(
    pre_mutation_reader: bool = False,
    bn_writes: Category = Category.BUFFER,
    bn_kind: str = "aten.native_batch_norm.default",
) -> Graph:
    """conv -> batch norm (writes its running mean) -> relu_ (rewrites the BN output) -> f ->
    loss -> a backward reading the rectified output, another reading the conv output."""
    tensors = [
        Tensor("x", 64, Category.INPUT, True),
        Tensor("w", 16, Category.PARAMETER, True),
        Tensor("running_mean", 8, bn_writes, True),
        Tensor("c", 64),
        Tensor("bn", 64),
        Tensor("relu_.alias", 0, Category.CONTROL),
        Tensor("relu_.ctl", 0, Category.CONTROL),
        Tensor("y", 32),
        Tensor("loss", 4, Category.OUTPUT),
        Tensor("g", 64),
        Tensor("g2", 64),
        Tensor("peek", 4),
    ]
    x, w, rm, c, bn, alias, ctl, y, loss, g, g2, peek = (TensorId(i) for i in range(len(tensors)))
    ops = [
        Op("x", "placeholder", (), (x,)),
        Op("w", "placeholder", (), (w,)),
        Op("rm", "placeholder", (), (rm,)),
        Op("conv", "aten.convolution.default", (x, w), (c,), flops=10),
        Op("bn", bn_kind, (c, rm), (bn,), mutates=(rm,), flops=3),
    ]
    if pre_mutation_reader:
        ops.append(Op("peek", "aten.sum.default", (bn,), (peek,), flops=1))
    ops += [
        Op("relu_", "aten.relu_.default", (bn,), (alias, ctl), mutates=(bn,), flops=1),
        Op("f", "aten.mm.default", (bn, alias, ctl, w), (y,), flops=10),
        Op("loss", "aten.sum.default", (y,), (loss,), flops=1),
        Op("gy", "aten.threshold_backward.default", (loss, bn, alias), (g,), flops=2),
        Op("gc", "aten.convolution_backward.default", (g, c), (g2,), flops=20),
    ]
    if not pre_mutation_reader:
        tensors.pop()
    return Graph(tuple(ops), tuple(tensors), "bn-relu")


# on a GPU, PyTorch's batch norm is cuDNN's (a ResNet-50 captured on an H100 has 53 of them)
@pytest.mark.parametrize("kind", ["aten.native_batch_norm.default", "aten.cudnn_batch_norm.default"])
def test_batch_norm_and_its_inplace_relu_may_be_recomputed(kind: str) -> None:
    graph = bn_relu_graph(bn_kind=kind)
    limits = rerun_limits(graph)
    bn, relu = graph.op_index["bn"], graph.op_index["relu_"]
    assert recompute_skips_mutation(graph, bn)
    assert limits[bn] > bn and limits[relu] > relu


@pytest.mark.parametrize("why", ["reader before the in-place write", "writes a parameter"])
def test_batch_norm_stays_run_once_when_its_recompute_would_differ(why: str) -> None:
    if why == "writes a parameter":
        graph = bn_relu_graph(bn_writes=Category.PARAMETER)
        assert not recompute_skips_mutation(graph, graph.op_index["bn"])
    else:
        graph = bn_relu_graph(pre_mutation_reader=True)
    limits = rerun_limits(graph)
    bn, relu = graph.op_index["bn"], graph.op_index["relu_"]
    assert limits[bn] == bn and limits[relu] == relu


def test_lowering_reruns_the_inplace_follower_once_after_each_recompute() -> None:
    graph = bn_relu_graph()
    sg = identity(RematProblem(graph, 10**6))
    bn, relu, gy = graph.op_index["bn"], graph.op_index["relu_"], graph.op_index["gy"]
    rows = [[t] for t in range(sg.size)]
    rows[gy] = [bn, relu, gy]  # the decisions re-run relu_ too: the lowering must not apply it twice here
    steps = lower(sg, rows)
    validate_sequence(graph, steps)
    runs = [i for kind, i in steps if kind == "run"]
    assert runs.count(bn) == 2 and runs.count(relu) == 2
    second_bn = len(runs) - 1 - runs[::-1].index(bn)
    assert runs[second_bn + 1 :].index(relu) < runs[second_bn + 1 :].index(gy)
    bn_out = graph.tensor_index["bn"]
    between = steps[steps.index(("run", graph.op_index["f"])) : steps.index(("run", gy))]
    assert ("free", bn_out) in between  # the recompute is what lets the BN output go


def test_validate_sequence_rejects_applying_an_inplace_op_twice() -> None:
    graph = bn_relu_graph()
    relu = graph.op_index["relu_"]
    steps = steps_for_order(graph, range(len(graph.ops)))
    twice = list(steps)
    twice.insert(twice.index(("run", relu)) + 1, ("run", relu))
    with pytest.raises(InvalidPlan, match="mutated"):
        validate_sequence(graph, twice)


def named_tensors(spec: list[tuple[str, int, Category, bool]]) -> tuple[tuple[Tensor, ...], dict[str, TensorId]]:
    """Tensors from ``(name, bytes, category, persistent)`` rows, and their ids by name."""
    tensors = tuple(Tensor(name, size, category, persistent) for name, size, category, persistent in spec)
    return tensors, {tensor.name: TensorId(i) for i, tensor in enumerate(tensors)}


def residual_graph() -> Graph:
    """A ResNet block's tail: ``add_`` rewrites the main branch's batch norm ``b1`` in place and
    reads the shortcut's ``b2`` (made after ``b1``, so the coarsening would put ``add_`` in its
    group), then a forward long enough that dropping the ReLU output pays."""
    sizes = [
        ("x", 8, Category.INPUT, True),
        ("w", 4, Category.PARAMETER, True),
        ("rm1", 4, Category.BUFFER, True),
        ("rm2", 4, Category.BUFFER, True),
        ("c1", 64, Category.ACTIVATION, False),
        ("b1", 64, Category.ACTIVATION, False),
        ("c2", 64, Category.ACTIVATION, False),
        ("b2", 64, Category.ACTIVATION, False),
        ("add_.alias", 0, Category.CONTROL, False),
        ("add_.ctl", 0, Category.CONTROL, False),
        ("r", 64, Category.ACTIVATION, False),
        ("y1", 128, Category.ACTIVATION, False),
        ("y", 16, Category.ACTIVATION, False),
        ("loss", 4, Category.OUTPUT, False),
        ("gy1", 128, Category.ACTIVATION, False),
        ("g", 64, Category.ACTIVATION, False),
        ("g1", 64, Category.ACTIVATION, False),
        ("g2", 64, Category.ACTIVATION, False),
    ]
    tensors, t = named_tensors(sizes)
    ops = [Op(name, "placeholder", (), (t[name],)) for name in ("x", "w", "rm1", "rm2")]
    ops += [
        Op("conv1", "aten.convolution.default", (t["x"], t["w"]), (t["c1"],), flops=10),
        Op("bn1", "aten.native_batch_norm.default", (t["c1"], t["rm1"]), (t["b1"],), mutates=(t["rm1"],), flops=3),
        Op("conv2", "aten.convolution.default", (t["x"], t["w"]), (t["c2"],), flops=10),
        Op("bn2", "aten.native_batch_norm.default", (t["c2"], t["rm2"]), (t["b2"],), mutates=(t["rm2"],), flops=3),
        Op("add_", "aten.add_.Tensor", (t["b1"], t["b2"]), (t["add_.alias"], t["add_.ctl"]), mutates=(t["b1"],)),
        Op("relu", "aten.relu.default", (t["b1"], t["add_.alias"], t["add_.ctl"]), (t["r"],), flops=1),
        Op("f1", "aten.mm.default", (t["r"], t["w"]), (t["y1"],), flops=10),
        Op("f2", "aten.mm.default", (t["y1"],), (t["y"],), flops=10),
        Op("loss", "aten.sum.default", (t["y"],), (t["loss"],), flops=1),
        Op("gf2", "aten.mm.default", (t["loss"], t["y1"]), (t["gy1"],), flops=10),
        Op("gy", "aten.threshold_backward.default", (t["gy1"], t["r"]), (t["g"],), flops=2),
        Op("gc1", "aten.convolution_backward.default", (t["g"], t["c1"]), (t["g1"],), flops=20),
        Op("gc2", "aten.convolution_backward.default", (t["g"], t["c2"]), (t["g2"],), flops=20),
    ]
    return Graph(tuple(ops), tensors, "residual")


def test_a_reapplied_residual_add_reads_the_recomputed_shortcut() -> None:
    """The decisions re-run both batch norms and the ReLU before ``gy``; nothing but the
    re-applied ``add_`` reads the shortcut's new ``b2``. The lowering must keep that recompute
    (it used to drop it as unread, and the re-applied ``add_`` then read the first ``b2``,
    kept alive from the forward to the backward: a peak no solver had planned)."""
    graph = residual_graph()
    sg = identity(RematProblem(graph, 10**6))
    op = graph.op_index
    rows = [[t] for t in range(sg.size)]
    rows[op["gy"]] = sorted([op["bn1"], op["bn2"], op["add_"], op["relu"], op["gy"]])
    steps = lower(sg, rows)
    validate_sequence(graph, steps)
    runs = [i for kind, i in steps if kind == "run"]
    assert runs.count(op["bn2"]) == 2 and runs.count(op["add_"]) == 2
    b2 = graph.tensor_index["b2"]
    first_free = steps.index(("free", b2))
    assert first_free < steps.index(("run", op["relu"]))  # the first b2 goes right after the first add_


def view_graph() -> Graph:
    """``detach`` makes a 0-byte view of a ReLU output that only the backward reads."""
    tensors = (
        Tensor("x", 8, Category.INPUT, True),
        Tensor("r", 64),
        Tensor("r.alias", 0, Category.CONTROL),
        Tensor("y1", 128),
        Tensor("y", 16),
        Tensor("loss", 4, Category.OUTPUT),
        Tensor("gy1", 128),
        Tensor("g", 64),
    )
    t = {tensor.name: TensorId(i) for i, tensor in enumerate(tensors)}
    ops = (
        Op("x", "placeholder", (), (t["x"],)),
        Op("relu", "aten.relu.default", (t["x"],), (t["r"],), flops=1),
        Op("detach", "aten.detach.default", (t["r"],), (t["r.alias"],)),
        Op("f1", "aten.mm.default", (t["r"],), (t["y1"],), flops=10),
        Op("f2", "aten.mm.default", (t["y1"],), (t["y"],), flops=10),
        Op("loss", "aten.sum.default", (t["y"],), (t["loss"],), flops=1),
        Op("gf2", "aten.mm.default", (t["loss"], t["y1"]), (t["gy1"],), flops=10),
        Op("gy", "aten.threshold_backward.default", (t["gy1"], t["r"], t["r.alias"]), (t["g"],), flops=2),
    )
    return Graph(ops, tensors, "view")


def test_a_view_read_only_after_its_base_is_recomputed_keeps_its_first_run() -> None:
    """``detach`` makes a 0-byte view of ``r``; ``r`` is recomputed before the only reader of the
    view, so the lowering re-makes the view there and nobody reads the first one. The first
    run must stay (the re-made one is the lowering's, made again each round; dropping both
    left the reader with a view never made: U-Net at 0.6 under Checkmate's MILP)."""
    graph = view_graph()
    sg = identity(RematProblem(graph, 10**6))
    rows = [[k] for k in range(sg.size)]
    rows[graph.op_index["gy"]] = sorted([graph.op_index["relu"], graph.op_index["gy"]])
    steps = lower(sg, rows)
    validate_sequence(graph, steps)
    runs = [i for kind, i in steps if kind == "run"]
    assert runs.count(graph.op_index["detach"]) == 2 and runs.count(graph.op_index["relu"]) == 2


def chain_graph(intermediate_reader: bool = False) -> Graph:
    """GELU's tail as the capture writes it over dying inputs (Chen et al. 4.1): ``pow`` makes
    ``p``; ``mul.out``, ``add.out`` and ``tanh.out`` write into ``p`` one after the other, each
    reading the handle of the one before; the forward and the backward read the final value.
    ``intermediate_reader``: a ``peek`` reads ``p`` after the first write only (a value a re-run
    of the whole chain would overwrite)."""
    names = [
        ("x", 8, Category.INPUT, True),
        ("w", 4, Category.PARAMETER, True),
        ("a", 64, Category.ACTIVATION, False),
        ("p", 64, Category.ACTIVATION, False),
        ("h1", 0, Category.CONTROL, False),
        ("h2", 0, Category.CONTROL, False),
        ("h3", 0, Category.CONTROL, False),
        ("y", 64, Category.ACTIVATION, False),
        ("big", 128, Category.ACTIVATION, False),
        ("loss", 4, Category.OUTPUT, False),
        ("gbig", 128, Category.ACTIVATION, False),
        ("gt", 64, Category.ACTIVATION, False),
        ("ga", 64, Category.ACTIVATION, False),
        ("peek", 4, Category.ACTIVATION, False),
    ]
    tensors, t = named_tensors(names)
    ops = [Op(name, "placeholder", (), (t[name],)) for name in ("x", "w")]
    ops += [
        Op("mm", "aten.mm.default", (t["x"], t["w"]), (t["a"],), flops=10),
        Op("pow", "aten.pow.Tensor_Scalar", (t["a"],), (t["p"],), flops=1),
        Op("mul.out", "aten.mul.out", (t["p"],), (t["h1"],), mutates=(t["p"],), flops=1),
        Op("add.out", "aten.add.out", (t["a"], t["p"], t["h1"]), (t["h2"],), mutates=(t["p"],), flops=1),
    ]
    if intermediate_reader:
        ops.append(Op("peek", "aten.sum.default", (t["p"], t["h2"]), (t["peek"],), flops=1))
    ops += [
        Op("tanh.out", "aten.tanh.out", (t["p"], t["h2"]), (t["h3"],), mutates=(t["p"],), flops=1),
        Op("y", "aten.mul.Tensor", (t["a"], t["p"], t["h3"]), (t["y"],), flops=1),
        Op("f", "aten.mm.default", (t["y"], t["w"]), (t["big"],), flops=10),
        Op("loss", "aten.sum.default", (t["big"],), (t["loss"],), flops=1),
        Op("gf", "aten.mm.default", (t["loss"], t["big"]), (t["gbig"],), flops=10),
        Op("gt", "aten.tanh_backward.default", (t["gbig"], t["p"], t["h3"]), (t["gt"],), flops=2),
        Op("ga", "aten.mul.Tensor", (t["gt"], t["a"]), (t["ga"],), flops=2),
    ]
    if not intermediate_reader:
        tensors = tensors[:-1]
    return Graph(tuple(ops), tensors, "chain")


def test_an_inplace_chain_may_be_recomputed_with_its_producer() -> None:
    graph = chain_graph()
    limits, op = rerun_limits(graph), graph.op_index
    for name in ("pow", "mul.out", "add.out", "tanh.out"):
        assert limits[op[name]] > op[name], name
    sg = identity(RematProblem(graph, 10**6))
    rows = [[k] for k in range(sg.size)]
    rows[op["gt"]] = sorted([op["pow"], op["gt"]])  # re-make p for the backward: the lowering re-applies the chain
    steps = lower(sg, rows)
    validate_sequence(graph, steps)  # every re-run reads the versions its first run read
    runs = [i for kind, i in steps if kind == "run"]
    again = runs[len(runs) - 1 - runs[::-1].index(op["pow"]) :]
    links = [again.index(op[name]) for name in ("mul.out", "add.out", "tanh.out")]
    assert links == sorted(links) and links[-1] < again.index(op["gt"])
    assert all(runs.count(op[name]) == 2 for name in ("pow", "mul.out", "add.out", "tanh.out"))


def test_a_chain_with_a_reader_of_an_intermediate_value_runs_once() -> None:
    graph = chain_graph(intermediate_reader=True)
    limits, op = rerun_limits(graph), graph.op_index
    for name in ("pow", "mul.out", "add.out", "tanh.out"):
        assert limits[op[name]] == op[name], name


def test_the_cheapest_plan_recomputes_the_chain_below_the_run_once_floor() -> None:
    """Without the chain, ``p`` would stay resident from ``pow`` to ``gt``: the budget below is
    under that floor, and the exact solver's plan re-applies the chain and validates."""
    graph, fixed = chain_graph(), chain_graph(intermediate_reader=True)
    budget = sequence_peak_bytes(graph, steps_for_order(graph, range(len(graph.ops)))) - 64
    assert memory_floor(RematProblem(fixed, budget)).bytes > budget - 4  # p held there (peek's 4 B aside)
    plan = rematerialize(graph, budget, "checkmate", 20)
    assert plan.feasible and plan.peak_bytes <= budget
    validate_sequence(graph, plan.steps)
    runs = [i for kind, i in plan.steps if kind == "run"]
    assert runs.count(graph.op_index["pow"]) == 2 and runs.count(graph.op_index["tanh.out"]) == 2


@pytest.mark.parametrize("make", [bn_relu_graph, residual_graph, view_graph, chain_graph])
def test_every_decision_lowers_to_a_valid_sequence(make: object) -> None:
    """Random Checkmate ``R`` on graphs with views and in-place followers: the lowering never
    fails and its sequence passes the validator (the brute-force oracles skip decisions that
    fail to lower, so a lowering fault would hide plans from them)."""
    graph = make()  # type: ignore[operator]
    sg = identity(RematProblem(graph, 10**6))
    cells = [(t, k) for t in range(sg.size) for k in range(t) if sg.may_run(t, k)]
    rng = random.Random(0)
    for _ in range(300):
        rows = [[t] for t in range(sg.size)]
        for t, k in rng.sample(cells, rng.randint(0, min(8, len(cells)))):
            rows[t].append(k)
        steps = lower(sg, [sorted(r) for r in rows])
        validate_sequence(graph, steps)


def test_batch_norm_kinds() -> None:
    assert base_kind("aten.native_batch_norm.default") == "native_batch_norm"
    assert base_kind("aten::_native_batch_norm_legit") == "_native_batch_norm_legit"
    graph = bn_relu_graph()
    assert not recompute_skips_mutation(graph, graph.op_index["relu_"])  # mutates an activation, not a buffer


# --- per-op workspace (kernel scratch) -----------------------------------------------------


def test_workspace_counts_only_while_its_op_runs() -> None:
    graph = fwd_bwd_chain([4, 6, 5], [3, 1, 2])  # f0 f1 f2 loss b2 b1; checkpoint-all peaks at 17
    steps = steps_for_order(graph, graph.program_order())
    assert sequence_peak_bytes(graph, steps) == 17
    early = [0] * len(graph.ops)
    early[0] = 5  # f0 runs with only x0 (4 B) live: 9 < 17
    assert sequence_peak_bytes(graph, steps, early) == 17
    early[0] = 20
    assert sequence_peak_bytes(graph, steps, early) == 24


@pytest.mark.parametrize(("budget", "scratch_op"), [(17, 4), (20, 4), (19, 5), (22, 1)])
def test_checkmate_is_exact_with_workspace(budget: int, scratch_op: int) -> None:
    graph = fwd_bwd_chain([4, 6, 5], [3, 1, 2])
    workspace = tuple(3 if v == scratch_op else 0 for v in range(len(graph.ops)))
    expected = _brute_force_cost(graph, budget, workspace)
    problem = RematProblem(graph, budget, time_limit_seconds=5.0, workers=1, workspace=workspace)
    plan = STRATEGIES["checkmate"](problem)
    assert plan.feasible == (expected is not None)
    if expected is not None:
        assert plan.compute_cost == expected
        assert plan.peak_bytes == sequence_peak_bytes(graph, plan.steps, workspace) <= budget


@pytest.mark.parametrize("seed", [3, 7])
def test_every_strategy_budgets_for_workspace(seed: int) -> None:
    graph = _with_flops(random_dag(seed, 14, output_fraction=0.0), seed)
    rng = random.Random(seed)
    biggest = max(t.size_bytes for t in graph.tensors)
    workspace = tuple(rng.choice([0, 0, biggest // 2, biggest]) for _ in graph.ops)
    plain = STRATEGIES["checkpoint-all"](RematProblem(graph, 10**9)).peak_bytes
    top = STRATEGIES["checkpoint-all"](RematProblem(graph, 10**9, workspace=workspace)).peak_bytes
    assert top >= plain
    for fraction in (1.0, 0.85):
        problem = RematProblem(graph, int(top * fraction), time_limit_seconds=3.0, workers=1, workspace=workspace)
        for name, solve in STRATEGIES.items():
            plan = solve(problem)
            if plan.steps:
                assert plan.peak_bytes == sequence_peak_bytes(graph, plan.steps, workspace), name
            if plan.feasible:
                assert plan.peak_bytes <= problem.budget_bytes, name


# --- the largest batch within a budget (Checkmate Figure 6) --------------------------------


@settings(max_examples=60, deadline=None)
@given(threshold=st.integers(0, 300), start=st.integers(1, 64), limit=st.integers(1, 400))
def test_largest_fitting_finds_the_threshold(threshold: int, start: int, limit: int) -> None:
    probed: list[int] = []

    def fits(batch: int) -> bool:
        probed.append(batch)
        return batch <= threshold

    assert largest_fitting(fits, start, limit) == min(threshold, limit)
    assert all(1 <= b <= limit for b in probed)
    assert len(probed) == len(set(probed))  # no batch probed twice


def test_largest_fitting_starts_above_a_known_fit() -> None:
    probed: list[int] = []
    assert largest_fitting(lambda b: probed.append(b) or b <= 50, start=1, known=40) == 50
    assert min(probed) > 40


def test_max_batches_on_a_chain_whose_activations_grow_with_the_batch() -> None:
    def problem_at(batch: int) -> RematProblem:
        graph = fwd_bwd_chain([4 * batch, 6 * batch, 5 * batch, 3 * batch], [3, 1, 2, 2])
        return RematProblem(graph, 17 * 8, time_limit_seconds=2.0, workers=1)

    results = max_batches(problem_at, ["checkpoint-all", "linearized-greedy", "checkmate"], limit=64)
    base = results["checkpoint-all"].batch
    assert base >= 1
    assert results["checkmate"].batch >= max(base, results["linearized-greedy"].batch)
    best = results["checkmate"]
    problem = problem_at(best.batch)
    assert best.plan is not None and within_overhead(problem, best.plan)
    assert not within_overhead(problem_at(best.batch + 1), STRATEGIES["checkmate"](problem_at(best.batch + 1)))


def test_forward_fraction_is_the_share_of_the_forward_cost() -> None:
    graph = fwd_bwd_chain([4, 6, 5], [3, 1, 2])  # forward 3 + 1 + 2 + loss 1, backward 2 * (2 + 1)
    assert RematProblem(graph, 10**6).forward_fraction == pytest.approx(7 / 13)
