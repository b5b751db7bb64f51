"""``memplan demo``: the main job on a built-in model, start to finish."""

from __future__ import annotations

from rich.console import Console

from memplan.commands.analyze import analysis_report, print_analysis
from memplan.commands.run import print_plan, print_run
from memplan.sources import load_source

DEMO_MODEL, DEMO_BATCH, DEMO_OPTIMIZER = "gpt2-2l", 1, "adam"


def demo() -> None:
    """Capture GPT-2 (2 layers) with Adam, plan it, train it with memplan and eager PyTorch."""
    from memplan.torch.compare import compare_with_eager

    console = Console()
    console.rule(f"1. capture: {DEMO_MODEL}, batch {DEMO_BATCH}, training step with {DEMO_OPTIMIZER}")
    graph = load_source(DEMO_MODEL, batch_size=DEMO_BATCH, optimizer=DEMO_OPTIMIZER)
    print_analysis(analysis_report(graph), console)
    console.rule("2. plan (reorder, then place) and 3. run: 3 steps with memplan and with eager PyTorch")
    report = compare_with_eager(DEMO_MODEL, DEMO_BATCH, 3, "train", DEMO_OPTIMIZER, time_limit_seconds=10)
    print_plan(report["plan"], console)
    print_run(report, console)


def register(app) -> None:
    app.command()(demo)
