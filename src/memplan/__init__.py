"""memplan: plan the memory of PyTorch training and inference steps without changing their math.

The core (``memplan.graph``, ``schedule``, ``placement``, ``remat``, ``streams``) never imports
torch; ``compile``, ``compile_step``, ``compile_inference``, ``plan_step`` and ``optimize``
(torch needed) are loaded on first use.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["compile", "compile_inference", "compile_step", "optimize", "plan_step"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from memplan import api

        return getattr(api, name)
    raise AttributeError(f"module 'memplan' has no attribute {name!r}")
