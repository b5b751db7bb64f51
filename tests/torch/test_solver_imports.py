"""The training process never loads the solvers' OR-Tools (and pandas, through CP-SAT's helpers:
about 57 MiB of resident memory and a second of start-up): they run in the planner's child, so a
plan's steps, with or without a memory budget, stay within what the user's own process needs."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys, torch, memplan
torch.manual_seed(0)
def model():
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 8))
x, y = torch.randn(64, 256), torch.randn(64, 8)
loss = lambda out, t: torch.nn.functional.mse_loss(out, t)
for budget in (None, 0.97):
    m = model()
    step = memplan.compile_step(m, torch.optim.AdamW(m.parameters()), loss, (x, y), memory_budget=budget)
    for _ in range(4):
        step((x, y))
    assert step.report.get("budget") is None or budget is not None
    print(budget, "ortools" in sys.modules, "pandas" in sys.modules)
"""


def test_planned_steps_never_load_or_tools_in_the_training_process() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["None False False", "0.97 False False"], done.stdout
