"""Large neighbourhood search over the CP model: improve a plan a few nodes at a time.

On graphs whose whole CP model is too big to search (a random 250-node layered DAG: 31k
events; at 0.7 of its peak the model finds no plan in 280 s), the portfolio's plans come
from the baselines and from the CP model over the nodes the stage cuts re-run. Large
neighbourhood search (Shaw, CP 1998; the paper's "destroy and repair") improves such a
plan: free the runs of a few nodes, keep every other node's runs as the plan has them, and
let the CP model (:func:`memplan.remat.moccasin.solve_neighbourhood`) find the cheapest
plan in that neighbourhood, a model a fraction of the whole one's size that it often
solves to optimality in a tenth of a second. Repeat from the better plan.

Neighbourhoods (each a set of re-runnable nodes to free), in turn:

* **crossing**: nodes whose outputs are resident across one stage (made before it, read
  by a first run after it; the stage cuts' ``crossing`` set), where re-running one of them
  makes room, and some of the nodes the plan re-runs;
* **re-runs**: half the nodes the plan re-runs, half chosen at random;
* **window**: the nodes of a run of consecutive stages and those re-run in those stages;
* **disagree** (with a guess at where a cheap plan re-runs, e.g. the nodes the stage cuts'
  relaxation re-runs: the guide): the nodes where the plan and the guide disagree (re-run by
  one, not the other), and half as many of those both re-run, as in RINS (Danna, Rothberg and
  Le Pape, Math. Programming 2005; there the LP solution and the incumbent). Every second and
  fifth round of five while a guided round (below) would be too large. On the 250-node DAG
  at 0.7 of its peak the best plans re-run 56-59 nodes, 54-57 of them among the relaxation's
  60. From DTR planned ahead (+48.6%) with 45 s and two threads, the three kinds above reached
  +20.74%, +21.62% and +22.12% (the first at 33 s); with this kind, six runs reached +20.74%
  in five (at 23-29 s) and +21.46% in one (at 9 s, then nothing better);
* **guided** (with a guide): the guide's nodes, every node the plan re-runs, and a few more
  drawn with weights by their pressure (the bytes they keep across the stages over the
  budget, where re-running them makes room), with a longer round
  (:data:`GUIDED_ROUND_SECONDS`), while those are few (:data:`GUIDED_MAX_NODES`), and less
  often while guided rounds find nothing (:data:`GUIDED_MAX_EVERY`). Drawn
  uniformly instead (one seed), the 250-node DAG at 0.8 of its peak gained nothing in 12
  rounds from +10.31% of compute; by pressure (three seeds), it reached +10.17% within 5
  rounds, and +9.78% within 8 in two of them.

The size adapts (the usual adaptive LNS rule): it grows while neighbourhoods are solved to
optimality with nothing better, and shrinks when a search runs out of time. Choices come
from a seeded generator, so a run depends only on the solver's timing. With ``threads``,
several neighbourhoods are solved at once, one CP-SAT search per thread (CP-SAT releases
the GIL while it solves), sharing the workers.

Every plan found is a plan of the CP model, lowered and measured by the one estimator like
any other (the portfolio validates it again); a neighbourhood's status and bound say
nothing about the problem, so the search never proves anything: the portfolio's bound
comes from elsewhere.
"""

from __future__ import annotations

import contextvars
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from memplan.remat.coarsen import SolverGraph
from memplan.remat.moccasin import (
    build_events,
    memory_units,
    node_reads,
    over_budget_stages,
    part_units,
    rerun_nodes,
    solve_neighbourhood,
)
from memplan.remat.problem import RematProblem, RematSchedule

START_SIZE = 30
"""Free nodes in the first neighbourhood (the 250-node DAG: solved in 0.1-2 s)."""
MIN_SIZE = 10
"""The neighbourhoods never shrink below this many nodes."""
GROWTH = 1.25
"""Factor by which the size grows (nothing better, proven) or shrinks (out of time)."""
ROUND_SECONDS = 2.0
"""Time for one neighbourhood: most are solved or improved well within it."""
GUIDED_ROUND_SECONDS = 5.0
"""Time for one guided neighbourhood: larger than the others (the 250-node DAG at 0.8: 40-60 nodes)."""
GUIDED_EXTRA = 10
"""Nodes drawn by pressure and added to a guided neighbourhood."""
GUIDED_MAX_NODES = 60
"""A guided neighbourhood is tried only while the guide and the plan's re-runs are at most
this many nodes (the 250-node DAG at 0.7: over a hundred, a model no round solves)."""
SEED = 0
KINDS = ("crossing", "re-runs", "window")
GUIDE_KINDS = ("crossing", "disagree", "re-runs", "window", "disagree")
"""The kinds' rotation while the guide and the plan's re-runs are more than
:data:`GUIDED_MAX_NODES` (no guided rounds then). Always, the 250-node DAG at 0.8 of its peak
(guided rounds) went from +9.41% and +9.78% in two 60 s solves to +9.78% in both."""
GUIDED_EVERY = 2
"""With a guide, every this many rounds is a guided one, the first included (the kind that
improves the 250-node DAG at 0.8; a 20 s solve leaves the search time for two rounds) ..."""
GUIDED_MAX_EVERY = 16
"""... and after each guided round that finds nothing better, twice as many rounds until the
next, up to this many (back to :data:`GUIDED_EVERY` after one that does). On the 250-node DAG at
0.7 the guided rounds (70 nodes) ran out of their 5 s every time: from 62 s to 235 s of a search
every second round was one, none found a better plan, and the plan stayed at +22.4%; once the
plan's re-runs outgrew the guided rounds' size cap, the other kinds took it to +20.1% in 7 s."""


WAITING = 1 << 62
"""``next_guided`` while a guided round runs: no other starts before its outcome is known."""


@dataclass
class LnsResult:
    """The best plan found (None if no neighbourhood beat the start) and what the search did."""

    plan: RematSchedule | None
    rounds: int
    improvements: int
    seconds: float


class Neighbourhoods:
    """Chooses the nodes to free around a plan (see the module docstring)."""

    def __init__(
        self, sg: SolverGraph, seed: int = SEED, budget_bytes: int | None = None, persistent_bytes: int = 0
    ) -> None:
        reads = node_reads(sg)
        events = build_events(sg, reads)
        self.size = sg.size
        self.movable = [k for k in range(sg.size) if events.recompute[k]]
        last_read: dict[int, int] = {}
        for j in range(sg.size):
            for p, _ in reads.first[j]:
                last_read[p] = max(last_read.get(p, j), j)
        movable = set(self.movable)
        self.crossing = [
            sorted(p for p, last in last_read.items() if p < v < last and p in movable) for v in range(sg.size)
        ]
        self.rng = random.Random(seed)
        self.pressure = [0] * sg.size
        """Per node: its bytes resident across the stages over ``budget_bytes`` (0 without one)."""
        if budget_bytes is not None:
            units = memory_units(sg, budget_bytes, persistent_bytes)
            size = part_units(sg, units)
            for _excess, _v, _fixed, crossing in over_budget_stages(sg, reads, units, size):
                for part in crossing:
                    self.pressure[part[0]] += size.get(part, 0)

    def pick(self, kind: str, rows: list[list[int]], size: int, guide: frozenset[int] = frozenset()) -> set[int]:
        """``size`` or so re-runnable nodes to free around the plan ``rows`` (Checkmate's ``R``)."""
        again_set = rerun_nodes(rows)
        again = sorted(again_set)
        if kind == "guided":
            base = again_set | (guide & set(self.movable))
            return base | self._by_pressure([k for k in self.movable if k not in base], GUIDED_EXTRA)
        if kind == "disagree":
            disagree = sorted(again_set ^ (guide & set(self.movable)))
            free = self._sample(disagree, size)
            return free | self._sample(sorted(again_set & guide), max(0, size - len(free)) // 2)
        if kind == "crossing":
            crossing = self.crossing[self.rng.randrange(self.size)]
            return self._sample(crossing, 2 * size // 3) | self._sample(again, size // 3)
        if kind == "re-runs":
            return self._sample(again, size // 2) | self._sample(self.movable, size - size // 2)
        start = self.rng.randrange(self.size)
        stages = range(max(0, start - size // 2), min(self.size, start + size // 2))
        window = {k for k in self.movable if k in stages}
        return window | {k for t in stages for k in rows[t] if k != t}

    def _sample(self, nodes: list[int], count: int) -> set[int]:
        return set(self.rng.sample(nodes, min(len(nodes), count)))

    def _by_pressure(self, nodes: list[int], count: int) -> set[int]:
        """``count`` of ``nodes`` drawn without replacement with probability by pressure
        (Efraimidis and Spirakis' keys), then uniformly among those without any."""
        if count <= 0:
            return set()
        keys = sorted((self.rng.random() ** (1.0 / self.pressure[k]), k) for k in nodes if self.pressure[k] > 0)
        chosen = {k for _key, k in keys[-count:]}
        rest = [k for k in nodes if k not in chosen]
        return chosen | self._sample(rest, count - len(chosen))


def improve(
    problem: RematProblem,
    sg: SolverGraph,
    plan: RematSchedule,
    seconds: float,
    runs_per_node: int,
    stop: Callable[[RematSchedule], bool] = lambda _: False,
    on_better: Callable[[RematSchedule], None] = lambda _: None,
    guide: frozenset[int] = frozenset(),
    threads: int = 1,
) -> LnsResult:
    """Large neighbourhood search from ``plan`` (its ``details["rows"]``, over ``sg``) for
    ``seconds``: each better plan goes to ``on_better``; the search ends early once
    ``stop(best plan)`` holds (e.g. it is proven within the gap limit of a bound). ``guide``:
    nodes a cheap plan may re-run, freed together in guided rounds: every :data:`GUIDED_EVERY`-th
    round, less often after guided rounds that find nothing (:data:`GUIDED_MAX_EVERY`).

    ``threads``: neighbourhoods solved at once, each by CP-SAT with ``problem.workers //
    threads`` workers and from the best plan when it starts (a plan better than that one but
    not than the best found meanwhile is dropped). On 2 cores two neighbourhoods of one worker
    each search faster than one of two: from DTR planned ahead (+48.6%) on the 250-node DAG at
    0.7 of its peak, 40 s of search with three seeds reached +20.7%, +23.9% and +22.1% of
    compute in about 60 rounds, one at a time +22.1%, +23.3% and +29.3% in 30-40 rounds."""
    return _Search(problem, sg, plan, seconds, runs_per_node, stop, on_better, guide).run(max(1, threads))


class _Search:
    """One search's state, shared by its threads (under ``lock``)."""

    def __init__(
        self,
        problem: RematProblem,
        sg: SolverGraph,
        plan: RematSchedule,
        seconds: float,
        runs_per_node: int,
        stop: Callable[[RematSchedule], bool],
        on_better: Callable[[RematSchedule], None],
        guide: frozenset[int],
    ) -> None:
        self.start = time.perf_counter()
        self.problem, self.sg, self.seconds, self.runs_per_node = problem, sg, seconds, runs_per_node
        self.stop, self.on_better, self.guide = stop, on_better, guide
        budget, persistent = problem.budget_bytes, problem.graph.persistent_bytes
        self.chooser = Neighbourhoods(sg, budget_bytes=budget, persistent_bytes=persistent)
        self.best, self.size, self.rounds, self.improvements = plan, START_SIZE, 0, 0
        self.every, self.next_guided = GUIDED_EVERY, 0
        self.lock = threading.Lock()

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)

    def run(self, threads: int) -> LnsResult:
        if threads > 1:
            self.problem = replace(self.problem, workers=max(1, self.problem.workers // threads))
        failed: list[BaseException] = []

        def rounds() -> None:
            try:
                self._rounds()
            except BaseException as err:  # raised again in the caller's thread
                failed.append(err)
                self.seconds = 0.0  # the other threads stop after their round

        # each thread in the caller's context: a stop event set for the call reaches every search
        others = [threading.Thread(target=contextvars.copy_context().run, args=(rounds,)) for _ in range(threads - 1)]
        for thread in others:
            thread.start()
        rounds()
        for thread in others:
            thread.join()
        if failed:
            raise failed[0]
        found = self.best if self.improvements else None
        return LnsResult(found, self.rounds, self.improvements, time.perf_counter() - self.start)

    def _rounds(self) -> None:
        while True:
            with self.lock:
                left = self.left()
                if left < 0.2 or self.stop(self.best):
                    return
                base, guided, free = self._pick()
                number = self.rounds
                self.rounds += 1
            rows: list[list[int]] = base.details["rows"]  # type: ignore[assignment]
            budget = GUIDED_ROUND_SECONDS if guided else ROUND_SECONDS
            found, status, _ = solve_neighbourhood(
                self.problem, self.sg, rows, free, self.runs_per_node, min(budget, left)
            )
            with self.lock:
                self._learn(number, base, guided, found, status.status)

    def _pick(self) -> tuple[RematSchedule, bool, set[int]]:
        """The plan to start from, whether the round is a guided one, and the nodes to free."""
        rows: list[list[int]] = self.best.details["rows"]  # type: ignore[assignment]
        guide = self.guide
        small = len(rerun_nodes(rows) | guide) <= GUIDED_MAX_NODES
        guided = bool(guide) and self.rounds >= self.next_guided and small
        kinds = GUIDE_KINDS if guide and not small else KINDS
        kind = "guided" if guided else kinds[self.rounds % len(kinds)]
        if guided:
            self.next_guided = WAITING  # until this round's outcome sets the next one
        return self.best, guided, self.chooser.pick(kind, rows, self.size, guide)

    def _learn(self, number: int, base: RematSchedule, guided: bool, found: RematSchedule | None, status: str) -> None:
        """Keep a better plan; adapt the size (only from rounds that did not improve on their
        start) and the wait until the next guided round."""
        better = found is not None and found.feasible and found.compute_cost < self.best.compute_cost * (1 - 1e-12)
        improved = found is not None and found.feasible and found.compute_cost < base.compute_cost * (1 - 1e-12)
        if guided:
            self.every = GUIDED_EVERY if improved else min(2 * self.every, GUIDED_MAX_EVERY)
            self.next_guided = number + self.every
        if better and found is not None:
            self.best, self.improvements = found, self.improvements + 1
            self.on_better(found)
        elif guided or improved:
            pass  # a guided round's size is not the adaptive one; nor is one whose plan another beat
        elif status == "optimal":
            self.size = min(len(self.chooser.movable), int(self.size * GROWTH) + 1)
        else:
            self.size = max(MIN_SIZE, int(self.size / GROWTH))
