"""``memplan run MODEL --budget fit``: train within the limit of the process, and say whether it held.

Eager PyTorch first, in a fresh process of its own (``python -m memplan.torch.run.limited``,
which stays in this process's cgroup, so under the same limit), then memplan in this process
with ``memory_budget="fit"`` (the limit resolved at its first call, :mod:`memplan.torch.run.fit`),
from the same initial state and seeds: neither holds memory while the other runs, and memplan
runs where a user's training would, in the process that holds the limit. Every step, from
the first (capture, planning, recording included), is measured: peak RSS (``VmHWM``, reset
before each step), seconds, the loss's bits and a SHA-256 digest of the parameters after it.
The two sides trained alike when every loss and digest is equal; when eager is killed (it
does not fit) that cannot be checked here, and the report says so.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIDES = ("memplan", "eager")


def state_digest(tensors: list[Any]) -> str:
    """SHA-256 over the bytes of ``tensors`` (in order): equal digests, equal bits."""
    import torch

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train_side(
    side: str,
    model_name: str,
    batch_size: int,
    steps: int,
    optimizer_name: str,
    *,
    memory_budget: str = "fit",
    time_limit_seconds: float = 10.0,
    seed: int = 0,
) -> dict[str, Any]:
    """Train ``steps`` steps with ``side`` in this process; per step: peak RSS, seconds, loss
    bits, parameter digest. memplan's steps include its first calls (capture, planning,
    recording)."""
    import torch
    from memplan.torch.compare import _eager_step
    from memplan.torch.rss import peak_rss_bytes, release_free_memory, reset_peak_rss, rss_bytes
    from memplan.torch.zoo import build_workload, make_optimizer

    w = build_workload(model_name, batch_size, seed=seed)
    w.model.train()
    optimizer = make_optimizer(optimizer_name, w.model.parameters())
    batch = (w.inputs, w.target)
    step: Any = None
    if side == "memplan":
        from memplan.api import CompiledStep

        step = CompiledStep.of_loss(
            w.model, optimizer, w.loss_fn, memory_budget=memory_budget, time_limit_seconds=time_limit_seconds
        )
    release_free_memory()
    rows, start_rss = [], rss_bytes()
    for k in range(steps):
        torch.manual_seed(seed + 1000 + k)
        release_free_memory()
        reset_peak_rss()
        started = time.perf_counter()
        loss = step(batch) if step is not None else _eager_step(w, w.model, optimizer)
        seconds = time.perf_counter() - started
        runner = next(iter(step.runners.values()), None) if step is not None else None
        rows.append(
            {
                "peak_rss_bytes": peak_rss_bytes(),
                "seconds": round(seconds, 4),
                "loss_bits": state_digest([loss.detach().float().reshape(1)]),
                "loss": float(loss),
                "state_digest": state_digest([*w.model.parameters(), *w.model.buffers()]),
                "replayed": bool(getattr(runner, "replaying", False)),
            }
        )
    report: dict[str, Any] = {"side": side, "rss_before_bytes": start_rss, "steps": rows}
    if step is not None:
        report["budget"] = step.report.get("budget")
        report["planned_peak_bytes"] = step.report.get("budget", {}).get("planned_peak_bytes")
    return report


def run_side(side: str, args: list[str], timeout: float | None) -> dict[str, Any]:
    """:func:`train_side` in a fresh process; a killed or failed one is reported as such."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{side}.json"
        command = [sys.executable, "-m", "memplan.torch.run.limited", side, *args, str(out)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"side": side, "fits": False, "outcome": f"not finished within {timeout:.0f} s"}
        if done.returncode == 0 and out.exists():
            return {**json.loads(out.read_text()), "fits": True, "outcome": "trained"}
        if done.returncode < 0:
            outcome = f"killed (signal {-done.returncode}{', the OOM killer' if done.returncode == -9 else ''})"
        else:
            lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
            outcome = f"failed: {lines[-1][:400]}"
        return {"side": side, "fits": False, "outcome": outcome}


def train_under_limit(
    model_name: str,
    batch_size: int,
    steps: int,
    optimizer_name: str,
    *,
    memory_budget: str = "fit",
    time_limit_seconds: float = 10.0,
    seed: int = 0,
    timeout: float | None = None,
) -> dict[str, Any]:
    """Eager in a fresh process, then memplan here, both under this process's limit; the
    report of ``memplan run --budget fit`` (see the module docstring). A refused budget is
    reported as memplan's outcome."""
    from memplan.errors import MemplanError

    args = [model_name, str(batch_size), str(steps), optimizer_name, memory_budget, str(time_limit_seconds), str(seed)]
    eager = run_side("eager", args, timeout)
    try:
        memplan = train_side(
            "memplan",
            model_name,
            batch_size,
            steps,
            optimizer_name,
            memory_budget=memory_budget,
            time_limit_seconds=time_limit_seconds,
            seed=seed,
        )
        memplan.update(fits=True, outcome="trained")
    except MemplanError as err:
        memplan = {"side": "memplan", "fits": False, "outcome": f"refused: {err}"}
    return summarize(memplan, eager, model_name, batch_size, steps, optimizer_name)


def summarize(
    memplan: dict[str, Any], eager: dict[str, Any], model: str, batch_size: int, steps: int, optimizer: str
) -> dict[str, Any]:
    """The two sides side by side: limit, planned and measured peaks, time, whether it held."""
    report: dict[str, Any] = {"model": model, "batch_size": batch_size, "steps": steps, "optimizer": optimizer}
    report["memplan"], report["eager"] = _side_summary(memplan), _side_summary(eager)
    budget = memplan.get("budget") or {}
    limit = budget.get("limit") or {}
    report["limit_bytes"] = limit.get("limit_bytes")
    report["limit_source"] = limit.get("source")
    report["margin_bytes"] = limit.get("margin_bytes")
    report["budget_bytes"] = budget.get("budget_bytes")
    report["planned_peak_bytes"] = budget.get("placed_peak_bytes", budget.get("planned_peak_bytes"))
    report["overhead"] = budget.get("overhead")
    report["recomputed_ops"] = budget.get("recomputed_ops")
    peak = report["memplan"].get("peak_rss_bytes")
    report["measured_peak_rss_bytes"] = peak
    report["held"] = bool(memplan.get("fits")) and peak is not None and peak <= (report["limit_bytes"] or 0)
    m_time, e_time = report["memplan"].get("step_seconds"), report["eager"].get("step_seconds")
    report["step_time_ratio"] = round(m_time / e_time, 4) if m_time and e_time else None
    report["identical"] = _identical(memplan, eager)
    report["budget"] = budget
    return report


def _side_summary(side: dict[str, Any]) -> dict[str, Any]:
    rows = side.get("steps") or []
    steady = [r["seconds"] for r in rows if r.get("replayed", True)][1:] or [r["seconds"] for r in rows][1:]
    return {
        "outcome": side.get("outcome"),
        "fits": side.get("fits"),
        "peak_rss_bytes": max((r["peak_rss_bytes"] for r in rows), default=None),
        "first_step_peak_rss_bytes": rows[0]["peak_rss_bytes"] if rows else None,
        "steady_peak_rss_bytes": rows[-1]["peak_rss_bytes"] if rows else None,
        "step_seconds": statistics.median(steady) if steady else None,
        "per_step": rows,
    }


def _identical(memplan: dict[str, Any], eager: dict[str, Any]) -> bool | None:
    """Every step's loss bits and parameter digest equal; None when a side did not train."""
    if not (memplan.get("fits") and eager.get("fits")):
        return None
    keys = ("loss_bits", "state_digest")
    a, b = memplan["steps"], eager["steps"]
    return len(a) == len(b) and all(x[k] == y[k] for x, y in zip(a, b, strict=True) for k in keys)


def main(argv: list[str]) -> None:
    side, model, batch, steps, optimizer, budget, time_limit, seed, out = argv
    report = train_side(
        side,
        model,
        int(batch),
        int(steps),
        optimizer,
        memory_budget=budget,
        time_limit_seconds=float(time_limit),
        seed=int(seed),
    )
    Path(out).write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
