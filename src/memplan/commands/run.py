"""``memplan run``: train with the plan and with eager PyTorch, compare numbers, memory, time."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from memplan.commands.console import Quiet, console, progress, set_quiet
from memplan.commands.options import BatchSize, JsonOut, Mode, ModeOption, OptimizerName, OptimizerOption, write_json
from memplan.errors import MemplanError
from memplan.report.format import format_bytes


class Allocator(str, Enum):
    auto = "auto"
    replay = "replay"
    views = "views"


def print_plan(plan: dict[str, Any], console: Console) -> None:
    table = Table(title="the plan")
    table.add_column("")
    table.add_column("bytes", justify="right")
    table.add_column("how", justify="left")
    s, p = plan["schedule"], plan["placement"]
    table.add_row("peak in program order (eager)", format_bytes(plan["program_order_peak_bytes"]), "")
    table.add_row(
        "peak in the optimised order",
        format_bytes(plan["optimized_order_peak_bytes"]),
        f"{s['method']}, {s['status']}, {s['seconds']:.2f} s",
    )
    table.add_row("lower bound over all orders", format_bytes(plan["lower_bound_bytes"]), "")
    table.add_row(
        "arena (one block, static offsets)",
        format_bytes(plan["arena_bytes"]),
        f"{p['method']}, {p['status']}, fragmentation {100 * plan['fragmentation']:.2f}%",
    )
    console.print(table)


def print_run(report: dict[str, Any], console: Console) -> None:
    m, e = report["memplan"], report["eager"]
    table = Table(title=f"{report['model']}  batch {report['batch_size']}  {report['mode']}  {report['steps']} steps")
    table.add_column("")
    table.add_column("memplan", justify="right")
    table.add_column("eager PyTorch", justify="right")
    table.add_row("measured peak", format_bytes(m["peak_bytes"]), format_bytes(e["peak_bytes"]))
    table.add_row("step seconds (median)", f"{m['step_seconds']:.3f}", f"{e['step_seconds']:.3f}")
    table.add_row("planned peak (persistent + arena)", format_bytes(m["planned_peak_bytes"]), "")
    table.add_row("arena", format_bytes(m["arena_bytes"]), "")
    table.add_row("persistent (params, state, batch)", format_bytes(m["persistent_bytes"]), "")
    table.add_row("left to the allocator", format_bytes(m["fallback_bytes"]), "")
    if report.get("allocator") == "views":
        table.add_row("computed then copied into the arena", format_bytes(m["copied_bytes"]), "")
    console.print(table)
    if report.get("allocator") == "replay":
        console.print(
            f"planned allocator: {m['allocations']} allocations per step, {m['fallback_allocations']} not from the "
            f"arena; arena {m['arena_method']} (lower bound {format_bytes(m['arena_lower_bound_bytes'])})"
        )
    verdict = "identical" if report["max_abs_diff"] == 0.0 else f"DIFFER by up to {report['max_abs_diff']:.3g}"
    console.print(f"loss and parameters after every step: {verdict} (max abs diff {report['max_abs_diff']})")


def print_budget(report: dict[str, Any], console: Console) -> None:
    """The budget's lines of ``memplan run --budget``: measured peak against the budget, the
    planned compute overhead and the measured step time against eager."""
    b = report["budget"]
    budget_bytes = b["budget_bytes"]
    measured, eager = format_bytes(b["measured_peak_bytes"]), format_bytes(report["eager"]["peak_bytes"])
    where = (
        f"budget {format_bytes(budget_bytes)} ({b['memory_budget']}), measured peak {measured} "
        f"({'within' if b['within_budget'] else 'OVER'} the budget), eager {eager}"
        if budget_bytes is not None
        else f"max overhead {b['max_overhead']}, measured peak {measured}"
    )
    console.print(where, markup=False, highlight=False)
    how = (
        f"{b['recomputed_ops']} recomputed ops, compute overhead +{100 * b['overhead']:.2f}% "
        f"({b['status']}, from {b.get('from')})"
        if b["method"] == "remat"
        else "reordering and placement fit: nothing recomputed"
    )
    if b["method"] == "remat" and b.get("joint_overhead") is not None:  # issue 36: which plan, both costs
        how += (
            f"; {b['remat_plan']} plan (sequential +{100 * b['sequential_overhead']:.2f}%, "
            f"joint +{100 * b['joint_overhead']:.2f}%)"
        )
    rounds = b.get("placement_rounds") or []
    if len(rounds) > 1:
        excess = format_bytes(rounds[0]["placed_peak_bytes"] - budget_bytes)
        how += f"; re-planned {len(rounds) - 1}x: the first placed arena was {excess} over the budget"
    ratio = "n/a" if b["step_time_ratio"] is None else f"{b['step_time_ratio']:.2f}"
    console.print(
        f"plan: {how}; planned peak {format_bytes(b['planned_peak_bytes'])} (checkpoint-all "
        f"{format_bytes(b['checkpoint_all_peak_bytes'])}); step time memplan/eager {ratio}",
        markup=False,
        highlight=False,
    )


def is_fit(budget: str) -> bool:
    from memplan.torch.run.fit import is_fit as fit

    return fit(budget)


def run_fit(
    model: str, batch_size: int, steps: int, optimizer: str, budget: str, time_limit: float, max_overhead: float | None
) -> dict[str, Any]:
    """``--budget fit``: memplan then eager, each in a fresh process under this process's limit."""
    from memplan.torch.run.limited import train_under_limit

    if max_overhead is not None:
        raise MemplanError("--budget fit takes no --max-overhead: the limit alone decides the plan")
    with progress(f"training {model} {steps} steps within this process's memory limit, memplan then eager"):
        report = train_under_limit(
            model, batch_size, steps, optimizer, memory_budget=budget, time_limit_seconds=time_limit
        )
    print_fit(report, console())
    return report


def print_fit(report: dict[str, Any], out: Console) -> None:
    """The lines of ``memplan run --budget fit``: the limit, planned and measured peaks, time, verdicts."""
    m, e = report["memplan"], report["eager"]
    if not m["fits"]:
        out.print(f"memplan: {m['outcome']}", markup=False, highlight=False)
        return
    lines = [
        f"limit {format_bytes(report['limit_bytes'])} ({report['limit_source']}), margin "
        f"{format_bytes(report['margin_bytes'])}: budget {format_bytes(report['budget_bytes'])} for the step",
        f"memplan: planned peak {format_bytes(report['planned_peak_bytes'])}, measured peak RSS "
        f"{format_bytes(report['measured_peak_rss_bytes'])} over all {report['steps']} steps (first step "
        f"{format_bytes(m['first_step_peak_rss_bytes'])}): {'held' if report['held'] else 'did NOT hold'}; "
        f"compute overhead +{100 * (report['overhead'] or 0):.2f}%",
        f"eager: {e['outcome']}"
        + (f", peak RSS {format_bytes(e['peak_rss_bytes'])}" if e["fits"] else "")
        + (f"; step time memplan/eager {report['step_time_ratio']:.2f}" if report["step_time_ratio"] else ""),
        "loss and parameters after every step vs eager: "
        + {True: "identical", False: "DIFFER", None: "not compared (eager did not train)"}[report["identical"]],
    ]
    for line in lines:
        out.print(line, markup=False, highlight=False)


def print_data_parallel(reports: list[dict[str, Any]], console: Console) -> None:
    """The table of ``memplan run --nproc N``: per rank, memplan vs DDP (both bucket settings)."""
    first = reports[0]
    table = _per_rank_table(reports, "gloo", lambda x: x["resident_bytes"] + x["step_peak_bytes"] + x["bucket_bytes"])
    console.print(table)
    plan = first["plan"]
    console.print(
        f"plan: {plan['buckets']} buckets as DDP's ({all(first['buckets_as_ddp'].values())}), waits {plan['waits']}, "
        f"arena {format_bytes(plan['arena_bytes'])} ({plan['placement']['method']}, {plan['placement']['status']}), "
        f"claimed peak {format_bytes(first['claimed_peak_bytes'])}; safe in every execution checked "
        f"({plan['stream_check']['states']} {'states' if plan['stream_check']['exhaustive'] else 'executions'})"
    )
    verdict = (
        "identical" if _data_parallel_diff(reports) == 0.0 else f"DIFFER by up to {_data_parallel_diff(reports):.3g}"
    )
    console.print(f"loss and parameters on every rank, after every step, vs DistributedDataParallel: {verdict}")


VARIANT_TITLES = {
    "memplan": "memplan",
    "ddp": "DDP",
    "ddp-view": "DDP (grad. as bucket view)",
    "fsdp2": "FSDP2",
    "fsdp2_ckpt": "FSDP2 + checkpoint",
    "memplan_budget": "memplan + budget",
}


def print_fsdp(reports: list[dict[str, Any]], console: Console) -> None:
    """The table of ``memplan run --nproc N --fsdp``: per rank, memplan vs eager FSDP2 and eager
    FSDP2 with every block checkpointed."""
    first = reports[0]
    table = _per_rank_table(reports, "gloo, FSDP2", lambda x: x["peak_bytes"])
    console.print(table)
    worst = _fsdp_diff(reports)
    verdict = "identical" if worst == 0.0 else f"DIFFER by up to {worst:.3g}"
    console.print(
        f"plan: {first['collectives']} collectives (all-gathers, reduce-scatters), arena "
        f"{format_bytes(first['arena_bytes'])}; loss, gathered parameters and optimizer state on every rank, "
        f"after every step, vs eager FSDP2 (with and without checkpointing): {verdict}"
    )
    if first.get("budget"):
        b = first["budget"]
        console.print(
            f"--budget {b['memory_budget']} ({format_bytes(b['budget_bytes'])}): rank 0's plan {b['method']}, "
            f"{b['recomputed_ops']} ops recomputed, planned overhead +{100 * b['overhead']:.2f}%"
        )


def _fsdp_diff(reports: list[dict[str, Any]]) -> float:
    return max(x["max_abs_diff"] for r in reports for x in r["variants"].values())


def _per_rank_table(reports: list[dict[str, Any]], backend: str, peak_of: Callable[[dict[str, Any]], int]) -> Table:
    """Per rank, each variant's measured peak (``peak_of`` its report), step time and diff to memplan."""
    first = reports[0]
    table = Table(
        title=f"{first['model']}  batch {first['batch_size']} per rank  {first['world_size']} ranks ({backend})  "
        f"{first['steps']} steps"
    )
    table.add_column("rank")
    table.add_column("")
    for name in first["variants"]:
        table.add_column(VARIANT_TITLES.get(name, name), justify="right")
    for r in reports:
        v = r["variants"]
        table.add_row(str(r["rank"]), "measured peak", *(format_bytes(peak_of(x)) for x in v.values()))
        table.add_row("", "step seconds (median)", *(f"{x['step_seconds']:.3f}" for x in v.values()))
        table.add_row(
            "", "max abs diff to memplan", *("" if n == "memplan" else str(x["max_abs_diff"]) for n, x in v.items())
        )
    return table


def _data_parallel_diff(reports: list[dict[str, Any]]) -> float:
    return max(
        max(r["loss_max_abs_diff"], r["param_spread_over_ranks"], *(x["max_abs_diff"] for x in r["variants"].values()))
        for r in reports
    )


def run_data_parallel(
    model: str,
    batch_size: int,
    steps: int,
    nproc: int,
    optimizer: str,
    time_limit: float,
    bucket_cap_mb: float | None,
    waits: str,
    extra: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Launch ``nproc`` ranks with torchrun (gloo, this machine) and return their reports
    (``extra``: more arguments for the worker, ``--fsdp``)."""
    import json
    import subprocess
    import tempfile
    from pathlib import Path

    from memplan.errors import MemplanError
    from memplan.torch.distributed.worker import launch_command

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        args = [model, "--batch", str(batch_size), "--steps", str(steps), "--optimizer", optimizer]
        args += ["--time-limit", str(time_limit), "--waits", waits, "--out", str(out), *(extra or [])]
        if bucket_cap_mb is not None:
            args += ["--bucket-cap-mb", str(bucket_cap_mb)]
        done = subprocess.run(launch_command(nproc, args), capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            errors = [line for line in done.stderr.splitlines() if "Error" in line or "error:" in line]
            ours = [line for line in done.stderr.splitlines() if "memplan.errors." in line]
            errors = ours or errors  # a rank's refusal (a memplan.errors type) first
            cause = errors[-1].strip() if errors else (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise MemplanError(f"the {nproc} ranks failed (torchrun exit {done.returncode}): {cause}")
        return json.loads(out.read_text())


def run(
    model: Annotated[str, typer.Argument(help="A zoo model name (see `memplan models`).")],
    batch_size: BatchSize = 8,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Steps to train with each.")] = 3,
    mode: ModeOption = Mode.train,
    optimizer: OptimizerOption = OptimizerName.sgd,
    time_limit: Annotated[float, typer.Option("--time-limit", min=0.1, help="Solver seconds per stage.")] = 10.0,
    allocator: Annotated[
        Allocator,
        typer.Option(
            "--allocator",
            help="replay: every allocation at a planned offset (profile-guided, needs a C++ compiler); "
            "views: out= kernels into arena views, the rest to PyTorch's allocator; auto: replay where it builds.",
        ),
    ] = Allocator.auto,
    nproc: Annotated[
        int,
        typer.Option(
            "--nproc",
            min=1,
            help="Ranks (processes) for data-parallel training under torchrun with gloo on this machine; "
            "above 1, memplan is compared with DistributedDataParallel.",
        ),
    ] = 1,
    fsdp: Annotated[
        bool,
        typer.Option(
            "--fsdp",
            help="With --nproc N: shard every block and the root with FSDP2's fully_shard (AdamW) and compare "
            "memplan's planned step with eager FSDP2.",
        ),
    ] = False,
    bucket_cap_mb: Annotated[
        float | None, typer.Option("--bucket-cap-mb", help="DDP's bucket size (default: DDP's, 25 MiB).")
    ] = None,
    waits: Annotated[
        str,
        typer.Option(
            "--waits",
            help="Where a bucket's wait goes: earliest (smallest peak), next-bucket (overlap the next bucket's "
            "backward), end-of-backward (as DDP).",
        ),
    ] = "next-bucket",
    budget: Annotated[
        str | None,
        typer.Option(
            "--budget",
            help="Memory budget for the whole step: bytes (2e9, 2GiB, 512MB) or a fraction of the checkpoint-all "
            "peak (0.5, 50%); activations are recomputed in the backward where reordering alone does not fit. "
            "'fit': whatever this process may use (cgroup limit or available memory, less a margin); memplan and "
            "eager then each train in a fresh process under that limit.",
        ),
    ] = None,
    max_overhead: Annotated[
        float | None,
        typer.Option(
            "--max-overhead",
            min=0.0,
            help="Compute recomputation may add (0.1: 10%): alone, the lowest peak within it; with --budget, a cap.",
        ),
    ] = None,
    json_path: JsonOut = None,
    snapshot: Annotated[
        Path | None,
        typer.Option(
            "--snapshot",
            help="Write memory snapshots for PyTorch's memory visualizer: the memplan step to this .pickle, "
            "the plan to NAME.plan.pickle, the eager step to NAME.eager.pickle.",
        ),
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option("--trace", help="Write the plan as a Chrome/Perfetto trace (JSON) with measured op times."),
    ] = None,
    quiet: Quiet = False,
) -> None:
    """Train K steps with memplan and with eager PyTorch (or, with --nproc N, with DDP) from the same state and seed."""
    from memplan.torch.compare import compare_with_eager

    set_quiet(quiet)
    for path, suffix in ((snapshot, ".pickle"), (trace, ".json")):
        if path is not None and path.suffix != suffix:
            raise MemplanError(f"{path}: the file must end in {suffix}")
    if fsdp and nproc < 2:
        raise MemplanError("--fsdp shards the model over ranks: give --nproc 2 or more")
    fsdp_budget = fsdp and budget is not None and max_overhead is None  # planned by every rank (compile_fsdp_step)
    if (budget is not None or max_overhead is not None) and (nproc > 1 or mode.value != "train") and not fsdp_budget:
        raise MemplanError("--budget and --max-overhead plan a training step on one process: drop --nproc/--mode infer")
    if fsdp:
        if mode.value != "train":
            raise MemplanError("--fsdp trains: it needs --mode train")
        extra = ["--fsdp"]
        if budget is not None:
            from memplan.torch.distributed.fsdp_step import check_fsdp_budget

            check_fsdp_budget(budget)  # "fit" or a malformed budget: refused here, in one line
            extra += ["--budget", budget]
        reports = run_data_parallel(model, batch_size, steps, nproc, "adamw", time_limit, None, waits, extra)
        print_fsdp(reports, console())
        write_json(json_path, {"ranks": reports})
        if _fsdp_diff(reports) != 0.0:
            raise typer.Exit(1)
        return
    if nproc > 1:
        if mode.value != "train":
            raise MemplanError("--nproc trains data-parallel: it needs --mode train")
        reports = run_data_parallel(model, batch_size, steps, nproc, optimizer.value, time_limit, bucket_cap_mb, waits)
        print_data_parallel(reports, console())
        write_json(json_path, {"ranks": reports})
        if _data_parallel_diff(reports) != 0.0:
            raise typer.Exit(1)
        return

    if budget is not None and is_fit(budget):
        report = run_fit(model, batch_size, steps, optimizer.value, budget, time_limit, max_overhead)
        write_json(json_path, report)
        if report["identical"] is False or not report["held"]:
            raise typer.Exit(1)
        return

    with progress(f"planning {model}, then training {steps} steps with memplan and eagerly"):
        report = compare_with_eager(
            model,
            batch_size,
            steps,
            mode.value,
            optimizer.value,
            time_limit_seconds=time_limit,
            allocator=allocator.value,
            memory_budget=budget,
            max_overhead=max_overhead,
        )
    out = console()
    print_run(report, out)
    if report.get("budget") is not None:
        print_budget(report, out)
    if snapshot is not None or trace is not None:
        from memplan.torch.export.zoo_exports import export_zoo_step

        report["exports"] = export_zoo_step(
            model,
            batch_size,
            optimizer.value,
            mode.value,
            snapshot=snapshot,
            trace=trace,
            allocator=allocator.value,
            time_limit_seconds=time_limit,
            stage=progress,
        )
        print_exports(report["exports"], out)
    write_json(json_path, report)
    if report["max_abs_diff"] != 0.0:
        raise typer.Exit(1)


def print_exports(exports: dict[str, Any], out: Console) -> None:
    """Where the exports went and the peaks their own replay finds (persistent bytes included)."""
    labels = {"memplan": "memplan step", "plan": "the plan", "eager": "eager step"}
    for key, label in labels.items():
        if key in exports:
            e = exports[key]
            out.print(
                f"wrote {e['path']}: {label}, {e['events']} events, peak allocated "
                f"{format_bytes(e['peak_allocated_bytes'])}, reserved {format_bytes(e['peak_reserved_bytes'])}",
                markup=False,
                highlight=False,
            )
    if "trace" in exports:
        t = exports["trace"]
        out.print(f"wrote {t['path']}: Chrome/Perfetto trace of the plan, {t['op_times']} op times", markup=False)
    if any(k in exports for k in labels):
        out.print("open the snapshots at https://pytorch.org/memory_viz (drag several files in to compare them)")


def register(app: typer.Typer) -> None:
    app.command()(run)
