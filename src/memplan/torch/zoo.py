"""The model zoo: models built from code or from HF configs with random weights; nothing is
downloaded. Each entry builds ``(model, example batch, loss function)`` for a batch size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from memplan.errors import MemplanError, UnknownModel
from memplan.graph.ir import Graph
from memplan.torch import models
from torch import nn

OPTIMIZERS = ("sgd", "adam", "adamw")
MODES = ("train", "infer")


@dataclass(frozen=True)
class Workload:
    """What a step needs: ``loss = loss_fn(model(inputs), target)``."""

    model: nn.Module
    inputs: Any
    target: Any
    loss_fn: Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class ZooEntry:
    name: str
    description: str
    build: Callable[[int], Workload]
    source: str  # "repo" or "transformers"


class Logits(nn.Module):
    """Wraps an HF model so that ``forward`` returns the logits tensor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.model(*args, **kwargs).logits


def _classify(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, labels)


def _token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _images(batch: int, side: int, classes: int, model: nn.Module) -> Workload:
    return Workload(model, torch.randn(batch, 3, side, side), torch.randint(0, classes, (batch,)), _classify)


def _mlp(batch: int) -> Workload:
    return Workload(models.MLP(), torch.randn(batch, 1024), torch.randint(0, 10, (batch,)), _classify)


def _vgg16(batch: int) -> Workload:
    return _images(batch, 32, 10, models.VGG16())


def _unet(batch: int) -> Workload:
    return Workload(models.UNet(), torch.randn(batch, 3, 128, 128), torch.randint(0, 4, (batch, 128, 128)), _classify)


def _lstm(batch: int) -> Workload:
    tokens = torch.randint(0, 1000, (batch, 32))
    return Workload(models.UnrolledLSTM(), tokens, torch.randint(0, 1000, (batch, 32)), _token_loss)


def _hf(factory: str, config: Callable[[], Any]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        cfg = config()
        with _skip_init_if_fake():
            model = getattr(transformers, factory)(cfg)
        model.tie_weights()  # skipping the init also skips tying (lm_head = embeddings)
        return Logits(model)

    return build


def _skip_init_if_fake() -> contextlib.AbstractContextManager:
    """Inside a FakeTensorMode the initial values are never read, and HF's truncated-normal
    init reads tensor values, which fake tensors cannot give: skip it, as from_pretrained does."""
    from torch._guards import detect_fake_mode

    if detect_fake_mode() is None:
        return contextlib.nullcontext()
    from transformers.initialization import no_init_weights

    return no_init_weights()


def _hf_vision(factory: str, config_name: str, side: int = 224, **kwargs: Any) -> Callable[[int], Workload]:
    def build(batch: int) -> Workload:
        import transformers

        cfg = getattr(transformers, config_name)(num_labels=1000, **kwargs)
        return _images(batch, side, 1000, _hf(factory, lambda: cfg)())

    return build


def _hf_text(factory: str, config_name: str, seq: int = 128, lm: bool = False, **kwargs: Any):
    def build(batch: int) -> Workload:
        import transformers

        cfg = getattr(transformers, config_name)(**kwargs)
        model = _hf(factory, lambda: cfg)()
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
        if lm:
            return Workload(model, tokens, torch.randint(0, cfg.vocab_size, (batch, seq)), _token_loss)
        return Workload(model, tokens, torch.randint(0, cfg.num_labels, (batch,)), _classify)

    return build


ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in [
        ZooEntry("mlp", "4-layer MLP, 1024-2048 wide, LayerNorm and dropout", _mlp, "repo"),
        ZooEntry("vgg16", "VGG-16 with BatchNorm on 32x32 images (CIFAR-style)", _vgg16, "repo"),
        ZooEntry("unet", "U-Net, 4 levels, 128x128 images, 4 classes per pixel", _unet, "repo"),
        ZooEntry("lstm", "2-layer LSTM language model unrolled over 32 steps", _lstm, "repo"),
        ZooEntry(
            "resnet50",
            "ResNet-50 (HF transformers config), 224x224",
            _hf_vision("ResNetForImageClassification", "ResNetConfig"),
            "transformers",
        ),
        ZooEntry(
            "mobilenet-v2",
            "MobileNet-v2 (HF config), 224x224",
            _hf_vision("MobileNetV2ForImageClassification", "MobileNetV2Config"),
            "transformers",
        ),
        ZooEntry(
            "efficientnet-b0",
            "EfficientNet-B0 (HF config), 224x224",
            _hf_vision(
                "EfficientNetForImageClassification",
                "EfficientNetConfig",
                width_coefficient=1.0,
                depth_coefficient=1.0,
                image_size=224,
                dropout_rate=0.2,
                hidden_dim=1280,
            ),
            "transformers",
        ),
        ZooEntry(
            "vit-base",
            "ViT-Base/16 (HF config), 224x224",
            _hf_vision("ViTForImageClassification", "ViTConfig"),
            "transformers",
        ),
        ZooEntry(
            "bert-base",
            "BERT-base sequence classification (HF config), 128 tokens",
            _hf_text("BertForSequenceClassification", "BertConfig"),
            "transformers",
        ),
        ZooEntry(
            "xlm-roberta-base",
            "XLM-RoBERTa-base sequence classification (HF config), 128 tokens",
            _hf_text(
                "XLMRobertaForSequenceClassification",
                "XLMRobertaConfig",
                vocab_size=250002,
                max_position_embeddings=514,
                type_vocab_size=1,
                pad_token_id=1,
            ),
            "transformers",
        ),
        ZooEntry(
            "gpt2",
            "GPT-2 small LM (HF config), 12 layers, 128 tokens",
            _hf_text("GPT2LMHeadModel", "GPT2Config", lm=True),
            "transformers",
        ),
        ZooEntry(
            "gpt2-2l",
            "GPT-2 LM with 2 layers (HF config), 128 tokens",
            _hf_text("GPT2LMHeadModel", "GPT2Config", lm=True, n_layer=2),
            "transformers",
        ),
    ]
}


def list_models() -> list[str]:
    return list(ZOO)


def get_entry(name: str) -> ZooEntry:
    if name not in ZOO:
        raise UnknownModel(f"unknown model {name!r}; `memplan models` lists the zoo: {', '.join(ZOO)}")
    return ZOO[name]


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    """The zoo's optimizers: SGD with momentum, Adam, AdamW (single-tensor implementations)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9, foreach=False)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3, foreach=False)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=False)
    raise MemplanError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


def build_workload(name: str, batch_size: int, *, fake_mode: Any = None, seed: int = 0) -> Workload:
    """Build a zoo model and its example batch: real tensors, or fake ones inside ``fake_mode``."""
    entry = get_entry(name)
    if batch_size < 1:
        raise MemplanError(f"batch size must be >= 1, not {batch_size}")
    torch.manual_seed(seed)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        workload = entry.build(batch_size)
    return workload


def capture_model(
    name: str, batch_size: int = 1, mode: str = "train", optimizer: str = "sgd"
):  # -> memplan.torch.capture.Capture
    """Capture a zoo model's step on FakeTensors (no real memory is allocated)."""
    from memplan.torch.capture import capture_infer_step, capture_train_step
    from memplan.torch.capture.fake import new_fake_mode

    if mode not in MODES:
        raise MemplanError(f"unknown mode {mode!r}; choose train or infer")
    fake_mode = new_fake_mode()
    w = build_workload(name, batch_size, fake_mode=fake_mode)
    label = f"{name}-b{batch_size}-{mode}" + (f"-{optimizer}" if mode == "train" else "")
    if mode == "infer":
        w.model.eval()
        return capture_infer_step(w.model, w.inputs, name=label)
    w.model.train()
    with fake_mode:
        opt = make_optimizer(optimizer, w.model.parameters())
    return capture_train_step(w.model, opt, w.loss_fn, (w.inputs, w.target), name=label)


def capture_graph(name: str, batch_size: int = 1, mode: str = "train", optimizer: str = "sgd") -> Graph:
    return capture_model(name, batch_size, mode, optimizer).graph
