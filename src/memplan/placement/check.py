"""Check a placement against its problem, written apart from every solver (as minimalloc's
validator is): one typed failure per kind, each a one-line message.

The rules are Sekiyama et al. eq. 2-6 / OLLA eq. 7a, 7b, 8, plus SOMAS's contiguous
constraints: every buffer has an offset; offsets are aligned; two conflicting buffers do
not share an address; every buffer lies in ``[0, arena)`` and the arena within the
capacity; fixed offsets are honoured; contiguous groups lie back to back in order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from memplan.errors import MemplanError
from memplan.placement.problem import IntervalConflicts, Placement, PlacementProblem


class InvalidPlacement(MemplanError):
    """A placement breaks its problem's rules."""


class MissingBuffer(InvalidPlacement):
    pass


class MisalignedOffset(InvalidPlacement):
    pass


class OverlappingBuffers(InvalidPlacement):
    pass


class OutsideArena(InvalidPlacement):
    """A buffer lies below 0 or beyond the arena, or the arena exceeds the capacity."""


class FixedOffsetIgnored(InvalidPlacement):
    pass


class ContiguityBroken(InvalidPlacement):
    pass


def placement_failures(problem: PlacementProblem, placement: Placement) -> list[InvalidPlacement]:
    """Every way ``placement`` breaks ``problem`` (empty if valid); at most one per buffer pair."""
    offsets = placement.offsets_bytes
    if len(offsets) != problem.num_buffers:
        return [MissingBuffer(f"placement has {len(offsets)} offsets for {problem.num_buffers} buffers")]
    sizes = _padded(problem)
    failures: list[InvalidPlacement] = []
    failures += _misaligned(problem, offsets)
    failures += _outside(problem, placement, sizes)
    failures += _overlaps(problem, offsets, sizes)
    failures += _fixed(problem, offsets)
    failures += _contiguity(problem, offsets, sizes)
    return failures


def validate_placement(problem: PlacementProblem, placement: Placement) -> None:
    """Raise the first :class:`InvalidPlacement` found, or return if the placement is valid."""
    failures = placement_failures(problem, placement)
    if failures:
        raise failures[0]


def _padded(problem: PlacementProblem) -> list[int]:
    a = problem.alignment_bytes
    return [(s + a - 1) // a * a for s in problem.sizes_bytes]


def _misaligned(problem: PlacementProblem, offsets: Sequence[int]) -> list[InvalidPlacement]:
    a = problem.alignment_bytes
    return [
        MisalignedOffset(f"buffer {problem.names[i]!r} at offset {o} is not a multiple of the alignment {a}")
        for i, o in enumerate(offsets)
        if o % a
    ]


def _outside(problem: PlacementProblem, placement: Placement, sizes: Sequence[int]) -> list[InvalidPlacement]:
    failures: list[InvalidPlacement] = []
    for i, (o, s) in enumerate(zip(placement.offsets_bytes, sizes, strict=True)):
        if o < 0 or o + s > placement.arena_bytes:
            failures.append(
                OutsideArena(
                    f"buffer {problem.names[i]!r} at [{o}, {o + s}) is outside the arena [0, {placement.arena_bytes})"
                )
            )
    cap = problem.capacity_bytes
    if cap is not None and placement.arena_bytes > cap:
        failures.append(OutsideArena(f"arena of {placement.arena_bytes} bytes exceeds the capacity of {cap} bytes"))
    return failures


def _overlaps(problem: PlacementProblem, offsets: Sequence[int], sizes: Sequence[int]) -> list[InvalidPlacement]:
    off = np.array(offsets, dtype=np.int64)
    end = off + np.array(sizes, dtype=np.int64)
    failures: list[InvalidPlacement] = []
    for i in range(problem.num_buffers):
        if sizes[i] == 0:
            continue
        others = _conflicting(problem, i)
        others = others[(others > i) & (off[others] < end[i]) & (off[i] < end[others]) & (end[others] > off[others])]
        if len(others):
            j = int(others[0])
            failures.append(
                OverlappingBuffers(
                    f"conflicting buffers {problem.names[i]!r} [{off[i]}, {end[i]}) and "
                    f"{problem.names[j]!r} [{off[j]}, {end[j]}) overlap"
                )
            )
    return failures


def _conflicting(problem: PlacementProblem, i: int) -> np.ndarray:
    conflicts = problem.conflicts
    if isinstance(conflicts, IntervalConflicts):  # recomputed here, not trusted from the relation
        s, e = conflicts.starts, conflicts.ends
        mask = (s < e[i]) & (s[i] < e)
        mask[i] = False
        return np.flatnonzero(mask)
    return np.array([j for j in range(problem.num_buffers) if j != i and conflicts.conflict(i, j)], dtype=np.int64)


def _fixed(problem: PlacementProblem, offsets: Sequence[int]) -> list[InvalidPlacement]:
    return [
        FixedOffsetIgnored(f"buffer {problem.names[b]!r} must be at offset {want} but is at {offsets[b]}")
        for b, want in problem.fixed_offsets.items()
        if offsets[b] != want
    ]


def _contiguity(problem: PlacementProblem, offsets: Sequence[int], sizes: Sequence[int]) -> list[InvalidPlacement]:
    failures: list[InvalidPlacement] = []
    for members in problem.contiguous:
        for prev, cur in itertools.pairwise(members):
            if offsets[cur] != offsets[prev] + sizes[prev]:
                failures.append(
                    ContiguityBroken(
                        f"buffer {problem.names[cur]!r} at {offsets[cur]} should follow {problem.names[prev]!r} "
                        f"at {offsets[prev] + sizes[prev]} in its contiguous group"
                    )
                )
                break
    return failures
