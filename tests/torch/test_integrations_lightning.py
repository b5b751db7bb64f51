"""Lightning's way in: ``MemplanCallback`` trains a LightningModule bit for bit like plain
Lightning from the same seed (losses, parameters, logged metrics, global step, checkpoints), with
accumulation, clipping and a per-step LR schedule; what it cannot plan is refused in one line."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import torch

L = pytest.importorskip("lightning")

from memplan.torch.integrations.lightning import LightningNotPlanned, MemplanCallback  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("lightning_train", ROOT / "examples" / "lightning_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _example()


def _same_run(plain: dict[str, Any], planned: dict[str, Any]) -> None:
    assert len(plain["losses"]) == len(planned["losses"]) == plain["global_step"] == planned["global_step"]
    diff = example.compare(plain, planned)
    assert diff == {"loss_max_abs_diff": 0.0, "param_max_abs_diff": 0.0, "bit_identical": True}
    assert plain["metrics"] == planned["metrics"]  # train_loss (replayed self.log) and val_loss
    assert plain["checkpoints"] == planned["checkpoints"] != []


def test_callback_trains_bit_for_bit_like_plain_lightning(tmp_path: Path) -> None:
    """Accumulation over 2 batches, clipping, a per-step LR schedule, dropout, self.log,
    validation and checkpoints; arena views here (fast), the example runs the default allocator."""
    options = {"steps": 5, "width": 32, "accumulate": 2, "clip": 1.0}
    plain = example.train(False, str(tmp_path), **options)
    planned = example.train(True, str(tmp_path), **options, callback_options={"allocator": "views"})
    _same_run(plain, planned)
    assert "train_loss" in planned["metrics"] and "val_loss" in planned["metrics"]
    assert planned["report"]["planned_peak_bytes"] > 0 and planned["report"]["allocator"] == "views"
    assert planned["planned_steps"] == 5  # every optimizer step ran the plan


class Tiny(L.LightningModule):
    """A small module whose step can be made to do what the callback refuses."""

    def __init__(self, **what: Any) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 2)
        self.what = what

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        if self.what.get("log_number"):
            self.log("lr", 0.1)
        if self.what.get("read_batch_idx") and batch_idx % 2 == 0:
            loss = loss * 2
        return None if self.what.get("return_none") else loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class NoOptimizer(Tiny):
    def configure_optimizers(self) -> Any:
        return None


class Manual(Tiny):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class OwnOptimizerStep(Tiny):
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)


def _fit(tmp_path: Path, module: L.LightningModule, **trainer_args: Any) -> L.Trainer:
    data = torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randint(0, 2, (16,)))
    options: dict[str, Any] = {
        "max_steps": 2,
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(tmp_path),
        "callbacks": [MemplanCallback()],
        **trainer_args,
    }
    trainer = L.Trainer(**options)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    return trainer


REFUSALS = [
    (Manual, {}, "manual optimization"),
    (OwnOptimizerStep, {}, "overrides optimizer_step"),
    (NoOptimizer, {}, "configure_optimizers returned no optimizer"),
    (Tiny, {"precision": "bf16-true"}, "precision 'bf16-true' is not planned"),
    (lambda: Tiny(log_number=True), {}, r"self.log\('lr', ...\) inside the step logs a float"),
    (lambda: Tiny(read_batch_idx=True), {}, "training_step reads batch_idx"),
    (lambda: Tiny(return_none=True), {}, "training_step returned None"),
]


@pytest.mark.parametrize(("make", "trainer_args", "reason"), REFUSALS, ids=[r[2][:24] for r in REFUSALS])
def test_what_cannot_be_planned_is_refused_in_one_line(tmp_path: Path, make: Any, trainer_args: Any, reason: str):
    with pytest.raises(LightningNotPlanned, match=reason) as refused:
        _fit(tmp_path, make(), **trainer_args)
    assert "\n" not in str(refused.value)


def test_a_strategy_other_than_one_device_is_refused_naming_it(tmp_path: Path) -> None:
    from lightning.pytorch.strategies import SingleDeviceStrategy

    class OwnStrategy(SingleDeviceStrategy):
        pass

    with pytest.raises(LightningNotPlanned, match="strategy OwnStrategy is not planned") as refused:
        _fit(tmp_path, Tiny(), strategy=OwnStrategy(device=torch.device("cpu")))
    assert "\n" not in str(refused.value)


def test_a_malformed_budget_is_refused_when_the_callback_is_made() -> None:
    from memplan.errors import MemplanError

    with pytest.raises(MemplanError):
        MemplanCallback(memory_budget="lots")


@pytest.mark.slow
def test_mixed_precision_clip_by_value_and_a_budget_train_bit_for_bit(tmp_path: Path) -> None:
    for options in (
        {"precision": "bf16-mixed"},
        {"plugins": "fp16"},
        {"gradient_clip_algorithm": "value"},
        {"memory_budget": 1.0},
    ):
        plain = _fit_both(tmp_path / "plain", False, options)
        planned = _fit_both(tmp_path / "memplan", True, options)
        for a, b in zip(plain, planned, strict=True):
            assert torch.equal(a, b), options


def _fit_both(root: Path, use_memplan: bool, options: dict[str, Any]) -> list[torch.Tensor]:
    """The example's MLP fitted 3 steps with ``options`` (Trainer's, or the callback's budget)."""
    L.seed_everything(0, verbose=False)
    module = example.MLP(width=32)
    train_loader, _ = example.loaders(batches=8)
    from lightning.pytorch.plugins.precision import MixedPrecision

    budget = {k: v for k, v in options.items() if k == "memory_budget"}
    scaler = None
    if options.get("plugins") == "fp16":  # a GradScaler that grows every step until a step is skipped; each run its own
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**19, growth_interval=1)
        options = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler)]}
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        callbacks=[MemplanCallback(**budget)] if use_memplan else [],
        **{k: v for k, v in options.items() if k != "memory_budget"},
    )
    trainer.fit(module, train_loader)
    if use_memplan:
        callback = next(c for c in trainer.callbacks if isinstance(c, MemplanCallback))  # type: ignore[attr-defined]
        assert callback.steps_planned == 3 and (not budget or "budget" in callback.report)
    scale = [torch.tensor(scaler.get_scale())] if scaler is not None else []  # the same skipped steps
    return [p.detach().clone() for p in module.parameters()] + scale


@pytest.mark.slow
def test_resuming_from_a_checkpoint_goes_on_bit_for_bit(tmp_path: Path) -> None:
    plain = _fit_and_resume(tmp_path / "plain", False)
    planned = _fit_and_resume(tmp_path / "memplan", True)
    for k, v in plain.items():
        assert torch.equal(v, planned[k]), k


def _fit_and_resume(root: Path, use_memplan: bool) -> dict[str, torch.Tensor]:
    """Fit 2 steps and save a checkpoint; then a fresh module and Trainer resume from it to 5."""
    path = root / "first.ckpt"
    for steps, ckpt in ((2, None), (5, path)):
        L.seed_everything(example.SEED, verbose=False)
        module = example.MLP(32)
        train_loader, _ = example.loaders(batches=5 * 2 + 2)
        trainer = L.Trainer(
            max_steps=steps,
            accelerator="cpu",
            devices=1,
            accumulate_grad_batches=2,
            gradient_clip_val=1.0,
            limit_val_batches=0,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(root),
            callbacks=[MemplanCallback()] if use_memplan else [],
        )
        trainer.fit(module, train_loader, ckpt_path=ckpt)
        assert trainer.global_step == steps
        if ckpt is None:
            trainer.save_checkpoint(path)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.slow
def test_example_runs_compares_and_writes_only_to_a_temporary_folder(tmp_path: Path) -> None:
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TMPDIR": str(tmp)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lightning_train.py")],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "max abs diff: loss 0.0, parameters 0.0" in done.stdout
    assert "bit-identical: True; global_step 5 / 5" in done.stdout
    peaks = re.findall(r"peak RSS, .*: plain ([\d.]+) MiB  memplan ([\d.]+) MiB", done.stdout)
    assert len(peaks) == 2, done.stdout
    assert list(cwd.iterdir()) == []  # nothing written where the user ran it
    assert "Lightning writes its logs and checkpoints to " + str(tmp / "memplan-lightning-") in done.stdout
    assert not list(tmp.glob("memplan-lightning-*"))  # and the temporary folder is gone


def test_the_example_runs_as_the_docs_show_on_a_tiny_mlp(tmp_path: Path) -> None:
    """`examples/lightning_train.py` (the default run's form of the slow test above): plain
    Lightning and the callback, each in its own process, with accumulation and clipping."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TMPDIR": str(tmp_path)}
    args = ["--model", "mlp", "--width", "64", "--steps", "3", "--accumulate", "2", "--clip", "1.0"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lightning_train.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "max abs diff: loss 0.0, parameters 0.0" in done.stdout
    assert "bit-identical: True; global_step 3 / 3" in done.stdout
