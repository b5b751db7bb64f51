"""DTR's simulation as it was first written (remake costs recomputed recursively at every
eviction, one memo per eviction; remakes run by recursion): the oracle of the cached, stack-driven
one in :mod:`memplan.remat.baselines`, and its baseline in ``bench/remat_scale.py --compare-dtr``."""

from __future__ import annotations

from memplan.remat.baselines import Part, _Dtr, _Evicted, _PlannedDtr
from memplan.remat.coarsen import SolverGraph


class NaiveDtr(_Dtr):
    """:class:`memplan.remat.baselines._Dtr` with its first remake costs, eviction and runs."""

    def forget(self, part: Part) -> None:
        pass  # nothing is cached

    def remake(self, k: int, memo: dict[int, float] | None = None) -> float:  # type: ignore[override]
        """Cost of making ``k`` again: itself and every evicted value it reads (DTR's e*)."""
        memo = {} if memo is None else memo
        if k not in memo:
            memo[k] = self.sg.cost[k]  # guards the recursion; parts come from earlier nodes
            memo[k] += sum(self.remake(p, memo) for p, q in self.reads.rerun[k] if (p, q) not in self.resident)
        return memo[k]

    def evict(self, need: int, pinned: set[Part], t: int) -> None:
        sg = self.sg
        while self.live + need > self.budget:
            self.check()  # (not in the first version: lets the bench stop it)
            candidates = [
                p for p in self.resident if p not in pinned and sg.limit[p[0]] > t + 1 and sg.recomputable(p[0])
            ]
            if not candidates:
                raise _Evicted
            memo: dict[int, float] = {}

            def score(part: Part, memo: dict[int, float] = memo) -> float:
                return (self.remake(part[0], memo) + 1e-9) / (self.resident[part] * self.weight(part, t))

            self.drop(min(candidates, key=score))

    def run(self, k: int, t: int, wanted: tuple[Part, ...], pinned: set[Part]) -> None:
        sg = self.sg
        needs = self.reads.first[k] if k == t else self.reads.rerun[k]
        mine = set(pinned)
        for part in needs:
            if part not in self.resident:
                if not sg.may_run(t, part[0]):
                    raise _Evicted
                self.run(part[0], t, (part,), mine)
            mine.add(part)
        self.evict(sg.peak_bytes[k], mine, t)
        self.clock += 1
        for part in needs:
            self.touched[part] = self.clock
        if k != t:
            self.rows[t].append(k)
        for q, (b, _) in enumerate(sg.parts[k]):
            part = (k, q)
            if b and (part in wanted or (k == t and self.last_reader.get(part, -1) > t)):
                self.keep(part, b)
        if k == t:
            self.live += sg.output_bytes[k]


class NaivePlannedDtr(_PlannedDtr, NaiveDtr):
    """DTR planned ahead over :class:`NaiveDtr`'s remake costs and eviction."""


def naive_dtr_rows(sg: SolverGraph, budget_bytes: int, power: float) -> list[list[int]] | None:
    return NaiveDtr(sg, budget_bytes, power).simulate()


def naive_dtr_planned_rows(sg: SolverGraph, budget_bytes: int, power: float, lookahead: bool) -> list[list[int]] | None:
    return NaivePlannedDtr(sg, budget_bytes, power, lookahead).simulate()
