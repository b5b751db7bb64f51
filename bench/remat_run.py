"""Run rematerialised training steps on real models and compare them with eager PyTorch.

Per configuration: plan within the budget (a fraction of the checkpoint-all peak), train K
steps with the plan and K steps eagerly from the same state and seed, and report the plan's
peak (``sequence_peak_bytes``), the measured peak (resident parameters, buffers, optimizer
state and batch plus the CPU allocator's peak), their ratio, the compute overhead and the
largest difference in loss, parameters and buffers. By default the plan budgets for each op's
measured workspace (kernel scratch beyond its outputs, :mod:`memplan.torch.run.profile`), and the
planned peak counts it; ``--no-workspace`` plans on the captured graph alone. Optionally, PyTorch's own
``activation_memory_budget`` partitioner (torch.compile, aot_eager backend) on the same step.

    python bench/remat_run.py --steps 1 --out bench/results/remat_run.md
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

CONFIGS: list[tuple[str, int, float, str]] = [
    ("vgg16", 64, 0.80, "linearized-greedy"),
    ("mobilenet-v2", 4, 0.60, "linearized-greedy"),
    ("unet", 4, 0.75, "linearized-greedy"),
    ("resnet50", 4, 0.80, "ap-greedy"),
]
MIB = 2**20


def run_config(model: str, batch: int, budget: float, strategy: str, steps: int, workspace: bool) -> dict[str, Any]:
    from memplan.torch.run.remat import compare_remat_with_eager

    return compare_remat_with_eager(model, batch, budget, strategy, steps, workspace=workspace)


def torch_budget_peak(model: str, batch: int, budget: float) -> dict[str, Any]:
    """Peak of one torch.compile'd step (aot_eager) with ``activation_memory_budget``, measured
    like ours: resident state plus the allocator's peak; or why it could not run."""
    import torch._functorch.config as functorch_config

    import torch
    from memplan.torch.capture import call_model
    from memplan.torch.measure import allocator_peak_bytes, optimizer_state_tensors, resident_bytes
    from memplan.torch.zoo import build_workload, make_optimizer

    w = build_workload(model, batch)
    w.model.train()
    opt = make_optimizer("sgd", w.model.parameters())

    def forward_loss() -> torch.Tensor:
        return w.loss_fn(call_model(w.model, w.inputs), w.target)

    try:
        with functorch_config.patch(activation_memory_budget=budget):
            compiled = torch.compile(forward_loss, backend="aot_eager")

            def step() -> torch.Tensor:
                loss = compiled()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss.detach()

            step()  # compiles; creates the optimizer state
            _, peak = allocator_peak_bytes(step)
    except Exception as err:  # report, do not hide: the table says why
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
    state = [*w.model.parameters(), *w.model.buffers()]
    return {"peak_bytes": resident_bytes(state, optimizer_state_tensors(opt), (w.inputs, w.target)) + peak}


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | batch | budget MiB | strategy | planned peak MiB | measured peak MiB | ratio | eager peak MiB "
        "| overhead (FLOPs) | step s remat / eager | max abs diff | largest op workspace MiB "
        "| torch budget partitioner peak MiB |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        torch_cell = r.get("torch_budget", {})
        torch_text = torch_cell.get("error", "-")
        if "peak_bytes" in torch_cell:
            torch_text = f"{torch_cell['peak_bytes'] / MIB:.1f}"
        lines.append(
            f"| {r['model']} | {r['batch_size']} | {r['budget_bytes'] / MIB:.1f} | {r['strategy']} "
            f"| {r['planned_peak_bytes'] / MIB:.1f} | {r['measured_peak_bytes'] / MIB:.1f} | {r['peak_ratio']:.3f} "
            f"| {r['eager_peak_bytes'] / MIB:.1f} | {100 * r['overhead']:.1f}% "
            f"| {r['remat_step_seconds']:.2f} / {r['eager_step_seconds']:.2f} | {r['max_abs_diff']:g} "
            f"| {r.get('workspace_bytes_max', 0) / MIB:.1f} | {torch_text} |"
        )
    return head + "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--models", nargs="*", default=None, help="subset of the configured models")
    parser.add_argument("--torch-budget", action="store_true", help="also run torch's activation_memory_budget")
    parser.add_argument(
        "--no-workspace",
        action="store_true",
        help="plan without the measured per-op scratch (torch/run/profile.py)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for model, batch, budget, strategy in CONFIGS:
        if args.models and model not in args.models:
            continue
        start = time.perf_counter()
        row = run_config(model, batch, budget, strategy, args.steps, not args.no_workspace)
        if args.torch_budget:
            row["torch_budget"] = torch_budget_peak(model, batch, budget)
        row["seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    text = table(rows)
    print(text)
    if args.out:
        command = "python bench/remat_run.py " + " ".join(
            [f"--steps {args.steps}"]
            + (["--models " + " ".join(args.models)] if args.models else [])
            + (["--torch-budget"] if args.torch_budget else [])
            + (["--no-workspace"] if args.no_workspace else [])
            + [f"--out {args.out}"]
        )
        title = "# Rematerialised training steps on real models vs eager PyTorch (CPU)"
        args.out.write_text(f"{title}\n\nRegenerate: `{command}`\n\n{text}")


if __name__ == "__main__":
    main()
