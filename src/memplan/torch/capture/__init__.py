"""Capture a PyTorch step as a memplan Graph: ``make_fx`` on fake copies of the model and
optimizer (:mod:`.trace`, :mod:`.fake`), then capture passes on the traced program
(:mod:`.recompute`)."""

from memplan.torch.capture.marks import BACKWARD_MARK, RELEASE_KIND
from memplan.torch.capture.trace import (
    Capture,
    LossFn,
    call_model,
    capture_infer_step,
    capture_step,
    capture_train_step,
)

__all__ = [
    "BACKWARD_MARK",
    "RELEASE_KIND",
    "Capture",
    "LossFn",
    "call_model",
    "capture_infer_step",
    "capture_step",
    "capture_train_step",
]
