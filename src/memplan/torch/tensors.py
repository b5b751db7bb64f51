"""Small helpers on tensors and fx nodes that capture and the runtime share: which storage a
tensor lives in, the tensors in a nested value, which storages an op writes, whether it draws
random numbers."""

from __future__ import annotations

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
    op = node.target
    positions = list(HIDDEN_WRITES.get(op._schema.name, ()))
    if op._schema.name in HIDDEN_WRITES and not batch_norm_training(node):
        positions = []
    keys: list[int] = []
    for i, arg in enumerate(op._schema.arguments):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        is_write = arg.alias_info is not None and arg.alias_info.is_write
        if (is_write or i in positions) and value is not None:
            for leaf in pytree.tree_leaves(value):
                if isinstance(leaf, torch.fx.Node):
                    keys.extend(storage_key(t) for t in tensor_leaves(leaf.meta.get("val")))
    return list(dict.fromkeys(keys))


def batch_norm_training(node: torch.fx.Node) -> bool:
    training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training", False)
    return bool(training)


def is_random(target: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())
