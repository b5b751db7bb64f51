"""The step that creates the optimizer's state: within eager's peak, and recorded as a steady one (issue 37).

An optimizer such as AdamW makes its state (two tensors as large as the parameters) inside its
first ``step()``, on top of the temporaries of its update. A planned step serves those
temporaries at their planned offsets in the arena (the update's traced ops), but not in the
step that creates the state: that call's allocations are not the traced ones, so its
temporaries come from the ordinary allocator while the arena's pages planned for them stay
resident, holding tensors already dead. The first step then peaks above eager's by those
pages (GPT-2 2 layers: the three 147 MiB slots of the tied embedding's gradient).

So, on a step whose optimizer will create state (its state is not yet what the captured step
leaves), just before each call of the user's optimizer the arena's pages that hold nothing
the step reads from that call on are given back to the operating system
(``madvise(MADV_DONTNEED)``): they read as zeros when touched again, and every tensor on them
is written before it is read (the plan's lifetimes, below). Later steps keep every page, so
they pay no page faults.

When a tensor holds data at a call: an update group runs as one call of the user's optimizer at
its op planned last (:mod:`memplan.torch.run.updates`), so each op runs at its own position,
or at its group's call. A tensor is kept at the call at position ``q`` when the op making it
ran before ``q`` and some op reading it runs at or after ``q`` (a group's inputs are read by
every op of the group, :func:`memplan.torch.capture.trace.hold_update_inputs`); outputs of the
step are kept once made. Ops that never run alone (an optimizer op in no group) count at their
own position, which only keeps more.

With the planned CPU allocator, the step that creates the state is recorded like any other.
For the optimizers whose first update makes the same temporaries as later ones
(:func:`first_update_allocates_as_later`: Adam and its kin, RMSprop, Adagrad, ...; not SGD
with momentum, whose first update clones the gradient where later ones scale the buffer in
place), the state's allocations (made inside the optimizer's calls and outliving the step) are
the only ones a later step does not make: :func:`noting_state_calls` notes which allocations
the optimizer's calls made, and :func:`steady_trace` leaves out those that outlived the step,
so the first step's recording stands for the steady ones and the second step replays (one
visit before the first replayed step, not two). For the others the second step is recorded
too, and placed. A later step that allocates otherwise than its plan is still correct (the
planned allocator checks every allocation and sends a step that differs to the ordinary
allocator), but it holds the arena and the allocator's blocks at once: hence the list.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from memplan.graph.ir import Category
from memplan.torch.capture import Capture
from memplan.torch.capture.trace import optimizer_state_meta
from memplan.torch.rss import _libc
from memplan.torch.run.updates import INDEPENDENT_OPTIMIZERS

MADV_DONTNEED = 4  # Linux: the pages read as zeros on the next touch
PAGE = mmap.PAGESIZE


def creates_state(capture: Capture, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
    """Whether a step of ``capture`` run now makes optimizer state: the optimizers' state is
    not yet what the captured (steady-state) step leaves."""
    if capture.mode != "train" or not capture.optimizer_state_meta:
        return False
    now = {k: v for opt in optimizers for k, v in optimizer_state_meta(model, opt).items()}
    return now != capture.optimizer_state_meta


@dataclass
class StateCalls:
    """What :func:`noting_state_calls` saw of a recorded step: ``ranges``, the allocation
    indices ``[first, end)`` of each call of the user's optimizer when the step created the
    optimizers' state (empty when it created none); ``steady``: False when it created state
    with an update not known to allocate as later ones (:func:`first_update_allocates_as_later`)."""

    ranges: list[tuple[int, int]] = field(default_factory=list)
    steady: bool = True


@contextlib.contextmanager
def noting_state_calls(runner: Any, native: Any) -> Iterator[StateCalls]:
    """Around a recorded step of ``runner`` (a :class:`~memplan.torch.run.interpreter.StepRunner`):
    which allocations (``native``'s recording) the optimizer's calls made, when the step
    creates the optimizers' state (:class:`StateCalls`)."""
    calls = StateCalls()
    capture, model, optimizers = (getattr(runner, a, None) for a in ("capture", "model", "optimizers"))
    if capture is None or model is None or not creates_state(capture, model, optimizers or ()):
        yield calls
        return
    before = _state_meta(model, optimizers)
    update_with = runner._update_with

    def noted(ins: Any, grads: Any) -> None:
        first = native.recorded_allocations()
        update_with(ins, grads)
        calls.ranges.append((first, native.recorded_allocations()))

    runner._update_with = noted
    try:
        yield calls
    finally:
        del runner._update_with
    if _state_meta(model, optimizers) == before:  # no state made (a GradScaler skipped the update)
        calls.ranges.clear()
    elif getattr(runner, "scaler", None) is not None or not all(map(first_update_allocates_as_later, optimizers)):
        calls.steady = False


def _state_meta(model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> list[dict[str, Any]]:
    return [optimizer_state_meta(model, opt) for opt in optimizers]


# The optimizers whose first step() makes the same freed allocations as every later one, besides
# the state it creates (tests/torch/test_first_visit.py checks each against this torch): those
# that update parameter by parameter, but SGD (only without momentum, or fused: with it, its
# first update clones the gradient) and ASGD
STEADY_FIRST_UPDATE = INDEPENDENT_OPTIMIZERS - {"SGD", "ASGD"}


def first_update_allocates_as_later(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s first ``step()`` frees the same allocations, in the same order,
    as its later ones (a torch optimizer of :data:`STEADY_FIRST_UPDATE`, or SGD without
    momentum or fused); False for any other, whose first update is not known."""
    kind = type(optimizer)
    if kind.__module__.split(".")[:2] != ["torch", "optim"]:
        return False
    if kind.__name__ == "SGD":
        return all(g.get("fused") or not g.get("momentum") for g in optimizer.param_groups)
    return kind.__name__ in STEADY_FIRST_UPDATE


def steady_trace(trace: Any, calls: StateCalls) -> Any:
    """``trace`` (an :class:`~memplan.torch.run.allocator.AllocationTrace`) without the
    allocations the optimizer's calls made that outlived the step: the state a later step
    finds made (:func:`noting_state_calls`); None where the step made state but its recording
    cannot stand for a later step's (an update not known to be a steady one)."""
    if not calls.steady:
        return None
    dropped = {k for first, end in calls.ranges for k in range(first, end) if trace.free_at[k] is None}
    return trace.without(dropped) if dropped else trace


def run_times(capture: Capture, order: Sequence[int]) -> list[int]:
    """When each op of ``order`` runs, as a position: its own, or its update group's call (the
    group's op planned last)."""
    from memplan.torch.run.updates import update_groups

    position = [0] * len(order)
    for t, op in enumerate(order):
        position[op] = t
    runs = list(position)
    for group in update_groups(capture):
        call = max((position[op] for op in group.ops), default=0)
        for op in group.ops:
            runs[op] = call
    return runs


def held_at(capture: Capture, runs: Sequence[int], offsets: dict[int, int], call: int) -> list[tuple[int, int]]:
    """The arena's byte ranges ``[start, end)`` holding data the step reads at or after the
    optimizer call at position ``call`` (see the module docstring), merged and sorted."""
    graph = capture.graph
    spans = []
    for t, offset in offsets.items():
        tensor = graph.tensors[t]
        if not tensor.size_bytes or runs[graph.producer[t]] >= call:
            continue
        reads = [runs[c] for c in graph.consumers[t]]
        if tensor.category is Category.OUTPUT or max(reads, default=-1) >= call:
            spans.append((offset, offset + tensor.size_bytes))
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def free_pages(held: list[tuple[int, int]], arena_bytes: int, base: int) -> list[tuple[int, int]]:
    """The whole pages, as ``(address, length)``, of an arena of ``arena_bytes`` at address
    ``base`` that lie outside the ``held`` byte ranges (sorted, merged offsets)."""
    out, cursor = [], 0
    for start, end in [*held, (arena_bytes, arena_bytes)]:
        lo, hi = -(-(base + cursor) // PAGE) * PAGE, ((base + start) // PAGE) * PAGE
        if hi > lo:
            out.append((lo, hi - lo))
        cursor = max(cursor, end)
    return out


def release_pages(block: torch.Tensor, held: list[tuple[int, int]]) -> int:
    """Give back the pages of the CPU arena ``block`` outside ``held``; returns the bytes given
    back (0 where the block is not on the CPU or ``madvise`` is missing)."""
    libc = _libc()
    madvise = getattr(libc, "madvise", None) if libc is not None else None
    if block.device.type != "cpu" or not block.numel() or madvise is None:
        return 0
    released = 0
    for address, length in free_pages(held, block.numel(), block.data_ptr()):
        if madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_DONTNEED) == 0:
            released += length
    return released


@contextlib.contextmanager
def state_step_within_eager(
    runner: Any, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]
) -> Iterator[None]:
    """Around a planned step (a :class:`~memplan.torch.run.interpreter.StepRunner` placed in
    an arena): when it will create the optimizers' state, the arena's pages holding nothing
    the step still reads are given back before each of its optimizer calls (the runner's
    ``_update_with``, wrapped for this step only). ``runner.released_at_state_bytes``: the
    most given back at one call. Once the state exists the runner is marked
    (``runner.state_made``) and later steps skip the check: it walks every parameter's state."""
    offsets, block = runner.plan.offsets, runner.arena
    if getattr(runner, "state_made", False):
        yield
        return
    if not offsets or block.device.type != "cpu" or not creates_state(runner.capture, model, optimizers):
        runner.state_made = bool(offsets) and block.device.type == "cpu"
        yield
        return
    runs = run_times(runner.capture, runner.plan.order)
    update_with = runner._update_with
    released = [0]

    def trimmed(ins: Any, grads: Any) -> None:
        held = held_at(runner.capture, runs, offsets, ins.position)
        released[0] = max(released[0], release_pages(block, held))
        update_with(ins, grads)

    runner._update_with = trimmed
    try:
        yield
    finally:
        del runner._update_with
        runner.released_at_state_bytes = released[0]
    runner.state_made = True
