"""A trie of recorded steps placed in one arena (memplan.torch.run.branches): buffers on a
common path are one buffer, branches after they part share memory, and every branch's own
lifetimes are checked against the joint offsets."""

from __future__ import annotations

import pytest

from memplan.placement import InvalidPlacement, place, validate_placement
from memplan.torch.run.allocator import AllocationTrace
from memplan.torch.run.branches import build_trie, trie_problem, validate_branches

KIB = 1024


def trace(events: list[tuple[str, int]], sizes: dict[int, int]) -> AllocationTrace:
    """A trace from ("a", k) / ("f", k) events; allocation k has ``sizes[k]`` bytes."""
    n = len(sizes)
    alloc_at, free_at = [0] * n, [None] * n
    for time, (kind, k) in enumerate(events):
        if kind == "a":
            alloc_at[k] = time
        else:
            free_at[k] = time
    return AllocationTrace(tuple(sizes[k] for k in range(n)), tuple(alloc_at), tuple(free_at))


# both part after allocation 1; buffer 0 (a gradient) lives across that point: the skipping
# branch frees it at its end, the updating one after its first temporary, so that its second
# one may take its place
SKIP = trace(
    [("a", 0), ("a", 1), ("f", 1), ("a", 2), ("f", 2), ("f", 0), ("a", 3)], {0: 4 * KIB, 1: KIB, 2: KIB, 3: 64}
)
UPDATE = trace(
    [("a", 0), ("a", 1), ("f", 1), ("a", 2), ("f", 0), ("a", 3), ("f", 3), ("f", 2), ("a", 4)],
    {0: 4 * KIB, 1: KIB, 2: 8 * KIB, 3: 8 * KIB, 4: 64},
)


def solve(traces):
    trie = build_trie(traces)
    problem, buffers = trie_problem(trie)
    solved = place(problem, time_limit_seconds=2)
    validate_placement(problem, solved)
    return trie, {i: solved.offsets_bytes[j] for j, i in enumerate(buffers)}, solved


@pytest.mark.parametrize("order", [(SKIP, UPDATE), (UPDATE, SKIP)], ids=["skip-first", "update-first"])
def test_a_common_path_is_one_buffer_and_the_branches_share_memory_after_it(order):
    trie, offsets, solved = solve(list(order))
    assert trie.buffer[0][:2] == trie.buffer[1][:2] and trie.buffer[0][2] != trie.buffer[1][2]
    assert trie.shared == ((len(order[0].sizes), 2), (2, len(order[1].sizes)))
    bound = validate_branches(trie, offsets, solved)
    assert bound == 16 * KIB  # the update's peak: its two temporaries, the gradient freed
    # the skip's temporary lies inside the update's memory, and the update's second temporary
    # takes the gradient's place whichever branch was recorded first
    assert solved.arena_bytes == bound
    assert not trie.placed[trie.buffer[0][-1]]  # kept past the step: never in the arena


def test_a_buffer_one_branch_keeps_past_the_step_is_not_placed_in_any():
    kept = trace([("a", 0), ("a", 1), ("f", 1), ("a", 2), ("f", 2)], {0: 4 * KIB, 1: KIB, 2: KIB})
    trie, offsets, _ = solve([SKIP, kept])
    assert trie.buffer[1][0] == trie.buffer[0][0] and trie.buffer[0][0] not in offsets


def test_the_per_branch_validator_catches_buffers_of_one_branch_on_top_of_each_other():
    trie, offsets, solved = solve([SKIP, UPDATE])
    clash = dict(offsets)
    clash[trie.buffer[1][3]] = clash[trie.buffer[1][2]]  # the update's two temporaries live together
    with pytest.raises(InvalidPlacement):
        validate_branches(trie, clash, solved)
