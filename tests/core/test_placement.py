"""Placement: validator failure kinds, heuristics vs exact vs brute force, CSV, generator, CLI."""

from __future__ import annotations

import itertools
import random
import time
from pathlib import Path

import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from memplan.commands.place import OutputClash
from memplan.commands.place import register as register_place
from memplan.graph.generate import random_dag
from memplan.graph.liveness import peak_bytes
from memplan.placement import (
    ContiguityBroken,
    FixedOffsetIgnored,
    MisalignedOffset,
    MissingBuffer,
    OutsideArena,
    OverlappingBuffers,
    PairConflicts,
    Placement,
    PlacementError,
    PlacementFormatError,
    PlacementProblem,
    UnknownMethod,
    arena_bytes,
    format_placement_csv,
    fragmentation,
    lower_bound_bytes,
    parse_placement_csv,
    place,
    placement_failures,
    portfolio,
    problem_from_graph,
    read_placement_csv,
    solve_exact,
    validate_placement,
    write_placement_csv,
)
from memplan.placement.generate import adversarial_instance
from memplan.placement.heuristics import HEURISTICS, best_fit_skyline, greedy_by_size, make_blocks, pyramid_offsets
from memplan.placement.repair import load_profile, peak_anchored, reach_bound, repair_top_band, solve_window


def sol(offsets: list[int], arena: int) -> Placement:
    return Placement(tuple(offsets), arena, "hand", "feasible", 0.0, 0.0, 0)


def two_live() -> PlacementProblem:
    """a and b live together; c alone later."""
    return PlacementProblem.from_intervals([4, 4, 8], [(0, 2), (1, 3), (3, 4)], alignment_bytes=4)


def random_intervals(rng: random.Random, n: int, max_size: int = 6, horizon: int = 8) -> PlacementProblem:
    lives = []
    for _ in range(n):
        start = rng.randrange(horizon)
        lives.append((start, rng.randint(start + 1, horizon)))
    return PlacementProblem.from_intervals([rng.randint(1, max_size) for _ in range(n)], lives)


def random_pairs(rng: random.Random, n: int, density: float = 0.5) -> PlacementProblem:
    pairs = [(i, j) for i, j in itertools.combinations(range(n), 2) if rng.random() < density]
    return PlacementProblem(tuple(rng.randint(1, 3) for _ in range(n)), PairConflicts(n, pairs))


def stacked(problem: PlacementProblem) -> Placement:
    """Every buffer above the previous one: valid and as bad as it gets, to make CP-SAT work."""
    offsets = list(itertools.accumulate(problem.padded_sizes_bytes, initial=0))
    return Placement(tuple(offsets[:-1]), offsets[-1], "stacked", "feasible", 0.0, 1.0, 0)


def brute_force_arena(problem: PlacementProblem) -> int:
    """Smallest arena over every offset vector on the integer grid: obviously right, slow."""
    sizes = problem.padded_sizes_bytes
    pairs = list(problem.conflicts.pairs())
    best = sum(sizes)
    for offsets in itertools.product(range(sum(sizes) + 1), repeat=problem.num_buffers):
        top = max(o + s for o, s in zip(offsets, sizes, strict=True))
        if top >= best:
            continue
        if all(offsets[i] + sizes[i] <= offsets[j] or offsets[j] + sizes[j] <= offsets[i] for i, j in pairs):
            best = top
    return best


# --- the validator: one failure kind each --------------------------------------------------


def test_valid_placement_passes() -> None:
    validate_placement(two_live(), sol([0, 4, 0], 8))


@pytest.mark.parametrize(
    ("offsets", "arena", "kind"),
    [
        ([0, 4], 8, MissingBuffer),
        ([0, 6, 0], 12, MisalignedOffset),
        ([0, 0, 0], 8, OverlappingBuffers),
        ([0, 4, 4], 8, OutsideArena),
        ([0, -4, 0], 8, OutsideArena),
    ],
)
def test_each_failure_kind(offsets: list[int], arena: int, kind: type) -> None:
    assert {type(f) for f in placement_failures(two_live(), sol(offsets, arena))} == {kind}
    with pytest.raises(kind) as err:
        validate_placement(two_live(), sol(offsets, arena))
    assert "\n" not in str(err.value)


def test_capacity_fixed_and_contiguous_failures() -> None:
    p = PlacementProblem.from_intervals(
        [4, 4, 8], [(0, 2), (1, 3), (3, 4)], fixed_offsets={2: 4}, contiguous=((0, 1),), capacity_bytes=12
    )
    kinds = {type(f) for f in placement_failures(p, sol([4, 0, 0], 16))}
    assert kinds == {OutsideArena, FixedOffsetIgnored, ContiguityBroken}
    validate_placement(p, sol([0, 4, 4], 12))


def test_non_conflicting_buffers_may_share_addresses() -> None:
    validate_placement(two_live(), sol([4, 0, 0], 8))


# --- the problem -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: PlacementProblem.from_intervals([1, -1], [(0, 1), (0, 1)]),
        lambda: PlacementProblem.from_intervals([1], [(2, 2)]),
        lambda: PlacementProblem.from_intervals([1, 1], [(0, 1), (0, 1)], names=("x", "x")),
        lambda: PlacementProblem.from_intervals([1], [(0, 1)], alignment_bytes=4, fixed_offsets={0: 2}),
        lambda: PlacementProblem.from_intervals([1, 1], [(0, 1), (0, 1)], contiguous=((0, 1), (1,))),
        lambda: PlacementProblem((1, 1), PairConflicts(2, [(0, 5)])),
    ],
)
def test_malformed_problem_is_one_typed_line(make) -> None:
    with pytest.raises(PlacementError) as err:
        make()
    assert "\n" not in str(err.value)


def test_lower_bound_is_the_estimators_peak_on_graphs() -> None:
    for seed in range(5):
        g = random_dag(seed, 60)
        order = g.program_order()
        assert lower_bound_bytes(problem_from_graph(g, order)) == peak_bytes(g, order) - g.persistent_bytes


def test_general_lower_bound_is_valid() -> None:
    rng = random.Random(3)
    for _ in range(10):
        p = random_pairs(rng, 4)
        assert lower_bound_bytes(p) <= brute_force_arena(p)


def test_fragmentation_definition() -> None:
    assert fragmentation(100, 75) == 0.25
    assert fragmentation(0, 0) == 0.0


# --- heuristics ----------------------------------------------------------------------------


def test_every_heuristic_is_valid_on_graphs_and_general_conflicts() -> None:
    rng = random.Random(0)
    problems = [problem_from_graph(g, g.program_order(), alignment=8) for g in (random_dag(s, 80) for s in range(3))]
    problems += [random_pairs(rng, 30, 0.2) for _ in range(3)]
    for p in problems:
        blocks = make_blocks(p)
        for name, run in HEURISTICS:
            result = run(p, blocks)
            if result is not None:
                validate_placement(p, result)
                assert result.arena_bytes >= lower_bound_bytes(p), name


def test_skyline_follows_sekiyama_figure_1_on_a_pyramid() -> None:
    # Nested lifetimes: longest first at offset 0, each next one on top; no waste.
    p = PlacementProblem.from_intervals([3, 2, 1], [(0, 6), (1, 5), (2, 4)])
    result = best_fit_skyline(p)
    assert result is not None and result.offsets_bytes == (0, 3, 5) and result.arena_bytes == 6


def test_pyramid_is_olla_function_5() -> None:
    p = PlacementProblem.from_intervals([5, 2, 7, 1], [(0, 10), (1, 9), (0, 3), (2, 8)])
    assert pyramid_offsets(p) == {0: 0, 1: 5, 3: 7}


def test_fixed_offsets_and_contiguous_groups_are_honoured() -> None:
    rng = random.Random(7)
    base = random_intervals(rng, 20)
    p = PlacementProblem.from_intervals(
        base.sizes_bytes, base.lifetimes, fixed_offsets={0: 10}, contiguous=((3, 4, 5), (7, 1)), alignment_bytes=2
    )
    validate_placement(p, portfolio(p))
    validate_placement(p, solve_exact(p, 2.0, workers=1))


# --- exact ----------------------------------------------------------------------------------


def test_exact_never_worse_than_heuristics() -> None:
    rng = random.Random(1)
    for _ in range(6):
        p = random_intervals(rng, 14)
        heuristic = place(p, method="heuristic")
        exact = place(p, time_limit_seconds=2.0, method="exact", workers=1)
        validate_placement(p, exact)
        assert lower_bound_bytes(p) <= exact.arena_bytes <= heuristic.arena_bytes


@pytest.mark.parametrize("kind", ["intervals", "pairs"])
def test_exact_equals_brute_force_on_tiny_instances(kind: str) -> None:
    rng = random.Random(2)
    for _ in range(6):
        p = random_intervals(rng, 4, max_size=3, horizon=4) if kind == "intervals" else random_pairs(rng, 4, 0.6)
        exact = solve_exact(p, 5.0, workers=1, repair=False, search=False, start=stacked(p))
        assert exact.method.startswith("cp-sat") or exact.arena_bytes == sum(p.padded_sizes_bytes)
        validate_placement(p, exact)
        assert exact.status == "optimal"
        assert exact.arena_bytes == brute_force_arena(p)


def test_odd_cycle_at_its_clique_bound_is_infeasible() -> None:
    cycle = PairConflicts(5, [(i, (i + 1) % 5) for i in range(5)])
    p = PlacementProblem((1,) * 5, cycle, capacity_bytes=2)
    assert lower_bound_bytes(p) == 2
    result = place(p, time_limit_seconds=5.0, workers=1)
    assert result.status == "infeasible" and not result.fits and result.arena_bytes == 3


def test_capacity_below_the_bound_is_infeasible_without_search() -> None:
    p = PlacementProblem.from_intervals([4, 4], [(0, 2), (1, 3)], capacity_bytes=7)
    for method in ("heuristic", "exact"):
        result = place(p, time_limit_seconds=1.0, method=method, workers=1)
        assert result.status == "infeasible" and not result.fits and result.arena_bytes == 8


def test_exact_reaches_the_bound_where_a_perfect_packing_exists() -> None:
    inst = adversarial_instance(0, 40, num_steps=60, height_units=40)
    validate_placement(inst.problem, sol(list(inst.optimal_offsets_bytes), inst.optimal_arena_bytes))
    assert lower_bound_bytes(inst.problem) == inst.optimal_arena_bytes
    capped = PlacementProblem.from_intervals(
        inst.problem.sizes_bytes, inst.problem.lifetimes, capacity_bytes=inst.optimal_arena_bytes
    )
    for result in (
        place(capped, time_limit_seconds=8.0, workers=1),
        solve_exact(capped, 8.0, workers=1, start=stacked(capped)),
    ):
        validate_placement(capped, result)
        assert result.arena_bytes == inst.optimal_arena_bytes and result.status == "optimal"


# --- repair: peak-anchored packing and top-band LNS ------------------------------------------


@st.composite
def interval_problems(draw: st.DrawFn) -> PlacementProblem:
    n = draw(st.integers(1, 14))
    starts = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    lengths = draw(st.lists(st.integers(1, 5), min_size=n, max_size=n))
    sizes = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    alignment = draw(st.sampled_from([1, 4]))
    lives = [(s, s + d) for s, d in zip(starts, lengths, strict=True)]
    return PlacementProblem.from_intervals(sizes, lives, alignment_bytes=alignment)


@settings(max_examples=40, deadline=None)
@given(interval_problems())
def test_reach_bound_is_valid_and_never_worse_than_its_start(p: PlacementProblem) -> None:
    for start in (portfolio(p), stacked(p)):
        result, unreachable = reach_bound(p, start, seconds=1.0, workers=1)
        validate_placement(p, result)
        assert lower_bound_bytes(p) <= result.arena_bytes <= start.arena_bytes
        assert not (unreachable and result.arena_bytes == lower_bound_bytes(p))


@settings(max_examples=25, deadline=None)
@given(interval_problems(), st.integers(0, 3))
def test_peak_anchored_placements_are_valid_and_tile_the_peak(p: PlacementProblem, half_width: int) -> None:
    anchoring = peak_anchored(p, half_width, seconds=1.0, workers=1)
    assert anchoring.placements or anchoring.bound_unreachable
    peak_time = int(load_profile(p).argmax())
    for placement in anchoring.placements:
        validate_placement(p, placement)
        live = [b for b, (s, e) in enumerate(p.lifetimes or ()) if s <= peak_time < e]
        assert all(placement.offsets_bytes[b] + p.padded_sizes_bytes[b] <= lower_bound_bytes(p) for b in live)


def test_exact_honours_its_time_limit_on_a_hard_instance() -> None:
    inst = adversarial_instance(1, 300)
    t0 = time.perf_counter()
    result = solve_exact(inst.problem, 1.0, workers=1)
    elapsed = time.perf_counter() - t0
    validate_placement(inst.problem, result)
    assert result.seconds <= 2.0 and elapsed <= 2.0
    assert result.arena_bytes <= portfolio(inst.problem).arena_bytes


def test_peak_anchored_past_its_deadline_keeps_one_greedy_order() -> None:
    p = adversarial_instance(0, 40, num_steps=60, height_units=40).problem
    anchoring = peak_anchored(p, 1, seconds=1.0, workers=1, deadline=time.perf_counter())
    assert len(anchoring.placements) == 1 or anchoring.bound_unreachable
    for placement in anchoring.placements:
        validate_placement(p, placement)


def test_load_profile_peaks_at_the_lower_bound() -> None:
    rng = random.Random(4)
    for _ in range(5):
        p = random_intervals(rng, 12)
        assert int(load_profile(p).max()) == lower_bound_bytes(p)


def test_top_band_repair_moves_only_the_top_buffers_down() -> None:
    p = two_live()  # a, b live together (4 B each), c (8 B) later: bound 8
    start = sol([0, 4, 4], 12)  # c needlessly on top of the bound
    validate_placement(p, start)
    repaired = repair_top_band(p, start, band_bytes=0, seconds=2.0, workers=1)
    assert repaired is not None
    validate_placement(p, repaired)
    assert repaired.arena_bytes == 8 and repaired.offsets_bytes[:2] == (0, 4)


def test_top_band_repair_gives_up_when_the_fixed_part_leaves_no_room() -> None:
    # a (1 B) lives throughout; b and c (2 B each) live at its start and end: bound 3
    p = PlacementProblem.from_intervals([1, 2, 2], [(0, 3), (0, 1), (2, 3)])
    assert lower_bound_bytes(p) == 3
    loose = sol([0, 1, 3], 5)  # only c is above the bound; it fits back at 1
    repaired = repair_top_band(p, loose, band_bytes=0, seconds=2.0, workers=1)
    assert repaired is not None and repaired.arena_bytes == 3
    stuck = sol([1, 2, 2], 4)  # a fixed in the middle leaves no 2 contiguous bytes under 3
    for placement in (loose, repaired, stuck):
        validate_placement(p, placement)
    assert repair_top_band(p, stuck, band_bytes=0, seconds=2.0, workers=1) is None
    freed = repair_top_band(p, stuck, band_bytes=2, seconds=2.0, workers=1)  # a reaches above 3 - 2: free too
    assert freed is not None and freed.arena_bytes == 3
    validate_placement(p, freed)


def test_a_window_fits_its_clipped_buffers_under_the_bound() -> None:
    p = PlacementProblem.from_intervals([2, 1, 2, 3], [(0, 2), (1, 3), (2, 4), (3, 5)])
    offsets, status = solve_window(p, 1, 3, seconds=2.0, workers=1)  # buffers 0, 1, 2; lifetimes clipped
    assert status in ("optimal", "feasible") and offsets is not None and sorted(offsets) == [0, 1, 2]
    sizes = p.padded_sizes_bytes
    assert all(o + sizes[b] <= lower_bound_bytes(p) for b, o in offsets.items())
    assert offsets[0] + sizes[0] <= offsets[1] or offsets[1] + sizes[1] <= offsets[0]  # live together at 1


def test_adversarial_generator_beats_greedy_by_size() -> None:
    inst = adversarial_instance(1, 150)
    assert inst.problem.num_buffers == 150
    assert greedy_by_size(inst.problem).arena_bytes >= 1.3 * lower_bound_bytes(inst.problem)
    assert arena_bytes(inst.problem, inst.optimal_offsets_bytes) == lower_bound_bytes(inst.problem)


def test_unknown_method() -> None:
    with pytest.raises(UnknownMethod):
        place(two_live(), method="magic")


# --- CSV -----------------------------------------------------------------------------------


def test_csv_round_trip(tmp_path: Path) -> None:
    p = random_intervals(random.Random(4), 12)
    offsets = portfolio(p).offsets_bytes
    path = tmp_path / "p.csv"
    write_placement_csv(path, p, offsets)
    back = read_placement_csv(path)
    assert back.offsets_bytes == offsets
    assert (back.problem.sizes_bytes, back.problem.lifetimes, back.problem.names) == (
        p.sizes_bytes,
        p.lifetimes,
        p.names,
    )
    assert parse_placement_csv(format_placement_csv(p)).offsets_bytes is None


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("", "empty file"),
        ("id,start,end,size\n", ":1:"),
        ("id,lower,upper,size\na,0,2\n", ":2:"),
        ("id,lower,upper,size\na,0,2,4\nb,0,x,4\n", ":3:"),
        ("id,lower,upper,size\na,2,2,4\n", ":2:"),
        ("id,lower,upper,size\na,0,2,-4\n", ":2:"),
        ("id,lower,upper,size\na,0,2,4\na,1,2,4\n", ":3:"),
    ],
)
def test_malformed_csv_is_one_line_with_file_and_line(tmp_path: Path, text: str, where: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(PlacementFormatError) as err:
        read_placement_csv(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and where in message


# --- CLI -----------------------------------------------------------------------------------


def cli() -> typer.Typer:
    app = typer.Typer()
    register_place(app)

    @app.callback()
    def _root() -> None:  # keeps "place" a sub-command, as in the real CLI
        pass

    return app


def test_cli_places_a_csv(tmp_path: Path) -> None:
    import json

    src = tmp_path / "in.csv"
    src.write_text("id,lower,upper,size\na,0,2,4\nb,1,3,4\nc,3,4,8\n")
    out, js, png = tmp_path / "out.csv", tmp_path / "r.json", tmp_path / "r.png"
    args = ["place", str(src), "-o", str(out), "--json", str(js), "--plot", str(png), "--time-limit", "1"]
    result = CliRunner().invoke(cli(), args)
    assert result.exit_code == 0, result.output
    report = json.loads(js.read_text())
    assert report["arena_bytes"] == report["lower_bound_bytes"] == 8 and report["fragmentation"] == 0.0
    assert {"status", "seconds", "method", "gap"} <= report.keys()
    placed = read_placement_csv(out)
    validate_placement(placed.problem, sol(list(placed.offsets_bytes), 8))
    assert png.stat().st_size > 0


def test_cli_refuses_to_overwrite_its_input(tmp_path: Path) -> None:
    src = tmp_path / "in.csv"
    text = "id,lower,upper,size\na,0,2,4\n"
    src.write_text(text)
    result = CliRunner().invoke(cli(), ["place", str(src), "-o", str(src)])
    assert isinstance(result.exception, OutputClash)
    assert src.read_text() == text
