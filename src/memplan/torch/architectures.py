"""The architectures of HF ``transformers`` at large, planned and trained against eager.

Each entry builds a model from a small config (random weights, nothing downloaded) and a batch
that holds its labels, so the loss is the model's own (``model(**batch).loss``): encoders,
decoders, encoder-decoders, vision models, mixtures of experts and speech models. One
function builds ``(model, batch)`` (:func:`build`), one trains it for a few steps through
:func:`memplan.compile_step` and eagerly from the same weights, seed and batch, and compares
everything a step may change bit for bit after every step (:func:`run_architecture`, with
:mod:`memplan.torch.equivalence`). The outcome is "equal", "refused" (a one-line error),
"refused at run", or "different" (a bug).

``tests/torch/test_architectures.py`` runs every entry at :data:`TINY`;
``python bench/architectures.py`` runs them at :data:`SMALL` and measures peaks.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from memplan.errors import MemplanError
from memplan.torch.equivalence import differences, snapshot

FAMILIES = ("encoder", "decoder", "encoder-decoder", "vision", "mixture-of-experts", "speech")


@dataclass(frozen=True)
class Size:
    """How big every architecture is built: width, depth, heads, vocabulary, tokens per
    sample, samples per batch, image side (pixels) and audio length (samples)."""

    hidden: int = 32
    layers: int = 2
    heads: int = 4
    vocab: int = 128
    seq: int = 8
    batch: int = 2
    image: int = 32
    audio_samples: int = 800

    @property
    def ffn(self) -> int:
        return 2 * self.hidden


TINY = Size()
SMALL = Size(hidden=128, layers=4, heads=4, vocab=1000, seq=64, batch=4, image=64, audio_samples=4000)

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Architecture:
    """One HF architecture: ``build(size)`` returns the model (training mode) and a batch with
    its labels."""

    name: str
    family: str
    model_class: str
    build: Callable[[Size], tuple[torch.nn.Module, Batch]]
    refused_because: str = ""  # a known refusal: a phrase its one-line reason contains
    # a known difference from eager: the largest absolute difference tested, and why
    tolerance: float = 0.0
    differs_because: str = ""


@dataclass(frozen=True)
class ArchitectureResult:
    """What happened when one architecture trained planned and eagerly."""

    name: str
    family: str
    outcome: str  # "equal", "refused", "refused at run", "different", "eager fails"
    detail: str = ""  # the one-line reason (refused) or what differs
    steps: int = 0  # steps compared
    max_abs_diff: float = 0.0  # over the loss, parameters, gradients, buffers and optimizer state
    memplan_peak_bytes: int = 0  # measured (with measure_memory), resident bytes included
    eager_peak_bytes: int = 0
    planned_peak_bytes: int = 0  # the plan's claim
    seconds: float = 0.0


# ---------------------------------------------------------------------- batches


def _tokens(size: Size, length: int | None = None, low: int = 3) -> torch.Tensor:
    return torch.randint(low, size.vocab, (size.batch, length or size.seq))


def _padding_mask(size: Size) -> torch.Tensor:
    """Ones, with the last two tokens of the first sample padded."""
    mask = torch.ones(size.batch, size.seq, dtype=torch.long)
    mask[0, -2:] = 0
    return mask


def _causal_lm(size: Size) -> Batch:
    """Packed sequences, as in pre-training: no padding, so no attention mask."""
    ids = _tokens(size)
    return {"input_ids": ids, "labels": ids.clone()}


def _causal_lm_with_ones_mask(size: Size) -> Batch:
    """As the HF tokenizer returns an unpadded batch: an attention mask of ones."""
    return {**_causal_lm(size), "attention_mask": torch.ones(size.batch, size.seq, dtype=torch.long)}


def _masked_lm(size: Size) -> Batch:
    ids = _tokens(size)
    labels = torch.full_like(ids, -100)
    labels[:, 1::3] = ids[:, 1::3]
    return {"input_ids": ids, "attention_mask": _padding_mask(size), "labels": labels}


def _classification(size: Size, classes: int = 3) -> Batch:
    return {
        "input_ids": _tokens(size),
        "attention_mask": _padding_mask(size),
        "labels": torch.randint(0, classes, (size.batch,)),
    }


def _seq2seq(size: Size) -> Batch:
    return {
        "input_ids": _tokens(size),
        "attention_mask": _padding_mask(size),
        "labels": _tokens(size, max(2, size.seq // 2)),
    }


def _images(size: Size, classes: int = 10) -> Batch:
    return {
        "pixel_values": torch.randn(size.batch, 3, size.image, size.image),
        "labels": torch.randint(0, classes, (size.batch,)),
    }


# ---------------------------------------------------------------------- models


def _hf(class_name: str, config_name: str, **config: Any) -> torch.nn.Module:
    import transformers

    cfg = getattr(transformers, config_name)(**config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, class_name)(cfg)
    return model.train()


def _decoder_config(size: Size, **extra: Any) -> dict[str, Any]:
    """The config keys Llama and its descendants share."""
    return {
        "vocab_size": size.vocab,
        "hidden_size": size.hidden,
        "intermediate_size": size.ffn,
        "num_hidden_layers": size.layers,
        "num_attention_heads": size.heads,
        "num_key_value_heads": max(1, size.heads // 2),
        "max_position_embeddings": max(64, 2 * size.seq),
        **extra,
    }


def _bert(s: Size):
    cfg = {"vocab_size": s.vocab, "hidden_size": s.hidden, "num_hidden_layers": s.layers}
    cfg |= {"num_attention_heads": s.heads, "intermediate_size": s.ffn, "max_position_embeddings": max(64, 2 * s.seq)}
    return _hf("BertForMaskedLM", "BertConfig", **cfg), _masked_lm(s)


def _roberta(s: Size):
    cfg = {"vocab_size": s.vocab, "hidden_size": s.hidden, "num_hidden_layers": s.layers, "num_labels": 3}
    cfg |= {"num_attention_heads": s.heads, "intermediate_size": s.ffn, "max_position_embeddings": 2 * s.seq + 2}
    return _hf("RobertaForSequenceClassification", "RobertaConfig", pad_token_id=1, **cfg), _classification(s)


def _deberta_v2(class_name: str) -> Callable[[Size], tuple[torch.nn.Module, Batch]]:
    def build(s: Size):
        cfg = {"vocab_size": s.vocab, "hidden_size": s.hidden, "num_hidden_layers": s.layers, "num_labels": 3}
        cfg |= {"num_attention_heads": s.heads, "intermediate_size": s.ffn}
        cfg |= {"max_position_embeddings": max(64, 2 * s.seq), "relative_attention": True}
        cfg |= {"pos_att_type": ["p2c", "c2p"], "position_buckets": 16}
        batch = _masked_lm(s) if class_name.endswith("MaskedLM") else _classification(s)
        return _hf(class_name, "DebertaV2Config", **cfg), batch

    return build


def _distilbert(s: Size):
    cfg = {"vocab_size": s.vocab, "dim": s.hidden, "n_layers": s.layers, "n_heads": s.heads, "hidden_dim": s.ffn}
    cfg |= {"max_position_embeddings": max(64, 2 * s.seq), "num_labels": 3}
    return _hf("DistilBertForSequenceClassification", "DistilBertConfig", **cfg), _classification(s)


def _albert(s: Size):
    cfg = {"vocab_size": s.vocab, "embedding_size": s.hidden // 2, "hidden_size": s.hidden, "num_labels": 3}
    cfg |= {"num_hidden_layers": s.layers, "num_attention_heads": s.heads, "intermediate_size": s.ffn}
    return _hf("AlbertForSequenceClassification", "AlbertConfig", max_position_embeddings=max(64, 2 * s.seq), **cfg), (
        _classification(s)
    )


def _electra(s: Size):
    cfg = {"vocab_size": s.vocab, "embedding_size": s.hidden, "hidden_size": s.hidden, "num_labels": 3}
    cfg |= {"num_hidden_layers": s.layers, "num_attention_heads": s.heads, "intermediate_size": s.ffn}
    return _hf(
        "ElectraForSequenceClassification", "ElectraConfig", max_position_embeddings=max(64, 2 * s.seq), **cfg
    ), (_classification(s))


def _gpt2(s: Size):
    cfg = {"vocab_size": s.vocab, "n_embd": s.hidden, "n_layer": s.layers, "n_head": s.heads, "n_positions": 2 * s.seq}
    return _hf("GPT2LMHeadModel", "GPT2Config", **cfg), _causal_lm(s)


def _llama_like(
    class_name: str, config_name: str, batch: Callable[[Size], Batch] | None = None, **extra: Any
) -> Callable[[Size], tuple[torch.nn.Module, Batch]]:
    def build(s: Size):
        return _hf(class_name, config_name, **_decoder_config(s, **extra)), (batch or _causal_lm)(s)

    return build


def _phi(s: Size):
    cfg = _decoder_config(s)
    del cfg["num_key_value_heads"]
    return _hf("PhiForCausalLM", "PhiConfig", **cfg), _causal_lm(s)


def _gpt_neox(s: Size):
    cfg = _decoder_config(s)
    del cfg["num_key_value_heads"]
    return _hf("GPTNeoXForCausalLM", "GPTNeoXConfig", **cfg), _causal_lm(s)


def _opt(s: Size):
    cfg = {"vocab_size": s.vocab, "hidden_size": s.hidden, "num_hidden_layers": s.layers, "ffn_dim": s.ffn}
    cfg |= {
        "num_attention_heads": s.heads,
        "max_position_embeddings": max(64, 2 * s.seq),
        "word_embed_proj_dim": s.hidden,
    }
    return _hf("OPTForCausalLM", "OPTConfig", **cfg), _causal_lm(s)


def _falcon(s: Size):
    cfg = {"vocab_size": s.vocab, "hidden_size": s.hidden, "num_hidden_layers": s.layers}
    cfg |= {"num_attention_heads": s.heads, "new_decoder_architecture": False, "multi_query": True}
    return _hf("FalconForCausalLM", "FalconConfig", **cfg), _causal_lm(s)


def _t5(s: Size):
    cfg = {"vocab_size": s.vocab, "d_model": s.hidden, "d_kv": s.hidden // s.heads, "d_ff": s.ffn}
    cfg |= {"num_layers": s.layers, "num_heads": s.heads, "decoder_start_token_id": 0, "pad_token_id": 0}
    return _hf("T5ForConditionalGeneration", "T5Config", **cfg), _seq2seq(s)


def _bart(s: Size):
    cfg = {"vocab_size": s.vocab, "d_model": s.hidden, "encoder_layers": s.layers, "decoder_layers": s.layers}
    cfg |= {"encoder_attention_heads": s.heads, "decoder_attention_heads": s.heads, "encoder_ffn_dim": s.ffn}
    cfg |= {"decoder_ffn_dim": s.ffn, "max_position_embeddings": max(64, 2 * s.seq)}
    return _hf("BartForConditionalGeneration", "BartConfig", **cfg), _seq2seq(s)


def _whisper(s: Size):
    frames = 2 * s.seq  # the encoder's two convolutions halve the mel frames
    cfg = {"vocab_size": s.vocab, "d_model": s.hidden, "encoder_layers": s.layers, "decoder_layers": s.layers}
    cfg |= {"encoder_attention_heads": s.heads, "decoder_attention_heads": s.heads, "encoder_ffn_dim": s.ffn}
    cfg |= {"decoder_ffn_dim": s.ffn, "num_mel_bins": 16, "max_source_positions": s.seq}
    cfg |= {"max_target_positions": max(32, s.seq), "decoder_start_token_id": 1, "pad_token_id": 0}
    batch = {"input_features": torch.randn(s.batch, 16, frames), "labels": _tokens(s, max(2, s.seq // 2))}
    return _hf("WhisperForConditionalGeneration", "WhisperConfig", **cfg), batch


def _wav2vec2(
    class_name: str, config_name: str, layerdrop: float = 0.0
) -> Callable[[Size], tuple[torch.nn.Module, Batch]]:
    """wav2vec2 and HuBERT: a CTC head (character labels) or an utterance classifier, with
    LayerDrop off (it draws a random number to skip a layer: a different program each step)
    unless ``layerdrop`` is given."""

    def build(s: Size):
        cfg = {"vocab_size": 32, "hidden_size": s.hidden, "num_hidden_layers": s.layers, "num_attention_heads": s.heads}
        cfg |= {"intermediate_size": s.ffn, "conv_dim": (16, 16), "conv_stride": (5, 2), "conv_kernel": (10, 3)}
        cfg |= {"num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 2, "pad_token_id": 0}
        cfg |= {
            "mask_time_prob": 0.0,
            "layerdrop": layerdrop,
            "ctc_loss_reduction": "mean",
            "num_labels": 4,
            "classifier_proj_size": 16,
        }
        ctc = class_name.endswith("CTC")
        labels = torch.randint(1, 32, (s.batch, 6)) if ctc else torch.randint(0, 4, (s.batch,))
        batch = {"input_values": torch.randn(s.batch, s.audio_samples), "labels": labels}
        return _hf(class_name, config_name, **cfg), batch

    return build


def _vit(s: Size):
    cfg = {"hidden_size": s.hidden, "num_hidden_layers": s.layers, "num_attention_heads": s.heads, "num_labels": 10}
    cfg |= {"intermediate_size": s.ffn, "image_size": s.image, "patch_size": 8}
    return _hf("ViTForImageClassification", "ViTConfig", **cfg), _images(s)


def _convnext(s: Size):
    widths = [s.hidden // 2, s.hidden]
    cfg = {"num_channels": 3, "hidden_sizes": widths, "depths": [1] * len(widths), "num_labels": 10}
    return _hf("ConvNextForImageClassification", "ConvNextConfig", num_stages=len(widths), **cfg), _images(s)


def _swin(s: Size):
    cfg = {"image_size": s.image, "patch_size": 4, "embed_dim": s.hidden // 2, "depths": [1, 1], "num_labels": 10}
    cfg |= {"num_heads": [2, 4], "window_size": 4}
    return _hf("SwinForImageClassification", "SwinConfig", **cfg), _images(s)


def _resnet(s: Size):
    cfg = {"embedding_size": s.hidden // 2, "hidden_sizes": [s.hidden // 2, s.hidden], "depths": [1, 1]}
    return _hf("ResNetForImageClassification", "ResNetConfig", layer_type="basic", num_labels=10, **cfg), _images(s)


def _mixtral(s: Size):
    cfg = _decoder_config(s, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)
    return _hf("MixtralForCausalLM", "MixtralConfig", **cfg), _causal_lm(s)


def _qwen2_moe(s: Size):
    cfg = _decoder_config(s, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=s.hidden)
    cfg |= {"shared_expert_intermediate_size": s.hidden, "output_router_logits": True}
    return _hf("Qwen2MoeForCausalLM", "Qwen2MoeConfig", **cfg), _causal_lm(s)


def _olmoe(s: Size):
    cfg = _decoder_config(s, num_experts=4, num_experts_per_tok=2, output_router_logits=True)
    return _hf("OlmoeForCausalLM", "OlmoeConfig", **cfg), _causal_lm(s)


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in [
        Architecture("bert", "encoder", "BertForMaskedLM", _bert),
        Architecture("roberta", "encoder", "RobertaForSequenceClassification", _roberta),
        Architecture("deberta-v2", "encoder", "DebertaV2ForMaskedLM", _deberta_v2("DebertaV2ForMaskedLM")),
        Architecture(
            "deberta-v2-cls",
            "encoder",
            "DebertaV2ForSequenceClassification",
            _deberta_v2("DebertaV2ForSequenceClassification"),
            refused_because="aten.nonzero",  # its loss keeps the labels >= 0: a data-dependent size
        ),
        Architecture("distilbert", "encoder", "DistilBertForSequenceClassification", _distilbert),
        Architecture("albert", "encoder", "AlbertForSequenceClassification", _albert),
        Architecture("electra", "encoder", "ElectraForSequenceClassification", _electra),
        Architecture("gpt2", "decoder", "GPT2LMHeadModel", _gpt2),
        Architecture("llama", "decoder", "LlamaForCausalLM", _llama_like("LlamaForCausalLM", "LlamaConfig")),
        Architecture(
            "llama-ones-mask",
            "decoder",
            "LlamaForCausalLM",
            _llama_like("LlamaForCausalLM", "LlamaConfig", batch=_causal_lm_with_ones_mask),
            # HF drops an all-ones mask for SDPA's is_causal kernel by reading its values; capture
            # follows that decision from the example batch (memplan.torch.capture.hf_masks)
        ),
        Architecture("mistral", "decoder", "MistralForCausalLM", _llama_like("MistralForCausalLM", "MistralConfig")),
        Architecture("qwen2", "decoder", "Qwen2ForCausalLM", _llama_like("Qwen2ForCausalLM", "Qwen2Config")),
        Architecture("qwen3", "decoder", "Qwen3ForCausalLM", _llama_like("Qwen3ForCausalLM", "Qwen3Config")),
        Architecture(
            "gemma", "decoder", "GemmaForCausalLM", _llama_like("GemmaForCausalLM", "GemmaConfig", head_dim=8)
        ),
        Architecture("phi", "decoder", "PhiForCausalLM", _phi),
        Architecture("gpt-neox", "decoder", "GPTNeoXForCausalLM", _gpt_neox),
        Architecture("opt", "decoder", "OPTForCausalLM", _opt),
        Architecture("falcon", "decoder", "FalconForCausalLM", _falcon),
        Architecture("t5", "encoder-decoder", "T5ForConditionalGeneration", _t5),
        Architecture("bart", "encoder-decoder", "BartForConditionalGeneration", _bart),
        Architecture("whisper", "speech", "WhisperForConditionalGeneration", _whisper),
        Architecture(
            "wav2vec2",
            "speech",
            "Wav2Vec2ForSequenceClassification",
            _wav2vec2("Wav2Vec2ForSequenceClassification", "Wav2Vec2Config"),
        ),
        Architecture(
            "wav2vec2-layerdrop",
            "speech",
            "Wav2Vec2ForSequenceClassification",
            _wav2vec2("Wav2Vec2ForSequenceClassification", "Wav2Vec2Config", layerdrop=0.1),
            refused_because="data-dependent",  # LayerDrop (its default 0.1) skips a layer on a random draw
        ),
        Architecture(
            "wav2vec2-ctc",
            "speech",
            "Wav2Vec2ForCTC",
            _wav2vec2("Wav2Vec2ForCTC", "Wav2Vec2Config"),
            refused_because="data-dependent",  # `labels.max() >= vocab_size` raises on a bad label
        ),
        Architecture(
            "hubert",
            "speech",
            "HubertForSequenceClassification",
            _wav2vec2("HubertForSequenceClassification", "HubertConfig"),
        ),
        Architecture("vit", "vision", "ViTForImageClassification", _vit),
        Architecture("convnext", "vision", "ConvNextForImageClassification", _convnext),
        Architecture("swin", "vision", "SwinForImageClassification", _swin),
        Architecture("resnet", "vision", "ResNetForImageClassification", _resnet),
        Architecture("mixtral", "mixture-of-experts", "MixtralForCausalLM", _mixtral),
        Architecture("qwen2-moe", "mixture-of-experts", "Qwen2MoeForCausalLM", _qwen2_moe),
        Architecture("olmoe", "mixture-of-experts", "OlmoeForCausalLM", _olmoe),
    ]
}


def build(name: str, size: Size = TINY, *, seed: int = 0) -> tuple[torch.nn.Module, Batch]:
    """The model (random weights from ``seed``, training mode) and a batch with its labels."""
    if name not in ARCHITECTURES:
        raise MemplanError(f"unknown architecture {name!r}; choose one of {', '.join(ARCHITECTURES)}")
    torch.manual_seed(seed)
    return ARCHITECTURES[name].build(size)


def output_loss(output: Any, target: Any) -> torch.Tensor:
    """The loss an HF model computed from the labels in its batch (``target`` is None)."""
    return output.loss


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW, as the HF Trainer uses by default."""
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def eager_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> torch.Tensor:
    """The loop a user writes: forward with the labels in the batch, the model's loss,
    backward, step, ``zero_grad(set_to_none=True)``."""
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def run_architecture(
    name: str,
    size: Size = TINY,
    steps: int = 3,
    *,
    seed: int = 0,
    allocator: str = "auto",
    time_limit_seconds: float = 1.0,
    measure_memory: bool = False,
) -> ArchitectureResult:
    """Build ``name`` at ``size``, then train it ``steps`` steps through
    :func:`memplan.compile_step` and eagerly from the same weights, with the same seed before
    each step and the same batch; compare the loss and everything a step may change bit for
    bit after every step. With ``measure_memory`` one more step of each side is measured
    once the planned allocator replays (as ``memplan run`` measures)."""
    start = time.perf_counter()
    arch = ARCHITECTURES[name]
    eager_model, batch = build(name, size, seed=seed)
    planned_model = copy.deepcopy(eager_model)
    eager_opt, planned_opt = make_optimizer(eager_model), make_optimizer(planned_model)

    def result(outcome: str, detail: str = "", **fields: Any) -> ArchitectureResult:
        seconds = round(time.perf_counter() - start, 2)
        return ArchitectureResult(name, arch.family, outcome, detail, seconds=seconds, **fields)

    try:
        step = _compile(planned_model, planned_opt, batch, allocator, time_limit_seconds)
    except MemplanError as err:
        return result("refused", _one_line(err))
    max_diff, first_difference = 0.0, ""
    for k in range(steps):
        torch.manual_seed(seed + 1000 + k)
        try:
            eager_loss = eager_step(eager_model, eager_opt, batch)
        except Exception as err:  # the model itself cannot train this way: say so, not memplan's fault
            return result("eager fails", _one_line(err), steps=k)
        eager_state = snapshot(eager_model, eager_opt)
        torch.manual_seed(seed + 1000 + k)
        try:
            planned_loss = step((batch, None))
        except MemplanError as err:
            return result("refused at run", f"step {k}: {_one_line(err)}", steps=k)
        planned_state = snapshot(planned_model, planned_opt)
        found = differences(eager_state, planned_state)
        if not torch.equal(eager_loss, planned_loss):
            found.insert(0, "loss")
        max_diff = max(max_diff, _max_abs_diff((eager_loss, eager_state), (planned_loss, planned_state)))
        if found and not first_difference:
            first_difference = f"step {k}: " + "; ".join(found[:4])
    peaks = {}
    if measure_memory:
        peaks = _measure_peaks(step, eager_model, eager_opt, planned_model, planned_opt, batch, seed)
    outcome = "different" if first_difference else "equal"
    return result(outcome, first_difference, steps=steps, max_abs_diff=max_diff, **peaks)


def _compile(model, optimizer, batch, allocator: str, time_limit_seconds: float):
    import memplan

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return memplan.compile_step(
            model, optimizer, output_loss, (batch, None), allocator=allocator, time_limit_seconds=time_limit_seconds
        )


def _measure_peaks(step, eager_model, eager_opt, planned_model, planned_opt, batch, seed: int) -> dict[str, int]:
    """Peak bytes of one steady-state step of each side, measured as ``memplan run`` does
    (:mod:`memplan.torch.compare`): the allocator's peak during the step plus the resident
    parameters, buffers, optimizer state, batch (and, for memplan, its arena)."""
    from memplan.torch.measure import allocator_peak_bytes, optimizer_state_tensors, resident_bytes
    from memplan.torch.run.replay import MAX_RECORDINGS

    runner = step.runner_for((batch, None))
    for k in range(MAX_RECORDINGS):  # the planned allocator records until allocations repeat
        if getattr(runner, "replaying", True):
            break
        torch.manual_seed(seed + 2000 + k)
        eager_step(eager_model, eager_opt, batch)
        torch.manual_seed(seed + 2000 + k)
        step((batch, None))
    torch.manual_seed(seed + 3000)
    _, eager_peak = allocator_peak_bytes(lambda: eager_step(eager_model, eager_opt, batch))
    torch.manual_seed(seed + 3000)
    _, planned_peak = allocator_peak_bytes(lambda: step((batch, None)))

    def resident(model, opt, *extra) -> int:
        return resident_bytes([*model.parameters(), *model.buffers()], optimizer_state_tensors(opt), batch, *extra)

    arena = getattr(runner, "arena", None)
    plan = step.plans[next(iter(step.plans))]
    return {
        "eager_peak_bytes": resident(eager_model, eager_opt) + eager_peak,
        "memplan_peak_bytes": resident(planned_model, planned_opt, *([arena] if arena is not None else []))
        + planned_peak,
        "planned_peak_bytes": int(plan.report.get("planned_peak_bytes", 0)),
    }


def _max_abs_diff(a: Any, b: Any) -> float:
    """The largest absolute difference between the floating tensors at the same place (key
    path) of two nests; dicts are matched by key, not by order (the planned optimizer's state
    is created in the planned order)."""
    from torch.utils import _pytree as pytree

    left = {pytree.keystr(path): x for path, x in pytree.tree_flatten_with_path(_as_tree(a))[0]}
    worst = 0.0
    for path, y in pytree.tree_flatten_with_path(_as_tree(b))[0]:
        x = left.get(pytree.keystr(path))
        if _comparable(x, y):
            worst = max(worst, float((x.double() - y.double()).abs().max()))
    return worst


def _comparable(x: Any, y: Any) -> bool:
    both = isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
    return both and x.shape == y.shape and x.numel() > 0 and x.is_floating_point() and y.is_floating_point()


def _as_tree(value: Any) -> Any:
    if hasattr(value, "params") and hasattr(value, "rng"):  # a StepState
        return {"params": value.params, "grads": value.grads, "buffers": value.buffers, "optimizer": value.optimizer}
    if isinstance(value, tuple):
        return [_as_tree(v) for v in value]
    return value


def _one_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def run_all(size: Size = TINY, steps: int = 3, **kwargs: Any) -> list[ArchitectureResult]:
    """Every architecture at ``size``."""
    return [run_architecture(name, size, steps, **kwargs) for name in ARCHITECTURES]
