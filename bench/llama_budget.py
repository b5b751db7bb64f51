"""Issue 33's LLM-size budget case: a Llama-style decoder (HF LlamaForCausalLM from a config: 4 layers,
hidden 1024, 0.12B parameters), AdamW, batch 1 (``--batch``) x 512 tokens, at memory budgets between the proven
floor and the reordered peak. For each budget: plan found or refused (the one line), the planned
peak, compute overhead, the measured peak of memplan's counted bytes and the process's RSS, and the
loss / parameters after N steps against the same step run eagerly (max abs diff).

The peaks are counted as the runtime holds memory: an update group is one call of the user's
AdamW with the gradient held as ``.grad`` for the whole call, so the lm_head's 125 MiB gradient is
resident while its update allocates two 125 MiB temporaries: capture makes it an input of every op
of its update group (``memplan.torch.capture.trace.hold_update_inputs``), so the reorderer plans for it.
Remat keeps the reordered plan's stage order (``memplan.remat.portfolio.solve_remat_in_order``), or
the same with the optimizer's updates moved early where the greedy at the peak does better there
(``memplan.remat.stage_order``): at batch 2 the reordered plan keeps program order's updates (its
peak is at the loss) and the embedding's update, every other gradient held, is a second peak
(1.99 GiB) no recomputation lowers.

    python bench/llama_budget.py --budgets 1.85GiB,1.8GiB,1.75GiB,1.7GiB,1.6GiB,1.55GiB --steps 3 \
        --account --out bench/results/llama_budget.md
    python bench/llama_budget.py --batch 2 --budgets 1.95GiB,1.85GiB,1.78GiB,1.72GiB,1.7GiB --steps 4 \
        --out bench/results/llama_budget_b2.md

At batch 2 the step as the OS measured it was 5-8 MiB above the plan and memplan's counted bytes at
1.95 and 1.85 GiB (issue 33). What that was: compiling the remat plan's generated function inside
the second step (its freed heap under that step's peak: 5.9 MiB), and the C heap's free pages,
handed back by ``malloc_trim`` before memplan read its own bytes, touched again by the step's small
allocations (2.5-3.9 MiB). The function is now written at the end of the first step, the heap's
free bytes are counted among memplan's own (``OwnBytes.reading``), and they are read again after
each recording step (``BudgetedReplay._recheck``). ``--steps 4``: the fourth step replays from the
placed arena, so both the recording steps and a replayed one are under the measured peak.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from memplan.errors import MemplanError
from memplan.report.format import format_bytes
from memplan.torch.rss import peak_rss_bytes, reset_peak_rss, rss_bytes


def llama(seed: int = 0, batch: int = 1):
    from fit import build  # bench/fit.py's Llama: the same config

    torch.manual_seed(seed)
    return build("llama", batch)


def run(budget: str, steps: int, time_limit: float, batch_size: int = 1) -> dict:
    """One budget, in a process of its own (see :func:`main`): its peak RSS is this budget's.

    The OS's account: ``outside_before`` is what the process holds outside the step's own tensors
    just before ``compile_step`` (the interpreter, torch, transformers, memplan's imports, the
    model's Python objects: RSS with the C heap's free pages handed back, less the bytes of the
    parameters and batch); the step as the OS measured it is the peak RSS less that, the number
    a budget can hold. ``memplan_own``: what capture and planning left resident outside the
    step (the same account, after the first call planned)."""
    import transformers  # noqa: F401  (its libraries resident before the baseline is read)

    from memplan.api import compile_step  # a library of the step: OR-Tools and pandas come with it

    row: dict = {"budget": budget, "steps": steps, "time_limit_s": time_limit, "batch": batch_size}
    row["libraries_rss_bytes"] = rss_bytes()  # the process before the model: interpreter, torch, transformers
    w = llama(batch=batch_size)
    model = w.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = (w.inputs, w.target)
    row["outside_before_bytes"] = _outside_step(model, opt, batch)
    reset_peak_rss()
    start = time.perf_counter()
    try:
        step = compile_step(model, opt, w.loss_fn, batch, memory_budget=budget, time_limit_seconds=time_limit)
        row["planning_peak_rss_bytes"] = peak_rss_bytes()
        row["memplan_own_bytes"] = _outside_step(model, opt, batch) - row["outside_before_bytes"]
        losses = [step(batch) for _ in range(steps)]
    except MemplanError as err:
        row.update(outcome="refused", message=str(err), seconds=round(time.perf_counter() - start, 1))
        return row
    row["seconds"] = round(time.perf_counter() - start, 1)
    row["peak_rss_bytes"] = peak_rss_bytes()
    row["rss_above_libraries_bytes"] = row["peak_rss_bytes"] - row["libraries_rss_bytes"]
    row["step_peak_os_bytes"] = row["peak_rss_bytes"] - row["outside_before_bytes"]
    report = step.report.get("budget", {})
    row.update(
        outcome="trained",
        method=report.get("method"),
        status=report.get("status"),
        planned_peak_bytes=report.get("planned_peak_bytes"),
        budget_bytes=report.get("budget_bytes"),
        overhead=report.get("overhead"),
        checkpoint_all_peak_bytes=report.get("checkpoint_all_peak_bytes"),
        plain_planned_peak_bytes=report.get("plain_planned_peak_bytes"),
        placed_peak_bytes=report.get("placed_peak_bytes"),
        stage_order=report.get("stage_order", "-"),
        recomputed_ops=report.get("recomputed_ops"),
        memory_budget_bytes=report.get("memory_budget_bytes") or report.get("budget_bytes"),
        counted_own_bytes=report.get("outside_counted_bytes"),
    )
    row["held"] = row["step_peak_os_bytes"] <= row["memory_budget_bytes"]  # the user's budget, memplan's own included
    reference = llama(batch=batch_size)  # the same seed: the same parameters and batch, built after the peak
    eager_model = reference.model
    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-3)
    assert torch.equal(reference.inputs, w.inputs)
    eager_losses = []
    for _ in range(steps):
        loss = w.loss_fn(eager_model(w.inputs), w.target)
        loss.backward()
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)
        eager_losses.append(loss.detach())
    row["max_abs_diff_loss"] = max(float((a - b).abs().max()) for a, b in zip(losses, eager_losses, strict=True))
    row["max_abs_diff_params"] = max(
        float((p.detach() - q.detach()).abs().max())
        for p, q in zip(model.parameters(), eager_model.parameters(), strict=True)
    )
    return row


def account(mode: str, batch_size: int = 1, budget: str = "1.85GiB", steps: int = 3) -> dict:
    """What the process holds outside the step's tensors (:func:`_outside_step`), above what it
    held before the first call, at each stage: ``eager`` runs the step eagerly (the control: the
    kernels' first runs create library caches eager keeps too); ``memplan`` after capture (when
    planning begins), after planning, and after each step."""
    import transformers  # noqa: F401

    import memplan.torch.run.budget as budget_module
    from memplan.api import compile_step

    w = llama(batch=batch_size)
    model, opt, batch = w.model, torch.optim.AdamW(w.model.parameters(), lr=1e-3), (w.inputs, w.target)
    base = _outside_step(model, opt, batch)
    grown: dict = {"mode": mode}

    def mark(name: str) -> None:
        grown[name] = _outside_step(model, opt, batch) - base

    if mode == "eager":
        for k in range(steps):
            w.loss_fn(model(w.inputs), w.target).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            mark(f"after step {k + 1}")
        return grown
    plan_budget = budget_module.plan_budget

    def marked(*args: object, **kwargs: object) -> object:
        mark("after capture")
        decided = plan_budget(*args, **kwargs)  # type: ignore[arg-type]
        mark("after planning")
        grown["counted"] = decided.report.get("outside_counted_bytes")
        return decided

    budget_module.plan_budget = marked  # type: ignore[assignment]
    step = compile_step(model, opt, w.loss_fn, batch, memory_budget=budget)
    for k in range(2):  # the recording steps; from the third the placed arena is resident (the step's own)
        step(batch)
        mark(f"after recording step {k + 1}")
    return grown


def _outside_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: object) -> int:
    """RSS (the C heap's free pages handed back) less the step's tensors already allocated: the
    account memplan's budget path reads (:func:`memplan.torch.run.budget.outside_step_bytes`)."""
    from memplan.torch.run.budget import outside_step_bytes

    return outside_step_bytes(model, [optimizer], batch) or 0


def account_text(accounts: list[dict]) -> str:
    """One sentence per account of :func:`account`."""
    parts = []
    for a in accounts:
        stages = ", ".join(f"{k} +{format_bytes(v)}" for k, v in a.items() if k not in ("mode", "counted"))
        counted = f" (counted against the budget: {format_bytes(a['counted'])})" if a.get("counted") else ""
        parts.append(f"{a['mode']}: {stages}{counted}")
    return "; ".join(parts)


def markdown(rows: list[dict], command: str, batch: int = 1, accounts: Sequence[dict] = ()) -> str:
    lines = [
        f"# Llama-style decoder (0.12B, 4 layers, hidden 1024), AdamW, batch {batch} x 512, under a memory_budget",
        "",
        f"`{command}` (each budget in a process of its own; peak RSS from the model's creation on; libraries: the "
        "process before the model: the interpreter, torch, transformers and memplan.api; OR-Tools and pandas load "
        "only in the planner's child). Seconds: on a 2-core machine, noisy.",
        "",
        "Peaks count each gradient until its optimizer call ends (the runtime holds it as `.grad` for the "
        "call; capture makes it an input of every op of its update group, so the reorderer sees it too). "
        "Planned: the plan's live bytes; placed: persistent bytes + the arena placed from the recorded "
        "allocations, held to the budget. Stages: the order remat's first runs keep. "
        "The OS's account: *outside*: what the process held outside the step's tensors just before "
        "`compile_step` (RSS with free heap pages handed back, less the parameters and batch: the "
        "interpreter, torch, transformers, memplan's imports, the model's Python objects); *step as the "
        "OS measured it*: peak RSS less *outside*, held when within the budget; *memplan's own*: what "
        "capture and planning left resident outside the step (the same account after planning; in brackets "
        "what memplan itself measured and took out of the budget, the C heap's free bytes included, which the "
        "step's small allocations touch again: the solver and the placement hold the step to the budget less "
        "that, `memplan.torch.run.budget.OwnBytes`; read again after each recording step, the step re-planned "
        "before the next when it no longer fits). Held: within the budget as given.",
        "",
        *(
            [
                f"Outside the step, above what the process held before the first call (one process each, "
                f"`--account`): {account_text(list(accounts))}.",
                "",
            ]
            if accounts
            else []
        ),
        "| budget | outcome | method | stages | status | planned peak | placed peak | overhead | recomputed ops "
        "| reordered peak | checkpoint-all | peak RSS (above the libraries) | outside | memplan's own "
        "| step as the OS measured it | max abs diff (loss, params) | seconds (plan + steps) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["outcome"] == "refused":
            lines.append(f"| {r['budget']} | refused: {r['message']} |" + " |" * 15 + f" {r['seconds']} |")
            continue
        b = {k: format_bytes(r[k]) if r.get(k) else "-" for k in r if k.endswith("_bytes")}
        held = "" if "held" not in r else (" (held)" if r["held"] else " (**over**)")
        lines.append(
            f"| {r['budget']} | trained {r['steps']} steps | {r['method']} | {r['stage_order']} | {r['status']} "
            f"| {b['planned_peak_bytes']} | {b['placed_peak_bytes']} | {100 * (r['overhead'] or 0):+.2f}% "
            f"| {r['recomputed_ops']} | {b['plain_planned_peak_bytes']} "
            f"| {b['checkpoint_all_peak_bytes']} | {b['peak_rss_bytes']} ({b['rss_above_libraries_bytes']}) "
            f"| {b.get('outside_before_bytes', '-')} | {b.get('memplan_own_bytes', '-')} "
            f"({b.get('counted_own_bytes', '-')}) "
            f"| {b.get('step_peak_os_bytes', '-')}{held} "
            f"| {r['max_abs_diff_loss']:g}, {r['max_abs_diff_params']:g} | {r['seconds']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="1.85GiB,1.8GiB,1.75GiB,1.7GiB,1.6GiB,1.55GiB")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=10.0, help="memplan's default time_limit_seconds")
    parser.add_argument("--out", default="bench/results/llama_budget.md")
    parser.add_argument("--batch", type=int, default=1, help="sequences of 512 tokens per step")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process of one budget: prints its row
    parser.add_argument("--account", action="store_true", help="also measure the stages outside the step")
    parser.add_argument("--mode", help=argparse.SUPPRESS)  # the child process of one account
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(account(args.mode, args.batch, args.budgets.split(",")[0], args.steps)), flush=True)
        return
    if args.one:
        print(json.dumps(run(args.one, args.steps, args.time_limit, args.batch)), flush=True)
        return
    command = "python bench/llama_budget.py " + " ".join(sys.argv[1:])
    rows: list[dict] = []
    accounts = []
    for mode in ("eager", "memplan") if args.account else ():
        child = [sys.executable, __file__, "--mode", mode, "--budgets", args.budgets, "--batch", str(args.batch)]
        done = subprocess.run(child, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"account {mode}: the child process failed: {done.stderr[-2000:]}")
        accounts.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(accounts[-1]), flush=True)
    for budget in args.budgets.split(","):
        child = [sys.executable, __file__, "--one", budget, "--steps", str(args.steps), "--batch", str(args.batch)]
        done = subprocess.run([*child, "--time-limit", str(args.time_limit)], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{budget}: the child process failed: {done.stderr[-2000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
        Path(args.out).write_text(markdown(rows, command, args.batch, accounts))
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
