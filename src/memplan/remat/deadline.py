"""The clock every remat entry point runs against: one :class:`Deadline`, shared down the calls.

A caller that owns a time limit (``memplan remat``, :func:`memplan.remat.solve_remat`, the
strategies of :func:`memplan.remat.sweep.solve_all`) makes a deadline and runs what it calls
:func:`within` it; a baseline asks :func:`deadline_for` for the sooner of that deadline and its
own problem's time limit, checks it as it goes (DTR's simulation every run and eviction; the
others between their candidate plans) and, once it has passed, stops: it keeps the plans it has
and says "cut at N s" (:func:`cut_message`), or returns status "unknown" when it has none.
Deadlines nest: an inner one never ends after the one around it.

Progress: :func:`ticking` calls a ``progress(text)`` callback every :data:`PROGRESS_SECONDS`
while a solve runs, with the elapsed time and the best plan's cost, bound and gap so far.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

PROGRESS_SECONDS = 2.0
"""A solve reports its progress at most this often (and first after this long)."""


class TimeUp(Exception):
    """Raised by :meth:`Deadline.check` once the deadline has passed (caught by the baseline that checks)."""


@dataclass(frozen=True)
class Deadline:
    """``end``: a ``time.perf_counter()`` value; ``start``: when the clock was started."""

    start: float
    end: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        now = time.perf_counter()
        return cls(now, now + max(0.0, float(seconds)) if math.isfinite(seconds) else math.inf)

    def left(self) -> float:
        return self.end - time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def expired(self) -> bool:
        return time.perf_counter() >= self.end

    def check(self) -> None:
        """Raise :class:`TimeUp` once the deadline has passed."""
        if time.perf_counter() >= self.end:
            raise TimeUp

    def sooner(self, seconds: float) -> Deadline:
        """A deadline ``seconds`` from now, or this one if it ends first (its clock starts now)."""
        now = time.perf_counter()
        return Deadline(now, min(self.end, now + max(0.0, seconds)))

    def share(self, fraction: float) -> Deadline:
        """``fraction`` of the time left, from now."""
        return self.sooner(fraction * max(0.0, self.left()))


_CURRENT: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar("memplan_remat_deadline", default=None)


def current() -> Deadline | None:
    """The deadline of the calling context (None: no caller set one)."""
    return _CURRENT.get()


@contextlib.contextmanager
def within(deadline: Deadline) -> Iterator[Deadline]:
    """Run the block against ``deadline``, or against the one around it if that ends sooner."""
    outer = _CURRENT.get()
    if outer is not None and outer.end < deadline.end:
        deadline = Deadline(deadline.start, outer.end)
    token = _CURRENT.set(deadline)
    try:
        yield deadline
    finally:
        _CURRENT.reset(token)


def deadline_for(time_limit_seconds: float) -> Deadline:
    """``time_limit_seconds`` from now, or the calling context's deadline if it ends sooner."""
    outer = _CURRENT.get()
    mine = Deadline.after(time_limit_seconds)
    return mine if outer is None or mine.end <= outer.end else Deadline(mine.start, outer.end)


def cut_message(name: str, seconds: float, done: int, total: int) -> str:
    """The one line a baseline stopped by its deadline says."""
    if done == 0:
        return f"{name}: cut at {seconds:.1f} s (its share of the time limit) before any plan: give more --time-limit"
    return f"{name}: cut at {seconds:.1f} s (its share of the time limit), after {done} of its {total} plans"


State = Callable[[], tuple[float | None, float | None, float | None]]
"""What a solve has now: (best plan's cost, bound, the plain step's cost), each None where unknown."""


@contextlib.contextmanager
def ticking(
    progress: Callable[[str], None] | None,
    label: str | Callable[[], str],
    state: State,
    every: float | None = None,
) -> Iterator[None]:
    """While the block runs, every ``every`` seconds (default :data:`PROGRESS_SECONDS`), from a
    daemon thread, tell ``progress`` a :func:`progress_line`: the label (a callable: what runs
    now), the seconds since the block began, and ``state()``. Nothing without ``progress``."""
    if progress is None:
        yield
        return
    every = PROGRESS_SECONDS if every is None else every
    stop = threading.Event()
    began = time.perf_counter()

    def loop() -> None:
        while not stop.wait(every):
            cost, bound, plain = state()
            text = label() if callable(label) else label
            progress(progress_line(text, time.perf_counter() - began, cost, bound, plain))

    thread = threading.Thread(target=loop, name="memplan-remat-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=1.0)


def progress_line(
    label: str, seconds: float, cost: float | None, bound: float | None, plain: float | None = None
) -> str:
    """``label [12 s: best +3.10%, bound +2.00%, gap 1.07%]`` (costs as overheads over ``plain``,
    the plain step's cost; as they are without it); parts not known are left out. Recognised
    by :func:`is_tick`."""

    def show(value: float) -> str:
        return f"+{100 * (value - plain) / plain:.2f}%" if plain else f"{value:.6g}"

    parts = [f"best {show(cost)}" if cost is not None else "no plan yet"]
    if bound is not None:
        parts.append(f"bound {show(bound)}")
    if cost is not None and bound is not None and cost > 0:
        parts.append(f"gap {100 * max(0.0, cost - bound) / cost:.2f}%")
    return f"{label} [{seconds:.0f} s: {', '.join(parts)}]"


_TICK = re.compile(r" \[\d+ s: .*\]$")


def is_tick(text: str) -> bool:
    """``text`` is a periodic :func:`progress_line` (not the start of a stage)."""
    return _TICK.search(text) is not None
