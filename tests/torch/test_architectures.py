"""HF architectures at large (encoders, decoders, encoder-decoders, vision, mixtures of
experts, speech), built from tiny configs with their labels in the batch, planned and trained
3 steps bit for bit like eager; the known refusals say why in one line."""

from __future__ import annotations

import pytest

import torch
from memplan.torch.architectures import ARCHITECTURES, FAMILIES, TINY, run_architecture

pytest.importorskip("transformers", reason="the architectures come from HF transformers")


@pytest.fixture(autouse=True)
def one_thread():
    """The models are tiny: a second intra-op thread only spins (3x the CPU time on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_list_covers_every_family_with_at_least_15_architectures():
    runnable = [a for a in ARCHITECTURES.values() if not a.refused_because and not a.tolerance]
    assert len(runnable) >= 15
    assert {a.family for a in runnable} == set(FAMILIES)


# one or two of each family in `make test`; every entry with `make test-all` (and the bench)
QUICK = {"bert", "gpt2", "llama", "llama-ones-mask", "t5", "wav2vec2", "convnext", "mixtral", "deberta-v2-cls"}


@pytest.mark.parametrize("name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in ARCHITECTURES])
def test_architecture_trains_like_eager_or_is_refused_in_one_line(name):
    arch = ARCHITECTURES[name]
    result = run_architecture(name, TINY, steps=3, time_limit_seconds=0.5)
    if arch.refused_because:
        assert result.outcome == "refused", result
        assert arch.refused_because in result.detail, result
        assert "\n" not in result.detail
    elif arch.tolerance:  # a named difference from eager, and the bound tested instead
        assert result.outcome in ("equal", "different"), result
        assert result.steps == 3 and result.max_abs_diff <= arch.tolerance, result
    else:
        assert result.outcome == "equal", result
        assert result.steps == 3 and result.max_abs_diff == 0.0, result
