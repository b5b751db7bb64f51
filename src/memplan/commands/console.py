"""What every command prints through: one console that ``--quiet`` silences, and progress
shown on stderr for any stage that lasts more than :data:`PROGRESS_DELAY_SECONDS`.

``--quiet`` prints nothing but errors: results go to ``--json`` and the exported files, and
the exit code says whether memplan and eager agreed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

PROGRESS_DELAY_SECONDS = 1.0  # a stage shorter than this shows no progress at all

Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors (results still go to files).")]

_state = {"quiet": False}


def set_quiet(quiet: bool) -> None:
    _state["quiet"] = bool(quiet)


def is_quiet() -> bool:
    return _state["quiet"]


def console() -> Console:
    """The console for results (stdout), silent under ``--quiet``."""
    return Console(quiet=is_quiet())


class _DelayedProgress:
    """A transient rich progress display on stderr that appears only once the stage has run
    for :data:`PROGRESS_DELAY_SECONDS` (so quick stages print nothing)."""

    def __init__(self, label: str, total: int | None) -> None:
        columns = [SpinnerColumn(), TextColumn("{task.description}")]
        if total is not None:
            columns += [BarColumn(), MofNCompleteColumn()]
        columns.append(TimeElapsedColumn())
        self.progress = Progress(*columns, console=Console(stderr=True), transient=True)
        self.task = self.progress.add_task(label, total=total)
        self.lock = threading.Lock()
        self.started = False
        self.finished = False
        self.timer = threading.Timer(PROGRESS_DELAY_SECONDS, self._start)
        self.timer.daemon = True

    def _start(self) -> None:
        with self.lock:
            if not self.finished:
                self.progress.start()
                self.started = True

    def advance(self, steps: int = 1, label: str | None = None) -> None:
        self.progress.update(self.task, advance=steps, description=label or self.progress.tasks[0].description)

    def close(self) -> None:
        self.timer.cancel()
        with self.lock:
            self.finished = True
            if self.started:
                self.progress.stop()


class _Silent:
    def advance(self, steps: int = 1, label: str | None = None) -> None:
        pass


@contextlib.contextmanager
def progress(label: str, total: int | None = None) -> Iterator[_DelayedProgress | _Silent]:
    """Show ``label`` with a spinner and the elapsed time (and a bar when ``total`` is given;
    call ``advance()`` as steps complete) while the block runs, if it runs longer than
    :data:`PROGRESS_DELAY_SECONDS`, the command is not ``--quiet`` and stderr is a terminal."""
    if is_quiet() or not Console(stderr=True).is_terminal:  # a log file gets no spinner frames
        yield _Silent()
        return
    shown = _DelayedProgress(label, total)
    shown.timer.start()
    try:
        yield shown
    finally:
        shown.close()


def load_source_with_progress(source: str, **kwargs: object):  # -> memplan.graph.ir.Graph
    """:func:`memplan.sources.load_source` with progress shown while a zoo model is captured."""
    from memplan.sources import is_graph_file, load_source

    label = f"reading {source}" if is_graph_file(source) else f"capturing {source}"
    with progress(label):
        return load_source(source, **kwargs)  # type: ignore[arg-type]


__all__ = [
    "PROGRESS_DELAY_SECONDS",
    "Quiet",
    "console",
    "is_quiet",
    "load_source_with_progress",
    "progress",
    "set_quiet",
]
