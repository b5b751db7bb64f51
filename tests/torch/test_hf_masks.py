"""HF's SDPA mask shortcut reads the mask's values: a plan follows it from the example batch and
refuses a later batch for which eager would choose the other kernel (memplan.torch.capture.hf_masks)."""

from __future__ import annotations

import pytest

import memplan
import torch
from memplan.errors import UnsupportedOp

pytest.importorskip("transformers", reason="the mask shortcut is HF transformers' own")

from memplan.torch.architectures import ARCHITECTURES, TINY


def _llama_with_mask(padded: bool):
    model, batch = ARCHITECTURES["llama"].build(TINY)
    mask = torch.ones_like(batch["input_ids"])
    if padded:
        mask[0, -2:] = 0
    return model, {**batch, "attention_mask": mask}


def test_an_all_ones_mask_is_refused_at_capture_in_one_line():
    model, batch = _llama_with_mask(padded=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(UnsupportedOp, match="reads the attention mask's values") as err:
        memplan.compile_step(model, opt, lambda out, _: out.loss, (batch, None))
    assert "\n" not in str(err.value)


def test_a_padded_mask_trains_like_eager_and_a_later_unpadded_batch_is_refused():
    model, batch = _llama_with_mask(padded=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = memplan.compile_step(model, opt, lambda out, _: out.loss, (batch, None))
    step((batch, None))  # the guard lets the padded batch through
    unpadded = {**batch, "attention_mask": torch.ones_like(batch["attention_mask"])}
    with pytest.raises(UnsupportedOp, match="would drop this batch's mask"):
        step((unpadded, None))
