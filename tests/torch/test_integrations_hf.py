"""HF Trainer and Accelerate ways in, against the same framework's plain run from the same seed.

Each example runs (its ``main`` on a tiny config in the default run; as a script, each side in
its own process with its peak RSS, in the slow run) and must end bit for bit where the plain
framework does: losses, gradient norms, learning rates and every parameter after 5 steps.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import memplan
import torch
from memplan.errors import MemplanError

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from memplan.torch.integrations.hf import MemplanTrainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--hidden", "32", "--vocab", "128", "--seq", "16", "--batch", "2", "--in-process"]
RSS_NOISE = 1.05  # the planned steps' peak RSS may not exceed the plain ones' by more than 5%


def example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Any:
    """Accelerate keeps its state (gradient accumulation, mixed precision) in process-wide
    singletons: each test starts and ends without another test's."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    for state in (AcceleratorState, GradientState, PartialState):
        state._reset_state()
    yield
    for state in (AcceleratorState, GradientState, PartialState):
        state._reset_state()


def assert_bit_identical(result: dict[str, Any]) -> None:
    plain, planned = result["plain"], result["memplan"]
    assert len(plain["losses"]) == 5
    assert planned["losses"] == plain["losses"]
    assert planned["grad_norms"] == plain["grad_norms"]
    assert planned["learning_rates"] == plain["learning_rates"]
    assert plain["params"].keys() == planned["params"].keys()
    for name, value in plain["params"].items():
        assert torch.equal(value, planned["params"][name]), name
    assert result["verdict"] == {"max_abs_diff": 0.0, "bit_identical": True}
    assert planned["planned_peak_bytes"] > 0


# ---------------------------------------------------------------------------- default run


class _Regressor(torch.nn.Module):
    """A small model the Trainer trains: a dict batch in, ``{"loss": ...}`` out, dropout inside."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.GELU(), torch.nn.Dropout(0.1))
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.head(self.net(x)), labels)}


def _trainer_run(cls: type, tmp: str) -> tuple[list[dict], dict[str, torch.Tensor], Any]:
    torch.manual_seed(0)
    model = _Regressor()
    args = _args(
        tmp,
        max_steps=5,
        gradient_accumulation_steps=2,
        max_grad_norm=0.05,
        logging_steps=1,
        lr_scheduler_type="linear",
        warmup_steps=2,
        learning_rate=1e-2,
        eval_strategy="steps",  # evaluation between steps: the model's mode changes and comes back
        eval_steps=2,
        disable_tqdm=True,
    )
    trainer = cls(model=model, args=args, train_dataset=_Pairs(40), eval_dataset=_Pairs(4))
    trainer.train()
    keys = ("loss", "grad_norm", "learning_rate", "eval_loss")
    logs = [{k: h[k] for k in keys if k in h} for h in trainer.state.log_history if "loss" in h or "eval_loss" in h]
    return logs, {k: v.clone() for k, v in model.state_dict().items()}, trainer


def test_trainer_matches_trainer_bit_for_bit_with_accumulation_clipping_and_schedule(tmp_path: Path) -> None:
    plain_logs, plain_params, plain = _trainer_run(transformers.Trainer, str(tmp_path / "plain"))
    logs, params, trainer = _trainer_run(MemplanTrainer, str(tmp_path / "memplan"))
    assert logs == plain_logs  # loss, grad norm and learning rate of every step; the evaluations' losses
    assert sum("loss" in log for log in logs) == 5 and sum("eval_loss" in log for log in logs) >= 2
    assert all(log["grad_norm"] > 0.05 for log in logs if "grad_norm" in log)  # clipping acted in every step
    for name, value in plain_params.items():
        assert torch.equal(value, params[name]), name
    assert trainer.optimizer.state_dict()["state"].keys() == plain.optimizer.state_dict()["state"].keys()
    for key, state in plain.optimizer.state_dict()["state"].items():
        for name, value in state.items():
            assert torch.equal(
                torch.as_tensor(value), torch.as_tensor(trainer.optimizer.state_dict()["state"][key][name])
            )
    assert trainer.lr_scheduler.state_dict() == plain.lr_scheduler.state_dict()
    assert trainer.memplan_step.plans_made == 1
    assert trainer.memplan_step.report["planned_peak_bytes"] > 0


def test_trainer_example_matches_trainer_bit_for_bit_with_accumulation_and_clipping() -> None:
    result = example("hf_trainer").main([*TINY, "--accumulation", "2", "--max-grad-norm", "0.5"])
    assert_bit_identical(result)
    assert result["plain"]["eval_loss"] == result["memplan"]["eval_loss"]
    assert result["memplan"]["checkpoint"] == result["plain"]["checkpoint"] == ["checkpoint-5"]
    assert all(n > 0.5 for n in result["plain"]["grad_norms"])  # clipping acted in every step


def _prepared_mlp(seed: int = 0) -> tuple[Any, ...]:
    """A small MLP, AdamW and a warmup schedule through ``accelerator.prepare``."""
    torch.manual_seed(seed)
    accelerator = accelerate.Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 2, 5)
    return accelerator, *accelerator.prepare(model, optimizer, scheduler)


def _accelerate_run(planned: bool) -> tuple[list[torch.Tensor], list[float], Any, Any]:
    accelerator, model, optimizer, scheduler = _prepared_mlp()
    assert type(optimizer).__name__ == "AcceleratedOptimizer"
    assert type(scheduler).__name__ == "AcceleratedScheduler"

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        for k in range(2):  # gradient accumulation over two micro-batches, inside the step
            loss = torch.nn.functional.mse_loss(model(x[4 * k : 4 * k + 4]), y[4 * k : 4 * k + 4]) / 2
            accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        return loss, norm

    if planned:  # the objects prepare() returned, unchanged
        step = memplan.compile(step, model=model, optimizer=optimizer, scheduler=scheduler)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(5)]
    torch.manual_seed(11)
    out = [step(b) for b in batches]
    losses = [o[0].detach() for o in out]
    assert all(o[1].item() > 0.05 for o in out)  # clipping acted in every step
    return losses, scheduler.get_last_lr(), list(model.parameters()), optimizer.state_dict()


def test_accelerate_prepared_objects_compile_unchanged_bit_for_bit() -> None:
    plain_losses, plain_lr, plain_params, plain_state = _accelerate_run(planned=False)
    losses, lr, params, state = _accelerate_run(planned=True)
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, losses, strict=True))
    assert lr == plain_lr
    for a, b in zip(plain_params, params, strict=True):
        assert torch.equal(a, b)
    for key, value in plain_state["state"].items():
        for name, tensor in value.items():
            assert torch.equal(torch.as_tensor(tensor), torch.as_tensor(state["state"][key][name])), name


class _Branching(torch.nn.Module):
    """A model whose forward reads a tensor's value to decide what to run."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.linear(x)
        if y.sum() > 0:  # data-dependent: no single plan runs every step
            y = y * 2
        return {"loss": torch.nn.functional.mse_loss(y, labels)}


class _Pairs(torch.utils.data.Dataset):
    def __init__(self, n: int = 8) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(4, generator=g), "labels": torch.randn(4, generator=g)}


def _args(tmp: str, **overrides: Any) -> Any:
    options = dict(
        output_dir=tmp, use_cpu=True, max_steps=2, per_device_train_batch_size=2, report_to=[], save_strategy="no"
    )
    return transformers.TrainingArguments(**{**options, **overrides})


def test_trainer_refuses_a_step_it_cannot_plan_in_one_line(tmp_path: Path) -> None:
    trainer = MemplanTrainer(model=_Branching(), args=_args(str(tmp_path), disable_tqdm=True), train_dataset=_Pairs())
    with pytest.raises(MemplanError) as err:
        trainer.train()
    message = str(err.value)
    assert "\n" not in message and "data-dependent" in message, message


@pytest.mark.parametrize(
    ("overrides", "named"),
    [({"activation_checkpointing": True}, "memory_budget"), ({"torch_compile": True}, "torch_compile")],
)
def test_trainer_refuses_what_it_does_not_plan_in_one_line(tmp_path: Path, overrides: dict, named: str) -> None:
    with pytest.raises(MemplanError) as err:
        MemplanTrainer(model=_Branching(), args=_args(str(tmp_path), **overrides), train_dataset=_Pairs())
    assert "\n" not in str(err.value) and named in str(err.value)


def test_accelerate_adapter_refuses_accumulation_by_the_accelerator_in_one_line() -> None:
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(4, 4)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(MemplanError) as err:
        memplan.compile(lambda batch: batch, model=model, optimizer=optimizer)
    assert "\n" not in str(err.value) and "gradient_accumulation_steps=2" in str(err.value)


# ---------------------------------------------------------------------------- slow


def _script(name: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run(
            [sys.executable, str(ROOT / "examples" / f"{name}.py"), *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=cwd,
            timeout=1800,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert os.listdir(cwd) == []  # nothing written where it ran
    return done.stdout


def _replayed_window(stdout: str) -> tuple[float, float, float, float]:
    """Peak RSS of steps 4-5 (memplan replays its plan), plain and memplan, absolute and above
    the RSS each side had before step 1 (MiB)."""
    line = next(x for x in stdout.splitlines() if x.strip().startswith("steps 4-"))
    numbers = [float(w) for w in line.split(")", 1)[1].replace("x", " ").split()]
    return numbers[0], numbers[1], numbers[3], numbers[4]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_trainer", "accelerate_loop"])
def test_example_script_bit_identical_and_peak_rss_not_above_plain(name: str) -> None:
    """At the examples' own sizes, where the step's memory outweighs memplan's fixed cost in the
    process (about 60 MiB: the planned allocator's extension and the modules capture imports)."""
    out = _script(name)
    assert "max abs diff 0.0;" in out and ": True" in out, out
    plain, planned, _, _ = _replayed_window(out)
    assert planned <= plain * RSS_NOISE, out


@pytest.mark.slow
def test_trainer_bf16_matches_trainer_bit_for_bit() -> None:
    assert_bit_identical(example("hf_trainer").main([*TINY, "--bf16"]))


def test_accelerate_example_matches_accelerate_bit_for_bit_with_accumulation_and_clipping() -> None:
    result = example("accelerate_loop").main([*TINY, "--accumulation", "2", "--max-grad-norm", "0.5"])
    assert_bit_identical(result)
    assert all(n > 0.5 for n in result["plain"]["grad_norms"])


@pytest.mark.slow
def test_accelerate_bf16_matches_accelerate_bit_for_bit() -> None:
    assert_bit_identical(example("accelerate_loop").main([*TINY, "--bf16"]))


@pytest.mark.slow
def test_trainer_memory_budget_reaches_the_step(tmp_path: Path) -> None:
    result = example("hf_trainer").main([*TINY, "--budget", "0.9", "--out", str(tmp_path)])
    assert_bit_identical(result)
    budget = result["memplan"]["budget"]
    assert budget["method"] in ("reorder", "remat")
    assert budget["planned_peak_bytes"] <= budget["budget_bytes"]


def _gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=1, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.slow
def test_trainer_resumes_from_its_checkpoint_as_trainer_does(tmp_path: Path) -> None:
    data = example("hf_trainer").TokenData(40, 16, 128, 1)

    def train(cls: type, out: str, resume: str | None = None) -> dict[str, torch.Tensor]:
        model = _gpt2()
        args = _args(
            out, max_steps=5, save_strategy="steps", save_steps=3, gradient_accumulation_steps=2, max_grad_norm=1.0
        )
        cls(model=model, args=args, train_dataset=data).train(resume_from_checkpoint=resume)
        return {k: v.clone() for k, v in model.state_dict().items()}

    straight = train(MemplanTrainer, str(tmp_path / "a"))
    checkpoint = str(tmp_path / "a" / "checkpoint-3")
    resumed = train(MemplanTrainer, str(tmp_path / "b"), checkpoint)
    plain_resumed = train(transformers.Trainer, str(tmp_path / "c"), checkpoint)
    for name, value in plain_resumed.items():
        assert torch.equal(value, resumed[name]), name
        assert torch.equal(value, straight[name]), name
