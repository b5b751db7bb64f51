"""Small helpers on tensors and fx nodes that capture and the runtime share: which storage a
tensor lives in, the tensors in a nested value, which storages an op writes, whether it draws
random numbers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

import torch

# Ops that write an argument although their schema does not mark it (running statistics).
HIDDEN_WRITES: dict[str, tuple[int, ...]] = {
    "aten::native_batch_norm": (3, 4),
    "aten::_native_batch_norm_legit": (3, 4),
    "aten::cudnn_batch_norm": (3, 4),
    "aten::miopen_batch_norm": (3, 4),
}


def storage_key(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]


def written_storages(node: torch.fx.Node) -> list[int]:
    """Storage keys of the tensors the traced op ``node`` writes."""
    keys: list[int] = []
    for value in written_arguments(node.target, node.args, node.kwargs):
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.fx.Node):
                keys.extend(storage_key(t) for t in tensor_leaves(leaf.meta.get("val")))
    return list(dict.fromkeys(keys))


def written_arguments(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments of a call of ``op`` that it writes: those its schema marks as written,
    and BatchNorm's running statistics in training (:data:`HIDDEN_WRITES`). Works on fx
    nodes and on real tensors alike."""
    schema = op._schema
    hidden = HIDDEN_WRITES.get(schema.name, ())
    if hidden and not _batch_norm_training(args, kwargs):
        hidden = ()
    written = []
    for i, arg in enumerate(schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        is_write = arg.alias_info is not None and arg.alias_info.is_write
        if (is_write or i in hidden) and value is not None:
            written.append(value)
    return written


def _batch_norm_training(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    training = args[5] if len(args) > 5 else kwargs.get("training", False)
    return bool(training)


def is_random(target: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())
