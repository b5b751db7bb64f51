"""memplan vs eager PyTorch on a CUDA device: reserved and allocated peaks, step time, numerics.

    python bench/run_cuda.py --models mlp,resnet50,gpt2-2l --batch 1,32 --steps 10   # writes bench/results/cuda.md
    python bench/run_cuda.py --models resnet50,gpt2-2l --batch 32 --budget 0.5 --memplan-allocator views \
        --results bench/results/cuda_budget.md   # remat in the main path, PyTorch's own counters

Each side of each row trains in a fresh process of its own (the planned CUDA allocator replaces
PyTorch's CUDA allocator, which PyTorch allows only before the first CUDA tensor), from the same
seed and batch, with ``torch.use_deterministic_algorithms(True, warn_only=True)``, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``
and cuDNN's benchmark mode off, so that both sides run the same kernels.

- eager: PyTorch's caching allocator; ``torch.cuda.max_memory_reserved()`` and
  ``torch.cuda.max_memory_allocated()`` over the steady-state steps (peaks reset after warm-up).
- memplan: ``memplan.torch.run.cuda_allocator.install()``, then ``compile_step`` (allocator
  "auto": recorded, placed, replayed at planned offsets). PyTorch keeps no statistics for a
  pluggable allocator, so the peaks are the planned allocator's own counters over the same steps:
  bytes taken from cudaMalloc (the arena and cached blocks: *reserved*) and bytes handed out
  (the arena counted whole: *allocated*).

With ``--memplan-allocator views`` the memplan side keeps PyTorch's caching allocator (the plan's
arena is one tensor in it), so both sides' peaks are PyTorch's own ``max_memory_reserved`` and
``max_memory_allocated``. ``--budget`` passes ``memory_budget`` to ``compile_step`` (a fraction
of the checkpoint-all peak, or bytes), so the memplan side recomputes where the plan says.
Both sides also report the device memory in use after the steps (``cudaMemGetInfo``: total less
free, the CUDA context included; nothing else runs on the device), a process-level figure.

Numerics: max abs difference of every parameter after the last step, and a per-step checksum
(bit-exact sums of the parameters' bytes). Times: median of the steady-state steps, each
synchronised; the machine's load is not controlled. Without a CUDA device the script prints
one line and measures nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "cuda.md"
WARMUP_STEPS = 6  # memplan: two recordings, placement, then replays (up to four recordings)
DETERMINISM_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
NO_CUDA = "no CUDA device here (torch.cuda.is_available() is false): nothing measured"


def run_side(
    side: str,
    model: str,
    *,
    batch: int,
    steps: int,
    out: Path,
    optimizer: str = "adam",
    extra: Sequence[str] = (),
) -> dict[str, Any]:
    """Train one side in a fresh process; returns what it measured (parameters saved under ``out``).
    ``extra``: the memplan side's options (``--budget``, ``--memplan-allocator``, ``--time-limit``)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--models", model]
    command += ["--batch", str(batch), "--steps", str(steps), "--optimizer", optimizer, "--out", str(out), *extra]
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, **DETERMINISM_ENV, "PYTHONPATH": path}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        (out / f"{side}-{model}-b{batch}.err").write_text(done.stderr)
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"{side} side of {model} (batch {batch}) failed: {tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _side(args: argparse.Namespace) -> dict[str, Any]:
    """One side, in this process (``--side``)."""
    import torch
    from memplan.torch.run import cuda_allocator

    native = cuda_allocator.install() if args.side == "memplan" and args.memplan_allocator == "replay" else None
    # warn_only: an op with no deterministic CUDA kernel (U-Net's 2-d nll_loss) still runs; its
    # row then says whether the two sides agreed bit for bit
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    step, state, reporter = _build(args, native)
    torch.cuda.synchronize()
    for k in range(WARMUP_STEPS):
        torch.manual_seed(k)
        step()
    torch.cuda.synchronize()
    if native is None:
        torch.cuda.reset_peak_memory_stats()
    else:
        native.reset_peaks()
    used_before = _device_used()
    times, checksums = [], []
    for k in range(args.steps):
        torch.manual_seed(100 + k)
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        checksums.append(_checksum(state))
    params = Path(args.out) / f"{args.side}-{args.models}-b{args.batch}.pt"
    torch.save({name: t.detach().cpu() for name, t in state.items()}, params)
    result = {"side": args.side, "step_s": statistics.median(times), "checksums": checksums, "params": str(params)}
    result["device_used_bytes"] = max(used_before, _device_used())
    if native is None:
        result["max_memory_reserved"] = torch.cuda.max_memory_reserved()
        result["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    else:
        stats = native.memory_stats()
        result["max_memory_reserved"] = stats.peak_held
        result["max_memory_allocated"] = stats.peak_in_use
    result.update(reporter())
    result["device"] = torch.cuda.get_device_name()
    return result


def _device_used() -> int:
    """Bytes in use on the device (``cudaMemGetInfo``: total less free), this process's context included."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free


def _budget_value(text: str | None) -> int | float | str | None:
    """``--budget``: a fraction (``0.5``), bytes (``123456``) or a string such as ``"2GiB"``."""
    if text is None:
        return None
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        return text


def _build(args: argparse.Namespace, native: Any):
    """The step to time, the tensors whose values must match, and a function of what to report."""
    from torch.utils import _pytree as pytree

    from memplan.api import CompiledStep
    from memplan.torch.compare import _eager_step
    from memplan.torch.zoo import Workload, build_workload, make_optimizer

    w = build_workload(args.models, args.batch, seed=0)
    model = w.model.cuda().train()
    inputs, target = pytree.tree_map(_to_cuda, (w.inputs, w.target))
    w = Workload(model, inputs, target, w.loss_fn)
    optimizer = make_optimizer(args.optimizer, model.parameters())
    state = dict(model.named_parameters())
    if args.side == "eager":
        return (lambda: _eager_step(w, model, optimizer)), state, dict
    compiled = CompiledStep.of_loss(
        model,
        optimizer,
        w.loss_fn,
        time_limit_seconds=args.time_limit,
        allocator=args.memplan_allocator,
        memory_budget=_budget_value(args.budget),
    )
    batch = (w.inputs, w.target)

    def report() -> dict[str, Any]:
        runner = compiled.runner_for(batch)
        stats = getattr(runner, "last_stats", None)
        return {
            "allocator": compiled.allocator,
            "allocator_reason": compiled.allocator_reason,
            "replayed_steps": getattr(runner, "replays", 0),
            "diverged": 0 if stats is None or stats.diverged_at is None else 1,
            "fallback_bytes": 0 if stats is None else stats.fallback_bytes,
            "planned_arena_bytes": compiled.report.get("arena_bytes"),
            "budget": compiled.report.get("budget"),
        }

    return (lambda: compiled(batch)), state, report


def _to_cuda(value: Any) -> Any:
    import torch

    return value.cuda() if isinstance(value, torch.Tensor) else value


def _checksum(state: dict[str, Any]) -> int:
    """Bit-exact: the sum of every parameter's bytes read as int64 words (modulo 2^63)."""
    import torch

    total = 0
    for tensor in state.values():
        flat = tensor.detach().reshape(-1).view(torch.uint8)
        total = (total + int(flat.to(torch.int64).sum())) % (1 << 63)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,vgg16,unet,lstm,resnet50,mobilenet-v2,efficientnet-b0,gpt2-2l")
    parser.add_argument("--batch", default="1,32")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--budget", default=None, help="memplan's memory_budget: 0.5, 2GiB or bytes (default: none)")
    parser.add_argument(
        "--memplan-allocator",
        choices=("replay", "views"),
        default="replay",
        help="replay: the planned CUDA allocator (its own counters); views: PyTorch's caching allocator",
    )
    parser.add_argument("--time-limit", type=float, default=10.0, help="memplan's solver time limit, seconds")
    parser.add_argument("--results", default=str(RESULTS), help="the table's file")
    parser.add_argument("--side", choices=("eager", "memplan"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "cuda-params"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA)
        raise SystemExit(1)
    if args.side is not None:
        args.batch = int(args.batch)
        print(json.dumps(_side(args)))
        return
    _table(args)


def _table(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    extra = ["--memplan-allocator", args.memplan_allocator, "--time-limit", str(args.time_limit)]
    extra += ["--budget", args.budget] if args.budget is not None else []
    results = Path(args.results)
    for model in args.models.split(","):
        for batch in (int(b) for b in args.batch.split(",")):
            try:
                eager = run_side("eager", model, batch=batch, steps=args.steps, out=out, optimizer=args.optimizer)
                ours = run_side(
                    "memplan", model, batch=batch, steps=args.steps, out=out, optimizer=args.optimizer, extra=extra
                )
                rows.append(_row(model, batch, eager, ours))
            except RuntimeError as error:
                rows.append({"device": None, "line": f"| {model} | {batch} | not measured: {error} |"})
            _write(results, args, rows)  # after every row: a run cut short keeps what it measured
    print(results.read_text())


def _write(results: Path, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    command = "python bench/run_cuda.py " + " ".join(sys.argv[1:])
    device = next((r["device"] for r in rows if r["device"]), "?")
    memplan_side = (
        "memplan's peaks are the planned CUDA allocator's own counters (PyTorch keeps none for a pluggable allocator)"
        if args.memplan_allocator == "replay"
        else "memplan keeps PyTorch's caching allocator (arena views), so both sides' peaks are PyTorch's own counters"
    )
    lines = [
        "# memplan vs eager on CUDA",
        "",
        f"Command: `{command}`. Device: {device}. `torch.use_deterministic_algorithms(True, warn_only=True)`, "
        f"`CUBLAS_WORKSPACE_CONFIG=:4096:8`, cuDNN benchmark off; each side in its own process. {memplan_side}; "
        "device used: total less free memory after the steps (`cudaMemGetInfo`, the CUDA context included); "
        "times are medians of the steady-state steps on a machine whose load was not controlled."
        + (f" memplan's `memory_budget`: {args.budget} (remat in the main path)." if args.budget else ""),
        "",
        "| model | batch | eager reserved | eager allocated | memplan reserved | memplan allocated "
        "| memplan reserved / eager allocated | device used eager / memplan "
        "| eager s | memplan s | time ratio | max abs diff | bit-exact | allocator | budget |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    lines += [r["line"] for r in rows]
    results.write_text("\n".join(lines) + "\n")


def _row(model: str, batch: int, eager: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    import torch

    a, b = torch.load(eager["params"]), torch.load(ours["params"])
    diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    exact = eager["checksums"] == ours["checksums"] and all(torch.equal(a[k], b[k]) for k in a)
    mib = 1 << 20
    cells = [
        model,
        str(batch),
        f"{eager['max_memory_reserved'] / mib:.1f} MiB",
        f"{eager['max_memory_allocated'] / mib:.1f} MiB",
        f"{ours['max_memory_reserved'] / mib:.1f} MiB",
        f"{ours['max_memory_allocated'] / mib:.1f} MiB",
        f"{ours['max_memory_reserved'] / eager['max_memory_allocated']:.3f}",
        f"{eager['device_used_bytes'] / mib:.0f} / {ours['device_used_bytes'] / mib:.0f} MiB",
        f"{eager['step_s']:.4f}",
        f"{ours['step_s']:.4f}",
        f"{ours['step_s'] / eager['step_s']:.3f}",
        f"{diff:.3g}",
        "yes" if exact else "no",
        f"{ours['allocator']} ({ours['allocator_reason']})",
        _budget_cell(ours.get("budget"), ours["max_memory_reserved"]),
    ]
    return {"device": eager["device"], "line": "| " + " | ".join(cells) + " |"}


def _budget_cell(budget: dict[str, Any] | None, reserved: int) -> str:
    """The budget in MiB, whether memplan's reserved peak is within it, and the plan's recomputation."""
    if not budget:
        return "none"
    mib, limit = 1 << 20, budget.get("budget_bytes")
    if limit is None:
        return f"max overhead {budget.get('max_overhead')}: +{100 * budget.get('overhead', 0):.2f}% compute"
    within = "within" if reserved <= limit else "OVER"
    return (
        f"{limit / mib:.1f} MiB ({budget.get('memory_budget')}): reserved {within}; {budget.get('method')}, "
        f"+{100 * budget.get('overhead', 0):.2f}% compute, {budget.get('recomputed_ops', 0)} recomputed, "
        f"{budget.get('status')}"
    )


if __name__ == "__main__":
    main()
