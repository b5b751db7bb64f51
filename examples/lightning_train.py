"""Lightning with memplan: one callback, the same training bit for bit, less memory.

    python examples/lightning_train.py [--root DIR] [--steps 5] [--model gpt|mlp] [--width 256]
                                       [--accumulate 2] [--clip 1.0]

A small causal transformer ``LightningModule`` (TinyGPT: 4 ``nn.TransformerEncoderLayer``s,
dropout, AdamW, a per-step LR schedule, ``self.log``, a validation loop, checkpoints), or an MLP,
trained by ``lightning.Trainer``: once plain, once with ``callbacks=[MemplanCallback()]``, each
in a fresh process from the same seed. Prints the loss at every optimizer step, the max abs
difference of losses and parameters, and each run's peak RSS (the whole fit, and its steady
state from the third step on). Lightning's logs and checkpoints go to ``--root`` (a temporary
folder by default), never into the current folder.

By default no accumulation and no clipping, where memplan updates each parameter as soon as its
gradient is ready and frees it, and Lightning holds every gradient until the next step's
``zero_grad``. ``--accumulate 2 --clip 1.0`` trains bit for bit too; clipping needs every
gradient at once, so less is saved there.
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
from pathlib import Path
from typing import Any

import lightning as L

import torch
from memplan.torch.integrations.lightning import MemplanCallback
from memplan.torch.rss import peak_rss_bytes, release_free_memory, reset_peak_rss

SEED = 0
IN_FEATURES, CLASSES, BATCH = 256, 10, 64
VOCAB, SEQ, GPT_BATCH = 4096, 256, 8  # TinyGPT: each row holds SEQ + 1 tokens


class MLP(L.LightningModule):
    """A plain MLP classifier; nothing in it knows about memplan."""

    def __init__(self, width: int = 1024, depth: int = 4, lr: float = 1e-3) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        size = IN_FEATURES
        for _ in range(depth):
            layers += [torch.nn.Linear(size, width), torch.nn.GELU(), torch.nn.Dropout(0.1)]
            size = width
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(size, CLASSES))
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class TinyGPT(L.LightningModule):
    """A small causal transformer language model (``torch.nn.TransformerEncoder`` layers, a causal
    mask, tied embeddings) trained on random tokens; nothing in it knows about memplan."""

    def __init__(self, width: int = 256, depth: int = 4, lr: float = 1e-3) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        torch.nn.init.normal_(self.embed.weight, std=0.02)
        self.position = torch.nn.Parameter(torch.randn(SEQ, width) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(width, nhead=8, dim_feedforward=4 * width, batch_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def _loss(self, batch: Any) -> torch.Tensor:
        tokens, _ = batch
        h = self.blocks(self.embed(tokens[:, :-1]) + self.position, mask=self.mask, is_causal=True)
        logits = self.norm(h) @ self.embed.weight.t()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self) -> Any:
        return MLP.configure_optimizers(self)


def loaders(batches: int, model: str = "mlp") -> tuple[torch.utils.data.DataLoader, torch.utils.data.DataLoader]:
    """Random data, the same for every run (its own generator): feature vectors and classes
    for the MLP, token sequences for TinyGPT."""
    g = torch.Generator().manual_seed(1234)
    size = BATCH if model == "mlp" else GPT_BATCH
    if model == "mlp":
        x = torch.randn(batches * size, IN_FEATURES, generator=g)
        y = torch.randint(0, CLASSES, (batches * size,), generator=g)
    else:
        x = torch.randint(0, VOCAB, (batches * size, SEQ + 1), generator=g)
        y = torch.zeros(batches * size, dtype=torch.long)
    data = torch.utils.data.TensorDataset(x, y)
    train = torch.utils.data.DataLoader(data, batch_size=size, shuffle=True, generator=g)
    val = torch.utils.data.DataLoader(torch.utils.data.Subset(data, range(2 * size)), batch_size=size)
    return train, val


class StepRecorder(L.Callback):
    """Each optimizer step's loss, and the process's peak RSS: the whole fit, and from the
    step ``steady_from`` on (after capture, planning and the recorded steps)."""

    def __init__(self, steady_from: int = 2) -> None:
        self.steady_from = steady_from
        self.losses: list[torch.Tensor] = []
        self.peak_before = 0
        self.steady_peak = 0

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.steady_from and not self.peak_before:
            release_free_memory()
            self.peak_before = peak_rss_bytes()
            reset_peak_rss()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, i: int):
        if not trainer.fit_loop._should_accumulate():  # the window's last batch: its loss is the step's
            self.losses.append(outputs["loss"].detach().clone())

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.steady_peak = peak_rss_bytes()


def train(
    use_memplan: bool,
    root: str,
    steps: int = 5,
    width: int = 256,
    accumulate: int = 1,
    clip: float | None = None,
    callback_options: dict[str, Any] | None = None,
    model: str = "mlp",
) -> dict[str, Any]:
    """Fit ``steps`` optimizer steps (``accumulate`` batches each, gradients clipped to norm
    ``clip``); returns the losses, parameters, logged metrics, checkpoints and peaks.
    ``callback_options`` go to :class:`MemplanCallback`."""
    L.seed_everything(SEED, verbose=False)
    module = MLP(width) if model == "mlp" else TinyGPT(width)
    train_loader, val_loader = loaders(steps * accumulate + 2, model)
    recorder = StepRecorder()
    planned = MemplanCallback(**(callback_options or {})) if use_memplan else None
    side = "memplan" if use_memplan else "plain"
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        val_check_interval=2 * accumulate,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        default_root_dir=str(Path(root) / side),
        callbacks=[recorder, *([planned] if planned else [])],
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=L.pytorch.loggers.CSVLogger(root, name=side),
    )
    trainer.fit(module, train_loader, val_loader)
    checkpoints = sorted(str(p.relative_to(Path(root) / side)) for p in (Path(root) / side).rglob("*.ckpt"))
    return {
        "losses": recorder.losses,
        "params": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "global_step": trainer.global_step,
        "checkpoints": checkpoints,
        "peak_rss": max(recorder.peak_before, recorder.steady_peak),
        "steady_peak_rss": recorder.steady_peak,
        "report": dict(planned.report) if planned else {},
        "planned_steps": planned.steps_planned if planned else 0,
    }


def train_in_fresh_process(use_memplan: bool, root: str, **options: Any) -> dict[str, Any]:
    """:func:`train` in a spawned process, so neither run's peak RSS includes the other's."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(train, (use_memplan, root), options)


def compare(plain: dict[str, Any], planned: dict[str, Any]) -> dict[str, Any]:
    """Max abs differences of the losses and the parameters, and whether every bit matches."""
    loss_diff = max((a - b).abs().max().item() for a, b in zip(plain["losses"], planned["losses"], strict=True))
    param_diff = max((plain["params"][k] - planned["params"][k]).abs().max().item() for k in plain["params"])
    same = all(torch.equal(a, b) for a, b in zip(plain["losses"], planned["losses"], strict=True)) and all(
        torch.equal(plain["params"][k], planned["params"][k]) for k in plain["params"]
    )
    return {"loss_max_abs_diff": loss_diff, "param_max_abs_diff": param_diff, "bit_identical": same}


def print_comparison(plain: dict[str, Any], planned: dict[str, Any]) -> None:
    mib = 2.0**-20
    for k, (a, b) in enumerate(zip(plain["losses"], planned["losses"], strict=True)):
        print(f"step {k + 1}: loss plain {a.item():.6f}  memplan {b.item():.6f}")
    diff = compare(plain, planned)
    print(f"max abs diff: loss {diff['loss_max_abs_diff']}, parameters {diff['param_max_abs_diff']}")
    print(f"bit-identical: {diff['bit_identical']}; global_step {plain['global_step']} / {planned['global_step']}")
    print(f"val_loss logged: plain {plain['metrics'].get('val_loss')}  memplan {planned['metrics'].get('val_loss')}")
    print(f"checkpoints: plain {plain['checkpoints']}  memplan {planned['checkpoints']}")
    for label, key in (("peak RSS, whole fit", "peak_rss"), ("peak RSS, steps 3-", "steady_peak_rss")):
        a, b = plain[key] * mib, planned[key] * mib
        print(f"{label}: plain {a:.1f} MiB  memplan {b:.1f} MiB  ({b / a:.3f}x)")
    report = planned["report"]
    planned_peak = report.get("planned_peak_bytes", 0) * mib
    print(f"plan: {planned_peak:.1f} MiB planned peak, allocator {report.get('allocator')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", help="where Lightning writes logs and checkpoints (default: a temporary folder)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    parser.add_argument("--model", choices=("gpt", "mlp"), default="gpt", help="TinyGPT (default) or an MLP")
    parser.add_argument("--width", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches (default 1)")
    parser.add_argument("--clip", type=float, default=None, help="gradient_clip_val (default: no clipping)")
    args = parser.parse_args()
    options = {"steps": args.steps, "width": args.width, "accumulate": args.accumulate, "clip": args.clip}
    options["model"] = args.model
    with tempfile.TemporaryDirectory(prefix="memplan-lightning-") as tmp:
        root = args.root or tmp
        print(f"Lightning writes its logs and checkpoints to {root}")
        plain = train_in_fresh_process(False, root, **options)
        planned = train_in_fresh_process(True, root, **options)
        print_comparison(plain, planned)
        if not compare(plain, planned)["bit_identical"]:
            raise SystemExit("memplan's run differs from plain Lightning's")


if __name__ == "__main__":
    main()
