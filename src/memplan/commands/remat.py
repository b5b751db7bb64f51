"""``memplan remat``: rematerialise a training step under a memory budget."""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from memplan.commands.console import Quiet, console, progress, set_quiet
from memplan.commands.options import BatchSize, JsonOut, OptimizerName, OptimizerOption, Source, write_json
from memplan.errors import MemplanError
from memplan.report.format import format_bytes
from memplan.sources import load_source

Budget = Annotated[str, typer.Option("--budget", help="Bytes (e.g. 2e9), or a fraction of the checkpoint-all peak.")]
StrategyOption = Annotated[
    str,
    typer.Option(
        "--strategy",
        help="portfolio (baselines, Moccasin's CP model and Checkmate's MILP; the best plan), checkmate (the MILP), "
        "moccasin (the CP model), a baseline name, or all.",
    ),
]
TimeLimit = Annotated[float, typer.Option("--time-limit", min=0.1, help="Time limit per solver and budget, seconds.")]
SweepOut = Annotated[Path | None, typer.Option("--sweep", help="Also sweep budgets and plot overhead to this PNG.")]
MaxBatch = Annotated[
    bool,
    typer.Option(
        "--max-batch", help="Also find each strategy's largest batch within the budget and one extra forward pass."
    ),
]


class SolverName(str, Enum):
    cp_sat = "cp-sat"
    highs = "highs"


SolverOption = Annotated[
    SolverName,
    typer.Option(
        "--solver",
        help="Checkmate's MILP backend for the plan at --budget: CP-SAT, or HiGHS (optional: pip install highspy); "
        "--sweep and --max-batch use CP-SAT.",
    ),
]


class CostModel(str, Enum):
    flops = "flops"
    profile = "profile"


CostOption = Annotated[
    CostModel,
    typer.Option("--cost", help="Op cost C_i: FLOPs, or seconds measured by running the step (profile)."),
]
WorkspaceFlag = Annotated[
    bool,
    typer.Option(
        "--workspace", help="Measure each op's kernel scratch by running the step, and plan for it while it runs."
    ),
]
ReorderFlag = Annotated[
    bool,
    typer.Option(
        "--reorder",
        help="Let the CP model (portfolio, moccasin) run an op first later than program order where that "
        "saves recomputation (joint recomputation and reordering).",
    ),
]
GapLimit = Annotated[
    float | None,
    typer.Option(
        "--gap-limit",
        min=0.0,
        max=1.0,
        help="Stop a solver once its plan is proven within this fraction of the step's compute (0.01 = 1%; "
        "0 = search until optimal or out of time). Default: 0.001 for portfolio and moccasin, 0 for checkmate.",
    ),
]
SacPolicyOut = Annotated[
    Path | None,
    typer.Option(
        "--sac-policy",
        help="Write the best plan as a selective-activation-checkpointing policy (JSON) for your own loop: "
        "memplan.torch.export.SACPolicy.load(FILE).apply(model, inputs).",
    ),
]
SacMeasure = Annotated[
    bool,
    typer.Option(
        "--sac-measure",
        help="Also train the model eagerly with the --sac-policy applied, and without; compare numerics and peaks.",
    ),
]
RunSteps = Annotated[
    int,
    typer.Option(
        "--run", min=0, help="Train K steps with the best feasible plan and eagerly; compare numerics and peak."
    ),
]


def parse_budget(text: str, top_bytes: int) -> int:
    """``0.6`` means 60% of the checkpoint-all peak; anything above 1 is bytes."""
    try:
        value = float(text)
    except ValueError:
        raise MemplanError(f"--budget {text!r} is neither bytes nor a fraction") from None
    if value <= 0:
        raise MemplanError(f"--budget must be positive, not {text}")
    return int(value * top_bytes) if value <= 1 else int(value)


def remat(
    source: Source,
    budget: Budget,
    batch_size: BatchSize = 1,
    optimizer: OptimizerOption = OptimizerName.sgd,
    strategy: StrategyOption = "portfolio",
    time_limit: TimeLimit = 60.0,
    json_path: JsonOut = None,
    sweep_png: SweepOut = None,
    max_batch_flag: MaxBatch = False,
    run_steps: RunSteps = 0,
    cost: CostOption = CostModel.flops,
    workspace: WorkspaceFlag = False,
    solver: SolverOption = SolverName.cp_sat,
    reorder: ReorderFlag = False,
    gap_limit: GapLimit = None,
    sac_policy: SacPolicyOut = None,
    sac_measure: SacMeasure = False,
    quiet: Quiet = False,
) -> None:
    """Recompute activations to fit a budget (a portfolio of Moccasin's CP model, Checkmate's MILP, baselines)."""
    began = time.perf_counter() - startup_seconds()
    from memplan.remat import STRATEGIES, memory_floor
    from memplan.remat.baselines import checkpoint_all
    from memplan.remat.milp import check_solver
    from memplan.remat.sweep import plot_sweep, sweep

    set_quiet(quiet)
    names = list(STRATEGIES) if strategy == "all" else [strategy]
    if any(n not in STRATEGIES for n in names):
        raise MemplanError(f"unknown strategy {strategy!r}; choose all or one of {', '.join(STRATEGIES)}")
    check_solver(solver.value)
    if sac_measure and sac_policy is None:
        raise MemplanError("--sac-measure applies the --sac-policy file: give --sac-policy FILE too")
    inputs = ProblemInputs(source, optimizer.value, cost.value, workspace, for_sac=sac_policy is not None)
    with progress(f"capturing {source}" + (" and measuring its ops" if cost.value == "profile" or workspace else "")):
        problem = inputs.problem(batch_size, 10**18, time_limit)
    graph = problem.graph
    top = checkpoint_all(problem).peak_bytes
    budget_bytes = parse_budget(budget, top)
    # each solver's time limit counts from the command's start (reading the graph is in it), leaving
    # the solvers at least half of it after a long capture
    seconds = max(0.5 * time_limit, time_limit - (time.perf_counter() - began))
    problem = problem.with_budget(budget_bytes).with_time_limit(seconds)
    with progress(f"solving {', '.join(names)} within {format_bytes(budget_bytes)}") as shown:
        plans = solve_plans(problem, names, solver.value, reorder, reporter(shown), gap_limit)
    floor = memory_floor(problem)
    report: dict[str, Any] = {
        "budget_bytes": budget_bytes,
        "solver": solver.value,
        "checkpoint_all_peak_bytes": top,
        "cost_model": cost.value,
        "workspace": workspace,
        "reorder": reorder,
        "gap_limit": gap_limit,
        "workspace_bytes_max": max(problem.workspace, default=0),
        "floor_bytes": floor.bytes,
        "strategies": {n: p.summary() for n, p in plans.items()},
    }
    out = console()
    print_plans(report, out)
    if sweep_png is not None:
        with progress("sweeping budgets", total=SWEEP_BUDGETS) as shown:
            report["sweep"] = sweep(
                graph,
                names,
                SWEEP_BUDGETS,
                time_limit_seconds=time_limit,
                cost=problem.cost,
                workspace=problem.workspace,
                progress=lambda budget, plans: shown.advance(label=f"swept {format_bytes(budget)}"),
            )
        plot_sweep(report["sweep"], sweep_png, title=str(graph.meta.get("model", graph.name)))
        out.print(f"wrote {sweep_png}")
    if max_batch_flag:
        with progress("finding the largest batch of each strategy"):
            report["max_batch"] = _max_batch(inputs, budget_bytes, time_limit, names)
        print_max_batch(report["max_batch"], out)
    if sac_policy is not None:
        report["sac_policy"] = _write_sac_policy(inputs, plans, sac_policy)
        out.print(
            f"wrote {sac_policy}: {report['sac_policy']['must_save']} of its "
            f"{report['sac_policy']['forward_ops']} forward ops saved, the rest recomputed"
        )
        if sac_measure:
            with progress("training eagerly with and without the SAC policy"):
                report["sac_measure"] = _measure_sac(source, batch_size, optimizer.value, plans, inputs)
            print_sac(report["sac_measure"], out)
    if run_steps:
        with progress(f"training {run_steps} steps with the plan and eagerly"):
            report["run"] = _run(source, batch_size, optimizer.value, plans, problem, run_steps)
        print_run(report["run"], out)
    write_json(json_path, report)


SWEEP_BUDGETS = 6


def startup_seconds() -> float:
    """How long this process ran before the command, when it is the ``memplan`` program (Python's
    start and the imports: seconds on a loaded machine, part of the time the user waits); 0
    elsewhere (under a test runner, or without Linux's /proc)."""
    import os
    import sys

    program = sys.argv[0].replace("\\", "/") if sys.argv else ""
    if not (program.endswith("/memplan") or program == "memplan" or program.endswith("memplan/cli.py")):
        return 0.0
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            started = int(stat.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
            now = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return min(max(0.0, now - started), 60.0)


def _best(plans: dict[str, Any]) -> Any:
    feasible = [p for p in plans.values() if p.feasible]
    if not feasible:
        raise MemplanError("no strategy has a plan within the budget: raise --budget")
    return min(feasible, key=lambda p: (p.compute_cost, p.peak_bytes))


def _write_sac_policy(inputs: ProblemInputs, plans: dict[str, Any], path: Path) -> dict[str, Any]:
    """The cheapest feasible plan as a SAC policy file."""
    from memplan.torch.export.sac import SACPolicy

    if inputs.capture is None:
        raise MemplanError("--sac-policy needs a zoo model (the policy names the ops of its forward), not a graph file")
    policy = SACPolicy.from_schedule(inputs.capture, _best(plans), model=inputs.source)
    policy.save(path)
    return {"path": str(path), **policy.summary()}


def _measure_sac(source: str, batch_size: int, optimizer: str, plans: dict[str, Any], inputs: Any) -> dict:
    from memplan.torch.export.sac_compare import compare_sac_with_eager

    best = _best(plans)
    return compare_sac_with_eager(
        source,
        batch_size,
        best.budget_bytes,
        best.strategy,
        optimizer_name=optimizer,
        capture=inputs.capture,
        schedule=best,
    )


def print_sac(run: dict[str, Any], out: Console) -> None:
    table = Table(title=f"{run['model']} b{run['batch_size']}: eager PyTorch with memplan's SAC policy")
    for column in ("planned peak", "eager + SAC peak", "SAC / plan", "eager peak", "max abs diff", "step s"):
        table.add_column(column)
    table.add_row(
        format_bytes(run["planned_peak_bytes"]),
        format_bytes(run["sac_peak_bytes"]),
        f"{run['sac_vs_plan']:.3f}",
        format_bytes(run["eager_peak_bytes"]),
        f"{run['max_abs_diff']:g}",
        f"{run['sac_step_seconds']:.2f} (eager {run['eager_step_seconds']:.2f})",
    )
    out.print(table)


def solve_plans(
    problem: Any,
    names: list[str],
    solver: str,
    reorder: bool = False,
    progress: Callable[[str], None] | None = None,
    gap_limit: float | None = None,
) -> dict[str, Any]:
    """Each strategy's plan (:func:`memplan.remat.sweep.solve_all`), each within the time limit;
    Checkmate's MILP with ``solver``, warm-started from the best baseline. ``progress(text)``
    hears which solver runs, and every few seconds how it stands; ``gap_limit``: every
    solver's (None: each its own default)."""
    from memplan.remat.sweep import solve_all

    return solve_all(problem, names, progress, reorder, gap_limit, solver)


LOG_TICK_SECONDS = 10.0
"""Where stderr is not a terminal, how a solve stands is written at most this often."""


def reporter(shown: Any) -> Callable[[str], None]:
    """Where the solvers' progress goes: the spinner's label on a terminal; to a log (stderr not
    a terminal), each stage's start as a line, and how the solve stands at most every
    :data:`LOG_TICK_SECONDS`; nowhere under ``--quiet``."""
    import sys

    from rich.markup import escape

    from memplan.commands.console import is_quiet
    from memplan.remat.deadline import is_tick

    if is_quiet():
        return lambda text: None
    if Console(stderr=True).is_terminal:
        return lambda text: shown.advance(0, label=escape(text))
    last = [-LOG_TICK_SECONDS]

    def write(text: str) -> None:
        now = time.perf_counter()
        if is_tick(text):
            if now - last[0] < LOG_TICK_SECONDS:
                return
            last[0] = now
        print(text, file=sys.stderr, flush=True)

    return write


class ProblemInputs:
    """How to build the remat problem of ``source`` at a batch: the captured graph, the cost
    model (FLOPs or profiled seconds) and, optionally, each op's measured workspace."""

    def __init__(self, source: str, optimizer: str, cost: str, workspace: bool, for_sac: bool = False) -> None:
        from memplan.sources import is_graph_file

        if (cost == "profile" or workspace) and is_graph_file(source):
            raise MemplanError("--cost profile and --workspace run the step: they need a zoo model, not a graph file")
        if for_sac and is_graph_file(source):
            raise MemplanError("--sac-policy needs a zoo model (the policy names its forward's ops), not a graph file")
        self.source, self.optimizer, self.cost, self.workspace = source, optimizer, cost, workspace
        self.for_sac = for_sac
        self.capture: Any = None  # the capture the last problem was built from, when one was made

    def problem(self, batch: int, budget_bytes: int, time_limit: float) -> Any:
        from memplan.remat.problem import RematProblem

        if self.for_sac:  # captured as it runs under checkpointing: the policy must name the same ops
            from memplan.torch.export.sac_compare import capture_for_sac

            self.capture = capture_for_sac(self.source, batch, self.optimizer)
            self.capture.graph.meta.update({"model": self.source, "batch_size": batch, "mode": "train"})
        if self.cost == "flops" and not self.workspace:
            if self.capture is not None:
                return RematProblem(self.capture.graph, budget_bytes, time_limit_seconds=time_limit)
            graph = load_source(self.source, batch_size=batch, mode="train", optimizer=self.optimizer)
            return RematProblem(graph, budget_bytes, time_limit_seconds=time_limit)
        from memplan.torch.run.profile import profile_model

        repeats = 3 if self.cost == "profile" else 0
        capture, profile = profile_model(
            self.source, batch, self.optimizer, repeats=repeats, workspace=self.workspace, capture=self.capture
        )
        self.capture = capture
        capture.graph.meta.update({"model": self.source, "batch_size": batch, "mode": "train"})
        costs = profile.costs() if self.cost == "profile" else ()
        scratch = profile.workspace_bytes if self.workspace else ()
        return RematProblem(capture.graph, budget_bytes, costs, time_limit, workspace=scratch)


def _run(source: str, batch_size: int, optimizer: str, plans: dict[str, Any], problem: Any, steps: int) -> dict:
    """Run the cheapest feasible plan for ``steps`` steps against eager PyTorch."""
    from memplan.sources import is_graph_file

    if is_graph_file(source):
        raise MemplanError("--run needs a zoo model to train, not a graph file")
    feasible = [p for p in plans.values() if p.feasible]
    if not feasible:
        raise MemplanError("--run: no strategy has a plan within the budget")
    best = min(feasible, key=lambda p: (p.compute_cost, p.peak_bytes))
    from memplan.torch.run.remat import compare_remat_with_eager

    return compare_remat_with_eager(
        source,
        batch_size,
        best.budget_bytes,
        best.strategy,
        steps,
        optimizer,
        schedule=best,
        expected_graph=problem.graph,
        workspace=problem.workspace,
    )


def print_run(run: dict[str, Any], console: Console) -> None:
    table = Table(title=f"{run['model']} b{run['batch_size']}: {run['steps']} steps with {run['strategy']} vs eager")
    for column in ("planned peak", "measured peak", "ratio", "eager peak", "overhead", "max abs diff", "step s"):
        table.add_column(column)
    table.add_row(
        format_bytes(run["planned_peak_bytes"]),
        format_bytes(run["measured_peak_bytes"]),
        f"{run['peak_ratio']:.3f}",
        format_bytes(run["eager_peak_bytes"]),
        f"{100 * run['overhead']:.1f}%",
        f"{run['max_abs_diff']:g}",
        f"{run['remat_step_seconds']:.2f} (eager {run['eager_step_seconds']:.2f})",
    )
    console.print(table)


def _max_batch(inputs: ProblemInputs, budget_bytes: int, time_limit: float, names: list[str]) -> dict:
    """Each strategy's largest batch within ``budget_bytes`` and one extra forward pass of
    overhead (Checkmate Figure 6); checkpoint-all (no remat) is always included."""
    from memplan.remat.maxbatch import max_batches
    from memplan.sources import is_graph_file

    if is_graph_file(inputs.source):
        raise MemplanError("--max-batch needs a zoo model to capture at other batch sizes, not a graph file")

    def problem_at(batch: int) -> Any:
        return inputs.problem(batch, budget_bytes, time_limit)

    strategies = list(dict.fromkeys(["checkpoint-all", *names]))
    results = max_batches(problem_at, strategies)
    return {
        "budget_bytes": budget_bytes,
        "overhead_limit": "one extra forward pass (the forward's share of the step's cost)",
        "strategies": {n: r.summary() for n, r in results.items()},
    }


def print_max_batch(result: dict[str, Any], console: Console) -> None:
    table = Table(title=f"largest batch within {format_bytes(result['budget_bytes'])}, <= 1 extra forward pass")
    for column in ("strategy", "batch", "overhead", "peak", "seconds"):
        table.add_column(column)
    for name, s in result["strategies"].items():
        overhead = f"{100 * s['overhead']:.2f}%" if s["overhead"] is not None else "-"
        peak = format_bytes(s["peak_bytes"]) if s["peak_bytes"] else "-"
        table.add_row(name, str(s["batch"]), overhead, peak, f"{s['seconds']:.1f}")
    console.print(table)


def print_plans(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"remat within {format_bytes(report['budget_bytes'])}")
    for column in ("strategy", "feasible", "peak", "overhead", "gap", "seconds", "status"):
        table.add_column(column)
    for name, s in report["strategies"].items():
        peak = format_bytes(s["peak_bytes"]) if s["peak_bytes"] else "-"
        overhead = f"{100 * s['overhead']:.2f}%" if s["feasible"] else "-"
        gap = f"{100 * s['gap']:.2f}%" if s.get("gap") is not None else "-"
        status = s["status"] + (f" ({s['from']})" if s.get("from") not in (None, name) else "")
        table.add_row(name, "yes" if s["feasible"] else "no", peak, overhead, gap, f"{s['seconds']:.2f}", status)
    console.print(table)
    for name, s in report["strategies"].items():
        if "nodes_before" in s and s.get("nodes_after") is not None:
            if s.get("coarsened"):
                console.print(
                    f"{name}: the whole graph has {s['nodes_before']} nodes, too many for the time limit; "
                    f"the CP model decided over {s['nodes_after']}"
                )
            else:
                console.print(f"{name}: solved on the whole graph ({s['nodes_before']} nodes)")
        if s.get("scope") and s.get("gap") is not None:
            console.print(f"{name}: gap relative to the bound for {s['scope']}")
        if s["message"] and (not s["feasible"] or "cut at" in s["message"]):
            console.print(s["message"], markup=False)
        for attempt in s.get("attempts") or ():  # a baseline the portfolio cut at its share of the time
            if "cut at" in str(attempt.get("message") or ""):
                console.print(f"{name}: {attempt['message']}", markup=False)


def register(app: typer.Typer) -> None:
    app.command()(remat)
