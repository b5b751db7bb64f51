"""A step that sets the random generator is refused: memplan replays its ops, not its Python calls.

``torch.manual_seed`` or ``torch.set_rng_state`` inside the step runs once, while capture runs
the step on fakes; the planned step then draws from wherever the generator is. Eager's step
sets it again on every call, so two patterns train differently, silently:

* a random op draws after the step set the generator: ``torch.utils.checkpoint`` (its default
  ``preserve_rng_state=True``) recomputes dropout in the backward from the state it saved in the
  forward, so eager's recompute draws the forward's mask again and a replay draws a new one; a
  ``torch.manual_seed`` before a dropout makes every eager step draw the same mask;
* the step leaves the generator elsewhere than it found it without drawing (a seed after the
  last draw): the user's next draws outside the step (data order, augmentation) differ.

Capture's fake random ops never touch the real generators, so while the step runs on fakes
the only way their state changes is such a call. :class:`GeneratorWatch` wraps PyTorch's
seeding and state-setting functions for the time of the capture, notes where the step called
them, refuses a random op dispatched after one (the fake mode asks :meth:`GeneratorWatch.drew`)
and a run that leaves a generator's state changed, each in one line, and always puts the
generators back as they were before the capture. A save and restore that draws nothing in
between (``checkpoint`` around code without random ops: ``fork_rng`` around the recompute) is
left alone.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.utils._python_dispatch import _disable_current_modes

import torch
from memplan.errors import UnsupportedOp
from memplan.torch.capture.frames import user_location

# (module, function name) of every PyTorch function that seeds or sets a generator's state
SETTERS = (
    (torch, "manual_seed"),
    (torch, "seed"),
    (torch, "set_rng_state"),
    (torch.random, "manual_seed"),
    (torch.random, "seed"),
    (torch.random, "set_rng_state"),
    (torch.cuda, "manual_seed"),
    (torch.cuda, "manual_seed_all"),
    (torch.cuda, "seed"),
    (torch.cuda, "seed_all"),
    (torch.cuda, "set_rng_state"),
    (torch.cuda, "set_rng_state_all"),
)
CHECKPOINT_FILE = Path(torch.utils.checkpoint.__file__)
CHECKPOINTED = "torch.utils.checkpoint"


def generator_states() -> list[bytes]:
    """The CPU generator's state, then each initialised CUDA device's (read with capture's fake
    mode set aside: under it the state would come back as a fake tensor)."""
    with _disable_current_modes():
        states = [bytes(torch.random.default_generator.get_state().numpy())]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            states += [bytes(s.numpy()) for s in torch.cuda.get_rng_state_all()]
    return states


def _restore(states: list[bytes]) -> None:
    with _disable_current_modes():
        torch.random.default_generator.set_state(torch.frombuffer(bytearray(states[0]), dtype=torch.uint8))
        for device, state in enumerate(states[1:]):
            torch.cuda.set_rng_state(torch.frombuffer(bytearray(state), dtype=torch.uint8), device)


def _caller() -> str:
    """Who set the generator: ``torch.utils.checkpoint`` when it did, else the innermost frame
    outside torch and memplan (the user's model or step, or its library), as FILE:LINE."""
    frames = traceback.extract_stack()[:-3]
    if any(Path(f.filename) == CHECKPOINT_FILE for f in frames):
        return CHECKPOINTED
    where = user_location(frames)
    return f"a call at {where}" if where else "a call inside the step"


class GeneratorWatch:
    """Notes the step's generator calls while capture runs it (see the module docstring)."""

    def __init__(self) -> None:
        self.set_by: str | None = None  # who set a generator in this run, if anyone

    def drew(self, op: Any) -> None:
        """A random op is dispatched in the step: refused if the step set a generator before it."""
        if self.set_by is None:
            return
        if self.set_by == CHECKPOINTED:
            raise UnsupportedOp(
                f"the step recomputes a random op ({op}) under torch.utils.checkpoint, which sets the generator "
                "back to redraw the forward's values; memplan replays the step's ops, not its generator calls, so "
                "the recompute would draw other values than eager's: take the checkpoint off the region with "
                "dropout (HF models: model.gradient_checkpointing_disable()) and let memory_budget= plan the "
                "recomputation"
            )
        raise UnsupportedOp(
            f"the step draws random numbers ({op}) after setting the random generator ({self.set_by}); memplan "
            "replays the step's ops, not its generator calls, so later steps would draw other values than "
            "eager's: seed outside the step"
        )

    @contextmanager
    def run(self, name: str = "step") -> Iterator[None]:
        """One run of the step: refused if it leaves a generator's state changed."""
        self.set_by = None
        before = generator_states()
        yield
        if generator_states() != before:
            raise UnsupportedOp(
                f"the {name} sets the random generator ({self.set_by or 'a call inside the step'}) and leaves it "
                "elsewhere than it found it; memplan replays the step's ops, not its generator calls: move the "
                "seeding out of the step"
            )

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def setter(*args: Any, **kwargs: Any) -> Any:
            self.set_by = self.set_by or _caller()
            return fn(*args, **kwargs)

        return setter


@contextmanager
def watching_generators(mode: Any) -> Iterator[GeneratorWatch]:
    """Wrap the setters (and tell ``mode``, capture's fake mode, to report random ops to the
    watch) for the time of the capture; the generators are put back as they were after it."""
    watch = GeneratorWatch()
    saved = generator_states()
    originals = [(home, name, getattr(home, name)) for home, name in SETTERS if hasattr(home, name)]
    previous = getattr(mode, "generator_watch", None)
    try:
        for home, name, fn in originals:
            setattr(home, name, watch._wrap(fn))
        if hasattr(mode, "generator_watch"):
            mode.generator_watch = watch
        yield watch
    finally:
        for home, name, fn in originals:
            setattr(home, name, fn)
        if hasattr(mode, "generator_watch"):
            mode.generator_watch = previous
        _restore(saved)
