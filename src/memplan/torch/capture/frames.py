"""Where in the user's code something happened: for one-line messages that name a FILE:LINE."""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from pathlib import Path

import torch

OURS = (Path(torch.__file__).parent, Path(__file__).parents[2])
"""torch's and memplan's own files: never the place a message names."""


def user_location(frames: Sequence[traceback.FrameSummary]) -> str | None:
    """``FILE:LINE`` of the innermost frame outside torch and memplan (the user's model or
    step, or the library it comes from, named from its package), or None."""
    for frame in reversed(frames):
        path = Path(frame.filename)
        if not any(path.is_relative_to(root) for root in OURS) and not frame.filename.startswith("<"):
            parts = path.parts
            short = "/".join(parts[parts.index("site-packages") + 1 :]) if "site-packages" in parts else path.name
            return f"{short}:{frame.lineno}"
    return None
