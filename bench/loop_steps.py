"""Step by step: where a loop-feature row of bench/results/loops.md gets its peak.

Runs one feature's step eagerly and planned for several steps from the same weights and seed
(as memplan.torch.loops.run_feature does) and prints, for every step, eager's peak, memplan's
(the CPU allocator's count during the step plus the arena held before it), the GradScaler's
scale after the step, what the planned allocator's replay did (allocations served from the
plan, sent to the ordinary allocator, the first that no branch of the plan made, the branch it
ended on) and how many recorded steps (branches) the plan holds after it.

    python bench/loop_steps.py bert "float16 + GradScaler (skipped steps)" 6

Memory figures do not depend on load; the step times printed are noisy.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import memplan
from memplan.torch.loops import FEATURES, _seeded, _setup, _shaped
from memplan.torch.measure import allocator_peak_bytes

sys.path.insert(0, str(Path(__file__).parent))
from loops import MODELS  # the models of bench/loops.py

MIB = 2**20


def main() -> None:
    warnings.filterwarnings("ignore")
    spec, feature = MODELS[sys.argv[1]](), FEATURES[sys.argv[2]]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    eager, planned = _setup(spec, feature, 0), _setup(spec, feature, 0)
    eager_step = feature.step(eager)
    objects = {"scaler": planned.scaler, "scheduler": planned.scheduler or ()}
    planned_step = memplan.compile(feature.step(planned), model=planned.model, optimizer=planned.optimizer, **objects)
    batches = [_shaped(spec.batch(k), feature) for k in range(3)]
    start = time.perf_counter()
    for k in range(steps):
        batch, seed = batches[k % len(batches)], 1000 + k
        eager_peak = allocator_peak_bytes(_seeded, eager_step, batch, seed)[1]
        runner = planned_step.runner_for(batch)
        arena = runner.arena.untyped_storage().nbytes() if getattr(runner, "replaying", True) else 0
        planned_peak = allocator_peak_bytes(_seeded, planned_step, batch, seed)[1]
        scale = float(planned.scaler.get_scale()) if planned.scaler is not None else None
        plan = getattr(runner, "plan", None)
        branches = len(plan.branches) if plan is not None and hasattr(plan, "branches") else 0
        print(
            f"step {k}: eager {eager_peak / MIB:.2f} MiB, memplan {planned_peak / MIB:.2f} + arena "
            f"{arena / MIB:.2f} = {(planned_peak + arena) / MIB:.2f} MiB, scale {scale}, "
            f"replay {getattr(runner, 'last_stats', None)}, plan branches after it {branches} "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
