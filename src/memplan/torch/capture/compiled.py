"""A step that calls a ``torch.compile``d function is refused: its kernels are inductor's.

``loss_fn = torch.compile(F.cross_entropy)`` called inside the step ran inductor's compiled
kernels on capture's fake tensors, which have no data: the process died with a segmentation
fault. Run on fakes as plain Python instead, it would be planned with eager's kernels, whose
rounding is not inductor's: the planned step would not train as the user's step does.

:func:`watching_compiled_calls` turns every call of a compiled function into a plain Python call
for the time of the capture (dynamo's frame callback is not set), notes where the step made it,
and :meth:`CompiledCalls.refuse` refuses the step in one line after the run.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from memplan.errors import UnsupportedOp
from memplan.torch.capture.frames import user_location


class CompiledCalls:
    """Where the step called a compiled function (FILE:LINE, or '' where no user frame shows)."""

    def __init__(self) -> None:
        self.where: list[str] = []

    def refuse(self) -> None:
        if self.where:
            at = f" at {self.where[0]}" if self.where[0] else ""
            raise UnsupportedOp(
                f"the step calls a function compiled with torch.compile{at}: memplan runs eager's kernels, not "
                "inductor's, so it would not train as this step does; call the function uncompiled inside the step "
                "(memplan plans the whole step), or use torch.compile without memplan"
            )


@contextmanager
def watching_compiled_calls() -> Iterator[CompiledCalls]:
    """For the time of a capture: a compiled function's call sets no dynamo frame callback
    (its Python runs as written, on fakes), and is noted (see the module docstring)."""
    calls = CompiledCalls()
    try:
        from torch._dynamo import eval_frame
    except ImportError:  # a build without dynamo compiles nothing
        yield calls
        return
    original = eval_frame._maybe_set_eval_frame

    def set_eval_frame(callback: Any) -> Any:
        if callback is not None:  # a compile callback, or False: run compiled code only
            calls.where.append(user_location(traceback.extract_stack()[:-1]) or "")
            callback = None  # no compiled frame runs on capture's fakes
        return original(callback)

    eval_frame._maybe_set_eval_frame = set_eval_frame
    try:
        yield calls
    finally:
        eval_frame._maybe_set_eval_frame = original
