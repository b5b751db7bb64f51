"""memplan: plan the memory of PyTorch training and inference steps without changing their math.

The core (``memplan.graph``, ``schedule``, ``placement``, ``remat``, ``streams``) never imports
torch; ``compile``, ``compile_step``, ``compile_inference``, ``plan_step``, ``optimize`` and
``compile_data_parallel_step``
(torch needed) are loaded on first use.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["compile", "compile_data_parallel_step", "compile_inference", "compile_step", "optimize", "plan_step"]


def __getattr__(name: str) -> Any:
    if name == "compile_data_parallel_step":
        from memplan.torch.distributed import step

        return step.compile_data_parallel_step
    if name in __all__:
        from memplan import api

        return getattr(api, name)
    raise AttributeError(f"module 'memplan' has no attribute {name!r}")
