"""One arena for every batch shape of a step (Sekiyama et al. 4.3).

A step compiled for variable-length batches gets a plan per shape; every plan places its
tensors at offsets in the same arena, sized for the largest plan in use and grown by
reallocation (the old block is released before the new one is allocated, so the two never
coexist). Plans are kept up to a bound and the least recently used one is evicted, so memory
never grows with the number of distinct shapes: only the arena (one, the largest) and each kept
plan's small tables stay.

While a new shape is recorded and planned the arena is released (the recording steps run on
the ordinary allocator), then allocated again at the size the plans need: the process then never
holds an arena and an unplanned step's memory at once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

import torch
from memplan.errors import MemplanError
from memplan.torch.rss import release_free_memory

V = TypeVar("V")


class SharedArena:
    """One uint8 block that every plan of a step uses at its own offsets; ``tensor`` is it
    (empty while released). Nobody else keeps a reference across steps, so growing really frees."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.tensor = torch.empty(0, dtype=torch.uint8, device=self.device)
        self.allocations = 0  # how many times a block was allocated (first one and regrowths)
        self.largest_bytes = 0
        self.target_bytes = 0  # what the kept plans need (set by fit): a regrowth allocates at least this

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def reserve(self, nbytes: int) -> torch.Tensor:
        """The arena, at least ``nbytes`` long: reallocated (old block freed first) if smaller,
        then at the size the kept plans need if that is more (one regrowth, not one per shape)."""
        if nbytes < 0:
            raise MemplanError(f"an arena cannot hold {nbytes} bytes")
        if nbytes > self.nbytes:
            nbytes = max(nbytes, self.target_bytes)
            self.release()
            # zeros, not empty: the pages are mapped now, in an untimed planning step, not on
            # first touch inside the first replayed step
            self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            self.allocations += 1
            self.largest_bytes = max(self.largest_bytes, nbytes)
        return self.tensor

    def release(self) -> None:
        """Give the block back (to the OS: blocks this large are mapped, not heap; on CUDA, out
        of the allocator's cache to the device)."""
        if self.nbytes:
            self.tensor = torch.empty(0, dtype=torch.uint8, device=self.device)
            if self.device.type == "cuda":
                from memplan.torch.run import cuda_allocator

                cuda_allocator.release_free_memory()
            else:
                release_free_memory()

    def fit(self, nbytes: int) -> torch.Tensor:
        """The arena at exactly ``nbytes`` when it is larger (the plans that needed more were
        evicted) or smaller; unchanged when equal. Later regrowths (after a release) go to this size."""
        self.target_bytes = nbytes
        if nbytes != self.nbytes:
            self.release()
        return self.reserve(nbytes)


class LruCache(Generic[V]):
    """Plans by key, at most ``max_entries``, evicting the least recently used (Sekiyama 4.3's
    bound on kept plans). ``evictions`` counts what was dropped."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise MemplanError(f"max_plans must be at least 1, not {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, V] = OrderedDict()
        self.evictions = 0

    def get(self, key: Hashable) -> V | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: Hashable, value: V) -> list[V]:
        """Insert as most recent; returns the entries evicted to stay within the bound."""
        self._entries[key] = value
        self._entries.move_to_end(key)
        evicted = []
        while len(self._entries) > self.max_entries:
            _, old = self._entries.popitem(last=False)
            evicted.append(old)
            self.evictions += 1
        return evicted

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, key: Hashable) -> V:
        return self._entries[key]

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._entries))

    def keys(self) -> list[Hashable]:
        return list(self._entries)

    def values(self) -> Iterator[V]:
        return iter(self._entries.values())
