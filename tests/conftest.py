"""The default run (`make test`) keeps one case of each kind; the siblings below re-check the same
code path on another optimizer form, model or allocator and run with `make test-all` (marked
``slow`` here, so the list of what moved is in one place). Each entry names the sibling that
stays in the default run."""

from __future__ import annotations

import pytest

# test name -> the parametrisation ids that only re-measure a path a kept sibling already covers
REMEASURES: dict[str, set[str]] = {
    # kept: SGD foreach, Adam for-loop, AdamW and Adagrad fused, RMSprop and Adafactor foreach,
    # the four warm states (SGD, Adam, AdamW, ASGD) and the two refused; every optimizer is still
    # checked eagerly by the self-check below; the rest of the matrix runs in `make test-all` and
    # bench/optimizers.py (every variant, after every step)
    "test_every_optimizer_variant_trains_like_eager_or_is_refused_at_compile_time": {
        "Adamax[foreach]",
        "NAdam[plain]",
        "RAdam[foreach]",
        "Adadelta[plain]",
        "Rprop[plain]",
        "SGD[plain]",
        "SGD[fused]",
        "Adam[foreach]",
        "Adam[fused]",
        "AdamW[plain]",
        "AdamW[foreach]",
        "Adamax[plain]",
        "NAdam[foreach]",
        "RAdam[plain]",
        "Adagrad[plain]",
        "Adagrad[foreach]",
        "Adadelta[foreach]",
        "RMSprop[plain]",
        "Rprop[foreach]",
        "ASGD[plain]",
        "ASGD[foreach]",
        "Adafactor[plain]",
    },
    # kept: SGD[plain], AdamW[fused]
    "test_arena_views_runtime_also_trains_like_eager": {"Adam[plain]", "Adam[foreach]", "AdamW[plain]"},
    # kept: GPT-2 with accumulation, BERT with clipping (the MLP runs every feature)
    "test_hf_models_with_their_loss_in_the_output": {
        "GPT-2 (2 layers, 32)-dict batch, loss from the output",
        "GPT-2 (2 layers, 32)-float16 + GradScaler (skipped steps)",
        "BERT (2 layers, 32)-nested batch",
        "BERT (2 layers, 32)-autocast bfloat16",
    },
    # kept: mlp-views, cnn-bn-replay, gpt2-replay
    "test_generated_and_interpreted_steps_give_the_same_bits": {
        "foreach optimizer-mlp-replay",
        "foreach optimizer-cnn-bn-views",
        "foreach optimizer-gpt2-views",
    },
    # kept: fused optimizer, the scaler's skipped steps
    "test_every_loop_feature_gives_the_same_bits_generated_and_interpreted": {
        "gradient accumulation (2 micro-batches)-replay",
        "nested batch-replay",
    },
    # kept: mlp at both batches, vgg16-2-sgd, gpt2-2l-1-adam
    "test_program_order_peak_matches_measured_eager_peak": {"vgg16-16-adamw", "gpt2-2l-4-sgd"},
    # kept: the other eight features; accumulation and clipping run on GPT-2 and BERT above, the
    # fused optimizer and the scaler's skipped steps in the codegen tests and the scaler tests
    "test_every_loop_feature_trains_like_eager_on_an_mlp": {
        "gradient accumulation (2 micro-batches)",
        "clip_grad_norm_",
        "fused optimizer",
        "float16 + GradScaler (skipped steps)",
    },
    # kept: U-Net at 0.85 (VGG-16 at 0.88 re-checks the same lowering on a chain)
    "test_remat_step_equals_eager_within_the_planned_peak": {"vgg16-32-0.88-linearized-greedy"},
    # kept: mlp-8-adam with views, both models with the planned allocator (the default)
    "test_arena_views_train_exactly_like_eager": {"vgg16-4-sgd"},
    # kept: vgg16-4-sgd (mlp-8-adam runs with arena views above)
    "test_planned_allocator_trains_exactly_like_eager": {"mlp-8-adam"},
    # kept: the planned allocator (the LRU eviction test runs arena views)
    "test_every_shape_shares_one_arena_bit_identical_to_eager": {"views"},
    # kept: the planned allocator, whose addresses the merged step must serve
    "test_consecutive_updates_run_as_one_optimizer_step": {"views"},
    # kept: the recomputed copies of the two small modules (SkipCat, CatThenWrite) against eager
    "test_unet_recomputes_its_cats_and_trains_like_eager": {"replay"},
    # kept: the other ten models (XLM-R is BERT's architecture, EfficientNet-B0 MobileNet-v2's blocks)
    "test_every_zoo_model_captures_a_valid_training_step": {"xlm-roberta-base", "efficientnet-b0"},
}


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.id in REMEASURES.get(item.originalname, ()):
            item.add_marker(pytest.mark.slow)
