"""One rank of ``memplan run MODEL --nproc N`` (and of ``bench/ddp.py``), started by ``torchrun``::

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m memplan.torch.distributed.worker mlp --batch 8 --steps 3 --out report.json

Each rank joins the gloo process group torchrun describes, trains with memplan and with
``DistributedDataParallel`` (:func:`memplan.torch.distributed.compare.compare_with_ddp`), and
rank 0 writes every rank's report to ``--out``. With ``--fsdp`` the model is sharded with FSDP2
and compared with eager FSDP2 instead (:func:`memplan.torch.distributed.fsdp_compare.zoo_report`).
With ``--rss VARIANT`` it runs that variant alone and measures this process's peak resident set
during one steady-state step (:func:`memplan.torch.distributed.compare.measure_rss`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def launch_command(nproc: int, args: list[str]) -> list[str]:
    """The command line that starts ``nproc`` ranks of this worker on this machine."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "memplan.torch.distributed.worker",
        *args,
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--bucket-cap-mb", type=float, default=None)
    parser.add_argument("--waits", default="next-bucket")
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--rss", default=None, help="measure the peak RSS of this variant alone")
    parser.add_argument("--trace", default=None, help="write one profiled step of each variant to this JSON")
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2 and compare with eager FSDP2")
    parser.add_argument("--budget", default=None, help="with --fsdp: memplan under this memory_budget too")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import torch.distributed as dist

    from memplan.torch.distributed import compare

    dist.init_process_group("gloo")
    try:
        common = {
            "bucket_cap_mb": args.bucket_cap_mb,
            "waits": args.waits,
            "time_limit_seconds": args.time_limit,
            "optimizer_name": args.optimizer,
        }
        if args.fsdp:
            reports = _fsdp_reports(args.model, args.batch, args.steps, args.time_limit, args.budget)
        elif args.rss:
            reports = compare.measure_rss(args.model, args.batch, args.rss, **common)
        else:
            reports = compare.compare_with_ddp(args.model, args.batch, args.steps, trace=args.trace, **common)
        if reports is not None:
            Path(args.out).write_text(json.dumps(reports, indent=1, default=str) + "\n")
    finally:
        dist.destroy_process_group()


def _fsdp_reports(model: str, batch: int, steps: int, time_limit: float, budget: str | None) -> list[dict] | None:
    """Every rank's :func:`memplan.torch.distributed.fsdp_compare.zoo_report`, on rank 0."""
    import torch.distributed as dist

    from memplan.torch.distributed.fsdp_compare import zoo_report

    report = zoo_report(model, batch, steps, time_limit, memory_budget=budget)
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    return reports if dist.get_rank() == 0 else None


if __name__ == "__main__":
    main()
