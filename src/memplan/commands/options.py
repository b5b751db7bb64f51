"""Options shared by the commands that take a model or a graph."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer


class Mode(str, Enum):
    train = "train"
    infer = "infer"


class OptimizerName(str, Enum):
    sgd = "sgd"
    adam = "adam"
    adamw = "adamw"


Source = Annotated[str, typer.Argument(help="A zoo model name (see `memplan models`) or a GRAPH.json file.")]
BatchSize = Annotated[int, typer.Option("--batch-size", "-b", min=1, help="Batch size of the captured step.")]
ModeOption = Annotated[Mode, typer.Option("--mode", help="train: forward+backward+optimizer; infer: forward.")]
OptimizerOption = Annotated[OptimizerName, typer.Option("--optimizer", help="The torch.optim optimizer (train).")]
JsonOut = Annotated[Path | None, typer.Option("--json", help="Also write the result as JSON to this file.")]


def write_json(path: Path | None, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` (refusing to overwrite something that is not a JSON file)."""
    import json

    from memplan.errors import MemplanError

    if path is None:
        return
    if path.exists() and path.suffix != ".json":
        raise MemplanError(f"refusing to overwrite {path}: the --json output must be a .json file")
    path.write_text(json.dumps(data, indent=2) + "\n")
