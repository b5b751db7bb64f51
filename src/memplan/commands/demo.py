"""``memplan demo``: the main job on a built-in model, start to finish."""

from __future__ import annotations

from memplan.commands.analyze import analysis_report, print_analysis
from memplan.commands.console import Quiet, console, load_source_with_progress, progress, set_quiet
from memplan.commands.run import print_plan, print_run

DEMO_MODEL, DEMO_BATCH, DEMO_OPTIMIZER = "gpt2-2l", 1, "adam"


def demo(quiet: Quiet = False) -> None:
    """Capture GPT-2 (2 layers) with Adam, plan it, train it with memplan and eager PyTorch."""
    from memplan.torch.compare import compare_with_eager

    set_quiet(quiet)
    out = console()
    out.rule(f"1. capture: {DEMO_MODEL}, batch {DEMO_BATCH}, training step with {DEMO_OPTIMIZER}")
    graph = load_source_with_progress(DEMO_MODEL, batch_size=DEMO_BATCH, optimizer=DEMO_OPTIMIZER)
    print_analysis(analysis_report(graph), out)
    out.rule("2. plan (reorder, then place) and 3. run: 3 steps with memplan and with eager PyTorch")
    with progress("planning, then training 3 steps with memplan and eagerly"):
        report = compare_with_eager(DEMO_MODEL, DEMO_BATCH, 3, "train", DEMO_OPTIMIZER, time_limit_seconds=10)
    print_plan(report["plan"], out)
    print_run(report, out)


def register(app) -> None:
    app.command()(demo)
