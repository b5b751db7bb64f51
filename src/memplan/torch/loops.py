"""The training loops people write, each planned by :func:`memplan.compile` and compared with the
same step function run eagerly, bit for bit.

Each feature is a step-function factory over a :class:`Setup` (model, optimizer, scheduler,
scaler, and how the model's loss is read off a batch). :func:`run_feature` builds two identical
setups from the same seed, runs the feature's step eagerly on one and planned on the other for
``steps`` steps, and compares everything a step may change after every step
(:mod:`memplan.torch.equivalence`), and, on request, the peak bytes of a steady-state step.

``python bench/loops.py`` prints the table; ``tests/torch/test_loops.py`` runs it on small models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from memplan.errors import MemplanError
from memplan.torch.equivalence import differences, snapshot

Batch = dict[str, Any]


@dataclass
class Setup:
    """One side of a comparison: the user's objects and how to get a loss from a batch."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[Batch], torch.Tensor]  # model(**batch).loss for an HF model
    scheduler: Any = None
    scaler: Any = None

    def objects(self) -> list[Any]:
        return [o for o in (self.scheduler, self.scaler) if o is not None]


@dataclass(frozen=True)
class Feature:
    name: str
    step: Callable[[Setup], Callable[[Batch], Any]]  # the step function over a setup
    optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None
    scheduler: bool = False
    scaler: bool = False
    freeze: bool = False
    nested: bool = False  # batch = {"inputs": {...}, "labels": ...}


def _adamw(model: torch.nn.Module, **options: Any) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **{"foreach": False, **options})


def _two_groups(model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    half = len(params) // 2
    groups = [{"params": params[:half]}, {"params": params[half:], "lr": 3e-3, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.01, foreach=False)


def _plain(s: Setup) -> Callable[[Batch], Any]:
    def step(batch: Batch) -> torch.Tensor:
        loss = s.loss(batch)
        loss.backward()
        s.optimizer.step()
        s.optimizer.zero_grad()
        return loss

    return step


def _nested(s: Setup) -> Callable[[Batch], Any]:
    def step(batch: Batch) -> torch.Tensor:
        loss = s.loss({**batch["inputs"], "labels": batch["labels"]})
        loss.backward()
        s.optimizer.step()
        s.optimizer.zero_grad()
        return loss

    return step


def _clip(s: Setup) -> Callable[[Batch], Any]:
    def step(batch: Batch) -> torch.Tensor:
        loss = s.loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(s.model.parameters(), max_norm=0.1)
        s.optimizer.step()
        s.optimizer.zero_grad()
        return loss

    return step


def _accumulate(s: Setup) -> Callable[[Batch], Any]:
    def step(batch: Batch) -> torch.Tensor:
        total = None
        for micro in _split(batch, 2):
            loss = s.loss(micro) / 2
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        s.optimizer.step()
        s.optimizer.zero_grad()
        return total

    return step


def _bf16(s: Setup) -> Callable[[Batch], Any]:
    def step(batch: Batch) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = s.loss(batch)
        loss.backward()
        s.optimizer.step()
        s.optimizer.zero_grad()
        return loss

    return step


def _fp16_scaler(s: Setup) -> Callable[[Batch], Any]:
    def step(batch: Batch) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = s.loss(batch)
        s.scaler.scale(loss).backward()
        s.scaler.unscale_(s.optimizer)
        torch.nn.utils.clip_grad_norm_(s.model.parameters(), max_norm=1.0)
        s.scaler.step(s.optimizer)
        s.scaler.update()
        s.optimizer.zero_grad()
        return loss

    return step


def _scheduled(s: Setup) -> Callable[[Batch], Any]:
    def step(batch: Batch) -> torch.Tensor:
        loss = s.loss(batch)
        loss.backward()
        s.optimizer.step()
        s.scheduler.step()
        s.optimizer.zero_grad()
        return loss

    return step


FEATURES: dict[str, Feature] = {
    f.name: f
    for f in [
        Feature("dict batch, loss from the output", _plain),
        Feature("nested batch", _nested, nested=True),
        Feature("clip_grad_norm_", _clip),
        Feature("gradient accumulation (2 micro-batches)", _accumulate),
        Feature("autocast bfloat16", _bf16),
        Feature("float16 + GradScaler (skipped steps)", _fp16_scaler, scaler=True),
        Feature("foreach optimizer", _plain, optimizer=lambda m: _adamw(m, foreach=True)),
        Feature("fused optimizer", _plain, optimizer=lambda m: _adamw(m, foreach=None, fused=True)),
        Feature("several param groups", _plain, optimizer=_two_groups),
        Feature("LR scheduler", _scheduled, scheduler=True),
        Feature("frozen parameters", _plain, freeze=True),
    ]
}


# ---------------------------------------------------------------------------- models


@dataclass(frozen=True)
class LoopModel:
    """A model with batches: ``build()`` makes the model (seeded by the caller), ``batch(seed)``
    a dict batch with its labels, ``loss(model)`` reads the loss off a batch."""

    name: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[int], Batch]
    loss: Callable[[torch.nn.Module], Callable[[Batch], torch.Tensor]]
    frozen_prefix: str = ""  # parameters frozen by the "frozen parameters" feature
    nested_keys: tuple[str, ...] = field(default=())


class _MLP(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(32, width)
        self.body = torch.nn.Sequential(
            torch.nn.LayerNorm(width), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(width, width)
        )
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x)))


def mlp(width: int = 256, batch: int = 16) -> LoopModel:
    def make_batch(seed: int) -> Batch:
        g = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(batch, 32, generator=g), "labels": torch.randint(0, 10, (batch,), generator=g)}

    def loss(model: torch.nn.Module) -> Callable[[Batch], torch.Tensor]:
        return lambda b: torch.nn.functional.cross_entropy(model(b["x"]), b["labels"])

    return LoopModel(f"MLP ({width} wide)", lambda: _MLP(width), make_batch, loss, "embed.")


def _hf_loss(model: torch.nn.Module) -> Callable[[Batch], torch.Tensor]:
    return lambda b: model(**b).loss


def _tokens(vocab: int, batch: int, seq: int, labels: str) -> Callable[[int], Batch]:
    def make_batch(seed: int) -> Batch:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        out = {"input_ids": ids, "attention_mask": torch.ones(batch, seq, dtype=torch.long)}
        out["labels"] = ids.clone() if labels == "lm" else torch.randint(0, 2, (batch,), generator=g)
        return out

    return make_batch


def bert(hidden: int = 768, layers: int = 2, batch: int = 8, seq: int = 128, vocab: int = 30522) -> LoopModel:
    def build() -> torch.nn.Module:
        import transformers

        config = transformers.BertConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=max(1, hidden // 64),
            intermediate_size=4 * hidden,
            num_labels=2,
        )
        return transformers.BertForSequenceClassification(config)

    batches = _tokens(vocab, batch, seq, "cls")
    return LoopModel(f"BERT ({layers} layers, {hidden})", build, batches, _hf_loss, "bert.embeddings.")


def gpt2(hidden: int = 768, layers: int = 2, batch: int = 8, seq: int = 128, vocab: int = 50257) -> LoopModel:
    def build() -> torch.nn.Module:
        import transformers

        config = transformers.GPT2Config(
            vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=max(1, hidden // 64), n_positions=max(seq, 128)
        )
        return transformers.GPT2LMHeadModel(config)

    batches = _tokens(vocab, batch, seq, "lm")
    return LoopModel(f"GPT-2 ({layers} layers, {hidden})", build, batches, _hf_loss, "transformer.wpe.")


# ---------------------------------------------------------------------------- running


@dataclass(frozen=True)
class FeatureResult:
    model: str
    feature: str
    works: bool
    detail: str = ""  # the refusal, or what differed
    max_abs_diff: float = 0.0
    planned_peak_bytes: int = 0
    eager_peak_bytes: int = 0


def _setup(spec: LoopModel, feature: Feature, seed: int) -> Setup:
    torch.manual_seed(seed)
    model = spec.build()
    model.train()
    if feature.freeze:
        for name, p in model.named_parameters():
            if name.startswith(spec.frozen_prefix):
                p.requires_grad_(False)
    optimizer = (feature.optimizer or _adamw)(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5) if feature.scheduler else None
    # an initial scale that overflows float16 gradients: the first steps are skipped and back off
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=2) if feature.scaler else None
    return Setup(model, optimizer, spec.loss(model), scheduler, scaler)


def run_feature(
    spec: LoopModel, feature: Feature, *, steps: int = 3, seed: int = 0, measure: bool = False, **compile_options: Any
) -> FeatureResult:
    """Run ``feature``'s step on ``spec`` eagerly and planned; compare after every step."""
    import memplan

    eager, planned = _setup(spec, feature, seed), _setup(spec, feature, seed)
    eager_step = feature.step(eager)
    batches = [_shaped(spec.batch(seed + k), feature) for k in range(steps + 1)]
    try:
        planned_step = memplan.compile(
            feature.step(planned),
            model=planned.model,
            optimizer=planned.optimizer,
            scaler=planned.scaler,
            scheduler=planned.scheduler or (),
            **compile_options,
        )
        worst, k = 0.0, 0
        # measuring: more steps (compared too) until the planned allocator replays its plan
        while k < steps or (measure and k < steps + MAX_WARMUP_STEPS and not _replaying(planned_step, batches[-1])):
            step_seed = seed + 1000 + k
            eager_loss, planned_loss = (_seeded(fn, batches[k % steps], step_seed) for fn in (eager_step, planned_step))
            found = differences(
                snapshot(eager.model, eager.optimizer, *eager.objects()),
                snapshot(planned.model, planned.optimizer, *planned.objects()),
            )
            worst = max(
                worst,
                _max_abs_diff(eager, planned),
                float((eager_loss.detach() - planned_loss.detach()).abs().nan_to_num()),
            )
            if found or not torch.equal(eager_loss.nan_to_num(), planned_loss.nan_to_num()):
                return FeatureResult(spec.name, feature.name, False, f"step {k}: " + "; ".join(found[:3]), worst)
            k += 1
    except MemplanError as err:
        return FeatureResult(spec.name, feature.name, False, str(err))
    peaks = _peaks(eager_step, planned_step, batches, seed + 1000 + k) if measure else (0, 0)
    return FeatureResult(spec.name, feature.name, True, "", worst, *peaks)


MEASURED_STEPS = 3
MAX_WARMUP_STEPS = 8  # recording until two steps allocate alike, then each new kind of step seen twice (run/replay.py)


def _seeded(fn: Callable[[Batch], Any], batch: Batch, seed: int) -> Any:
    torch.manual_seed(seed)  # both sides draw the same dropout masks (and so make the same scaler decisions)
    return fn(batch)


def _replaying(planned_step: Any, batch: Batch) -> bool:
    """The planned step runs its plan: a views runner always, the planned allocator once it is
    settled (run/replay.py: its latest step served by the plan, none waiting to become a
    branch). The steps before are recorded on the ordinary allocator, or are of a kind the plan
    has not placed yet, such as the first GradScaler steps that update after skipped ones."""
    return bool(getattr(planned_step.runner_for(batch), "settled", True))


def _shaped(batch: Batch, feature: Feature) -> Batch:
    if not feature.nested:
        return batch
    return {"inputs": {k: v for k, v in batch.items() if k != "labels"}, "labels": batch["labels"]}


def _split(batch: Batch, parts: int) -> list[Batch]:
    chunks = {k: v.chunk(parts) for k, v in batch.items()}
    return [{k: c[i] for k, c in chunks.items()} for i in range(parts)]


def _max_abs_diff(a: Setup, b: Setup) -> float:
    diffs = [
        float((x.detach().double() - y.detach().double()).abs().max())
        for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True)
    ]
    return max(diffs, default=0.0)


def _peaks(eager_step: Callable, planned_step: Any, batches: list[Batch], seed: int) -> tuple[int, int]:
    """Bytes each side holds at its peak beyond the persistent tensors (parameters, optimizer
    state, the batch), the most over ``MEASURED_STEPS`` more steps: the CPU allocator's own
    count during each step, plus, for memplan, its arena, which it holds from before the step.
    Several steps, because a GradScaler step that skips the update needs less than one that
    makes it; both sides draw the same random numbers, so they skip the same steps."""
    from memplan.torch.measure import allocator_peak_bytes

    eager_peak = planned_peak = 0
    for k in range(MEASURED_STEPS):
        batch = batches[k % len(batches)]
        eager_peak = max(eager_peak, allocator_peak_bytes(_seeded, eager_step, batch, seed + k)[1])
        runner = planned_step.runner_for(batch)
        # a step that records releases the arena first (run/replay.py): it holds no arena
        arena = runner.arena.untyped_storage().nbytes() if getattr(runner, "replaying", True) else 0
        planned = allocator_peak_bytes(_seeded, planned_step, batch, seed + k)[1]
        planned_peak = max(planned_peak, planned + arena)
    return planned_peak, eager_peak
