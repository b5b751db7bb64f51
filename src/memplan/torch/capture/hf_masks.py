"""HF's attention-mask shortcut, which reads the mask's values: followed, guarded, or refused.

With SDPA attention, HF ``transformers`` drops a padding mask that masks nothing and calls
SDPA's ``is_causal`` kernel instead (``masking_utils._ignore_causal_mask_sdpa``; its
bidirectional twin drops a mask of zeros, which gives the same bits). It decides by reading
the mask's values, except while it is traced (``is_tracing`` is true for a FakeTensor), when it
keeps the mask. A plan captured on fakes
therefore always runs the masked kernel, while eager runs ``is_causal`` for an all-ones mask:
exact attention both, but other kernels, other last bits (1e-6 after one step, growing).

So during capture each such decision is made as eager makes it, from the real example batch's
mask (the batch leaf whose pytree path names a mask and has the traced mask's shape), and the
plan follows it: an all-ones mask is dropped for ``is_causal`` as in eager, a padded one kept.
Every later step checks that its batch's mask gets the same decision
(:func:`check_mask_guards`), and refuses in one line where it would not (a padded batch after
an unpadded example, or the reverse). A mask found in no batch leaf (one the model derives
itself, such as a seq2seq decoder's) is traced as before, with the mask kept: the one case left
unchecked (BART, T5 and Whisper train bit-exactly in the architecture tests).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import _disable_current_modes

import torch
from memplan.errors import UnsupportedOp

# The causal one only: dropping a bidirectional all-ones mask leaves SDPA's CPU kernel adding
# zeros, the same bits (BERT with an all-ones mask trains bit-exactly in tests/torch/test_loops.py),
# while the causal one switches to is_causal, which skips blocks and sums in another order.
SKIP_CHECKS = ("_ignore_causal_mask_sdpa",)


@dataclass(frozen=True)
class MaskGuard:
    """At run time, ``decide(mask_leaf)`` must give ``expected``, HF's decision at capture."""

    leaf: int  # position in the flattened batch
    name: str  # the HF function that decides
    decide: Callable[[torch.Tensor], bool]
    expected: bool  # True: the mask was dropped for SDPA's is_causal


def _refusal(guard: MaskGuard) -> UnsupportedOp:
    planned, now = ("dropped", "keeps") if guard.expected else ("kept", "drops")
    return UnsupportedOp(
        f"HF attention reads the attention mask's values to choose SDPA's kernel ({guard.name}): the plan "
        f"{planned} the example batch's mask, but eager {now} this batch's, another kernel with other bits; "
        "make a plan per kind of batch (padded or not, e.g. pass no attention_mask when nothing is padded), "
        "or build the model with attn_implementation='eager'"
    )


def _mask_leaves(real_flat: Sequence[Any], paths: Sequence[str], shape: torch.Size) -> list[int]:
    return [
        i
        for i, (leaf, path) in enumerate(zip(real_flat, paths, strict=True))
        if isinstance(leaf, torch.Tensor) and "mask" in path.lower() and tuple(leaf.shape) == tuple(shape)
    ]


@contextlib.contextmanager
def follow_mask_shortcuts(real_batch: Any, guards: list[MaskGuard]) -> Iterator[None]:
    """While capturing: HF's mask-skip decisions made from ``real_batch`` (see the module
    docstring); the guards for later steps are appended to ``guards``."""
    module = sys.modules.get("transformers.masking_utils")
    if module is None:
        yield
        return
    with_paths, _ = torch.utils._pytree.tree_flatten_with_path(real_batch)
    real_flat = [leaf for _, leaf in with_paths]
    paths = [torch.utils._pytree.keystr(path) for path, _ in with_paths]
    originals = {name: getattr(module, name) for name in SKIP_CHECKS if hasattr(module, name)}

    def wrap(name: str, original: Callable[..., bool]) -> Callable[..., bool]:
        signature = inspect.signature(original)

        def decide(*args: Any, **kwargs: Any) -> bool:
            bound = signature.bind(*args, **kwargs)
            mask = bound.arguments.get("padding_mask")
            if not isinstance(mask, torch.Tensor) or not is_fake(mask):
                return original(*args, **kwargs)
            found = _mask_leaves(real_flat, paths, mask.shape)
            if len(found) != 1:
                # a mask the model makes itself (a seq2seq decoder's): its values are not the
                # batch's, so nothing here can decide; kept, as before (see the module docstring)
                return original(*args, **kwargs)
            leaf = found[0]
            rest = {k: v for k, v in bound.arguments.items() if k != "padding_mask"}

            def eager_would_skip(value: torch.Tensor) -> bool:
                return bool(original(padding_mask=value.to(torch.bool), **rest))

            with _disable_current_modes():  # decide on the real mask, outside the fake and tracing modes
                skip = eager_would_skip(real_flat[leaf])
            guards.append(MaskGuard(leaf, name, eager_would_skip, skip))
            return skip

        return decide

    for name, original in originals.items():
        setattr(module, name, wrap(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(module, name, original)


def check_mask_guards(guards: Sequence[MaskGuard], flat_batch: Sequence[Any]) -> None:
    """Refuse a batch whose mask HF would treat otherwise in eager than at capture."""
    for guard in guards:
        if guard.decide(flat_batch[guard.leaf]) != guard.expected:
            raise _refusal(guard)
