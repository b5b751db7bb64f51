"""Run an FSDP2 step planned on two streams (:mod:`memplan.torch.distributed.fsdp_plan`).

The captured program runs as for one stream (:class:`memplan.torch.run.interpreter.StepRunner`,
the generated executor by default), in the plan's order with the waits left out; inside the
step the collectives' ``out=`` kernels launch asynchronously (:func:`memplan.torch.distributed.
fsdp_ops.launching`): an all-gather or reduce-scatter returns at once, writing into its arena
view while gloo's threads run it. Each wait is an instruction (a :class:`RunHook`) after the
capture position its plan puts it at: ``work.wait()`` of that collective (by launch number: the
order is the same on every rank, so are the launches), before any reader of its output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from memplan.errors import MemplanError
from memplan.graph.ir import Graph
from memplan.streams.sync import is_collective, is_wait
from memplan.torch.capture import Capture
from memplan.torch.distributed import fsdp_ops
from memplan.torch.distributed.runner import merge_hooks
from memplan.torch.run.interpreter import Plan, RunHook, StepRunner


@dataclass
class _Wait(RunHook):
    after: int  # position in the capture order after which it runs (-1: first)
    launch: int  # the collective's launch number in the step
    position: int = -1

    def run(self, runner: StepRunner, env: dict[str, Any]) -> None:
        assert isinstance(runner, FsdpStreamRunner)
        runner.inflight.wait(self.launch)


def split_order(capture: Capture, step: Graph, order: tuple[int, ...]) -> tuple[list[int], list[_Wait]]:
    """The capture order (the step's order without its waits, as capture op ids) and a wait
    hook per wait, after the capture position it follows."""
    capture_id = capture.graph.op_index
    launch_number: dict[int, int] = {}
    for v in order:
        if is_collective(step.ops[v]):
            launch_number[v] = len(launch_number)
    capture_order: list[int] = []
    hooks = []
    for v in order:
        op = step.ops[v]
        if is_wait(op):
            (c,) = [p for p in step.predecessors[v] if is_collective(step.ops[p])]
            hooks.append(_Wait(len(capture_order) - 1, launch_number[c]))
        else:
            capture_order.append(capture_id[op.name])
    return capture_order, hooks


class FsdpStreamRunner(StepRunner):
    """A :class:`StepRunner` whose FSDP2 collectives run asynchronously and are waited for at
    their planned places. ``record_times``: each launch's times in ``inflight.launches``."""

    def __init__(
        self,
        capture: Capture,
        step: Graph,
        order: tuple[int, ...],
        offsets: dict,
        arena_bytes: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        record_times: bool = False,
    ) -> None:
        self.step_graph = step
        self.stream_order = order
        self.record_times = record_times
        self.inflight = fsdp_ops.Inflight(record_times=record_times)
        capture_order, self._hooks = split_order(capture, step, order)
        super().__init__(capture, Plan(tuple(capture_order), offsets, arena_bytes), model, [optimizer])

    def _compile(self) -> list:
        """The interpreter's instructions with each wait after the instruction at its planned position."""
        return merge_hooks(super()._compile(), self._hooks)

    def run_step(self, batch: Any) -> Any:
        self.inflight = fsdp_ops.Inflight(record_times=self.record_times)
        left = 0
        try:
            with fsdp_ops.launching(self.inflight):
                result = super().run_step(batch)
        finally:
            left = self.inflight.drain()  # a failed step: no collective left writing into the arena
        if left:
            raise MemplanError(f"{left} collective(s) were never waited for; the plan is broken (please report it)")
        return result
