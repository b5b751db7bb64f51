"""Accelerate with memplan: your own loop after ``accelerator.prepare(...)``, planned, same bits.

python examples/accelerate_loop.py [--out DIR] [--bf16] [--steps 5] [--accumulation 2] [--budget 0.8]

The step is the one written for Accelerate (``accelerator.backward``, ``accelerator.clip_grad_norm_``,
the prepared optimizer and scheduler, gradient accumulation over micro-batches inside the step);
``memplan.compile`` takes the objects ``prepare()`` returned as they are
(``memplan.torch.integrations.accelerate`` says how). A 2-layer BERT from a config (nothing
downloaded) trains a few steps with the plain step and with the planned one, each in a fresh
process from the same seed, and the script prints the losses, the largest difference in any
parameter and the peak resident memory of both. Results go to ``--out`` or a temporary folder, never into the checkout.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from typing import Any

import torch

MIB = 2**20


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="where the results are written (default: a temporary folder, removed afterwards)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps")
    p.add_argument("--accumulation", type=int, default=2, help="micro-batches per step")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="clipping (0: none)")
    p.add_argument("--batch", type=int, default=8, help="micro-batch size")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--bf16", action="store_true", help="Accelerator(mixed_precision='bf16'): autocast on the CPU")
    p.add_argument("--budget", help="memory_budget: bytes, '2GiB' or a fraction such as 0.8")
    p.add_argument("--in-process", action="store_true", help="both sides in this process (no memory comparison)")
    p.add_argument("--side", choices=["plain", "memplan"], help=argparse.SUPPRESS)  # one side, in a child
    return p.parse_args(argv)


def batches(opts: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    """Masked-language-model micro-batches, the same on both sides."""
    g = torch.Generator().manual_seed(1)
    n = opts.steps * opts.accumulation * opts.batch
    ids = torch.randint(0, opts.vocab, (n, opts.seq), generator=g)
    labels = torch.where(torch.rand(n, opts.seq, generator=g) < 0.15, ids, torch.full_like(ids, -100))
    return [
        {"input_ids": i, "attention_mask": torch.ones_like(i), "labels": lab}
        for i, lab in zip(ids, labels, strict=True)
    ]


def train_side(side: str, opts: argparse.Namespace) -> dict[str, Any]:
    """The user's Accelerate loop, eager ("plain") or planned ("memplan")."""
    import transformers
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    import memplan
    from memplan.torch import rss

    set_seed(0)
    accelerator = Accelerator(cpu=True, mixed_precision="bf16" if opts.bf16 else "no")
    config = transformers.BertConfig(
        vocab_size=opts.vocab,
        hidden_size=opts.hidden,
        num_hidden_layers=opts.layers,
        num_attention_heads=max(1, opts.hidden // 64),
        intermediate_size=4 * opts.hidden,
        max_position_embeddings=max(opts.seq, 64),
    )
    model = transformers.BertForMaskedLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 2, opts.steps)
    loader = torch.utils.data.DataLoader(batches(opts), batch_size=opts.batch * opts.accumulation, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    def train_step(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        total = 0.0
        for k in range(opts.accumulation):  # gradient accumulation, inside the step
            micro = {key: v[k * opts.batch : (k + 1) * opts.batch] for key, v in batch.items()}
            loss = model(**micro).loss / opts.accumulation
            accelerator.backward(loss)
            total = total + loss.detach()
        norm = accelerator.clip_grad_norm_(model.parameters(), opts.max_grad_norm or float("inf"))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        return total, norm

    if side == "memplan":  # the one line memplan adds
        budget = _budget(opts.budget)
        train_step = memplan.compile(
            train_step, model=model, optimizer=optimizer, scheduler=scheduler, memory_budget=budget
        )
    torch.manual_seed(7)  # dropout's draws: the same on both sides
    losses, norms = [], []
    windows = RssWindows(rss, opts.steps)
    for i, batch in enumerate(loader):
        loss, norm = train_step(batch)
        losses.append(loss.item())
        norms.append(norm.item())
        windows.step_done(i + 1)
    result = {
        "losses": losses,
        "grad_norms": norms,
        "learning_rates": scheduler.get_last_lr(),
        "params": {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
        "start_rss": windows.start,
        "rss_peaks": windows.peaks,
    }
    if side == "memplan":
        result["planned_peak_bytes"] = int(train_step.report["planned_peak_bytes"])
        result["program_order_peak_bytes"] = int(train_step.report["program_order_peak_bytes"])
        result["planning_seconds"] = train_step.planning_seconds
    return result


def _budget(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return text


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
    result_file = os.path.join(out_dir, f"accelerate-{side}.pt")
    cmd = [sys.executable, __file__, *argv, "--side", side, "--out", result_file]
    subprocess.run(cmd, check=True)
    return torch.load(result_file, weights_only=False)


def compare(plain: dict[str, Any], planned: dict[str, Any]) -> dict[str, Any]:
    """Losses, gradient norms, learning rates and every parameter: equal, and the largest difference."""
    keys = plain["params"]
    diff = max((plain["params"][k].double() - planned["params"][k].double()).abs().max().item() for k in keys)
    same = all(torch.equal(plain["params"][k], planned["params"][k]) for k in keys)
    same_logs = all(plain[k] == planned[k] for k in ("losses", "grad_norms", "learning_rates"))
    return {"max_abs_diff": diff, "bit_identical": same and same_logs}


def show(plain: dict[str, Any], planned: dict[str, Any], verdict: dict[str, Any], opts: argparse.Namespace) -> None:
    print(
        f"BERT (masked LM) {opts.layers} layers, hidden {opts.hidden}, vocab {opts.vocab}, micro-batch {opts.batch} x "
        f"{opts.seq} tokens, accumulation {opts.accumulation}, max_grad_norm {opts.max_grad_norm}, bf16 {opts.bf16}"
    )
    print(f"{'step':>4}  {'Accelerate loss':>16}  {'memplan loss':>14}  {'grad norm':>10}")
    for i, (a, b) in enumerate(zip(plain["losses"], planned["losses"], strict=True), 1):
        print(f"{i:>4}  {a:>16.8f}  {b:>14.8f}  {plain['grad_norms'][i - 1]:>10.6f}")
    print(
        f"parameters after {len(plain['losses'])} steps: max abs diff {verdict['max_abs_diff']}; "
        f"bit-identical (params, losses, grad norms, learning rates): {verdict['bit_identical']}"
    )
    print(
        f"counted peak of the step (memplan's liveness): {planned['program_order_peak_bytes'] / MIB:.1f} MiB in "
        f"the loop's order, {planned['planned_peak_bytes'] / MIB:.1f} MiB planned; "
        f"planning {planned['planning_seconds']:.1f} s"
    )
    show_rss(plain, planned, ("Accelerate", "memplan"))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run both sides, print the comparison and return it (``verdict``, ``plain``, ``memplan``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = parse(argv)
    if opts.side is not None:  # a child: one side, its result to the file the parent named
        torch.save(train_side(opts.side, opts), opts.out)
        return {}
    if opts.in_process:
        plain, planned = train_side("plain", opts), train_side("memplan", opts)
        plain["rss_peaks"] = planned["rss_peaks"] = {}  # one process: no comparison
    else:
        with tempfile.TemporaryDirectory(prefix="memplan-accelerate-") as tmp:
            out_dir = opts.out or tmp
            os.makedirs(out_dir, exist_ok=True)
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
        sys.exit("the planned step differed from the plain Accelerate step")
