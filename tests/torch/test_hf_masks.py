"""HF's SDPA mask shortcut reads the mask's values: a plan follows eager's decision for the
example batch, and refuses a later batch for which eager would decide otherwise
(memplan.torch.capture.hf_masks)."""

from __future__ import annotations

import copy

import pytest

import memplan
import torch
from memplan.errors import UnsupportedOp
from memplan.torch.equivalence import differences, snapshot

pytest.importorskip("transformers", reason="the mask shortcut is HF transformers' own")

from memplan.torch.architectures import ARCHITECTURES, TINY


def _llama_with_mask(padded: bool):
    model, batch = ARCHITECTURES["llama"].build(TINY)
    mask = torch.ones_like(batch["input_ids"])
    if padded:
        mask[0, -2:] = 0
    return model, {**batch, "attention_mask": mask}


def _loss(out, _target):
    return out.loss


@pytest.mark.parametrize("padded", [False, True])
def test_the_plan_takes_eagers_kernel_and_refuses_the_other_kind_of_batch(padded):
    model, batch = _llama_with_mask(padded)
    eager = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    step = memplan.compile_step(model, opt, _loss, (batch, None))
    for k in range(2):
        torch.manual_seed(k)
        step((batch, None))
        torch.manual_seed(k)
        eager(**batch).loss.backward()
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)
        assert not differences(snapshot(eager, eager_opt), snapshot(model, opt))
    other = torch.ones_like(batch["attention_mask"])
    if not padded:
        other[1, -3:] = 0
    with pytest.raises(UnsupportedOp, match="reads the attention mask's values") as err:
        step(({**batch, "attention_mask": other}, None))
    assert "\n" not in str(err.value)
