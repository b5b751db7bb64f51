"""Host time per step: memplan's replayed step against eager PyTorch, and where it goes (issue 34).

On a GPU eager's ops are launched asynchronously and its backward runs in C++ (autograd's engine),
so a step is as fast as the device unless the host's time per op is larger than the kernel's.
memplan runs every op, backward included, from one generated Python function
(``memplan.torch.run.codegen``): its host time per op is what this bench measures, on the CPU,
where it shows as step time when the kernels are small (batch 1, small models).

For each zoo model and batch, one process (Adam, the classic step, ``torch.set_num_threads``
``--threads``, one by default, so the figure is the per-op cost and not a share of a busy
machine's cores) builds eager's and memplan's step from the same weights, warms both up (6
steps: the self-check, the recordings, the first replays), then interleaves ``--steps`` rounds of
four steps: eager, memplan as before issue 34 (``boxed``: every op through ``OpOverload._op``,
and with arena views each replayed optimizer op matched by pytree walks,
:func:`_same_call_before`), eager, memplan as now (``bound``: each op through its proven Python
binding, ``codegen.generate(direct=True)``, and the matcher's traced side computed once). Eager
and memplan reseed the RNG alike before each step, so after the rounds both models must hold
the same bits (checked: *bit-identical*). Step times are the thread's CPU time (one torch
thread: the host's work, not stretched by other jobs), medians. Then three steps of each under
``torch.profiler`` give the wall time outside the top-level ATen ops (those of
``optimizer.step()`` included): on a GPU, host time that launches no kernel, which eager's
asynchronous launches hide only while it is below the kernels' time. The profiler adds its own
cost to every op, and ``OpOverload._op`` unboxes its arguments partly inside the op's event:
compare eager with memplan there, and boxed with bound by the CPU times.

The machine may be shared and busy (a 2-core CI box with other jobs): the seconds are noisy,
compare the ratios within one row.

    python bench/step_overhead.py                                  # writes bench/results/step_overhead.md
    python bench/step_overhead.py --models mobilenet-v2 resnet50 --batches 1 --allocator views \
        --out bench/results/step_overhead_views.md                  # arena views (a GPU's default path)
    python bench/step_overhead.py --models mlp lstm --batches 1 --steps 10 --out /tmp/step_overhead.md
    python bench/step_overhead.py --budget 0.65 0.86               # memory_budget rows (issue 33):
        # writes bench/results/step_overhead_budget.md: plain replay vs the remat runner, interpreted / generated
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("mlp", "lstm", "mobilenet-v2", "resnet50", "gpt2-2l")
BATCHES = (1, 8)
WARMUP = 6
PROFILED = 3
SIDES = ("eager", "boxed", "bound")
DEFAULT_OUT = ROOT / "bench" / "results" / "step_overhead.md"
BUDGET_MODELS = ("mobilenet-v2", "resnet50")
BUDGET_OUT = ROOT / "bench" / "results" / "step_overhead_budget.md"
# (side, executor, budgeted): memplan without a budget, then the budget's remat runner both ways
BUDGET_RUNS = (("plain", "generated", False), ("interpreted", "interpreted", True), ("generated", "generated", True))
BUDGET_SIDES = ("eager", "plain", "interpreted", "generated")


def child(model_name: str, batch: int, steps: int, threads: int, allocator: str, out: Path) -> None:
    """One process: eager and memplan (both executors) on ``model_name``; writes what it measured."""
    import memplan.api  # OR-Tools before torch's extensions
    import torch
    from memplan.torch.compare import _eager_step
    from memplan.torch.run import codegen, interpreter
    from memplan.torch.zoo import build_workload, make_optimizer

    torch.set_num_threads(threads)
    w = build_workload(model_name, batch, seed=0)
    eager_model = copy.deepcopy(w.model)
    opt, eager_opt = make_optimizer("adam", w.model.parameters()), make_optimizer("adam", eager_model.parameters())
    memplan_step = memplan.api.standard_step(w.model, opt, w.loss_fn)
    step = memplan.api.CompiledStep(memplan_step, w.model, [opt], allocator=allocator)
    data = (w.inputs, w.target)
    seed = 0

    def pair(memplan_step: Any) -> tuple[tuple[float, float], tuple[float, float]]:
        nonlocal seed
        seed += 1
        torch.manual_seed(seed)
        eager_seconds = _timed(lambda: _eager_step(w, eager_model, eager_opt))
        torch.manual_seed(seed)
        return eager_seconds, _timed(lambda: memplan_step(data))

    for _ in range(WARMUP):
        pair(step)
    runner = step.runner_for(data)
    base = getattr(runner, "run", runner)
    programs = {"boxed": codegen.generate(base, direct=False), "bound": codegen.generate(base)}

    same_call = {"boxed": _same_call_before, "bound": interpreter._same_call}

    def with_program(name: str) -> Any:
        def run(batch_: Any) -> Any:
            base._generated = programs[name]
            interpreter._same_call = same_call[name]
            return step(batch_)

        return run

    seconds: dict[str, list[tuple[float, float]]] = {side: [] for side in SIDES}
    for _ in range(steps):
        for name in ("boxed", "bound"):
            eager_s, memplan_s = pair(with_program(name))
            seconds["eager"].append(eager_s)
            seconds[name].append(memplan_s)
    same = all(torch.equal(a, b) for a, b in zip(_state(w.model), _state(eager_model), strict=True))
    profile = {"eager": _profiled(lambda: _eager_step(w, eager_model, eager_opt))}
    for name in ("boxed", "bound"):
        run = with_program(name)
        profile[name] = _profiled(lambda run=run: run(data))
    result = {
        "model": model_name,
        "batch": batch,
        "threads": threads,
        "allocator": step.allocator,
        "steps": steps,
        "cpu_seconds": {side: statistics.median(cpu for cpu, _ in t) for side, t in seconds.items()},
        "wall_seconds": {side: statistics.median(wall for _, wall in t) for side, t in seconds.items()},
        "bit_identical": same,
        "op_calls": _op_calls(programs["bound"].source),
        "profile": profile,
    }
    out.write_text(json.dumps(result, indent=1))


def child_budget(
    model_name: str, batch: int, steps: int, threads: int, allocator: str, budget: float, out: Path
) -> None:
    """One process: eager, memplan without a budget (*plain*), and memplan with
    ``memory_budget=budget`` run by the remat runner as before issue 33 (*interpreted*) and now
    (*generated*: the sequence written as one function, :mod:`memplan.torch.run.remat_codegen`).
    Each memplan side trains its own copy of the model next to its own eager twin; both budgeted
    sides run the same remat plan (the first solve's, handed to the second: the solver's time
    limit makes two solves differ)."""
    import dataclasses

    import memplan.api  # OR-Tools before torch's extensions
    import torch
    from memplan.torch.compare import _eager_step
    from memplan.torch.run import budget as budget_module
    from memplan.torch.zoo import build_workload, make_optimizer

    torch.set_num_threads(threads)
    w = build_workload(model_name, batch, seed=0)
    data = (w.inputs, w.target)
    solve = budget_module.plan_budget
    solved: list[Any] = []

    def one_plan(*args: Any, **kwargs: Any) -> Any:
        if not solved:
            solved.append(solve(*args, **kwargs))
        return dataclasses.replace(solved[0], report=dict(solved[0].report))

    budget_module.plan_budget = one_plan
    sides: dict[str, tuple[Any, Any, Any, Any]] = {}
    for name, executor, budgeted in BUDGET_RUNS:
        model, eager_model = copy.deepcopy(w.model), copy.deepcopy(w.model)
        opt, eager_opt = make_optimizer("adam", model.parameters()), make_optimizer("adam", eager_model.parameters())
        step = memplan.api.CompiledStep(
            memplan.api.standard_step(model, opt, w.loss_fn),
            model,
            [opt],
            allocator=allocator,
            executor=executor,
            memory_budget=budget if budgeted else None,
        )
        sides[name] = (model, eager_model, eager_opt, step)
    seed = 0

    def pair(name: str) -> tuple[tuple[float, float], tuple[float, float]]:
        nonlocal seed
        seed += 1
        _, eager_model, eager_opt, step = sides[name]
        torch.manual_seed(seed)
        eager_seconds = _timed(lambda: _eager_step(w, eager_model, eager_opt))
        torch.manual_seed(seed)
        return eager_seconds, _timed(lambda: step(data))

    for _ in range(WARMUP):
        for name in sides:
            pair(name)
    seconds: dict[str, list[tuple[float, float]]] = {side: [] for side in BUDGET_SIDES}
    for _ in range(steps):
        for name in sides:
            eager_s, memplan_s = pair(name)
            seconds["eager"].append(eager_s)
            seconds[name].append(memplan_s)
    same = {
        name: all(torch.equal(a, b) for a, b in zip(_state(model), _state(eager_model), strict=True))
        for name, (model, eager_model, _, _) in sides.items()
    }
    profile = {name: _profiled(lambda step=sides[name][3]: step(data)) for name in ("plain", "generated")}
    runners = {name: sides[name][3].runner_for(data) for name in sides}
    report = sides["generated"][3].report.get("budget", {})
    result = {
        "model": model_name,
        "batch": batch,
        "threads": threads,
        "budget": budget,
        "allocator": sides["generated"][3].allocator,
        "runner": type(getattr(runners["generated"], "run", runners["generated"])).__name__,
        "steps": steps,
        "method": report.get("method"),
        "recomputed_ops": report.get("recomputed_ops"),
        "overhead": report.get("overhead"),
        "op_calls": {name: _calls_per_step(runners[name]) for name in ("plain", "generated")},
        "cpu_seconds": {side: statistics.median(cpu for cpu, _ in t) for side, t in seconds.items()},
        "wall_seconds": {side: statistics.median(wall for _, wall in t) for side, t in seconds.items()},
        "bit_identical": same,
        "profile": profile,
    }
    out.write_text(json.dumps(result, indent=1))


def _calls_per_step(runner: Any) -> int:
    """The op calls one step makes: a remat plan's runs (recomputes included), else the plan's calls."""
    from memplan.torch.run.interpreter import _Call

    base = getattr(runner, "run", runner)
    steps = getattr(base, "steps", None)
    if steps is not None:
        calls = {base.plan.order[ins.position] for ins in base.instructions if isinstance(ins, _Call)}
        return sum(1 for kind, i in steps if kind == "run" and i in calls)
    return sum(1 for ins in base.instructions if isinstance(ins, _Call))


def _same_call_before(traced: Any, func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """``interpreter._same_call`` before issue 34 (the *boxed* side): both argument trees walked
    with pytree on every replayed optimizer op (arena views only; the same answer)."""
    from memplan.torch.run.interpreter import _arg_nodes
    from memplan.torch.tensors import tensor_leaves

    node = traced.node
    if node.target is not func:
        return False
    real = tensor_leaves((args, kwargs))
    traced_leaves = [v for a in _arg_nodes(node) for v in tensor_leaves(a.meta.get("val"))]
    return len(real) == len(traced_leaves) and all(
        r.shape == t.shape and r.dtype == t.dtype for r, t in zip(real, traced_leaves, strict=True)
    )


def _op_calls(source: str) -> tuple[int, int]:
    """(calls through a proven binding, calls through ``OpOverload._op``) in a generated step."""
    return len(re.findall(r"\b_bind\d+\(", source)), len(re.findall(r"\b_op\d+\(", source))


def _timed(fn: Any) -> tuple[float, float]:
    """(this thread's CPU seconds, wall seconds) of ``fn()``: the CPU time is the host's work,
    unlike the wall time not stretched by other jobs on a shared machine (one torch thread)."""
    cpu, wall = time.thread_time(), time.perf_counter()
    fn()
    return time.thread_time() - cpu, time.perf_counter() - wall


def _state(model: Any) -> list[Any]:
    return [*model.parameters(), *model.buffers()]


def _profiled(run: Any) -> dict[str, float]:
    """Medians over ``PROFILED`` steps of ``run`` under the profiler (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for _ in range(PROFILED):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            wall = _timed(run)[1]
        rows.append(_split(prof.events(), wall))
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}


def _split(events: Any, wall: float) -> dict[str, float]:
    """One profiled step's wall time split into the top-level ATen ops (those of
    ``optimizer.step()`` included: on a GPU, kernels) and the host time outside them."""
    optimizer = [e for e in events if e.name.startswith("Optimizer.step#")]
    ops = [e for e in events if e.name.startswith("aten::") and not _nested(e)]
    op_s = sum(e.time_range.elapsed_us() for e in ops) / 1e6
    outside = max(wall - op_s, 0.0)
    return {
        "wall_s": wall,
        "ops": len(ops),
        "ops_s": op_s,
        "optimizer_calls": len(optimizer),
        "outside_ops_s": outside,
        "outside_us_per_op": outside / max(len(ops), 1) * 1e6,
    }


def _nested(event: Any) -> bool:
    """Inside another ATen op (its own work, not a call the host makes)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def parent(
    models: list[str],
    batches: list[int],
    steps: int,
    threads: int,
    allocator: str,
    out: Path,
    budgets: list[float] | None = None,
) -> None:
    rows: list[dict[str, Any]] = []
    for m, model in enumerate(models):
        budget = None if budgets is None else budgets[min(m, len(budgets) - 1)]
        for batch in batches:
            with tempfile.TemporaryDirectory() as folder:
                target = Path(folder) / "row.json"
                options = [str(o) for o in (batch, steps, threads, allocator, target)]
                command = [sys.executable, __file__, "--child", model, *options]
                if budget is not None:
                    command = [sys.executable, __file__, "--budget-child", model, *options, str(budget)]
                done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
                if done.returncode != 0 or not target.exists():
                    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                    rows.append({"model": model, "batch": batch, "failed": tail[0]})
                else:
                    rows.append(json.loads(target.read_text()))
            if budget is not None:
                print(_budget_row(rows[-1]), flush=True)
                out.write_text(_budget_markdown(rows, models, batches, steps, threads, allocator, budgets, out))
                out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
                continue
            print(_row(rows[-1]), flush=True)
            out.write_text(_markdown(rows, models, batches, steps, threads, allocator, out))
            out.with_suffix(".json").write_text(json.dumps(rows, indent=1))


HEADER = (
    "| model | batch | ops bound / boxed | eager ms | memplan ms, boxed | memplan ms, bound | ratio boxed "
    "| ratio bound | wall ratio bound | outside ops ms eager / boxed / bound | us/op eager / boxed / bound "
    "| optimizer.step() calls eager / memplan | bit-identical |\n"
    "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|---|---|"
)


def _row(r: dict[str, Any]) -> str:
    if "failed" in r:
        return f"| {r['model']} | {r['batch']} | failed: {r['failed']} |" + " |" * 10
    s, wall, p = r["cpu_seconds"], r["wall_seconds"], r["profile"]
    outside = " / ".join(f"{p[side]['outside_ops_s'] * 1e3:.1f}" for side in SIDES)
    per_op = " / ".join(f"{p[side]['outside_us_per_op']:.1f}" for side in SIDES)
    return (
        f"| {r['model']} ({r['allocator']}) | {r['batch']} | {r['op_calls'][0]} / {r['op_calls'][1]} "
        f"| {s['eager'] * 1e3:.1f} | {s['boxed'] * 1e3:.1f} | {s['bound'] * 1e3:.1f} | {s['boxed'] / s['eager']:.3f} "
        f"| {s['bound'] / s['eager']:.3f} | {wall['bound'] / wall['eager']:.3f} | {outside} | {per_op} "
        f"| {p['eager']['optimizer_calls']:.0f} / {p['bound']['optimizer_calls']:.0f} "
        f"| {'yes' if r['bit_identical'] else 'NO'} |"
    )


def _markdown(
    rows: list[dict[str, Any]],
    models: list[str],
    batches: list[int],
    steps: int,
    threads: int,
    allocator: str,
    out: Path,
) -> str:
    run = (models, batches, steps, threads, allocator, out)
    command = _command("python bench/step_overhead.py", run, (MODELS, BATCHES, DEFAULT_OUT))
    lines = [
        "# Host time per step: memplan's replayed step vs eager (issue 34)",
        "",
        "Written by:",
        "",
        f"    {command}",
        "",
        f"On the CPU, {threads} thread(s), Adam (single-tensor), each model in its own process. Step times are this "
        f"thread's CPU time, medians of {steps} interleaved rounds after 6 warm-up steps (*wall ratio*: the same "
        "with wall time). *boxed*: memplan as before issue 34 (every op through `OpOverload._op`; with arena views "
        "each replayed optimizer op matched by pytree walks); *bound*: memplan now (each op through its Python "
        "binding where one is proven to make the same call; the matcher's traced side computed once). *ops*: calls "
        "in the generated step through a binding / through `_op`. *outside ops*: a profiled step's wall time outside "
        "the top-level ATen ops (on a GPU: host time that launches nothing), median of 3, the profiler's own cost "
        "included and boxing partly inside the op events: compare eager with memplan, not boxed with bound. "
        "*bit-identical*: eager's and memplan's models hold the same bits after all steps of the run. The machine "
        "is shared and busy: the figures are noisy, compare ratios within a row.",
        "",
        HEADER,
        *(_row(r) for r in rows),
        "",
    ]
    return "\n".join(lines)


BUDGET_HEADER = (
    "| model | batch | budget | plan | op calls plain / budget | eager ms | plain ms | budget ms, interpreted "
    "| budget ms, generated | interpreted / plain | generated / plain | generated / eager | wall generated / plain "
    "| outside ops ms plain / generated | us/op plain / generated | optimizer.step() calls plain / generated "
    "| bit-identical plain / interpreted / generated |\n"
    "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|"
)


def _budget_row(r: dict[str, Any]) -> str:
    if "failed" in r:
        return f"| {r['model']} | {r['batch']} | failed: {r['failed']} |" + " |" * 14
    s, wall, p, calls = r["cpu_seconds"], r["wall_seconds"], r["profile"], r["op_calls"]
    plan = f"{r['method']}, {r['recomputed_ops']} recomputed, +{100 * (r['overhead'] or 0):.2f}% compute"
    outside = " / ".join(f"{p[side]['outside_ops_s'] * 1e3:.1f}" for side in ("plain", "generated"))
    per_op = " / ".join(f"{p[side]['outside_us_per_op']:.1f}" for side in ("plain", "generated"))
    same = " / ".join("yes" if r["bit_identical"][side] else "NO" for side in BUDGET_SIDES[1:])
    return (
        f"| {r['model']} ({r['allocator']}, {r['runner']}) | {r['batch']} | {r['budget']:g} | {plan} "
        f"| {calls['plain']} / {calls['generated']} | {s['eager'] * 1e3:.1f} | {s['plain'] * 1e3:.1f} "
        f"| {s['interpreted'] * 1e3:.1f} | {s['generated'] * 1e3:.1f} | {s['interpreted'] / s['plain']:.3f} "
        f"| {s['generated'] / s['plain']:.3f} | {s['generated'] / s['eager']:.3f} "
        f"| {wall['generated'] / wall['plain']:.3f} | {outside} | {per_op} "
        f"| {p['plain']['optimizer_calls']:.0f} / {p['generated']['optimizer_calls']:.0f} | {same} |"
    )


def _budget_markdown(
    rows: list[dict[str, Any]],
    models: list[str],
    batches: list[int],
    steps: int,
    threads: int,
    allocator: str,
    budgets: Any,
    out: Path,
) -> str:
    run = (models, batches, steps, threads, allocator, out)
    budget = f"python bench/step_overhead.py --budget {' '.join(f'{b:g}' for b in budgets)}"
    command = _command(budget, run, (BUDGET_MODELS, [1], BUDGET_OUT))
    lines = [
        "# Host time per step under a memory budget: the remat runner vs the plain replayed step (issue 33)",
        "",
        "Written by:",
        "",
        f"    {command}",
        "",
        f"On the CPU, {threads} thread(s), Adam (single-tensor), each model in its own process. *plain*: memplan "
        "without a budget; *budget*: the `memory_budget` (a fraction of the checkpoint-all peak) of the row, one remat "
        "plan (*plan*: its recomputed ops and the compute they add) run by the remat runner as before issue 33's "
        "host-time work (*interpreted*: the step sequence walked step by step, each argument tree resolved with "
        "pytree, each free looked up and dropped by walking its holders' values) and now (*generated*: the sequence "
        "written once as one Python function, each op through its proven Python binding, each free a `del`, "
        "`memplan.torch.run.remat_codegen`). Each memplan side trains its own copy of the model next to its own "
        f"eager twin, reseeded alike before each step. Step times are this thread's CPU time, medians of {steps} "
        "interleaved rounds after 6 warm-up steps (*wall*: the same with wall time). *op calls*: the ops one step "
        "calls (a remat plan's recomputes included). *outside ops*: a profiled step's wall time outside the "
        "top-level ATen ops, median of 3 (the profiler's own cost included); *us/op*: that per top-level op. "
        "*optimizer.step() calls*: a profiled step's (the generated remat step merges updates with only frees "
        "between them into one call while that does not raise the plan's modeled peak). "
        "*bit-identical*: each side's model holds its eager twin's bits after all its steps. The machine is shared "
        "and busy: the figures are noisy, compare ratios within a row.",
        "",
        BUDGET_HEADER,
        *(_budget_row(r) for r in rows),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        model, batch, steps, threads, allocator, out = sys.argv[2:8]
        child(model, int(batch), int(steps), int(threads), allocator, Path(out))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--budget-child":
        model, batch, steps, threads, allocator, out, budget = sys.argv[2:9]
        child_budget(model, int(batch), int(steps), int(threads), allocator, float(budget), Path(out))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=None)
    parser.add_argument("--batches", nargs="+", type=int, default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--allocator", default="auto", choices=["auto", "replay", "views"])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--budget",
        type=float,
        nargs="+",
        default=None,
        help="memory_budget rows (one fraction, or one per model): plain vs the remat runner, both executors",
    )
    args = parser.parse_args()
    budgeted = args.budget is not None
    models = args.models or list(BUDGET_MODELS if budgeted else MODELS)
    batches = args.batches or ([1] if budgeted else list(BATCHES))
    out = args.out or (BUDGET_OUT if budgeted else DEFAULT_OUT)
    parent(models, batches, args.steps, args.threads, args.allocator, out, args.budget)


def _command(base: str, run: tuple, defaults: tuple) -> str:
    """The command line that writes a results page: ``base`` and the options off their defaults."""
    models, batches, steps, threads, allocator, out = run
    default_models, default_batches, default_out = defaults
    command = base
    if list(models) != list(default_models) or list(batches) != list(default_batches) or steps != 10 or threads != 1:
        command += (
            f" --models {' '.join(models)} --batches {' '.join(map(str, batches))} --steps {steps} --threads {threads}"
        )
    if allocator != "auto":
        command += f" --allocator {allocator}"
    if out.resolve() != default_out:
        command += f" --out {os.path.relpath(out.resolve(), ROOT)}"
    return command


if __name__ == "__main__":
    main()
