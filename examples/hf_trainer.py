"""HF Trainer with memplan: ``Trainer`` -> ``MemplanTrainer``, one changed line, same bits.

python examples/hf_trainer.py [--out DIR] [--bf16] [--steps 5] [--accumulation 2] [--budget 0.8]

Trains a 2-layer GPT-2 built from a config (nothing downloaded) for a few optimizer steps, once
with ``transformers.Trainer`` and once with ``MemplanTrainer``, each in a fresh process from the
same seed (gradient accumulation, ``max_grad_norm`` clipping, a warmup-linear schedule, dropout,
an evaluation and a checkpoint at the end), and prints the losses, the largest difference in any
parameter, and the peak resident memory of both. The Trainer's output (the checkpoint) goes to
``--out`` or a temporary folder, never into the checkout.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

MIB = 2**20


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="where the Trainers write (default: a temporary folder, removed afterwards)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps")
    p.add_argument("--accumulation", type=int, default=2, help="gradient_accumulation_steps")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--batch", type=int, default=8, help="per_device_train_batch_size")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--bf16", action="store_true", help="the Trainer's bf16=True (autocast on the CPU)")
    p.add_argument("--budget", help="MemplanTrainer(memory_budget=...): bytes, '2GiB' or a fraction such as 0.8")
    p.add_argument("--in-process", action="store_true", help="both sides in this process (no memory comparison)")
    p.add_argument("--side", choices=["plain", "memplan"], help=argparse.SUPPRESS)  # one side, in a child
    return p.parse_args(argv)


class TokenData(torch.utils.data.Dataset):
    """Random token sequences (a language-modelling batch: labels = inputs)."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def train_side(side: str, opts: argparse.Namespace, out_dir: str) -> dict[str, Any]:
    """Train with ``Trainer`` (side "plain") or ``MemplanTrainer``; return what both compare."""
    import transformers

    from memplan.torch import rss
    from memplan.torch.integrations.hf import MemplanTrainer

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=opts.vocab,
        n_embd=opts.hidden,
        n_layer=opts.layers,
        n_head=max(1, opts.hidden // 64),
        n_positions=opts.seq,
    )
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out_dir, side),
        use_cpu=True,
        seed=42,
        max_steps=opts.steps,
        per_device_train_batch_size=opts.batch,
        gradient_accumulation_steps=opts.accumulation,
        max_grad_norm=opts.max_grad_norm,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        warmup_steps=2,
        bf16=opts.bf16,
        logging_steps=1,
        save_strategy="steps",
        save_steps=opts.steps,
        eval_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    n = opts.batch * opts.accumulation * opts.steps
    data = {
        "train_dataset": TokenData(n, opts.seq, opts.vocab, 1),
        "eval_dataset": TokenData(opts.batch, opts.seq, opts.vocab, 2),
    }
    if side == "plain":
        trainer = transformers.Trainer(model=model, args=args, **data)
    else:
        trainer = MemplanTrainer(model=model, args=args, memory_budget=_budget(opts.budget), **data)
    peaks = _RssCallback(rss)
    trainer.add_callback(peaks)
    trainer.train()
    evaluation = trainer.evaluate()
    logs = [h for h in trainer.state.log_history if "loss" in h and "eval_loss" not in h]
    result = {
        "losses": [h["loss"] for h in logs],
        "grad_norms": [h.get("grad_norm") for h in logs],
        "learning_rates": [h.get("learning_rate") for h in logs],
        "eval_loss": evaluation["eval_loss"],
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "start_rss": peaks.windows.start,
        "rss_peaks": peaks.windows.peaks,
        "checkpoint": sorted(p.name for p in Path(args.output_dir).glob("checkpoint-*")),
    }
    if side == "memplan":
        report = trainer.memplan_step.report
        result["planned_peak_bytes"] = int(report["planned_peak_bytes"])
        result["program_order_peak_bytes"] = int(report["program_order_peak_bytes"])
        result["planning_seconds"] = trainer.memplan_step.planning_seconds
        budget = report.get("budget") or {}
        result["budget"] = {k: budget[k] for k in ("method", "budget_bytes", "planned_peak_bytes") if k in budget}
    return result


def _budget(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return text


def _peak_callback_base() -> type:
    from transformers import TrainerCallback

    return TrainerCallback


class _RssCallback(_peak_callback_base()):
    """:class:`RssWindows` over the Trainer's steps (the evaluation and the checkpoint after the
    last step left out)."""

    def __init__(self, rss: Any) -> None:
        self.rss = rss
        self.windows: RssWindows | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.windows = RssWindows(self.rss, state.max_steps)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.windows.step_done(state.global_step)


class RssWindows:
    """Peak RSS per window of steps: step 1 (memplan captures and plans in it), steps 2-3 (it
    records the allocations until two steps allocate alike), steps 4 on (it replays its plan);
    each window starts from the resident set the one before left, glibc's free pages returned."""

    def __init__(self, rss: Any, steps: int) -> None:
        self.rss, self.ends, self.begin = rss, sorted({1, min(3, steps), steps}), 1
        self.start = rss.rss_bytes()  # before step 1
        self.peaks: dict[str, int] = {}

    def step_done(self, step: int) -> None:
        if step in self.ends:
            label = f"step {step}" if self.begin == step else f"steps {self.begin}-{step}"
            self.peaks[label] = self.rss.peak_rss_bytes()
            self.rss.release_free_memory()
            self.rss.reset_peak_rss()
            self.begin = step + 1


WHAT_MEMPLAN_DOES = {1: "captures, plans", 2: "records allocations", 4: "replays its plan"}


def show_rss(plain: dict[str, Any], planned: dict[str, Any], names: tuple[str, str]) -> None:
    """The peak RSS of each window, both sides, and above the RSS each had before step 1."""
    if not plain["rss_peaks"] or not planned["rss_peaks"]:
        return
    print(f"peak RSS, MiB (fresh process per side)   {names[0]:>10} {names[1]:>10}  ratio   above RSS before step 1")
    for label, a in plain["rss_peaks"].items():
        b = planned["rss_peaks"][label]
        what = WHAT_MEMPLAN_DOES.get(int(label.split()[-1].split("-")[0]), "")
        above = f"{(a - plain['start_rss']) / MIB:7.1f} {(b - planned['start_rss']) / MIB:7.1f}"
        print(f"  {label:<10} (memplan {what + ')':<20} {a / MIB:10.1f} {b / MIB:10.1f}  {b / a:.3f}x  {above}")
    print(f"RSS before step 1: {plain['start_rss'] / MIB:.1f} / {planned['start_rss'] / MIB:.1f} MiB")


def run_in_child(side: str, argv: list[str], out_dir: str) -> dict[str, Any]:
    """One side in a fresh Python process (its own peak RSS); its result comes back through a file."""
    result_file = os.path.join(out_dir, f"{side}.pt")
    cmd = [sys.executable, __file__, *argv, "--side", side, "--out", out_dir]
    subprocess.run(cmd, check=True, env={**os.environ, "HF_RESULT_FILE": result_file})
    return torch.load(result_file, weights_only=False)


def compare(plain: dict[str, Any], planned: dict[str, Any]) -> dict[str, Any]:
    """Loss, gradient norm, learning rate and every parameter: equal, and the largest difference."""
    diff = max(
        (plain["params"][k].double() - planned["params"][k].double()).abs().max().item() for k in plain["params"]
    )
    same = all(torch.equal(plain["params"][k], planned["params"][k]) for k in plain["params"])
    same_logs = all(plain[k] == planned[k] for k in ("losses", "grad_norms", "learning_rates", "eval_loss"))
    return {"max_abs_diff": diff, "bit_identical": same and same_logs}


def show(plain: dict[str, Any], planned: dict[str, Any], verdict: dict[str, Any], opts: argparse.Namespace) -> None:
    print(
        f"GPT-2 {opts.layers} layers, hidden {opts.hidden}, vocab {opts.vocab}, batch {opts.batch} x {opts.seq} "
        f"tokens, accumulation {opts.accumulation}, max_grad_norm {opts.max_grad_norm}, bf16 {opts.bf16}"
    )
    print(f"{'step':>4}  {'Trainer loss':>14}  {'MemplanTrainer loss':>20}  {'grad norm':>10}")
    for i, (a, b) in enumerate(zip(plain["losses"], planned["losses"], strict=True), 1):
        print(f"{i:>4}  {a:>14.8f}  {b:>20.8f}  {plain['grad_norms'][i - 1]:>10.6f}")
    print(f"eval loss: Trainer {plain['eval_loss']:.8f}, MemplanTrainer {planned['eval_loss']:.8f}")
    print(
        f"parameters after {len(plain['losses'])} steps: max abs diff {verdict['max_abs_diff']}; "
        f"bit-identical (params, losses, grad norms, learning rates, eval): {verdict['bit_identical']}"
    )
    print(f"checkpoints: Trainer {plain['checkpoint']}, MemplanTrainer {planned['checkpoint']}")
    print(
        f"counted peak of the step (memplan's liveness): {planned['program_order_peak_bytes'] / MIB:.1f} MiB in "
        f"the Trainer's order, {planned['planned_peak_bytes'] / MIB:.1f} MiB planned; "
        f"planning {planned['planning_seconds']:.1f} s"
    )
    if planned.get("budget"):
        print(f"memory_budget: {planned['budget']}")
    show_rss(plain, planned, ("Trainer", "Memplan"))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run both sides, print the comparison and return it (``verdict``, ``plain``, ``memplan``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = parse(argv)
    if opts.side is not None:  # a child: one side, its result to the file the parent named
        torch.save(train_side(opts.side, opts, opts.out), os.environ["HF_RESULT_FILE"])
        return {}
    with tempfile.TemporaryDirectory(prefix="memplan-hf-") as tmp:
        out_dir = opts.out or tmp
        if opts.in_process:
            plain, planned = train_side("plain", opts, out_dir), train_side("memplan", opts, out_dir)
            plain["rss_peaks"] = planned["rss_peaks"] = {}  # one process: no comparison
        else:
            rest = _without_option(argv, "--out")
            plain, planned = run_in_child("plain", rest, out_dir), run_in_child("memplan", rest, out_dir)
    verdict = compare(plain, planned)
    show(plain, planned, verdict, opts)
    return {"verdict": verdict, "plain": plain, "memplan": planned}


def _without_option(argv: list[str], name: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


if __name__ == "__main__":
    result = main()
    if result and not result["verdict"]["bit_identical"]:
        sys.exit("MemplanTrainer differed from Trainer")
