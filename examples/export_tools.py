"""memplan's plans in the tools a PyTorch user already has.

    python examples/export_tools.py [OUT_DIR]

writes to OUT_DIR (without one, to a fresh temporary folder, whose path it prints; never
into the current folder):

* planned.pickle, eager.pickle: memory snapshots of the planned step and of the same step
  run eagerly; open both at https://pytorch.org/memory_viz (or run
  ``python -m torch.cuda._memory_viz trace_plot planned.pickle -o planned.html``);
* plan.json: the plan as a Chrome/Perfetto trace with measured op times
  (https://ui.perfetto.dev or chrome://tracing);
* sac_policy.json: memplan's recompute decision as a selective-activation-checkpointing
  policy, then applied in a plain eager loop (peaks printed);
and trains the model with ``torch.compile(backend=memplan_backend(...))``.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import torch
from memplan import compile_step
from memplan.remat import rematerialize, sequence_peak_bytes
from memplan.remat.baselines import checkpoint_all
from memplan.remat.problem import RematProblem
from memplan.torch.capture import capture_train_step
from memplan.torch.export import (
    SACPolicy,
    check_snapshot,
    eager_snapshot,
    memplan_backend,
    plan_snapshot,
    plan_trace,
    write_snapshot,
    write_trace,
)
from memplan.torch.measure import allocator_peak_bytes, optimizer_state_tensors, resident_bytes
from memplan.torch.run.profile import profile_capture


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch) -> torch.Tensor:
    loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def peak_of_step(model, optimizer, batch) -> int:
    """What the user's tools show: resident parameters, state and batch plus the CPU
    allocator's peak during the step (the profiler's memory events)."""
    _, peak = allocator_peak_bytes(train_step, model, optimizer, batch)
    return peak + resident_bytes(list(model.parameters()), optimizer_state_tensors(optimizer), batch)


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = Net()
    batch = (torch.randn(512, 64), torch.randint(0, 10, (512,)))

    # 1. the planned step and the eager step, as memory snapshots
    planned_model, eager_model = copy.deepcopy(model), copy.deepcopy(model)
    step = compile_step(planned_model, sgd(planned_model), torch.nn.functional.cross_entropy, batch, allocator="views")
    runner = step.runner_for(batch)
    plan = step.plans[next(iter(step.plans))]
    graph, phases = runner.capture.graph, runner.capture.op_phase
    planned = plan_snapshot(graph, plan.order, plan.offsets, plan.arena_bytes, phases=phases)
    eager_optimizer = sgd(eager_model)
    train_step(eager_model, eager_optimizer, batch)  # the optimizer's state exists: a steady-state step next
    persistent = {
        "params": list(eager_model.parameters()),
        "state": optimizer_state_tensors(eager_optimizer),
        "batch": batch,
    }
    eager, _ = eager_snapshot(lambda: train_step(eager_model, eager_optimizer, batch), persistent)
    for name, snap in (("planned", planned), ("eager", eager)):
        numbers = check_snapshot(snap)
        write_snapshot(snap, out / f"{name}.pickle")
        print(f"{name}.pickle: peak {mib(numbers['peak_allocated_bytes'])}, {numbers['events']} events")

    # 2. the plan as a Chrome/Perfetto trace, each op timed on a copy of the model
    timed = copy.deepcopy(model)
    profile = profile_capture(runner.capture, timed, sgd(timed), batch, repeats=1, workspace=False)
    trace = plan_trace(graph, plan.order, op_seconds=profile.seconds, phases=phases, title="Net")
    write_trace(trace, out / "plan.json")
    print(f"plan.json: {len(plan.order)} ops, measured op times")

    # 3. memplan's recompute decision as a SAC policy in a plain eager loop
    capture = capture_train_step(model, sgd(model), torch.nn.functional.cross_entropy, batch)
    top = checkpoint_all(RematProblem(capture.graph, 10**18)).peak_bytes
    schedule = rematerialize(capture.graph, int(0.8 * top), "linearized-greedy", 5.0)
    policy = SACPolicy.from_schedule(capture, schedule, model="Net")
    policy.save(out / "sac_policy.json")
    plain, checkpointed = copy.deepcopy(model), copy.deepcopy(model)
    SACPolicy.load(out / "sac_policy.json").apply(checkpointed, batch[0])  # what a training script does
    optimizers = sgd(plain), sgd(checkpointed)
    train_step(plain, optimizers[0], batch)
    train_step(checkpointed, optimizers[1], batch)
    peaks = peak_of_step(plain, optimizers[0], batch), peak_of_step(checkpointed, optimizers[1], batch)
    planned_peak = sequence_peak_bytes(capture.graph, schedule.steps)
    same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), checkpointed.parameters(), strict=True))
    print(
        f"sac_policy.json: eager {mib(peaks[0])}, eager with the policy {mib(peaks[1])}, "
        f"memplan's plan {mib(planned_peak)}; parameters identical: {same}"
    )

    # 4. the same decision inside torch.compile
    compiled_model = copy.deepcopy(model)
    backend = memplan_backend(budget=0.8, strategy="linearized-greedy")
    compiled = torch.compile(compiled_model, backend=backend)
    optimizer = sgd(compiled_model)
    for _ in range(2):
        loss = train_step(compiled, optimizer, batch)
    report = backend.last_report
    print(f"torch.compile: loss {loss.item():.4f}, {len(report.recomputed_nodes)} forward nodes recomputed")


def output_folder(argv: list[str] | None = None) -> Path:
    """OUT_DIR from the command line, else a new temporary folder (printed)."""
    parser = argparse.ArgumentParser(description="Write memplan's plan as memory snapshots, a trace, a SAC policy.")
    parser.add_argument("out_dir", nargs="?", type=Path, help="where to write (default: a new temporary folder)")
    out = parser.parse_args(argv).out_dir
    return out if out is not None else Path(tempfile.mkdtemp(prefix="memplan-exports-"))


if __name__ == "__main__":
    folder = output_folder()
    print(f"writing to {folder}")
    main(folder)
