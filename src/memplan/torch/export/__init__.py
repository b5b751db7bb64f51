"""Exports a PyTorch user already knows how to open, made from memplan's plans:

* memory snapshots in ``torch.cuda.memory._snapshot()``'s layout for PyTorch's memory
  visualizer (:mod:`.snapshot`: the plan, a real eager step, the planned allocator's step);
* Chrome/Perfetto traces of a plan, one lane per stream, a counter of resident bytes
  (:mod:`.chrome_trace`);
* a selective-activation-checkpointing policy from a remat plan, for the user's own loop
  (:mod:`.sac`);
* a ``torch.compile`` backend that puts memplan's remat decision into AOTAutograd's
  partitioner (:mod:`.backend`).

Names are loaded on first use, so the trace and snapshot builders, which need no torch, can
be used on a GRAPH.json without importing it.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "plan_snapshot": "snapshot",
    "eager_snapshot": "snapshot",
    "replay_snapshot": "snapshot",
    "check_snapshot": "snapshot",
    "write_snapshot": "snapshot",
    "read_snapshot": "snapshot",
    "plan_trace": "chrome_trace",
    "check_trace": "chrome_trace",
    "write_trace": "chrome_trace",
    "SACPolicy": "sac",
    "memplan_backend": "backend",
    "MemplanBackend": "backend",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
