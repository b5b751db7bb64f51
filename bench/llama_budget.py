"""Issue 33's LLM-size budget case: a Llama-style decoder (HF LlamaForCausalLM from a config: 4 layers,
hidden 1024, 0.12B parameters), AdamW, batch 1 x 512 tokens, at memory budgets between the proven
floor and the reordered peak. For each budget: plan found or refused (the one line), the planned
peak, compute overhead, the measured peak of memplan's counted bytes and the process's RSS, and the
loss / parameters after N steps against the same step run eagerly (max abs diff).

    python bench/llama_budget.py --budgets 1.6GiB,1.55GiB --steps 3 --out bench/results/llama_budget.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import memplan
import torch
from memplan.errors import MemplanError
from memplan.report.format import format_bytes
from memplan.torch.rss import peak_rss_bytes, reset_peak_rss


def llama(seed: int = 0):
    from fit import build  # bench/fit.py's Llama: the same config

    torch.manual_seed(seed)
    return build("llama", 1)


def run(budget: str, steps: int, time_limit: float) -> dict:
    w = llama()
    model = w.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = (w.inputs, w.target)
    row: dict = {"budget": budget, "steps": steps, "time_limit_s": time_limit}
    reset_peak_rss()
    start = time.perf_counter()
    try:
        step = memplan.compile_step(model, opt, w.loss_fn, batch, memory_budget=budget, time_limit_seconds=time_limit)
        losses = [step(batch) for _ in range(steps)]
    except MemplanError as err:
        row.update(outcome="refused", message=str(err), seconds=round(time.perf_counter() - start, 1))
        return row
    row["seconds"] = round(time.perf_counter() - start, 1)
    row["peak_rss_bytes"] = peak_rss_bytes()
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
    )
    reference = llama()  # the same seed: the same initial parameters and batch, built after memplan's peak
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


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        "# Llama-style decoder (0.12B, 4 layers, hidden 1024), AdamW, batch 1 x 512, under a memory_budget",
        "",
        f"`{command}` (each budget in this process, one after the other; RSS is the process's peak so far).",
        "",
        "| budget | outcome | method | status | planned peak | overhead | reordered peak | checkpoint-all | "
        "peak RSS | max abs diff (loss, params) | seconds (plan + steps) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["outcome"] == "refused":
            lines.append(f"| {r['budget']} | refused: {r['message']} | | | | | | | | | {r['seconds']} |")
            continue
        b = {k: format_bytes(r[k]) if r.get(k) else "-" for k in r if k.endswith("_bytes")}
        lines.append(
            f"| {r['budget']} | trained {r['steps']} steps | {r['method']} | {r['status']} "
            f"| {b['planned_peak_bytes']} | {100 * (r['overhead'] or 0):+.2f}% | {b['plain_planned_peak_bytes']} "
            f"| {b['checkpoint_all_peak_bytes']} | {b['peak_rss_bytes']} "
            f"| {r['max_abs_diff_loss']:g}, {r['max_abs_diff_params']:g} | {r['seconds']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="1.6GiB,1.55GiB")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=10.0, help="memplan's default time_limit_seconds")
    parser.add_argument("--out", default="bench/results/llama_budget.md")
    args = parser.parse_args()
    command = "python bench/llama_budget.py " + " ".join(sys.argv[1:])
    rows = []
    for budget in args.budgets.split(","):
        rows.append(run(budget, args.steps, args.time_limit))
        print(json.dumps(rows[-1]), flush=True)
        Path(args.out).write_text(markdown(rows, command))
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
