"""Measure the live bytes of a real eager run: every storage an op creates is tracked until
PyTorch frees it, so the peak is the largest total of storages alive at once.

Storages keep their Python object alive as long as the C++ storage lives, so a finalizer on
that object fires exactly when the memory is released.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import torch


class LiveBytesTracker(TorchDispatchMode):
    """Counts the bytes of every storage alive; ``peak_bytes`` is the maximum seen.

    Call :meth:`track` on the tensors that exist before the step (parameters, optimizer
    state, the batch); everything ops create inside the mode is tracked automatically.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, int] = {}

    def track(self, *tensors: Any) -> None:
        for leaf in pytree.tree_leaves(tensors):
            if isinstance(leaf, torch.Tensor):
                self._track_storage(leaf.untyped_storage())

    def _track_storage(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._live or storage.nbytes() == 0:
            return
        self._live[key] = storage.nbytes()
        self.current_bytes += storage.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.current_bytes -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(out)
        return out


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def measure_train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Any,
    batch: tuple[Any, Any],
    *,
    warmup: bool = True,
) -> int:
    """Peak live bytes of one real eager step ``loss_fn(model(inputs), target); backward;
    step; zero_grad(set_to_none=True)``, counting parameters, buffers, optimizer state and the
    batch. With ``warmup`` one step runs first so the optimizer state exists (steady state)."""
    from memplan.torch.capture import call_model

    inputs, target = batch

    def step() -> None:
        loss = loss_fn(call_model(model, inputs), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del loss

    if warmup:
        step()
    tracker = LiveBytesTracker()
    tracker.track(list(model.parameters()), list(model.buffers()), optimizer_state_tensors(optimizer), batch)
    with tracker:
        step()
    return tracker.peak_bytes


def measure_infer_step(model: torch.nn.Module, inputs: Any) -> int:
    """Peak live bytes of ``with torch.no_grad(): model(inputs)``, parameters included."""
    from memplan.torch.capture import call_model

    tracker = LiveBytesTracker()
    tracker.track(list(model.parameters()), list(model.buffers()), inputs)
    with tracker, torch.no_grad():
        out = call_model(model, inputs)
        del out
    return tracker.peak_bytes


KINETO_QUIET_LEVEL = "6"  # above every severity kineto logs with, its USDT markers included


def quiet_profiler() -> None:
    """Keep kineto (the profiler's tracing library) from printing ``USDT: ... profiler_start``
    and ``profiler_stop`` lines on stderr around every profiled region: kineto prints them
    at its highest severity, so only a log level above all severities (``KINETO_LOG_LEVEL``,
    read once, when the profiler first starts in the process) silences them. A level the
    user set is kept."""
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET_LEVEL)


def allocator_peak_bytes(fn: Any, *args: Any) -> tuple[Any, int]:
    """Run ``fn(*args)`` and return its result and the largest number of bytes the CPU
    allocator held at once during the call, above what it held before.

    Unlike :class:`LiveBytesTracker` this sees every allocation, including temporaries that
    kernels make internally; it reads the profiler's memory events ("Total Allocated").
    """
    import json
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    quiet_profiler()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        result = fn(*args)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)
    return result, peak_above_start(events)


def peak_above_start(events: list[dict[str, Any]]) -> int:
    """The largest "Total Allocated" of a profile's memory events above the level at its start.

    The profiler's CPU counter is not reset per profile: it still counts the tensors that
    earlier profiled calls allocated and that are alive (optimizer state made lazily, a
    returned loss). The level before the first event is that event's total less its own bytes
    (negative for a free)."""
    memory = sorted(
        (e for e in events if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})),
        key=lambda e: e.get("ts", 0),
    )
    if not memory:
        return 0
    first = memory[0]["args"]
    start = int(first["Total Allocated"]) - int(first.get("Bytes", 0))
    return max(0, max(int(e["args"]["Total Allocated"]) for e in memory) - start)


def resident_bytes(*tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (parameters, state, batch, arena)."""
    seen: dict[int, int] = {}
    for leaf in pytree.tree_leaves(tensors):
        if isinstance(leaf, torch.Tensor):
            storage = leaf.untyped_storage()
            seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())
