"""The canonical placement search (MiniMalloc): sweep, every option combination, the compiled
kernel against the Python reference, naive oracles, honest statuses, the hard-instance generator."""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.placement import (
    PairConflicts,
    Placement,
    PlacementProblem,
    native,
    place,
    portfolio,
    solve_exact,
    validate_placement,
)
from memplan.placement.generate import STACKINGS, GenerationError, perfect_instance, similar_sizes, tight_instance
from memplan.placement.heuristics import greedy_by_size
from memplan.placement.search import (
    Cancel,
    SearchOptions,
    applies,
    fit,
    minimise,
    overlapping_pairs,
    problem_units,
    search_placement,
    sweep,
)
from tests.core.naive import naive_fits, naive_min_arena

FLAGS = SearchOptions.flag_names()
needs_native = pytest.mark.skipif(not native.available(), reason="no C compiler here to build the compiled search")


def random_lives(rng: random.Random, n: int, horizon: int) -> list[tuple[int, int]]:
    lives = []
    for _ in range(n):
        start = rng.randrange(horizon)
        lives.append((start, rng.randint(start + 1, horizon)))
    return lives


def small_instances(count: int, n: int, seed: int) -> list[tuple[list[int], list[tuple[int, int]]]]:
    rng = random.Random(seed)
    return [([rng.randint(1, 4) for _ in range(n)], random_lives(rng, n, 6)) for _ in range(count)]


def every_combination() -> list[SearchOptions]:
    return [
        SearchOptions(**dict(zip(FLAGS, bits, strict=True)))
        for bits in itertools.product((False, True), repeat=len(FLAGS))
    ]


def far() -> float:
    return time.perf_counter() + 60.0


def arena_of(offsets: tuple[int, ...], sizes: list[int]) -> int:
    return max((o + s for o, s in zip(offsets, sizes, strict=True)), default=0)


def overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


# --- the sweep -------------------------------------------------------------------------------


def test_sections_are_the_cliques_where_a_lifetime_ends() -> None:
    rng = random.Random(0)
    for _ in range(30):
        lives = random_lives(rng, 12, 10)
        data = sweep(lives, range(12))
        for section in data.sections:  # every section is a set of buffers live together
            assert all(overlaps(lives[a], lives[b]) for a, b in itertools.combinations(section, 2))
        for b in range(12):
            assert [s for s, sec in enumerate(data.sections) if b in sec] == list(range(data.first[b], data.last[b]))
            assert set(data.overlaps[b]) == {o for o in range(12) if o != b and overlaps(lives[o], lives[b])}
        for a, b in itertools.combinations(range(12), 2):  # every live-together pair shares a section
            if overlaps(lives[a], lives[b]):
                assert any(a in sec and b in sec for sec in data.sections)
        assert sorted(b for members, _, _ in data.partitions for b in members) == list(range(12))
        for (_, _, hi), (_, lo, _) in itertools.pairwise(data.partitions):
            assert hi == lo


def test_overlapping_pairs_counts_without_listing() -> None:
    rng = random.Random(1)
    for n in (0, 1, 5, 40):
        lives = random_lives(rng, n, 12)
        assert overlapping_pairs(lives) == sum(overlaps(a, b) for a, b in itertools.combinations(lives, 2))


# --- no rule may change the answer ---------------------------------------------------------


def _answers(
    sizes: list[int], lives: list[tuple[int, int]], best: int, options: SearchOptions, engine: str
) -> tuple[bool, bool]:
    """(fits at the optimum ``best``, fits one unit below it), both proven."""
    at = fit(sizes, lives, best, far(), options, engine=engine)
    below = fit(sizes, lives, best - 1, far(), options, engine=engine)
    assert at.proven and below.proven
    if at.offsets_units is not None:
        assert arena_of(at.offsets_units, sizes) <= best
    return at.offsets_units is not None, below.offsets_units is not None


@needs_native
def test_every_option_combination_gives_the_same_answer() -> None:
    """MiniMalloc's habit: all 512 combinations of the pruning rules, on small instances, each
    finds a placement at the (naively computed) optimum and proves none exists one unit below."""
    for sizes, lives in small_instances(5, 7, seed=2):
        best = naive_min_arena(sizes, lives)
        for options in every_combination():
            assert _answers(sizes, lives, best, options, "native") == (True, False), options


def test_every_option_combination_gives_the_same_answer_in_python() -> None:
    for sizes, lives in small_instances(2, 5, seed=3):
        best = naive_min_arena(sizes, lives)
        for options in every_combination():
            assert _answers(sizes, lives, best, options, "python") == (True, False), options


@needs_native
def test_compiled_kernel_follows_the_reference_node_for_node() -> None:
    rng = random.Random(4)
    for sizes, lives in small_instances(3, 7, seed=5):
        capacity = naive_min_arena(sizes, lives)
        for options in [*rng.sample(every_combination(), 24), SearchOptions()]:
            for cap in (capacity - 1, capacity):
                a = fit(sizes, lives, cap, far(), options, engine="native")
                b = fit(sizes, lives, cap, far(), options, engine="python")
                assert (a.offsets_units, a.proven, a.nodes, a.backtracks) == (
                    b.offsets_units,
                    b.proven,
                    b.nodes,
                    b.backtracks,
                ), options


@st.composite
def interval_cases(draw: st.DrawFn) -> tuple[list[int], list[tuple[int, int]], dict[int, int]]:
    n = draw(st.integers(1, 6))
    sizes = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    starts = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    lengths = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    fixed = draw(st.dictionaries(st.integers(0, n - 1), st.integers(0, 3), max_size=2))
    return sizes, [(s, s + d) for s, d in zip(starts, lengths, strict=True)], fixed


@settings(max_examples=60, deadline=None)
@given(interval_cases())
def test_search_finds_the_naive_optimum_with_fixed_offsets(case) -> None:
    sizes, lives, fixed = case
    if not naive_fits(sizes, lives, sum(sizes) + 8, fixed):
        return  # fixed offsets that clash: no placement at any capacity
    best = naive_min_arena(sizes, lives, fixed)
    fixed_units = [fixed.get(b, -1) for b in range(len(sizes))]
    for engine in ("python", *(("native",) if native.available() else ())):
        found = fit(sizes, lives, best, far(), fixed_units=fixed_units, engine=engine)
        assert found.offsets_units is not None and arena_of(found.offsets_units, sizes) <= best
        assert all(found.offsets_units[b] == o for b, o in fixed.items())
        below = fit(sizes, lives, best - 1, far(), fixed_units=fixed_units, engine=engine)
        assert below.proven and below.offsets_units is None


# --- on whole problems: statuses, bounds, alignment -----------------------------------------


# Eight buffers whose optimum (13) is above their lower bound (12): found by random search
# with the canonical search, shrunk buffer by buffer, checked by the naive oracle below.
OUT_OF_REACH_SIZES = (3, 1, 7, 2, 4, 4, 1, 7)
OUT_OF_REACH_LIVES = ((0, 1), (2, 6), (0, 3), (0, 5), (4, 5), (3, 6), (2, 4), (5, 6))


def bound_out_of_reach() -> PlacementProblem:
    return PlacementProblem.from_intervals(OUT_OF_REACH_SIZES, OUT_OF_REACH_LIVES)


def test_the_out_of_reach_instance_is_what_it_says() -> None:
    problem = bound_out_of_reach()
    assert problem.lower_bound_bytes == 12
    assert naive_min_arena(list(OUT_OF_REACH_SIZES), list(OUT_OF_REACH_LIVES)) == 13


def test_a_tiny_instance_is_proven_infeasible_at_its_lower_bound() -> None:
    problem = bound_out_of_reach()
    optimum = naive_min_arena(list(problem.sizes_bytes), list(problem.lifetimes or ()))
    capped = replace(problem, capacity_bytes=problem.lower_bound_bytes)
    result = place(capped, time_limit_seconds=5.0, workers=1)
    assert result.status == "infeasible" and not result.fits
    free = place(problem, time_limit_seconds=5.0, workers=1)
    validate_placement(problem, free)
    assert free.arena_bytes == optimum and free.status == "optimal" and free.bound_bytes == optimum


def test_minimise_proves_the_optimum_above_the_lower_bound() -> None:
    problem = bound_out_of_reach()
    unit, sizes, lives, _ = problem_units(problem)
    optimum = naive_min_arena(sizes, lives)
    lower = problem.lower_bound_bytes // unit
    for engine in ("python", *(("native",) if native.available() else ())):
        found = minimise(sizes, lives, lower, sum(sizes), far(), engine=engine)
        assert found.arena_units == optimum and found.proven_lower_units == optimum
        assert found.probes[0].capacity_units == lower and found.probes[0].outcome == "infeasible"


def test_out_of_time_at_a_capacity_is_unknown_never_infeasible() -> None:
    inst = tight_instance(0, 300, hole_share=0.5, size_spread=4.0, mean_size_units=32, height_units=256)
    capped = replace(inst.problem, capacity_bytes=inst.optimal_arena_bytes)
    assert portfolio(capped).arena_bytes > inst.optimal_arena_bytes  # the heuristics miss it
    result = place(capped, time_limit_seconds=0.05, workers=1)
    assert result.status == "unknown" and not result.fits
    assert result.arena_bytes > inst.optimal_arena_bytes


def test_cancel_stops_a_search_unproven() -> None:
    inst = tight_instance(1, 300, hole_share=0.5, size_spread=4.0, mean_size_units=32, height_units=256)
    unit, sizes, lives, _ = problem_units(inst.problem)
    cancel = Cancel()
    cancel.set()
    t0 = time.perf_counter()
    result = fit(sizes, lives, inst.optimal_arena_bytes // unit, far(), cancel=cancel)
    assert not result.proven and result.offsets_units is None
    assert time.perf_counter() - t0 < 5.0


def test_a_cancelled_search_placement_returns_at_once() -> None:
    inst = tight_instance(1, 300, hole_share=0.5, size_spread=4.0, mean_size_units=32, height_units=256)
    capped = replace(inst.problem, capacity_bytes=inst.optimal_arena_bytes)
    cancel = Cancel()
    cancel.set()
    t0 = time.perf_counter()
    outcome = search_placement(capped, portfolio(capped), far(), cancel=cancel)
    assert outcome.placement is None and time.perf_counter() - t0 < 5.0


@pytest.mark.parametrize("workers", [1, 2])
def test_search_reaches_the_bound_where_the_heuristics_miss(workers: int) -> None:
    inst = tight_instance(2, 60, height_units=32, mean_size_units=6, size_spread=2.0)
    problem = inst.problem
    assert portfolio(problem).arena_bytes > problem.lower_bound_bytes
    result = solve_exact(problem, 10.0, workers=workers)
    validate_placement(problem, result)
    assert result.arena_bytes == problem.lower_bound_bytes and result.status == "optimal"


def test_alignment_is_respected_by_the_bound_and_the_search() -> None:
    rng = random.Random(6)
    sizes = [rng.choice([100, 511, 512, 513, 1500, 3000]) for _ in range(40)]
    problem = PlacementProblem.from_intervals(sizes, random_lives(rng, 40, 30), alignment_bytes=512)
    assert all(p % 512 == 0 for p in problem.padded_sizes_bytes)
    assert problem_units(problem)[0] % 512 == 0
    outcome = search_placement(problem, portfolio(problem), far())
    placement = outcome.placement or portfolio(problem)
    validate_placement(problem, placement)  # includes the alignment check
    assert placement.arena_bytes >= problem.lower_bound_bytes
    assert all(o % 512 == 0 for o in placement.offsets_bytes)


def test_general_conflicts_and_contiguous_groups_keep_the_old_path() -> None:
    rng = random.Random(7)
    pairs = [(i, j) for i, j in itertools.combinations(range(12), 2) if rng.random() < 0.4]
    general = PlacementProblem(tuple(rng.randint(1, 4) for _ in range(12)), PairConflicts(12, pairs))
    lives = random_lives(rng, 12, 8)
    grouped = PlacementProblem.from_intervals([rng.randint(1, 4) for _ in range(12)], lives, contiguous=((0, 1, 2),))
    for problem in (general, grouped):
        assert not applies(problem)
        result = place(problem, time_limit_seconds=2.0, workers=1)
        validate_placement(problem, result)
        assert result.method != "canonical-search"


def test_long_chains_run_on_a_deep_stack() -> None:
    """More buffers than the main thread's stack is trusted with (one nested call each)."""
    n = native.MAIN_STACK_BUFFERS + 500
    sizes = [1 + (b % 3) for b in range(n)]
    lives = [(b, b + 3) for b in range(n)]
    for engine in ("auto",):
        result = fit(sizes, lives, 8, far(), engine=engine)
        assert result.offsets_units is not None
    problem = PlacementProblem.from_intervals(sizes, lives)
    placement = Placement(
        tuple(result.offsets_units), arena_of(result.offsets_units, sizes), "search", "feasible", 0.0, 0.0, 0
    )
    validate_placement(problem, placement)


# --- the hard-instance generator ------------------------------------------------------------


def test_tight_instances_are_perfect_packings_greedy_misses() -> None:
    for seed in range(3):
        inst = tight_instance(seed, 120, hole_share=0.3)
        problem = inst.problem
        known = Placement(inst.optimal_offsets_bytes, inst.optimal_arena_bytes, "cut", "feasible", 0.0, 0.0, 0)
        validate_placement(problem, known)
        assert problem.lower_bound_bytes == inst.optimal_arena_bytes
        assert all(s % 512 == 0 for s in problem.sizes_bytes) and problem.alignment_bytes == 512
        assert greedy_by_size(problem).arena_bytes > inst.optimal_arena_bytes


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(20, 400),
    num_sizes=st.sampled_from([0, 3, 6]),
    height=st.sampled_from([256, 1024]),
    stacking=st.sampled_from(STACKINGS),
)
def test_perfect_instances_fill_the_capacity_at_every_time(
    seed: int, n: int, num_sizes: int, height: int, stacking: str
) -> None:
    inst = perfect_instance(
        seed, n, num_sizes=num_sizes, height_units=height, mean_size_units=height // 24, stacking=stacking
    )
    problem = inst.problem
    known = Placement(inst.optimal_offsets_bytes, inst.optimal_arena_bytes, "cut", "feasible", 0.0, 0.0, 0)
    validate_placement(problem, known)
    assert problem.lower_bound_bytes == inst.optimal_arena_bytes == height * 1024
    assert problem.num_buffers >= n
    assert problem.lifetimes is not None
    horizon = max(end for _, end in problem.lifetimes)
    load = [0] * horizon
    for size, (start, end) in zip(problem.sizes_bytes, problem.lifetimes, strict=True):
        for t in range(start, end):
            load[t] += size
    assert set(load) == {inst.optimal_arena_bytes}  # no gap anywhere: every section tiles exactly


def test_similar_sizes_divide_none_of_each_other() -> None:
    rng = random.Random(0)
    for count in (2, 6, 10):
        sizes = similar_sizes(rng, count, 40, 1.3)
        assert len(set(sizes)) == count and all(31 <= s <= 52 for s in sizes)
        assert all(a % b for a in sizes for b in sizes if a != b)
    with pytest.raises(GenerationError, match="widen the spread"):
        similar_sizes(rng, 10, 4, 1.2)
    with pytest.raises(GenerationError, match="unknown stacking"):
        perfect_instance(0, 10, stacking="sideways")
