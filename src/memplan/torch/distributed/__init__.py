"""Data-parallel training with memplan on ``torch.distributed`` (the torch half of SOMAS):
DDP's gradient buckets planned on a communication stream (:mod:`.plan`), run with real
asynchronous all-reduces in place in the arena (:mod:`.runner`), behind DDP's API (:mod:`.step`);
FSDP2 (``fully_shard``) steps with their all-gathers and reduce-scatters planned (:mod:`.fsdp`)."""

from memplan.torch.distributed.fsdp_step import FsdpStep, compile_fsdp_step
from memplan.torch.distributed.plan import BucketLayout, DataParallelPlan, plan_data_parallel
from memplan.torch.distributed.runner import CommEvent, DataParallelRunner
from memplan.torch.distributed.step import DataParallelStep, compile_data_parallel_step

__all__ = [
    "BucketLayout",
    "CommEvent",
    "DataParallelPlan",
    "DataParallelRunner",
    "DataParallelStep",
    "FsdpStep",
    "compile_data_parallel_step",
    "compile_fsdp_step",
    "plan_data_parallel",
]
