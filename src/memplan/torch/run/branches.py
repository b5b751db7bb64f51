"""Several recorded steps of one step function placed in one arena: a trie of traces.

A step does not always allocate alike: a ``GradScaler`` step whose gradients overflow skips
the optimizer's update, the next one makes it. Each kind recorded once is a *branch*; the
branches' event sequences (allocations with their size and stream, frees) are merged into a
trie, so the events two branches have in common before they part are one path of it, and an
allocation on that path is ONE buffer in both (Sekiyama et al. 3's profile-guided allocation,
one profile per branch). The buffers are placed as one problem:

- every trie event gets a time by a depth-first walk of the trie, which is increasing along
  every branch;
- a buffer lives from its allocation to the latest of its frees over the branches that make
  it: a superset of its lifetime in each branch, so two buffers live together in some branch
  overlap there too (OLLA eq. 6 per branch), while buffers of two branches after they part are
  never live together and may share memory;
- a buffer that some branch keeps past the step is not placed (it goes to the ordinary
  allocator in every branch).

The placement is then validated against every branch's own lifetimes apart from the solver
(:func:`validate_branches`), and the offsets become a :class:`BranchedPlan` the planned
allocator replays, moving from branch to branch where a step departs from the one it follows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from memplan.placement import Placement, PlacementProblem, validate_placement
from memplan.torch.run.allocator import AllocationTrace, BranchedPlan, replay_plan


@dataclass(frozen=True)
class BranchTrie:
    """The branches' allocations as buffers of one placement problem.

    ``buffer[b][k]``: the buffer of allocation k of branch b (allocations on a common path share
    it); ``lifetimes[i]``: buffer i's lifetime on the trie's time axis; ``placed[i]``: freed within
    the step in every branch that makes it; ``shared[a][b]``: leading allocations of branches a
    and b that are the same buffers.
    """

    traces: tuple[AllocationTrace, ...]
    buffer: tuple[tuple[int, ...], ...]
    sizes: tuple[int, ...]
    lifetimes: tuple[tuple[int, int], ...]
    placed: tuple[bool, ...]
    shared: tuple[tuple[int, ...], ...]


def build_trie(traces: Sequence[AllocationTrace]) -> BranchTrie:
    """Merge ``traces`` (one recorded step each) into a trie of their event sequences."""
    children: dict[tuple[int, tuple], int] = {}  # (node, event) -> node, numbered as created
    paths = []  # the node of each event, per branch
    for trace in traces:
        node, path = -1, []
        for event in _events(trace):
            node = children.setdefault((node, event), len(children))
            path.append(node)
        paths.append(path)
    times = _time_axis(children, paths, traces)
    buffers: list[tuple[int, ...]] = []
    sizes: list[int] = []
    lifetimes: list[list[int]] = []
    placed: list[bool] = []
    of_node: dict[int, int] = {}  # allocation node -> buffer
    for trace, path in zip(traces, paths, strict=True):
        mine = []
        for k in range(trace.num_allocations):
            node = path[trace.alloc_at[k]]
            if node not in of_node:
                of_node[node] = len(sizes)
                sizes.append(trace.sizes[k])
                lifetimes.append([times[node], times[node] + 1])
                placed.append(True)
            i = of_node[node]
            end = trace.free_at[k]
            if end is None:
                placed[i] = False
            else:
                lifetimes[i][1] = max(lifetimes[i][1], times[path[end]])
            mine.append(i)
        buffers.append(tuple(mine))
    shared = tuple(tuple(_common(a, b) for b in buffers) for a in buffers)
    spans = tuple((start, end) for start, end in lifetimes)
    return BranchTrie(tuple(traces), tuple(buffers), tuple(sizes), spans, tuple(placed), shared)


def _time_axis(
    children: dict[tuple[int, tuple], int], paths: Sequence[Sequence[int]], traces: Sequence[AllocationTrace]
) -> list[int]:
    """Each trie node's time: its position in a depth-first walk (so increasing along every
    branch). Where branches part, the one in which the allocations live across the parting
    point outlive it the least goes first: a buffer's lifetime runs to its latest free, over
    the branches walked before that one too, so that order claims the least memory twice."""
    kids: dict[int, list[int]] = {}
    for (parent, _), node in children.items():
        kids.setdefault(parent, []).append(node)
    through = {}  # node -> (branch, depth) of the first branch through it
    for b, path in enumerate(paths):
        for depth, node in enumerate(path):
            through.setdefault(node, (b, depth))
    times, stack = [0] * len(children), list(reversed(kids.get(-1, [])))
    for clock in range(len(children)):
        node = stack.pop()
        times[node] = clock
        later = kids.get(node, [])
        if len(later) > 1:
            later = sorted(later, key=lambda child: _overclaim(traces, *through[child]))
        stack.extend(reversed(later))
    return times


def _overclaim(traces: Sequence[AllocationTrace], b: int, depth: int) -> int:
    """Bytes x events that branch ``b``'s allocations live across event ``depth`` stay freed
    before its end: what walking it first adds to their lifetimes."""
    trace = traces[b]
    end = trace.num_allocations + sum(free is not None for free in trace.free_at)  # its number of events
    return sum(
        size * (end - free)
        for size, start, free in zip(trace.sizes, trace.alloc_at, trace.free_at, strict=True)
        if free is not None and start < depth <= free
    )


def _events(trace: AllocationTrace) -> list[tuple]:
    """The trace's events in time order: ("alloc", size, stream, k) and ("free", k)."""
    count = trace.num_allocations + sum(end is not None for end in trace.free_at)
    events: list[tuple] = [()] * count
    streams = trace.streams or (0,) * trace.num_allocations
    for k in range(trace.num_allocations):
        # the key of an allocation is its size and stream; k rides along (the same on a common path)
        events[trace.alloc_at[k]] = ("alloc", trace.sizes[k], streams[k], k)
        if trace.free_at[k] is not None:
            events[trace.free_at[k]] = ("free", k)
    return events


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def trie_problem(trie: BranchTrie) -> tuple[PlacementProblem, list[int]]:
    """The trie's placed buffers as one interval placement problem, with each one's buffer."""
    alignment = trie.traces[0].alignment_bytes
    indices = [i for i, ok in enumerate(trie.placed) if ok]
    problem = PlacementProblem.from_intervals(
        [trie.sizes[i] for i in indices], [trie.lifetimes[i] for i in indices], alignment_bytes=alignment
    )
    return problem, indices


def branch_problem(trie: BranchTrie, b: int, offsets: dict[int, int]) -> tuple[PlacementProblem, list[int]]:
    """Branch ``b``'s placed allocations with their lifetimes in that branch alone, and the
    buffer of each: what :func:`validate_branches` checks the joint offsets against."""
    trace = trie.traces[b]
    ks = [k for k in range(trace.num_allocations) if trie.buffer[b][k] in offsets]
    problem = PlacementProblem.from_intervals(
        [trace.sizes[k] for k in ks],
        [(trace.alloc_at[k], trace.free_at[k]) for k in ks],
        alignment_bytes=trace.alignment_bytes,
    )
    return problem, [trie.buffer[b][k] for k in ks]


def validate_branches(trie: BranchTrie, offsets: dict[int, int], solved: Placement) -> int:
    """Raise :class:`memplan.placement.InvalidPlacement` unless, in every branch, no two of its
    allocations live together overlap (the validator run per branch). Returns the largest of
    the branches' lower bounds: a lower bound on any arena that serves every branch."""
    bound = 0
    for b in range(len(trie.traces)):
        problem, buffers = branch_problem(trie, b, offsets)
        validate_placement(problem, replace(solved, offsets_bytes=tuple(offsets[i] for i in buffers)))
        bound = max(bound, problem.lower_bound_bytes)
    return bound


def branched_plan(trie: BranchTrie, offsets: dict[int, int], arena_bytes: int) -> BranchedPlan:
    """What the allocator replays: each branch's offsets (-1: ordinary allocator) and the
    allocations the branches share."""
    plans = []
    for b, trace in enumerate(trie.traces):
        mine = {k: offsets[i] for k, i in enumerate(trie.buffer[b]) if i in offsets}
        plans.append(replay_plan(trace, mine, arena_bytes))
    return BranchedPlan(tuple(plans), trie.shared, arena_bytes)
