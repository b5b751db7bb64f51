"""Typed errors: each carries a one-line message that names the cause and what to do."""

from __future__ import annotations


class MemplanError(Exception):
    """Base class: ``str(err)`` is a single line a user can act on."""


class GraphError(MemplanError, ValueError):
    """The graph is malformed."""


class DuplicateName(GraphError):
    pass


class DanglingReference(GraphError):
    pass


class ProducerError(GraphError):
    """A tensor has no producer or more than one."""


class NegativeSize(GraphError):
    pass


class CycleError(GraphError):
    pass


class InvalidOrder(GraphError):
    """An order is not a topological permutation of the graph's ops."""


class GraphFormatError(GraphError):
    """A graph or problem file could not be read."""


class WaitCycle(CycleError):
    """The streams of a multi-stream graph wait on each other in a circle (a deadlock)."""


class MissingWait(GraphError):
    """A collective's result is used (or never awaited) without waiting for the collective."""


class ContiguityConflict(GraphError):
    """A contiguous group cannot be laid out back to back, whatever the offsets."""


class CaptureError(MemplanError):
    """A model step could not be captured as a static graph."""


class UnsupportedOp(CaptureError):
    pass


class DataDependentControlFlow(CaptureError):
    pass


class DynamicShape(CaptureError):
    pass


class ModuleCast(CaptureError):
    """The step casts or moves a module's parameters (``.to(torch.bfloat16)`` inside forward)."""


class UnplannedWrapper(CaptureError):
    """The model is wrapped in something memplan does not plan (FSDP, DDP, torch.compile)."""


class UnknownModel(MemplanError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class InfeasibleBudget(MemplanError):
    pass


class SolverError(MemplanError):
    pass


class SelfCheckFailed(MemplanError):
    """A planned step did not change what eager's step would have: training stops."""
