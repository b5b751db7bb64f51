"""Fit what eager cannot: each contender trains the same step under a hard memory limit, side by side.

Per model: a reference process runs the eager step at the target batch (under a safety cap only)
and saves its losses and parameters after ``--steps`` steps; eager's peak there sets the limits
(``--limits``: fractions of it). At each limit every contender runs in its own process under a
memory cgroup the bench makes for that child and removes after (:mod:`memplan.torch.memlimit`;
where none can be made, the output says so and the resident set is only watched):

* ``eager``: the plain step;
* ``checkpoint``: ``torch.utils.checkpoint`` (non-reentrant) around every block (HF:
  ``gradient_checkpointing_enable``; ResNet: each bottleneck; U-Net: each double conv);
* ``accumulate``: the same batch as k micro-batches with gradient accumulation (k = 2, 4, ...:
  the first that fits; the math is eager's up to rounding, and BatchNorm's statistics change);
* ``compile``: ``torch.compile`` (inductor) of model + loss with
  ``torch._functorch.config.activation_memory_budget`` at ``--compile-budgets`` (the largest that
  fits; ``fallback_random`` so dropout draws eager's numbers);
* ``memplan``: ``memplan.compile_step(..., memory_budget=limit - the child's RSS after its imports
  - --margin-mib)``;
* ``memplan-fit``: the same with ``memory_budget="fit"``: memplan reads the cgroup's limit itself.

Per try: fits or killed (OOM: the cgroup's ``oom_kill`` count, exit signal 9), the cgroup's peak
charge and the child's VmHWM, the median steady step time (steps after the first), the largest
difference in loss and in parameters to the reference after the same steps, and compute overhead
(FLOPs of one step / the reference's, FlopCounterMode on fake tensors; memplan: its plan's report;
compile: n/a). ``--max-batch MODEL,...``: the largest batch each contender trains within the first limit
(doubling/halving from the target batch, then bisection; 3 steps per try, each its own process).

    python bench/fit.py --quick
    python bench/fit.py --models gpt2-2l,unet --limits 0.7,0.5 --max-batch gpt2-2l
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20
GIB = 2**30
CONTENDERS = ("eager", "checkpoint", "accumulate", "compile", "memplan", "memplan-fit")
STEADY_FROM = 1  # steps before this index are warm-up (capture, planning, compilation)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    batch: int  # the target batch
    description: str


MODELS = {
    "gpt2-2l": ModelSpec("gpt2-2l", 16, "GPT-2 LM, 2 layers, 128 tokens (HF config)"),
    "gpt2": ModelSpec("gpt2", 8, "GPT-2 small LM, 12 layers, 128 tokens (HF config, 124M params)"),
    "llama": ModelSpec(
        "llama",
        2,
        "Llama-style decoder (HF LlamaForCausalLM): 4 layers, hidden 1024, 16 heads, "
        "MLP 2816, vocab 32000, 512 tokens (0.12B params)",
    ),
    "llama-0.3b": ModelSpec(
        "llama-0.3b",
        1,
        "Llama-style decoder (HF LlamaForCausalLM): 8 layers, hidden 1536, 16 heads, "
        "MLP 4096, vocab 32000, 512 tokens (0.32B params)",
    ),
    "resnet50": ModelSpec("resnet50", 16, "ResNet-50 (HF config), 224x224"),
    "unet": ModelSpec("unet", 16, "U-Net, 4 levels, 128x128 (repo model)"),
}
QUICK = ModelSpec("mlp", 4096, "4-layer MLP, 1024-2048 wide (repo model); --quick")
QUICK_LIMIT = 0.9


# ================================================================ the child: one try


LLAMAS = {  # name: (layers, hidden, MLP); 16 heads, vocab 32000, 512 tokens
    "llama": (4, 1024, 2816),
    "llama-0.3b": (8, 1536, 4096),
}


def _llama(name: str, batch: int) -> Any:
    import transformers

    import torch
    from memplan.torch.zoo import Logits, Workload, _skip_init_if_fake, _token_loss

    layers, hidden, mlp = LLAMAS[name]
    cfg = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
        max_position_embeddings=512,
    )
    with _skip_init_if_fake():  # fake tensors (FLOP counting) have no values to initialise
        model = Logits(transformers.LlamaForCausalLM(cfg))
    tokens = torch.randint(0, cfg.vocab_size, (batch, 512))
    return Workload(model, tokens, torch.randint(0, cfg.vocab_size, (batch, 512)), _token_loss)


def build(model: str, batch: int) -> Any:
    """The zoo's workload (seed 0), or one of the bench's Llamas."""
    import torch
    from memplan.torch.zoo import build_workload

    if model in LLAMAS:
        torch.manual_seed(0)
        return _llama(model, batch)
    return build_workload(model, batch)


def checkpoint_blocks(model: Any) -> str:
    """Non-reentrant activation checkpointing around every block of a bench model; how."""
    hf = getattr(model, "model", None)
    if hf is not None and getattr(hf, "supports_gradient_checkpointing", False):
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return "HF gradient_checkpointing_enable(use_reentrant=False)"
    if hf is not None and hasattr(hf, "resnet"):
        for stage in hf.resnet.encoder.stages:
            for i, layer in enumerate(stage.layers):
                stage.layers[i] = _checkpointed(layer)
        return "checkpoint around each ResNet bottleneck"
    if hasattr(model, "down") and hasattr(model, "merge"):
        for blocks in (model.down, model.merge):
            for i, block in enumerate(blocks):
                blocks[i] = _checkpointed(block)
        model.bottom = _checkpointed(model.bottom)
        return "checkpoint around each U-Net double conv"
    raise SystemExit(f"no checkpointing recipe for {type(model).__name__}")


def _checkpointed_class() -> type:
    from torch.utils.checkpoint import checkpoint

    import torch

    class Checkpointed(torch.nn.Module):
        """``block`` run under ``torch.utils.checkpoint`` (parameters keep their order)."""

        def __init__(self, block: torch.nn.Module) -> None:
            super().__init__()
            self.block = block

        def forward(self, *args: Any) -> Any:
            return checkpoint(self.block, *args, use_reentrant=False)

    return Checkpointed


def _checkpointed(block: Any) -> Any:
    """``block`` under checkpoint (the class is made on first use: torch is imported in the child only)."""
    return _checkpointed_class()(block)


def make_step(spec: dict[str, Any], w: Any, opt: Any, baseline: int) -> tuple[Any, dict[str, Any]]:
    """The contender's step (no argument; returns the loss) and what it says about itself."""
    kind = spec["contender"]
    if kind == "checkpoint":
        return _eager_step(w, opt), {"setting": checkpoint_blocks(w.model)}
    if kind == "accumulate":
        return _accumulate_step(w, opt, spec["micro"]), {}
    if kind == "compile":
        return _compile_step(w, opt, spec["amb"]), {}
    if kind in ("memplan", "memplan-fit"):
        return _memplan_step(spec, w, opt, baseline)
    return _eager_step(w, opt), {}


def _eager_step(w: Any, opt: Any) -> Any:
    def step() -> Any:
        loss = w.loss_fn(w.model(w.inputs), w.target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def _accumulate_step(w: Any, opt: Any, micro: int) -> Any:
    pieces = list(zip(w.inputs.chunk(micro), w.target.chunk(micro), strict=True))

    def step() -> Any:
        total = 0.0
        for x, y in pieces:
            loss = w.loss_fn(w.model(x), y) / micro
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return step


def _compile_step(w: Any, opt: Any, budget: float) -> Any:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    import torch

    functorch_config.activation_memory_budget = budget
    inductor_config.fallback_random = True  # dropout draws eager's random numbers
    forward = torch.compile(lambda x, y: w.loss_fn(w.model(x), y))

    def step() -> Any:
        loss = forward(w.inputs, w.target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def _memplan_step(spec: dict[str, Any], w: Any, opt: Any, baseline: int) -> tuple[Any, dict[str, Any]]:
    import memplan

    budget = "fit" if spec["contender"] == "memplan-fit" else spec.get("memplan_budget")
    budget = budget or int(spec["limit"] - baseline - spec["margin"])
    started = time.perf_counter()
    compiled = memplan.compile_step(w.model, opt, w.loss_fn, (w.inputs, w.target), memory_budget=budget)
    b = compiled.report.get("budget") or {}
    info = {
        "setting": f"memory_budget={budget if isinstance(budget, str) else f'{budget / MIB:.0f}MiB'}",
        "budget_bytes": b.get("budget_bytes"),
        "planned_peak_bytes": b.get("planned_peak_bytes"),
        "overhead": b.get("overhead"),
        "method": b.get("method"),
        "plan_seconds": round(time.perf_counter() - started, 1),
        "fit_limit": b.get("limit"),
    }
    return (lambda: compiled((w.inputs, w.target))), info


def max_abs_diff(params: list[Any], reference_path: str) -> float:
    """The largest |p - ref| over every parameter, a million elements at a time (little memory)."""
    import torch

    reference = torch.load(reference_path, mmap=True)
    worst = 0.0
    for p, r in zip(params, reference, strict=True):
        a, b = p.detach().reshape(-1), r.reshape(-1)
        for start in range(0, a.numel(), 2**20):
            d = (a[start : start + 2**20] - b[start : start + 2**20]).abs().max()
            worst = max(worst, float(d))
    return worst


def count_flops(spec: dict[str, Any]) -> int:
    """FLOPs of one step of the contender's recipe, run on fake tensors (FlopCounterMode on the
    real step would hold what checkpointing frees: ResNet-50 b16 checkpointed peaks at 2686 MiB
    counted, 1540 MiB not)."""
    from torch.utils.flop_counter import FlopCounterMode

    from memplan.torch.capture.fake import new_fake_mode
    from memplan.torch.zoo import make_optimizer

    with new_fake_mode():
        w = build(spec["model"], spec["batch"])
        opt = make_optimizer("adamw", w.model.parameters())
        step, _ = make_step(spec, w, opt, 0)
        with FlopCounterMode(display=False) as counter:
            step()
    return counter.get_total_flops()


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One try: build, set up the contender, run the steps, measure, compare (or save)."""
    import transformers  # noqa: F401 (imported before the baseline is read: part of every process)

    import torch
    from memplan.errors import MemplanError
    from memplan.torch.rss import rss_bytes
    from memplan.torch.zoo import make_optimizer

    progress = Path(spec["out"] + ".progress")
    baseline = rss_bytes()
    progress.write_text("counting FLOPs on fake tensors\n")
    flops = count_flops(spec) if spec["contender"] in ("eager", "checkpoint", "accumulate") else None
    _note(progress, "building the model")
    w = build(spec["model"], spec["batch"])
    opt = make_optimizer("adamw", w.model.parameters())
    phases = {"build": _phase_peak()}  # VmHWM of each phase (the whole life's is their maximum)
    out: dict[str, Any] = {"baseline_rss_bytes": baseline, "phase_peak_rss_bytes": phases}
    try:
        _note(progress, "setting up (memplan: capture and plan; checkpoint: wrap)")
        step, info = make_step(spec, w, opt, baseline)
    except MemplanError as err:
        return {**out, "refused": str(err).splitlines()[0]}
    phases["setup"] = _phase_peak()
    out.update(info)
    times, losses = [], []
    for i in range(spec["steps"]):
        _note(progress, f"step {i + 1}")
        started = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - started)
        losses.append(float(loss))
        phases[f"step {i + 1}"] = _phase_peak()
    last = phases[f"step {spec['steps']}"]
    out.update(last_step_peak_rss_bytes=last, step_seconds=times, losses=losses, flops=flops)
    _note(progress, "comparing or saving the parameters")
    params = list(w.model.parameters())
    if spec.get("save"):
        torch.save([p.detach().clone() for p in params], spec["save"])
    if spec.get("reference"):
        out["max_abs_diff_params"] = max_abs_diff(params, spec["reference"])
    phases["compare"] = _phase_peak()  # the reference is mapped from its file: its pages count as resident
    return out


def _phase_peak() -> int:
    """VmHWM since the last call (the process's start the first time), then reset."""
    from memplan.torch.rss import peak_rss_bytes, reset_peak_rss

    peak = peak_rss_bytes()
    reset_peak_rss()
    return peak


def _note(progress: Path, what: str) -> None:
    """Where the child is (the parent reads the last line of a killed try)."""
    with progress.open("a") as f:
        f.write(what + "\n")


def child_main(raw: str) -> None:
    from memplan.torch.rss import peak_rss_bytes

    spec = json.loads(raw)
    result = child(spec)
    phases = result.get("phase_peak_rss_bytes") or {}
    # whole life: building, first steps, comparing included
    result["vmhwm_bytes"] = max([peak_rss_bytes(), *phases.values()])
    Path(spec["out"]).write_text(json.dumps(result))


# ================================================================ the parent: tries under limits


def run_try(spec: dict[str, Any], limit: int, timeout: float, tmp: Path) -> dict[str, Any]:
    """``spec`` in its own process under ``limit`` bytes; what happened, and what the child said."""
    from memplan.torch.memlimit import run_limited

    out = tmp / f"try-{time.monotonic_ns()}.json"
    spec = {**spec, "out": str(out), "limit": limit}
    run = run_limited([sys.executable, __file__, "--child", json.dumps(spec)], limit, timeout=timeout)
    row: dict[str, Any] = {
        "contender": spec["contender"],
        "batch": spec["batch"],
        "limit_bytes": limit,
        "outcome": run.outcome,
        "mechanism": run.mechanism,
        "cgroup_peak_bytes": run.peak_bytes,
        "watched_peak_bytes": run.watched_peak_bytes,
        "wall_seconds": round(run.seconds, 1),
    }
    progress = Path(str(out) + ".progress")
    if progress.exists():
        row["last_phase"] = progress.read_text().splitlines()[-1]
        progress.unlink()
    row["setting"] = describe(spec)
    if out.exists():
        row.update(json.loads(out.read_text()))
        out.unlink()
        if "refused" in row:
            row["outcome"] = "refused"
    elif run.outcome.startswith("failed"):
        lines = (run.stderr or run.stdout).strip().splitlines() or ["no output"]
        row["error"] = lines[-1][:300]
    return row


def describe(spec: dict[str, Any]) -> str:
    """The contender's setting, as the parent knows it (the child refines memplan's)."""
    if spec["contender"] == "accumulate":
        return f"{spec['micro']} micro-batches of {spec['batch'] // spec['micro']}"
    if spec["contender"] == "compile":
        return f"activation_memory_budget={spec['amb']}"
    if spec["contender"] == "checkpoint":
        return "checkpoint around every block"
    if spec["contender"] == "memplan-fit":
        return 'memory_budget="fit"'
    if spec["contender"] == "memplan":
        budget = spec.get("memplan_budget")
        return f"memory_budget={budget}" if budget else f"memory_budget=limit - baseline - {_mib(spec['margin'])} MiB"
    return ""


def steady(row: dict[str, Any]) -> float | None:
    times = row.get("step_seconds") or []
    return statistics.median(times[STEADY_FROM:]) if len(times) > STEADY_FROM else None


def compare(row: dict[str, Any], reference: dict[str, Any]) -> None:
    """Loss difference and compute overhead against the reference (in place)."""
    if row.get("losses") and reference.get("losses"):
        row["max_abs_diff_loss"] = max(abs(a - b) for a, b in zip(row["losses"], reference["losses"], strict=True))
    if row.get("flops") and reference.get("flops"):
        row["overhead"] = row["flops"] / reference["flops"] - 1


class Bench:
    """The bench's state: arguments, results so far, and where they are written."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        from memplan.torch.memlimit import probe

        self.args, self.tmp = args, tmp
        self.mechanism, self.where = probe()
        self.results: list[dict[str, Any]] = []

    def spec(self, model: ModelSpec, contender: str, batch: int, **extra: Any) -> dict[str, Any]:
        return {
            "model": model.name,
            "batch": batch,
            "contender": contender,
            "steps": self.args.steps,
            "margin": self.args.margin_mib * MIB,
            "memplan_budget": self.args.memplan_budget,
            **extra,
        }

    def attempt(self, entry: dict[str, Any], spec: dict[str, Any], limit: int) -> dict[str, Any]:
        row = run_try(spec, limit, self.args.timeout, self.tmp)
        compare(row, entry["reference"])
        print(f"  {_line(row)}", flush=True)
        return row

    def reference(self, model: ModelSpec, entry: dict[str, Any]) -> bool:
        """Eager at the target batch under the safety cap only; saves its parameters."""
        saved = str(self.tmp / f"{model.name}-reference.pt")
        spec = self.spec(model, "eager", model.batch, save=saved)
        row = run_try(spec, int(self.args.cap_gib * GIB), self.args.timeout, self.tmp)
        entry["reference"], entry["reference_path"] = row, saved
        print(f"  reference: {_line(row)}", flush=True)
        return row["outcome"] == "fits"

    def at_limit(self, model: ModelSpec, entry: dict[str, Any], limit: int) -> None:
        for contender in self.args.contenders:
            for extra in self._settings(contender, model.batch):
                spec = self.spec(model, contender, model.batch, reference=entry["reference_path"], **extra)
                row = self.attempt(entry, spec, limit)
                entry["rows"].append(row)
                self.write()
                if row["outcome"] == "fits":
                    break

    def _settings(self, contender: str, batch: int) -> list[dict[str, Any]]:
        if contender == "accumulate":
            return [{"micro": k} for k in (2, 4, 8, 16, 32, 64) if k <= batch and batch % k == 0]
        if contender == "compile":
            return [{"amb": b} for b in sorted(self.args.compile_budgets, reverse=True)]
        return [{}]

    def max_batch(self, model: ModelSpec, entry: dict[str, Any], limit: int) -> None:
        """The largest batch each contender trains within ``limit`` (3 steps per try)."""
        grain = self.args.max_batch_grain
        entry["max_batch"] = {"limit_bytes": limit, "grain": grain, "cap": self.args.max_batch_cap, "contenders": {}}
        for contender in [c for c in self.args.contenders if c != "accumulate"]:
            extra = {"amb": min(self.args.compile_budgets)} if contender == "compile" else {}
            tries: dict[int, str] = {}

            def fits(batch: int, contender: str = contender, extra: dict = extra, tries: dict = tries) -> bool:
                spec = {**self.spec(model, contender, batch, **extra), "steps": 3}
                row = self.attempt(entry, spec, limit)
                tries[batch] = row["outcome"]
                return row["outcome"] == "fits"

            best = largest_batch(fits, model.batch, self.args.max_batch_cap, grain)
            entry["max_batch"]["contenders"][contender] = {"batch": best, "tries": tries, **extra}
            self.write()

    def write(self) -> None:
        out = self.args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"command": self.command, "mechanism": self.mechanism, "where": self.where, "steps": self.args.steps}
        meta["limit_base"] = "vmhwm"
        meta["json"] = _shown(out.with_suffix(".json"))
        out.with_suffix(".json").write_text(json.dumps({**meta, "models": self.results}, indent=1, default=str))
        out.with_suffix(".md").write_text(markdown(meta, self.results))

    @property
    def command(self) -> str:
        return "python bench/fit.py " + " ".join(sys.argv[1:])


def largest_batch(fits: Any, start: int, cap: int, grain: int = 1) -> int:
    """The largest batch ``b <= cap`` with ``fits(b)`` (0: not even 1), assuming fitting is
    monotone: doubling (or halving) from ``start``, then bisection until the largest batch that fits
    and the smallest that does not are at most ``grain`` apart (1: exact)."""
    low, high = 0, min(start, cap)
    if fits(high):
        low, high = high, 0
        while not high:
            if low >= cap:
                return low
            probe = min(2 * low, cap)
            low, high = (probe, 0) if fits(probe) else (low, probe)
    else:
        while not low and high > 1:
            probe = high // 2
            low, high = (probe, high) if fits(probe) else (0, probe)
        if not low:
            return 0
    while high - low > max(grain, 1):
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


# ================================================================ output


def _mib(value: Any) -> str:
    return f"{value / MIB:.0f}" if isinstance(value, (int, float)) else "-"


def _num(value: Any, fmt: str = ".2g") -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "-"


def _line(row: dict[str, Any]) -> str:
    return (
        f"{row['contender']:<10} b{row['batch']:<3} {row.get('setting', '') or '':<45} {row['outcome']:<14} "
        f"cgroup {_mib(row.get('cgroup_peak_bytes'))} MiB, VmHWM {_mib(row.get('vmhwm_bytes'))} MiB, "
        f"step {_num(steady(row), '.2f')} s, dloss {_num(row.get('max_abs_diff_loss'))}, "
        f"dparam {_num(row.get('max_abs_diff_params'))} {row.get('refused') or row.get('error') or ''} "
        f"[{row.get('last_phase', '')}]"
    )


def _overhead(row: dict[str, Any]) -> str:
    if row["contender"] == "compile":
        return "n/a"
    value = row.get("overhead")
    return f"+{100 * value:.2f}%" if isinstance(value, (int, float)) else "-"


def _row(row: dict[str, Any], eager_step: float | None) -> str:
    step = steady(row)
    ratio = f"{step / eager_step:.2f}" if step and eager_step else "-"
    note = " ".join(filter(None, [row.get("remark"), row.get("refused") or row.get("error")]))
    if row["outcome"] != "fits" and row.get("last_phase"):
        note = f"ended during: {row['last_phase']}; {note}"
    if row["contender"].startswith("memplan") and row.get("planned_peak_bytes"):
        note = (
            f"budget {_mib(row.get('budget_bytes'))} MiB, planned {_mib(row['planned_peak_bytes'])} MiB "
            f"({row.get('method')}); {note}"
        )
    phases = row.get("phase_peak_rss_bytes") or {}
    if row["contender"].startswith("memplan") and row["outcome"] == "fits" and phases:
        note += " VmHWM by phase MiB: " + ", ".join(f"{name} {_mib(peak)}" for name, peak in phases.items())
    return (
        f"| {_mib(row['limit_bytes'])} | {row['contender']} | {row.get('setting') or ''} | **{row['outcome']}** | "
        f"{_mib(row.get('cgroup_peak_bytes'))} | {_mib(row.get('vmhwm_bytes'))} | "
        f"{_mib(row.get('last_step_peak_rss_bytes'))} | {_num(step, '.2f')} | {ratio} | "
        f"{_num(row.get('max_abs_diff_loss'))} | {_num(row.get('max_abs_diff_params'))} | {_overhead(row)} | "
        f"{note.replace('|', '/')} |"
    )


def _model_section(entry: dict[str, Any]) -> list[str]:
    ref = entry["reference"]
    eager_step = steady(ref)
    if not entry.get("rows") and ref["outcome"].startswith("not run"):  # --max-batch-only: the search alone
        lines = [
            f"## {entry['model']}, largest batch (search from {entry['batch']}): {entry['description']}",
            "",
            f"`{entry.get('command', '')}`: no reference run (the limit is in bytes); no diffs are taken here.",
            "",
        ]
        return lines + _max_batch_lines(entry)
    lines = [
        f"## {entry['model']}, batch {entry['batch']}: {entry['description']}",
        "",
        f"`{entry.get('command', '')}`: {len(ref.get('step_seconds') or []) or '?'} steps per try.",
        "",
        f"Reference (eager, safety cap only): **{ref['outcome']}**, cgroup peak {_mib(ref.get('cgroup_peak_bytes'))} "
        f"MiB, VmHWM {_mib(ref.get('vmhwm_bytes'))} MiB, RSS after imports {_mib(ref.get('baseline_rss_bytes'))} "
        f"MiB, steady step {_num(eager_step, '.2f')} s.",
        "",
        "| limit MiB | contender | setting | outcome | cgroup peak MiB | VmHWM MiB | last step VmHWM MiB "
        "| steady step s | x eager | max abs diff loss | max abs diff params | compute overhead | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(_row(r, eager_step) for r in entry.get("rows", [])),
        "",
    ]
    return lines + _max_batch_lines(entry)


def _max_batch_lines(entry: dict[str, Any]) -> list[str]:
    """The largest-batch table of one model, if it was searched."""
    lines: list[str] = []
    mb = entry.get("max_batch")
    if mb:
        grain = mb.get("grain", 1)
        cap = mb.get("cap") or _cap_in(entry.get("command", ""))
        coarse = (
            f"; bisection stopped once the largest batch that fits and the smallest that does not were at most {grain}"
            " apart, so the true largest batch may be up to "
            f"{grain - 1} more than shown (see the tries)"
            if grain > 1
            else ""
        )
        lines += [
            f"Largest batch within {_mib(mb['limit_bytes'])} MiB (3 steps per try, each its own process{coarse}):",
            "",
            "| contender | largest batch | tries (batch: outcome) |",
            "|---|---|---|",
        ]
        for name, c in mb["contenders"].items():
            tries = ", ".join(f"{b}: {o}" for b, o in sorted(c["tries"].items(), key=lambda kv: int(kv[0])))
            best = f"{c['batch']} (the search's cap: larger not tried)" if c["batch"] == cap else c["batch"]
            lines.append(f"| {name}{' (amb=' + str(c['amb']) + ')' if 'amb' in c else ''} | {best} | {tries} |")
        lines.append("")
    return lines


def _cap_in(command: str) -> int:
    """The ``--max-batch-cap`` of a command line (runs whose JSON predates the cap's field)."""
    found = re.search(r"--max-batch-cap[ =](\d+)", command)
    return int(found.group(1)) if found else 256


def render(out: Path, parts: list[Path]) -> None:
    """``--render OUT.json``: OUT.md again from the JSON; ``--merge OUT.json A.json B.json ...``:
    the models of several runs in one file, each under the command that made it."""
    runs = [json.loads(p.read_text()) for p in parts] or [json.loads(out.read_text())]
    models = [{"command": run["command"], "steps": run.get("steps"), **m} for run in runs for m in run["models"]]
    merged = {**runs[0], "command": "; ".join(dict.fromkeys(run["command"] for run in runs)), "models": models}
    merged["json"] = _shown(out)
    out.write_text(json.dumps(merged, indent=1, default=str))
    out.with_suffix(".md").write_text(markdown(merged, models))


def _shown(path: Path) -> str:
    """``path`` as a command line in the repository's root would name it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def markdown(meta: dict[str, Any], results: list[dict[str, Any]]) -> str:
    enforced = meta["mechanism"].startswith("cgroup")
    how = (
        f"a {meta['mechanism']} memory cgroup per try, made by the bench under `{meta['where']}` and removed after "
        "(swap limited to the same bytes): the kernel's OOM killer ends a try that needs more"
        if enforced
        else f"NOT enforced by the kernel ({meta['where']}): the resident set of each try's process tree is watched "
        "every 20 ms and the tree killed past the limit"
    )
    models = ", ".join(dict.fromkeys(str(entry["model"]) for entry in results))
    lines = [
        f"# Fit under a hard memory limit, side by side{': ' + models if models else ''}",
        "",
        f"Regenerate: `{meta['command']}` (`python bench/fit.py --render {meta.get('json', 'bench/results/fit.json')}` "
        "rewrites this "
        f"file from the JSON). Limit: {how}. CPU, AdamW, the number of steps per try under each model, the "
        f"same batch each step. A limit is bytes or a fraction of the reference's {_limit_base(meta)}. "
        "cgroup peak: what "
        "the kernel charged the try (its forked children included); VmHWM: the child's own peak resident set (shared "
        "libraries included), over its whole life and over its last step alone. Steady step: median of the steps "
        "after the first. Diffs: after the same steps, against the reference (eager without the limit, its own "
        "process). Compute overhead: FLOPs of one step over the reference's (FlopCounterMode, on fake tensors); "
        "memplan: its plan's recomputed FLOPs; compile: n/a). A killed try names the phase it was in. Shared "
        "2-core machine: timings are noisy, compare ratios within one run.",
        "",
    ]
    for entry in results:
        lines += _model_section(entry)
    return "\n".join(lines) + "\n"


# ================================================================ main


def parse_limit(text: str) -> float | int:
    """A fraction of the reference's peak (``0.6``) or bytes (``2600MiB``, ``2.5GiB``)."""
    units = {"mib": MIB, "gib": GIB}
    for unit, size in units.items():
        if text.lower().endswith(unit):
            return int(float(text[: -len(unit)]) * size)
    return float(text)


def _limit_base(meta: dict[str, Any]) -> str:
    """What a fractional limit was a fraction of, in the runs ``meta`` describes (older runs: the cgroup peak)."""
    if meta.get("limit_base") == "vmhwm":
        return "peak resident set (VmHWM: the cgroup's peak also holds the page cache of the file the reference saved)"
    return "cgroup peak"


def limit_bytes(limit: float | int, peak: int) -> int:
    return limit if isinstance(limit, int) else int(limit * peak)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2-2l,unet,resnet50,gpt2,llama", help=f"of {', '.join(MODELS)}")
    parser.add_argument("--batch", type=int, default=None, help="the target batch (default: the model's)")
    parser.add_argument("--limits", default="0.8,0.6", help="fractions of the reference's peak, or 2600MiB")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--compile-budgets", default="0.5,0.3,0.1")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--margin-mib", type=float, default=256, help="memplan's budget: limit - baseline - this")
    parser.add_argument("--memplan-budget", default=None, help="give memplan this memory_budget instead (e.g. fit)")
    parser.add_argument("--max-batch", default="", help="models whose largest batch is searched (first limit)")
    parser.add_argument("--max-batch-cap", type=int, default=256)
    parser.add_argument("--max-batch-grain", type=int, default=1, help="stop bisecting at this gap (1: exact)")
    parser.add_argument("--max-batch-only", action="store_true", help="only the largest-batch search")
    parser.add_argument("--cap-gib", type=float, default=6.0, help="the reference's safety limit")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per try")
    parser.add_argument("--quick", action="store_true", help="one small model (MLP, batch 4096), one limit (0.9)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fit.md")
    args = parser.parse_args()
    args.contenders = [c for c in args.contenders.split(",") if c]
    unknown = [c for c in args.contenders if c not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contender(s) {', '.join(unknown)}; choose from {', '.join(CONTENDERS)}")
    args.compile_budgets = [float(b) for b in args.compile_budgets.split(",")]
    args.limits = [parse_limit(f) for f in args.limits.split(",")]
    if args.quick:
        args.models, args.limits = "quick", [QUICK_LIMIT]
    names = [m for m in args.models.split(",") if m]
    bad = [m for m in names if m not in MODELS and m != "quick"]
    if bad:
        parser.error(f"unknown model(s) {', '.join(bad)}; choose from {', '.join(MODELS)}")
    args.specs = [QUICK if m == "quick" else MODELS[m] for m in names]
    if args.batch:
        args.specs = [ModelSpec(s.name, args.batch, s.description) for s in args.specs]
    args.max_batch = [m for m in args.max_batch.split(",") if m]
    return args


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(sys.argv[2])
        return
    if len(sys.argv) >= 3 and sys.argv[1] in ("--render", "--merge"):
        render(Path(sys.argv[2]), [Path(p) for p in sys.argv[3:]])
        return
    args = parse()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the try's cgroup is removed, its child killed
    with tempfile.TemporaryDirectory(prefix="memplan-fit-") as tmp:
        bench = Bench(args, Path(tmp))
        print(f"limit: {bench.mechanism} ({bench.where})", flush=True)
        for model in args.specs:
            entry = {"model": model.name, "batch": model.batch, "description": model.description, "rows": []}
            entry["command"] = bench.command  # each table's header names the command that made it
            bench.results.append(entry)
            print(f"{model.name} batch {model.batch}", flush=True)
            if args.max_batch_only and all(isinstance(limit, int) for limit in args.limits):
                entry["reference"] = {"outcome": "not run (--max-batch-only with a limit in bytes)"}
                bench.max_batch(model, entry, args.limits[0])
                continue
            if not bench.reference(model, entry):
                bench.write()
                continue
            # eager's peak RSS, as the issue states the limits: the cgroup's peak also holds the page
            # cache of the reference file the bench saved (Llama 0.3B: 6825 vs 6233 MiB)
            peak = entry["reference"].get("vmhwm_bytes") or entry["reference"]["cgroup_peak_bytes"]
            for limit in [] if args.max_batch_only else args.limits:
                bench.at_limit(model, entry, limit_bytes(limit, peak))
            if args.max_batch_only or model.name in args.max_batch or (args.quick and args.max_batch):
                bench.max_batch(model, entry, limit_bytes(args.limits[0], peak))
            bench.write()
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
