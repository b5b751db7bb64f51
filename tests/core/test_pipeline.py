"""The pipeline's group pass: an update group runs as one call of user code, in program order."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.graph import validate_order
from memplan.graph.analysis import topological_order
from memplan.graph.generate import random_dag
from memplan.pipeline import make_groups_contiguous


def _descendant_closed_group(graph, start: int) -> set[int]:
    """``start`` and everything that reads what it (transitively) makes: no op outside the
    group reads a member's output, as for an optimizer update."""
    group, frontier = {start}, [start]
    while frontier:
        op = frontier.pop()
        for t in graph.ops[op].outputs:
            for consumer in graph.consumers[t]:
                if consumer not in group:
                    group.add(consumer)
                    frontier.append(consumer)
    return group


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), num_ops=st.integers(4, 30))
def test_groups_run_contiguously_in_program_order_at_their_last_members_position(seed, num_ops):
    graph = random_dag(seed, num_ops)
    rng = random.Random(seed)
    order = topological_order(graph, [rng.random() for _ in graph.ops])
    group = _descendant_closed_group(graph, rng.randrange(graph.num_ops))
    result = make_groups_contiguous(order, [sorted(group)])
    validate_order(graph, result)
    positions = [i for i, op in enumerate(result) if op in group]
    assert positions == list(range(positions[0], positions[0] + len(group)))
    assert [result[i] for i in positions] == sorted(group)
    outside = [op for op in order if op not in group]
    assert [op for op in result if op not in group] == outside
    last = max(group, key=order.index)
    before_last = [op for op in order[: order.index(last)] if op not in group]
    assert result[: positions[0]] == before_last


def test_a_solver_order_inside_a_group_is_undone():
    """A reordering inside an update (a gradient's clone moved ahead to free it early) is not
    what the optimizer's Python code runs: the group keeps program order."""
    assert make_groups_contiguous([0, 1, 2, 3, 5, 4], [[4, 5]]) == [0, 1, 2, 3, 4, 5]
    assert make_groups_contiguous([0, 5, 1, 4, 2, 3], [[5, 4]]) == [0, 1, 4, 5, 2, 3]
    assert make_groups_contiguous([2, 0, 1], []) == [2, 0, 1]
