"""Step time of the generated and the interpreted executor against eager PyTorch, on one
model, interleaved in one process (the plan and the model are the same; only the executor
changes between steps). One thread by default, so that the figure is the per-op dispatch
cost and not the share of a busy machine's cores.

    python bench/executors.py mobilenet-v2 --batch 1 --steps 15
"""

from __future__ import annotations

import argparse
import copy
import time

import memplan.api  # OR-Tools before torch's extensions
import torch
from memplan.torch.compare import _eager_step
from memplan.torch.zoo import build_workload, make_optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--allocator", default="auto", choices=["auto", "replay", "views"])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    w = build_workload(args.model, args.batch)
    eager_model = copy.deepcopy(w.model)
    opt, eager_opt = make_optimizer("adam", w.model.parameters()), make_optimizer("adam", eager_model.parameters())
    step = memplan.api.CompiledStep(
        memplan.api.standard_step(w.model, opt, w.loss_fn), w.model, [opt], allocator=args.allocator
    )
    batch = (w.inputs, w.target)
    runner = step.runner_for(batch)
    base = getattr(runner, "run", runner)
    for _ in range(5):  # self-check, recordings, warm-up
        step(batch)
        _eager_step(w, eager_model, eager_opt)
    seconds: dict[str, list[float]] = {"generated": [], "interpreted": [], "eager": []}
    for _ in range(args.steps):
        for name, times in seconds.items():
            start = time.perf_counter()
            if name == "eager":
                _eager_step(w, eager_model, eager_opt)
            else:
                base.executor = name
                step(batch)
            times.append(time.perf_counter() - start)
    median = {name: sorted(t)[len(t) // 2] for name, t in seconds.items()}
    print(
        f"{args.model} batch {args.batch} ({step.allocator}, {args.threads} thread(s)): eager {median['eager']:.4f} s, "
        f"generated {median['generated']:.4f} s ({median['generated'] / median['eager']:.3f}x), "
        f"interpreted {median['interpreted']:.4f} s ({median['interpreted'] / median['eager']:.3f}x)"
    )


if __name__ == "__main__":
    main()
