"""Time to the first replayed step (issue 37): eager's first step vs memplan cold and restarted.

For each zoo model at batch 8 and a Llama-style decoder (:func:`llama_workload`), with AdamW and
the classic step (``loss_fn(model(x), y)``, backward, ``step()``, ``zero_grad(set_to_none=True)``),
three fresh processes, one after the other:

* **eager**: the seconds of eager PyTorch's first step;
* **cold**: ``memplan`` with ``plan_cache=FOLDER`` on an empty folder: the seconds from the
  compiled step's creation to the end of the first step served from the placed plan throughout
  (capture, the solvers, the recorded steps and the placement included), and how many steps ran
  before it;
* **restarted**: the same script again on the folder the cold run filled (a restart, the next
  job): the same seconds, with the plan and the placed recording read from the cache.

Each process runs ``--steps`` steps from the same weights, batch and seeds; every step's loss
bits and the final parameters' digest are compared with eager's (bitwise). Peak RSS is the
process's ``VmHWM`` at the end (model, optimizer state, capture and steps). The target of the
issue is at most 2x eager's first step; where a model misses it, the table says so. The
machine may be shared: seconds are noisy, compare the ratios within one run; ``--repeat N``
runs N trials and reports the fastest per column. ``--src`` runs other memplan sources (an
earlier revision's ``src``, e.g. from ``git archive``) for a before/after under one load.

    python bench/first_step.py                  # writes bench/results/first_step.md
    python bench/first_step.py --models mlp lstm --steps 4 --out /tmp/first_step.md
    python bench/first_step.py --repeat 3 --src /tmp/before/src --out /tmp/before.md
    python bench/first_step.py --reproducible   # MKL_CBWR=COMPATIBLE: eager's bits alike in every process
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("mlp", "lstm", "gpt2-2l", "mobilenet-v2", "llama")
"""The zoo's, and ``llama``: a Llama-style decoder from an HF ``LlamaConfig`` (:func:`llama_workload`)."""
BATCH = 8
MIB = 2**20


def llama_workload(batch: int, tokens: int = 128) -> Any:
    """A Llama-style decoder (HF ``LlamaForCausalLM``: RMSNorm, RoPE, SwiGLU, grouped-query
    attention; 4 layers, hidden 256, vocab 32000, no dropout, as Llama trains) on ``batch`` x
    ``tokens`` tokens: a step that draws no random numbers and has no BatchNorm."""
    import transformers

    import torch
    from memplan.torch.zoo import Logits, Workload, _token_loss

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    )
    model = Logits(transformers.LlamaForCausalLM(config))
    ids = torch.randint(0, 32000, (batch, tokens))
    return Workload(model, ids, ids, _token_loss)


def child(mode: str, model_name: str, batch: int, steps: int, cache: str, out: Path) -> None:
    """One process: eager or memplan, ``steps`` steps; writes what it measured to ``out``."""
    import torch
    from memplan.torch.rss import peak_rss_bytes
    from memplan.torch.zoo import build_workload, make_optimizer

    w = llama_workload(batch) if model_name == "llama" else build_workload(model_name, batch, seed=0)
    optimizer = make_optimizer("adamw", w.model.parameters())
    torch.manual_seed(1)
    start = time.perf_counter()
    if mode == "eager":

        def run(batch_: Any) -> torch.Tensor:
            loss = w.loss_fn(w.model(batch_[0]), batch_[1])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        step: Any = run
    else:
        from memplan.api import CompiledStep

        step = CompiledStep.of_loss(w.model, optimizer, w.loss_fn, plan_cache=cache)
    ends, cpu, losses, first_steps = [], [], [], {}
    cpu_start = cpu_seconds()
    for _ in range(steps):
        loss = step((w.inputs, w.target))
        ends.append(time.perf_counter() - start)
        cpu.append(cpu_seconds() - cpu_start)
        losses.append(loss.detach().float().reshape(()).view(torch.int32).item())
    if mode != "eager":
        first_steps = step.report.get("first_steps", {})
    digest = hashlib.sha256()
    for p in w.model.parameters():
        digest.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    out.write_text(
        json.dumps(
            {
                "ends": ends,
                "cpu": cpu,
                "losses": losses,
                "digest": digest.hexdigest(),
                "peak_rss": peak_rss_bytes(),
                "first_steps": first_steps,
            }
        )
    )


def snapshot(tmp: Path, src: Path = ROOT / "src") -> dict[str, str]:
    """memplan's sources copied once, so that the cold and the restarted process run the same
    code (the cache key holds a digest of it, and this checkout may be edited meanwhile), and
    the environment that runs them; the planned allocator is built (or found) before timing."""
    shutil.copytree(src / "memplan", tmp / "src" / "memplan", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(tmp / "src")}
    warm = "from memplan.torch.run import allocator; allocator.load()"
    subprocess.run([sys.executable, "-c", warm], env=env, check=True, capture_output=True, timeout=600)
    return env


def cpu_seconds() -> float:
    """CPU seconds of this process (all its threads) and of its finished children (the solvers
    run in forked ones): a measure the other jobs of a shared machine disturb less than wall time."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_child(mode: str, model: str, args: argparse.Namespace, cache: Path, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{model}-{mode}.json"
    command = [sys.executable, __file__, "--child", mode, model, str(args.batch), str(args.steps), str(cache), str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=args.env)
    if done.returncode != 0 or not out.exists():
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(out.read_text())


def first_replay_seconds(result: dict[str, Any]) -> tuple[float | None, float | None, int | None]:
    """Wall and CPU seconds to the end of the first wholly replayed step, and the steps before it."""
    at = result.get("first_steps", {}).get("replayed_at_call")
    if at is None:
        return None, None, None
    return result["ends"][at - 1], result["cpu"][at - 1], at - 1


def measure(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """``--repeat`` trials of the three processes (each on its own empty cache); per mode the
    fastest trial is reported (the least disturbed by a shared machine's other jobs), and the
    bits must be eager's in every trial."""
    trials = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as folder:
            tmp, cache = Path(folder), Path(folder) / "cache"
            trials.append({mode: run_child(mode, model, args, cache, tmp) for mode in ("eager", "cold", "restarted")})
    runs = {mode: _fastest([t[mode] for t in trials], mode) for mode in ("eager", "cold", "restarted")}
    row: dict[str, Any] = {"model": model, "runs": runs, "trials": len(trials)}
    eager = runs["eager"]
    if "error" in eager:
        return row
    row["eager_first"], row["eager_first_cpu"] = eager["ends"][0], eager["cpu"][0]
    for mode in ("cold", "restarted"):
        run = runs[mode]
        if "error" in run:
            continue
        seconds, cpu, before = first_replay_seconds(run)
        identical = all(
            t[mode].get("losses") == t["eager"].get("losses") and t[mode].get("digest") == t["eager"].get("digest")
            for t in trials
        )
        row[mode] = {
            "seconds": seconds,
            "cpu": cpu,
            "steps_before": before,
            "ratio": None if seconds is None else seconds / row["eager_first"],
            "cpu_ratio": None if cpu is None else cpu / row["eager_first_cpu"],
            "plan": run["first_steps"].get("plan"),
            "placement": run["first_steps"].get("placement"),
            "identical": identical and run["losses"] == eager["losses"] and run["digest"] == eager["digest"],
        }
    return row


def _fastest(results: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """The trial with the fewest seconds to eager's first step or memplan's first replayed one
    (the first error if any trial failed)."""
    failed = [r for r in results if "error" in r]
    if failed:
        return failed[0]

    def seconds(r: dict[str, Any]) -> float:
        value = r["ends"][0] if mode == "eager" else first_replay_seconds(r)[0]
        return float("inf") if value is None else value

    return min(results, key=seconds)


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    lines = [
        "# Time to the first replayed step (issue 37)",
        "",
        f"`{command}` (batch {args.batch}, AdamW, {args.steps} steps per process; each column a fresh process;",
        f"the fastest of {getattr(args, 'repeat', 1)} trial(s) per column, bits checked in every trial).",
        "eager: its first step's seconds. cold: memplan on an empty plan cache, seconds from the compiled",
        "step's creation to the end of its first step served from the placed plan throughout (capture,",
        "solvers, recorded steps, placement included; steps run before it in brackets). restarted: the",
        "same on the cache the cold process wrote (plan + placed recording read from disk). x: ratio to",
        "eager's first step (issue target <= 2x). Peak RSS: VmHWM of each process. Bits: every step's",
        "loss and the final parameters equal eager's. Seconds on a shared 2-core machine: noisy, so the",
        "same ratios in CPU seconds (the process's threads and its solver children) are given too.",
        "The bits compare processes, and eager's own CPU step is not reproducible across processes with",
        "2 threads here (`bench/results/eager_repro.md`: the LSTM's eager step gave two results in 15",
        "processes, one with 1 thread or MKL_CBWR=COMPATIBLE): a DIFFER here can be eager's own, which",
        "`--reproducible` (MKL_CBWR=COMPATIBLE in every process) tells apart; the tests compare within",
        "one process.",
        *_load_line(args),
        "",
        "| model | eager 1st step (s) | cold (s) | cold x | restarted (s) | restarted x | cold x CPU "
        "| restarted x CPU | cache | peak RSS eager / cold / restarted (MiB) | bits |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        runs = row["runs"]
        errors = [f"{m}: {r['error']}" for m, r in runs.items() if "error" in r]
        if errors:
            lines.append(f"| {row['model']} | {'; '.join(errors)} |||||||| |")
            continue
        cold, warm = row.get("cold", {}), row.get("restarted", {})
        rss = " / ".join(f"{runs[m]['peak_rss'] / MIB:.0f}" for m in ("eager", "cold", "restarted"))
        cache = f"{warm.get('plan')}, placement {warm.get('placement')}"
        bits = "identical" if cold.get("identical") and warm.get("identical") else "DIFFER"
        lines.append(
            f"| {row['model']} | {row['eager_first']:.2f} | {_cell(cold.get('seconds'), '.2f')} "
            f"({cold.get('steps_before')}) | {_cell(cold.get('ratio'), '.2f')} | "
            f"{_cell(warm.get('seconds'), '.2f')} ({warm.get('steps_before')}) | {_cell(warm.get('ratio'), '.2f')} "
            f"| {_cell(cold.get('cpu_ratio'), '.2f')} | {_cell(warm.get('cpu_ratio'), '.2f')} "
            f"| {cache} | {rss} | {bits} |"
        )
    lines += ["", *breakdown(rows), ""]
    for mode in ("restarted", "cold"):
        for unit, key in (("wall", "ratio"), ("CPU", "cpu_ratio")):
            met = [r["model"] for r in rows if ((r.get(mode) or {}).get(key) or 3) <= 2]
            missed = ", ".join(r["model"] for r in rows if r["model"] not in met) or "none"
            within = ", ".join(met) or "none"
            lines.append(f"{mode.capitalize()} within 2x eager's first step ({unit} seconds): {within}; not: {missed}.")
    return "\n".join(lines)


def _load_line(args: argparse.Namespace) -> list[str]:
    """The machine's load average (1 minute) when the run began and ended, if it was taken."""
    load = getattr(args, "load", None)
    if not load:
        return []
    cores = os.cpu_count()
    return [f"Load average (1 min) at the start / end of the run: {load[0]:.1f} / {load[1]:.1f} on {cores} cores."]


def breakdown(rows: list[dict[str, Any]]) -> list[str]:
    """Where memplan's seconds to the first replayed step go, from its report's ``first_steps``."""
    lines = [
        "Where memplan's seconds go (its `report['first_steps']`): compiling the step (capture, then the",
        "graph plan: solved and stored, or read and validated; for restarted also reading and validating",
        "the placed recording and mapping its arena), the placement of the recorded step when solved",
        "(cold: right after the step it places), and the steps up to and including the first replayed one.",
        "other: the rest of compiling: the capture's first run on fakes, untraced (it creates the",
        "optimizer's state and shows the literals; capture seconds count the traced run only), the",
        "runner's build, and the garbage collection that gives capture's memory back. fake runs: 2 with",
        "that untraced run; 1 where the cache's record of it held (a restart: the optimizer's state made",
        "by one step() of the optimizer on fakes, the trace checked by the capture's fingerprint).",
        "",
        "| model | run | compile (s) | of which capture (s) | of which graph plan (s) | of which other (s) "
        "| placement (s) | steps (s) | fake runs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for mode in ("cold", "restarted"):
            run, summary = row["runs"].get(mode, {}), row.get(mode) or {}
            first = run.get("first_steps", {})
            if "error" in run or summary.get("seconds") is None:
                continue
            planning, placing = first.get("planning_seconds", 0.0), first.get("placing_seconds", 0.0)
            capture, plan = first.get("capture_seconds", 0.0), first.get("plan_seconds", 0.0)
            # a cached placement is read while the step is compiled, a solved one during a step
            steps = summary["seconds"] - planning - (placing if mode == "cold" else 0.0)
            other = planning - capture - plan - (placing if mode == "restarted" else 0.0)
            lines.append(
                f"| {row['model']} | {mode} | {planning:.2f} | {capture:.2f} | {plan:.2f} ({first.get('plan')}) "
                f"| {other:.2f} | {placing:.2f} ({first.get('placement')}) | {steps:.2f} "
                f"({summary['steps_before'] + 1} steps) | {first.get('fake_runs', '-')} |"
            )
    return lines


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        mode, model, batch, steps, cache, out = sys.argv[2:8]
        child(mode, model, int(batch), int(steps), cache, Path(out))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "first_step.md")
    parser.add_argument("--json", type=Path, default=None, help="also write every number here")
    parser.add_argument("--render", type=Path, default=None, help="write the table of a saved --json run, run nothing")
    parser.add_argument("--repeat", type=int, default=1, help="trials per model; the fastest is reported")
    parser.add_argument("--src", type=Path, default=ROOT / "src", help="the memplan sources to run (another revision)")
    parser.add_argument(
        "--reproducible",
        action="store_true",
        help="run every process with MKL_CBWR=COMPATIBLE: MKL's GEMMs give the same bits in every process (slower)",
    )
    args = parser.parse_args()
    if args.render is not None:
        saved = json.loads(args.render.read_text())
        args.load, args.repeat = saved.get("load"), saved.get("repeat", 1)
        table = markdown(saved["rows"], args, saved["command"])
        args.out.write_text(table + "\n")
        print(table)
        return
    command = "python bench/first_step.py " + " ".join(sys.argv[1:])
    rows = []
    start_load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as folder:
        args.env = snapshot(Path(folder), args.src)
        if args.reproducible:
            args.env["MKL_CBWR"] = "COMPATIBLE"
        for model in args.models:
            rows.append(measure(model, args))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "runs"}), flush=True)
    args.load = (start_load, os.getloadavg()[0])
    table = markdown(rows, args, command.strip())
    print(table)
    args.out.write_text(table + "\n")
    if args.json is not None:
        saved = {"command": command.strip(), "load": args.load, "repeat": args.repeat, "rows": rows}
        args.json.write_text(json.dumps(saved, indent=2))


if __name__ == "__main__":
    main()
