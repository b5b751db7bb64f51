"""Operator reordering over the model zoo: program order vs memplan vs inductor's heuristics.

Every peak is memplan's estimator (``peak_bytes``) applied to the order each method returns.
Inductor's ``topological_sort_lpmf/bfs/dfs`` run on small adapter objects that expose our
graph as scheduler nodes and buffers; "inductor" is the best of them and program order, as
``reorder_for_peak_memory`` picks.

Regenerate: python bench/reorder.py --time-limit 60 --out bench/results/reorder.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from memplan.graph.ir import Category, Graph, OpId
from memplan.graph.liveness import peak_bytes
from memplan.schedule import optimize_order, validate_schedule


@dataclass
class Row:
    model: str
    batch: int
    optimizer: str
    num_ops: int
    program_bytes: int
    optimized_bytes: int
    inductor_bytes: int
    seconds: float
    status: str
    gap: float | None
    lower_bytes: int = 0

    @property
    def reduction(self) -> float:
        return 1 - self.optimized_bytes / self.program_bytes


# ----------------------------------------------------------------------------- inductor adapters


class _Dep:
    def __init__(self, name: str) -> None:
        self.name = name


class _Buffer:
    def __init__(self, name: str, size_bytes: int) -> None:
        from torch._inductor.memory import MemoryPlanningInfoForBuffer

        self.name = name
        self.mpi_buffer = MemoryPlanningInfoForBuffer(size_alloc=size_bytes, size_free=size_bytes)

    def get_name(self) -> str:
        return self.name


class _Node:
    def __init__(self, name: str, outputs: list[_Buffer], deps: set[str]) -> None:
        self.name = name
        self.outputs = outputs
        self.unmet_dependencies = {_Dep(d) for d in deps}

    def get_name(self) -> str:
        return self.name

    def get_outputs(self) -> list[_Buffer]:
        return self.outputs

    def get_buffer_names(self) -> list[str]:
        return [b.name for b in self.outputs]


def _adapt(graph: Graph) -> tuple[list[_Node], dict[str, _Buffer], set[str]]:
    """Scheduler nodes and buffers for ``graph``. Persistent tensors cost the same in every
    order, so their buffers have size 0 (inductor does not free graph inputs it cannot)."""
    from torch._inductor.memory import MemoryPlanningInfoForNode
    from torch.utils._ordered_set import OrderedSet

    buffers = {t.name: _Buffer(t.name, 0 if t.persistent else t.size_bytes) for t in graph.tensors}
    nodes = [
        _Node(op.name, [buffers[graph.tensors[t].name] for t in op.outputs], {graph.tensors[t].name for t in op.inputs})
        for op in graph.ops
    ]
    for t_id, tensor in enumerate(graph.tensors):
        succ = OrderedSet(nodes[c] for c in graph.consumers[t_id])
        buffers[tensor.name].mpi_buffer.succ_nodes = succ
        buffers[tensor.name].mpi_buffer.succ_nodes_for_ordering = OrderedSet(succ)
    for v, op in enumerate(graph.ops):
        nodes[v].mpi_node = MemoryPlanningInfoForNode(
            index=v,
            size=sum(buffers[graph.tensors[t].name].mpi_buffer.size_alloc for t in op.outputs),
            pred_buffers=OrderedSet(buffers[graph.tensors[t].name] for t in op.inputs),
            pred_nodes=OrderedSet(nodes[p] for p in graph.predecessors[v]),
            succ_nodes=OrderedSet(nodes[s] for s in graph.successors[v]),
        )
    outputs = {t.name for t in graph.tensors if t.category is Category.OUTPUT}
    return nodes, buffers, outputs


def inductor_orders(graph: Graph) -> dict[str, list[OpId]]:
    from torch._inductor import memory
    from torch.utils._ordered_set import OrderedSet

    nodes, buffers, outputs = _adapt(graph)
    index = {node.name: OpId(v) for v, node in enumerate(nodes)}
    result = {
        "lpmf": memory.topological_sort_lpmf(nodes, {}, buffers, OrderedSet(outputs)),
        "bfs": memory.topological_sort_bfs(nodes),
        "dfs": memory.topological_sort_dfs(nodes),
    }
    return {name: [index[n.name] for n in order] for name, order in result.items()}


def inductor_best_bytes(graph: Graph) -> int:
    orders = inductor_orders(graph)
    return min([peak_bytes(graph, graph.program_order())] + [peak_bytes(graph, o) for o in orders.values()])


# ----------------------------------------------------------------------------- the table


def run_one(model: str, batch: int, optimizer: str, time_limit_seconds: float) -> Row:
    from memplan.torch.zoo import capture_model

    graph = capture_model(model, batch_size=batch, mode="train", optimizer=optimizer).graph
    start = time.perf_counter()
    result = optimize_order(graph, time_limit_seconds=time_limit_seconds, workers=2)
    seconds = time.perf_counter() - start
    validate_schedule(graph, result)
    return Row(
        model,
        batch,
        optimizer,
        graph.num_ops,
        peak_bytes(graph, graph.program_order()),
        result.peak_bytes,
        inductor_best_bytes(graph),
        seconds,
        result.status,
        result.gap,
        result.lower_bound_bytes,
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def render(rows: list[Row], command: str) -> str:
    lines = [
        "# Operator reordering (OLLA lifetime optimisation) over the model zoo",
        "",
        "Training steps (forward + backward + optimizer step), peaks in MiB from memplan's estimator.",
        "`inductor` = best of program order and torch._inductor.memory's lpmf/bfs/dfs sorts on the same graph.",
        "`seconds` = wall time of `optimize_order` (portfolio, exact search over ideals, cut and ordering bounds,",
        "search again from the raised bound, CP-SAT; 2 workers).",
        "`bound` = the lower bound `optimize_order` proves for every order (status optimal when the peak meets it).",
        "",
        f"Regenerate: `{command}`",
        "",
        "| model | batch | optimizer | ops | program | optimised | bound | reduction | inductor | seconds | status "
        "| gap |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        gap = "-" if r.gap is None else f"{100 * r.gap:.1f}%"
        lines.append(
            f"| {r.model} | {r.batch} | {r.optimizer} | {r.num_ops} | {_mib(r.program_bytes)} | "
            f"{_mib(r.optimized_bytes)} | {_mib(r.lower_bytes)} | {100 * r.reduction:.1f}% | "
            f"{_mib(r.inductor_bytes)} | "
            f"{r.seconds:.1f} | {r.status} | {gap} |"
        )
    lines.append("")
    for batch in sorted({r.batch for r in rows}):
        sub = [r for r in rows if r.batch == batch]
        lines.append(
            f"- batch {batch}: mean reduction {100 * statistics.mean(r.reduction for r in sub):.1f}% over {len(sub)} "
            f"graphs; worse than inductor on {sum(r.optimized_bytes > r.inductor_bytes for r in sub)}"
        )
    times = [r.seconds for r in rows]
    lines.append(f"- solve seconds: median {statistics.median(times):.2f}, max {max(times):.1f}")
    lines.append(
        f"- status: {', '.join(f'{s} {sum(r.status == s for r in rows)}' for s in sorted({r.status for r in rows}))}"
    )
    at_bound = [r for r in rows if r.optimized_bytes <= r.lower_bytes]
    lines.append(f"- optimised peak = proven bound on {len(at_bound)}/{len(rows)} graphs")
    for r in rows:
        if r.optimized_bytes > r.lower_bytes:
            lines.append(
                f"  - {r.model} b{r.batch} {r.optimizer}: {_mib(r.optimized_bytes)} MiB, proven >= "
                f"{_mib(r.lower_bytes)} MiB ({100 * (r.gap or 0):.2f}% gap)"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from memplan.torch.zoo import list_models

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=None)
    parser.add_argument("--batches", nargs="*", type=int, default=[1, 32])
    parser.add_argument("--optimizers", nargs="*", default=["sgd", "adam"])
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/reorder.md"))
    args = parser.parse_args(argv)
    rows = []
    for model in args.models or list_models():
        for batch in args.batches:
            for optimizer in args.optimizers:
                try:
                    row = run_one(model, batch, optimizer, args.time_limit)
                except Exception as err:  # a capture failure must not hide the other rows
                    print(f"{model} b{batch} {optimizer}: FAILED {type(err).__name__}: {err}", file=sys.stderr)
                    continue
                rows.append(row)
                print(
                    f"{model} b{batch} {optimizer}: {row.num_ops} ops, {100 * row.reduction:.1f}% "
                    f"({row.status}, {row.seconds:.1f} s), inductor {_mib(row.inductor_bytes)} MiB",
                    flush=True,
                )
    command = "python bench/reorder.py " + " ".join(sys.argv[1:] if argv is None else argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(rows, command.strip()))
    print(f"wrote {args.out}\nregenerate with: {command.strip()}")


if __name__ == "__main__":
    main()
