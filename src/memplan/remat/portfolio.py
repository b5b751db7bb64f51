"""One call that plans rematerialisation under a budget: :func:`solve_remat`.

The portfolio runs, within one time limit, and keeps the cheapest plan that fits:

1. the **memory floor** (:func:`memplan.remat.problem.memory_floor`): a budget below it has
   no plan, proven, and the answer is "infeasible" at once; then the **drop-cover bound**
   (:func:`memplan.remat.bounds.drop_cover_bound`), the first bound on the compute;
2. every **baseline** of :mod:`memplan.remat.baselines` on the whole graph (Chen's, Griewank's,
   AP, linearized, Chen's drop-cheap, DTR), within a share of the time: plans in seconds, and
   the warm starts of the solvers (:func:`solve_remat_in_order`, stages in the reordered plan's
   order, runs :func:`memplan.remat.baselines.peak_greedy` first);
3. the **stage cuts' relaxation** (:func:`memplan.remat.moccasin.stage_cut_relaxation`: re-run
   flags per node and stage window, the memory at each first run covered by what is re-run
   after it and what those re-runs read before their readers' windows close; its LP, then a
   MILP solved by SCIP), a bound far above the drop cover where re-runs need re-runs; given
   :data:`memplan.remat.moccasin.TIGHT_LP_MIN_SECONDS` or more for it and highspy, the same cuts with
   reader windows go to HiGHS in a child process on the other core, for the rest of the time
   (:class:`memplan.remat.moccasin.CutMilp`: its bound is taken when it ends);
   then the CP model over only the nodes its best solution re-runs
   (:func:`memplan.remat.moccasin.solve_restricted`, widened while no plan fits): a small
   model that finds in a second what the whole one misses for minutes. Before and after
   it, once, where the best plan is within 1% of the bound: the **exact stage cuts**
   (:func:`memplan.remat.stage_bounds.near_proof`: the cuts' MILP one stage, then a few, at a
   time, solved exactly), which prove what the LP leaves open by a few whole re-runs;
4. a **large neighbourhood search** (:mod:`memplan.remat.lns`) from the cheapest plan over
   the whole graph, on graphs whose whole CP model is too big to search well: the CP model
   over a few freed nodes at a time, every other node's runs kept, one neighbourhood per
   worker at once, in the time left;
5. **Moccasin's CP model** (:mod:`memplan.remat.moccasin`) on the whole graph, hinted with the
   best plan so far (after the neighbourhood search, only if it left time: :data:`CP_MIN_SECONDS`).
   Only when the whole model is too big for the time limit is the graph coarsened first, and
   the result says so (``details["nodes_before"]``/``["nodes_after"]``);
6. **Checkmate's MILP** (:mod:`memplan.remat.milp`), warm-started from the best plan, in the
   time the CP model leaves when it has not closed its gap: a share of the time on graphs of
   at most :data:`MILP_NODES` nodes (there the MILP decides over the whole graph, with any
   number of recomputations, and can prove what the CP model cannot); on larger graphs only
   what the CP model leaves unused (its model over a coarsened graph seldom beats the CP
   model over the whole one, measured in ``bench/results/remat_portfolio.md``).

Every candidate is lowered, validated (:func:`memplan.remat.lower.validate_sequence`) and
measured by the one estimator; an invalid one is dropped and noted. The answer has one
status: "optimal" (a formulation proved its optimum and no plan beats it), "feasible" (a plan
within the budget, with its gap to the best bound), "infeasible" (only with a proof: the
memory floor, or Checkmate's MILP on a graph of one node per op) or "unknown" (no plan within
the time limit, and no proof that none exists). The bound starts at the drop-cover bound (the
plain step's cost with ``reorder``: every op runs at least once), so that a baseline's plan
within the gap limit of it ends the search after the baselines of :data:`ALWAYS_RUN`; the CP
model is given it as its objective's floor. It is raised by a solver's bound over the whole
graph, never by one over a coarsened graph; it and the gap speak for the scope named in
``details["scope"]`` (the drop cover's: plans whose first runs keep program order; the CP
model's: those with at most ``runs_per_node`` runs of each node).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from memplan.graph.check import validate_order
from memplan.graph.ir import Graph
from memplan.remat.baselines import BASELINES, ap_kept_greedy, baseline_deadline, peak_greedy
from memplan.remat.bounds import SCOPE as COVER_SCOPE
from memplan.remat.bounds import drop_cover_bound
from memplan.remat.coarsen import SolverGraph, coarsen
from memplan.remat.deadline import Deadline, ticking, within
from memplan.remat.deadline import current as current_deadline
from memplan.remat.highs import highs_available
from memplan.remat.lns import improve
from memplan.remat.lower import InvalidPlan, validate_sequence
from memplan.remat.milp import solve_checkmate
from memplan.remat.moccasin import (
    RUNS_PER_NODE,
    TIGHT_LP_MIN_SECONDS,
    CutMilp,
    build_events,
    node_reads,
    rerun_neighbours,
    solve_moccasin,
    solve_restricted,
    stage_cut_relaxation,
)
from memplan.remat.problem import RematProblem, RematSchedule, default_costs, memory_floor
from memplan.remat.stage_bounds import near_proof
from memplan.remat.stage_order import broken_group, call_groups, early_update_order

WHOLE = 10**9
"""``max_solver_nodes`` that keeps every unit: the whole graph (0-byte ops ride with the op before)."""
MILP_NODES = 200
"""The MILP's solver graph (O(n^2) variables): Checkmate's model on about this many nodes."""
EVENTS_PER_SECOND = 4000
"""Largest CP model (events) per second of time limit that solves on the whole graph; above it
the graph is coarsened until the model fits (measured on the zoo, 2 cores)."""
GAP_LIMIT = 1e-3
"""Stop once the plan is proven within 0.1% of the whole step's compute of the best bound
(``gap_limit`` of :func:`solve_remat`)."""
CP_SHARE = 0.8
"""The CP model's share of the time left on graphs small enough for the MILP to run after it."""
MILP_MIN_SECONDS = 8.0
"""The MILP runs after the CP model only with at least this much time left (it needs seconds to build)."""
MARGIN_SECONDS = 1.0
"""Kept back from each solver's time for building and lowering, so that the whole call ends in time."""
BASELINE_SHARE = 0.25
"""The baselines stop (the rest are skipped) once this share of the time is spent."""
BASELINE_ORDER = (
    "checkpoint-all",
    "ap-kept-greedy",
    "dtr",
    "chen-drop-cheap",
    "dtr-planned",
    "linearized-greedy",
    "ap-greedy",
    "chen-greedy",
    "griewank",
    "linearized-sqrtn",
    "ap-sqrtn",
    "chen-sqrtn",
)
"""The baselines, the most useful first: per-block checkpoints found from the graph
(``ap-kept-greedy``) fit the transformers where nothing else does, in under a second (GPT-2,
12 layers, batch 26: +13.8% where DTR's plan, the only other, is +30%, and left no time for it);
DTR's plan is the cheapest on most of the zoo and takes tenths of a second; once a plan is
proven within the gap limit, those after :data:`ALWAYS_RUN` are skipped. The greedy at the
peak (:func:`memplan.remat.baselines.peak_greedy`) runs only as the ``lead`` of
:func:`solve_remat_in_order`, from the reordered plan."""
LEAD_SHARE = 0.35
"""The share of the time the ``lead`` baseline of :func:`solve_remat` may use (before the others)."""
ALWAYS_RUN = ("checkpoint-all", "dtr", "chen-drop-cheap", "dtr-planned")
"""The baselines that run even once a plan is proven within the gap limit: at most about a
second together, and one of them has the cheapest plan on most of the zoo's budgets."""
COARSE_BASELINES = ("dtr", "dtr-planned")
"""Baselines run again over the MILP's coarsened graph on graphs larger than it (tenths of a
second): deciding over groups of ops can beat deciding per op, and a plan proven within the
gap limit may still cost a little more than theirs (MobileNet-v2 at 2070 MiB: 0.21% over its
472 nodes, DTR's 0.20% over 201)."""
QUICK_BASELINES = ("checkpoint-all", "chen-drop-cheap", "dtr", "linearized-greedy")
"""The baselines that warm-start the CP model over a coarsened graph."""

RELAXATION_SHARE = 0.3
"""The stage cuts' relaxation gets at most this share of the time left after the baselines ..."""
RELAXATION_MAX_SECONDS = 15.0
"""... and at most this long (its bound seldom moves after that) ..."""
RELAXATION_LP_SECONDS = 8.0
"""... but its LP may take this long (or half the time left): it is the first step to a plan on the
layered DAGs, and on the 500-node one it took 3-6 s on 2 loaded cores (given 6 s, at times none)."""
RESTRICTED_SHARE = 0.35
"""Each search of the CP model over the relaxation's nodes gets this share of the time left
(it has no plan to start from: on the 250-node DAG at 0.8 its first one comes after 0.5-4 s)."""
RESTRICTED_MAX_SECONDS = 5.0
"""... and at most this long once a plan over the whole graph is in hand (the 250-node DAG at
0.7: the widened search over 88 nodes finds nothing in 200 s, time the neighbourhood search
turns into plans)."""
RESTRICTED_WIDENINGS = 2
"""How often the relaxation's nodes are widened (their re-runs' inputs) when no plan re-running only them fits ..."""
RESTRICTED_WIDENINGS_BEFORE_LNS = 1
"""... and how often when a plan over the whole graph is in hand and the neighbourhood search
follows, which turns the time into better plans (the 250-node DAG at 0.7: over 52 and 63 nodes
no plan fits, proven in 0.1 s; over 88 the search finds none in 5 s)."""
RESTRICTED_MAX_FRACTION = 0.5
"""The restricted search runs only over at most this fraction of the nodes that may run again:
over more it is hardly smaller than the whole model, which has the stage cuts to guide it (the
100-node DAG at 0.9: 68 of 99 nodes, no plan in 7 s; the whole model: optimal in 0.5 s)."""
RESTRICTED_RUNS = 3
"""Runs per node in the restricted CP model: it is small, and a node near the memory floor may need a third run."""
LNS_MIN_EVENTS = 20_000
"""The neighbourhood search runs on graphs whose whole CP model has at least this many events
(the 250-node DAG: 31k; below, e.g. the 100-node DAG's 5k, the whole model proves optima in seconds)."""
CUT_MILP_MARGIN_SECONDS = 1.0
"""HiGHS's time limit ends this long before the portfolio's margin: the child's start (its
imports, reading the model) is not in HiGHS's clock."""
CP_MIN_SECONDS = 2.0
"""After the neighbourhood search (which has the time left), the whole CP model runs only with
at least this much time left. On the 250-node DAG it never found a better plan after the
search: given the last quarter of 60 s at 0.7 of the peak, nothing, where the search in that
time takes the plan from +23.5% of compute to +22.9%; at 0.8 in 20 s, a search stopped after
5 s without a better plan left the whole model (coarsened to 213 nodes) nothing to find either."""
EARLY_CP_EVENTS = 4000
"""A CP model over the whole graph this small (events, :func:`_events`) is tried right after the
baselines, before the stage cuts' relaxation: it proves in a second what the relaxation's branch
and bound takes seconds over (FCN at 0.8 of its peak, 65 nodes, +22.3% of compute: proven at
6.8 s after the relaxation, 2.2 s by the CP peer)."""
EARLY_CP_MAX_NODES = 200
"""... counted only on graphs of at most this many nodes (the zoo's: 104 nodes, 3885 events) ..."""
EARLY_CP_SHARE = 0.2
"""... with at most this share of the time left ..."""
EARLY_CP_MAX_SECONDS = 6.0
"""... and at most this long; unproven, the portfolio goes on from its plan."""
CUT_SCOPE = "plans whose first runs keep program order (stage cuts, solved as a MILP)"
"""What the stage cuts' relaxation speaks for."""

BELOW_BOUND = (
    "cheaper than the bound of its scope: its lowering runs some op first later than program order, "
    "outside that scope, so it beats every plan of the scope but is not proven optimal"
)
"""The message of a plan whose cost is below the portfolio's bound (status "feasible", gap 0)."""

PLAIN_SCOPE = "every plan (each op runs at least once: the plain step's cost)"
"""The bound every answer starts with: a plan within the gap limit of it needs no solver."""

Progress = Callable[[str], None]


def solve_remat(
    graph: Graph,
    budget_bytes: int,
    time_limit_seconds: float = 60.0,
    *,
    cost: tuple[float, ...] = (),
    workspace: tuple[int, ...] = (),
    workers: int = 2,
    formulations: tuple[str, ...] = ("moccasin", "checkmate"),
    runs_per_node: int = RUNS_PER_NODE,
    gap_limit: float = GAP_LIMIT,
    reorder: bool = False,
    progress: Progress | None = None,
    lead: Callable[[RematProblem], RematSchedule] | None = None,
) -> RematSchedule:
    """The cheapest plan for ``graph`` within ``budget_bytes`` that the portfolio finds in
    ``time_limit_seconds`` (see the module docstring).

    Returns a :class:`RematSchedule` with strategy "portfolio": ``steps`` is the lowered
    sequence the runtime executes (``("run", op)``, ``("free", tensor)``), ``details["rows"]``
    the decisions (Checkmate's ``R`` over ``details["groups"]``, the solver graph's nodes as
    op ids), ``status`` and ``gap`` as above, ``details["attempts"]`` what each part of the
    portfolio found. ``cost``/``workspace``: per op, as in :class:`RematProblem`. ``reorder``:
    the CP model may run an op first later than program order (joint recomputation and
    reordering, see :func:`memplan.remat.moccasin.solve_moccasin`). ``lead``: a baseline run
    before the others, with up to :data:`LEAD_SHARE` of the time (:func:`solve_remat_in_order`:
    :func:`memplan.remat.baselines.peak_greedy`, from the reordered plan).

    ``gap_limit`` (default :data:`GAP_LIMIT`, 0.1%): the stopping rule of MIP solvers. The
    portfolio stops, and calls off the members still to run, as soon as its plan is proven
    within this gap: ``(plan's cost - best bound) / plan's cost``, costs being the whole step's
    compute (so 0.001 = 0.1% of the step). Each CP-SAT search gets it as its
    ``relative_gap_limit``. Such a plan's status is "feasible" with its ``gap``, never
    "optimal"; 0 searches until optimal or out of time. ``details["timeline"]``: each plan
    kept, in order, with the seconds from the call's start at which it was found.
    """
    start = time.perf_counter()
    outer = current_deadline()
    clock = Deadline(start, start + time_limit_seconds if outer is None else min(outer.end, start + time_limit_seconds))
    stage = ["starting"]

    def report(text: str) -> None:
        stage[0] = text
        if progress is not None:
            progress(text)

    problem = RematProblem(
        graph,
        int(budget_bytes),
        cost,
        time_limit_seconds=time_limit_seconds,
        workers=workers,
        max_solver_nodes=WHOLE,
        workspace=workspace,
    )
    floor = memory_floor(problem)
    if problem.budget_bytes < floor.bytes:
        op = graph.ops[floor.op].name
        why = (
            f"no plan within {problem.budget_bytes} B: at op {op!r} at least {floor.bytes} B are resident in any "
            "plan (memory floor: its inputs and outputs, and values nothing can make again)"
        )
        return _no_plan(problem, "infeasible", why, start, {"floor_bytes": floor.bytes})
    run = _Portfolio(problem, start, gap_limit, report, formulations, reorder, clock.end)
    run.lead = lead
    with within(clock), ticking(progress, lambda: stage[0], run.state):
        _solve(run, runs_per_node)
    return run.result(floor.bytes)


def _solve(run: _Portfolio, runs_per_node: int) -> None:
    """The members of the portfolio, in order, until the plan is proven or the time is spent."""
    reorder, formulations = run.reorder, run.formulations
    try:
        if not reorder:
            run.take_bound(drop_cover_bound(run.problem).cost, COVER_SCOPE, run.whole)
        run.baselines()
        if "moccasin" in formulations and not reorder and not run.done() and run.small_cp_model():
            run.moccasin(runs_per_node, seconds=min(EARLY_CP_SHARE * run.left(), EARLY_CP_MAX_SECONDS))
        near_proof(run)  # exact stage cuts, where the plan is near the bound (once)
        if "moccasin" in formulations and not reorder and not run.done():
            run.relaxation(runs_per_node)
        near_proof(run)
        if "moccasin" in formulations and not reorder and not run.done():
            run.neighbourhoods(runs_per_node)
        late = run.left() < MARGIN_SECONDS and run.best is not None  # its model would end past the limit
        if (
            "moccasin" in formulations
            and not run.done()
            and not late
            and not (run.searched and run.left() < CP_MIN_SECONDS)
        ):
            run.moccasin(runs_per_node)
        if "checkmate" in formulations and not run.done() and run.left() >= MILP_MIN_SECONDS:
            run.checkmate()
        run.collect_cut_milp(wait=not run.proven())
    finally:
        run.stop_cut_milp()


class _Portfolio:
    """The state of one :func:`solve_remat` call: the best plan so far and every attempt."""

    def __init__(
        self,
        problem: RematProblem,
        start: float,
        gap_limit: float,
        report: Progress,
        formulations: tuple[str, ...],
        reorder: bool = False,
        end: float | None = None,
    ) -> None:
        self.problem, self.start, self.gap_limit, self.report = problem, start, gap_limit, report
        self.end = start + problem.time_limit_seconds if end is None else end  # a time.perf_counter() value
        self.formulations = formulations
        self.whole = coarsen(problem, WHOLE)
        self._whole_events: int | None = None
        self.best: RematSchedule | None = None
        self.attempts: list[dict[str, object]] = []
        self.bound: float | None = problem.plain_cost  # every op runs at least once
        self.scope = PLAIN_SCOPE
        self.proved_optimal = False
        self.cp_nodes = self.whole.size
        self.sg_of: dict[str, SolverGraph] = {}
        self.lowest: RematSchedule | None = None
        self.reorder = reorder
        self.timeline: list[dict[str, object]] = []
        self.max_nodes_of: dict[tuple[tuple[int, ...], ...], int] = {}  # coarsened graph -> its node limit
        self.best_whole: RematSchedule | None = None  # the cheapest plan over the whole graph: the CP model's hint
        self.cut_bound: float | None = None
        self.relaxed = False  # the stage cuts' relaxation ran: the CP model does not probe them again
        self.cut_reruns: frozenset[int] = frozenset()  # the nodes its best solution re-runs
        self.searched = False  # the neighbourhood search ran (and may have used the time)
        self.cut_milp: CutMilp | None = None  # HiGHS on the stage cuts with reader windows, running
        self.cut_milp_began = 0.0
        self.lead: Callable[[RematProblem], RematSchedule] | None = None  # run first, with LEAD_SHARE of the time

    def left(self) -> float:
        return self.end - time.perf_counter()

    def whole_events(self) -> int:
        """The events of the CP model over the whole graph (computed once: 7 s on 2000 nodes)."""
        if self._whole_events is None:
            self._whole_events = _events(self.whole)
        return self._whole_events

    def small_cp_model(self) -> bool:
        """The CP model over the whole graph has at most :data:`EARLY_CP_EVENTS` events (counted
        only on graphs of at most :data:`EARLY_CP_MAX_NODES` nodes: 0.6 s on a 1616-node GPT-2)."""
        return self.whole.size <= EARLY_CP_MAX_NODES and self.whole_events() <= EARLY_CP_EVENTS

    def state(self) -> tuple[float | None, float | None, float]:
        """(best plan's cost, bound, plain step's cost): what the progress lines show."""
        best = self.best
        return (best.compute_cost if best is not None else None), self.bound, self.problem.plain_cost

    def done(self) -> bool:
        """The best plan is proven optimal or within the gap limit, or no time is left."""
        return self.left() <= 0.05 or self.proven()

    def proven(self) -> bool:
        """The best plan is proven optimal or within the gap limit (with the stage cuts'
        MILP's bound, once it has ended)."""
        self.collect_cut_milp(wait=False)
        if self.best is None:
            return False
        if self.best.compute_cost <= self.best.plain_cost:
            return True  # no recomputation: nothing can be cheaper
        return self.proved_optimal or (self.gap() is not None and self.gap() <= self.gap_limit)  # type: ignore[operator]

    def gap(self) -> float | None:
        if self.best is None or self.bound is None or self.best.compute_cost <= 0:
            return None
        return max(0.0, self.best.compute_cost - self.bound) / self.best.compute_cost

    def offer(self, plan: RematSchedule | None, source: str, sg: SolverGraph, began: float | None = None) -> bool:
        """Keep ``plan`` if it is valid, fits and is cheaper than the best so far, and note in
        the timeline when it was found: ``began`` (the clock when its solver started) plus its
        ``details["found_at"]``, else now."""
        if plan is None or not plan.feasible:
            return False
        try:
            validate_sequence(self.problem.graph, plan.steps)
        except InvalidPlan as err:
            self.attempts.append({"name": source, "status": "invalid", "message": str(err)})
            return False
        if sg.groups == self.whole.groups and (
            self.best_whole is None or plan.compute_cost < self.best_whole.compute_cost
        ):
            self.best_whole = plan
        if self.best is not None and plan.compute_cost >= self.best.compute_cost:
            return False
        plan.details["from"] = source
        self.best = plan
        found_at = plan.details.get("found_at")
        at = began + found_at if began is not None and isinstance(found_at, float | int) else time.perf_counter()
        self.timeline.append({"seconds": round(at - self.start, 3), "cost": plan.compute_cost, "from": source})
        self.sg_of[source] = sg
        return True

    def baselines(self) -> None:
        """Every baseline, the most useful first, until :data:`BASELINE_SHARE` of the time is spent
        and some plan is in hand: on a slow or loaded machine a baseline that fits is not skipped
        for time while the step would otherwise be refused for want of a plan."""
        self.report("baselines")
        if self.lead is not None:
            began = time.perf_counter()
            with within(Deadline(began, min(self.end, began + LEAD_SHARE * self.problem.time_limit_seconds))):
                plan = self.lead(self.problem)
            self.offer(plan, plan.strategy, self.whole)
            self.lowest = _lower_peak(self.lowest, plan)
            self.attempts.append(_attempt(plan.strategy, plan, time.perf_counter() - began, self.whole.size))
        deadline = min(self.start + BASELINE_SHARE * self.problem.time_limit_seconds, self.end)
        for name in BASELINE_ORDER:
            if name not in ALWAYS_RUN and self.proven():
                self.attempts.append({"name": name, "status": "skipped", "message": "a plan is proven within the gap"})
                continue
            if time.perf_counter() > deadline and self.best is not None:
                self.attempts.append({"name": name, "status": "skipped", "message": "the baselines' time is spent"})
                continue
            if self.left() < (MARGIN_SECONDS if self.best is not None else 0.0):
                self.attempts.append({"name": name, "status": "skipped", "message": "the time is spent"})
                continue
            began = time.perf_counter()
            hard = deadline if self.best is not None else self.end
            with within(baseline_deadline(deadline, hard, self.problem.time_limit_seconds)):
                plan = BASELINES[name](self.problem)  # cut, and said so, at its share of the time
            self.offer(plan, name, self.whole)
            self.lowest = _lower_peak(self.lowest, plan)
            self.attempts.append(_attempt(name, plan, time.perf_counter() - began, self.whole.size))
        if self.whole.size > MILP_NODES:
            self.coarse_baselines()

    def coarse_baselines(self) -> None:
        """:data:`COARSE_BASELINES` over the MILP's coarsened graph: deciding over groups of ops
        can beat deciding per op (DTR planned ahead on the 250-node layered DAG at 0.7: +46.0%
        over 200 nodes, +48.6% over the whole graph), and such a plan warm-starts the MILP."""
        problem = self.problem_for_milp(max(0.1, self.left()))
        sg = coarsen(problem, MILP_NODES)
        for name in COARSE_BASELINES:
            began = time.perf_counter()
            end = self.end - MARGIN_SECONDS
            with within(baseline_deadline(end, end, self.problem.time_limit_seconds)):
                plan = BASELINES[name](problem)
            self.offer(plan, f"{name} over {sg.size} nodes", sg)
            self.attempts.append(_attempt(f"{name} over {sg.size} nodes", plan, time.perf_counter() - began, sg.size))

    def relaxation(self, runs_per_node: int) -> None:
        """The stage cuts' relaxation over the whole graph (:func:`stage_cut_relaxation`, a
        MILP), then the CP model over only the nodes it re-runs (:func:`solve_restricted`,
        widened by :func:`rerun_neighbours` while that proves no plan fits).

        The relaxation's bound (plans in program order) is often far above the drop cover
        on graphs whose re-runs need re-runs (a random 250-node DAG at 0.8 of its peak: 9.2%
        of compute, the drop cover 0.9%); the nodes its best solution re-runs are where a
        cheap plan re-runs, and the CP model restricted to them solves in a fraction of a
        second what the whole model does not find in minutes."""
        seconds = min(RELAXATION_SHARE * self.left(), RELAXATION_MAX_SECONDS)
        if seconds < 0.5:
            return
        if seconds >= TIGHT_LP_MIN_SECONDS:
            self.start_cut_milp()
        self.report(f"stage cuts' relaxation on {self.whole.size} nodes ({seconds:.0f} s)")
        enough = None if self.best is None else self.best.compute_cost * (1 - self.gap_limit)
        relaxed = stage_cut_relaxation(
            self.whole,
            self.problem.budget_bytes,
            self.problem.graph.persistent_bytes,
            seconds,
            self.problem.workers,
            enough=enough,
            lp_seconds=min(RELAXATION_LP_SECONDS, 0.5 * self.left()),
        )
        self.relaxed, self.cut_bound, self.cut_reruns = True, relaxed.bound, frozenset(relaxed.rerun)
        self.attempts.append(
            {
                "name": "stage-cut relaxation",
                "nodes": self.whole.size,
                "seconds": round(relaxed.status.seconds, 3),
                "solver_status": relaxed.status.status,
                "bound": relaxed.bound,
                "reruns": len(relaxed.rerun),
            }
        )
        self.take_bound(relaxed.bound, CUT_SCOPE, self.whole)
        nodes = set(relaxed.rerun)
        movable = sum(1 for k in range(self.whole.size) if self.whole.recomputable(k))
        searches = self.best_whole is not None and self.whole_events() >= LNS_MIN_EVENTS
        for _ in range((RESTRICTED_WIDENINGS_BEFORE_LNS if searches else RESTRICTED_WIDENINGS) + 1):
            if self.done() or not nodes or len(nodes) > RESTRICTED_MAX_FRACTION * movable:
                return
            seconds = RESTRICTED_SHARE * self.left()
            if self.best_whole is not None:
                seconds = min(seconds, RESTRICTED_MAX_SECONDS)
            self.report(f"CP model over the {len(nodes)} nodes the relaxation re-runs ({seconds:.0f} s)")
            began = time.perf_counter()
            plan, status, _ = solve_restricted(
                self.problem_for(self.whole),
                self.whole,
                nodes,
                max(runs_per_node, RESTRICTED_RUNS),
                seconds,
                self.gap_limit,
            )
            name = f"cut-guided ({len(nodes)} nodes)"
            attempt = _attempt(name, plan, status.seconds, self.whole.size)
            self.attempts.append({**attempt, "solver_status": status.status})
            self.offer(plan, name, self.whole, began)
            if status.status != "infeasible":
                return
            wider = rerun_neighbours(self.whole, nodes)
            if wider == nodes:
                return
            nodes = wider

    def start_cut_milp(self) -> None:
        """With highspy at hand, HiGHS on the cuts with reader windows (:class:`CutMilp`) in a
        child process for the rest of the time, on the core the relaxation and the searches
        leave idle at times: SCIP's branch and bound in this process gives no bound on that
        model in 20 s on the 250-node DAG, HiGHS proves its optimum in about 21 s. Only where the
        relaxation has :data:`TIGHT_LP_MIN_SECONDS` (a solve of about 35 s or more): in 20 s
        solves it started too (the bound at 0.7 of that DAG's peak: +20.3%, gap 3-5% instead of
        10%, still not within 1%), but it cost MobileNet-v2 at 0.6 a fifth of its solve time
        (3.9 s to 4.8 s; the child's start and the model's export)."""
        seconds = self.left() - MARGIN_SECONDS - CUT_MILP_MARGIN_SECONDS
        if seconds < TIGHT_LP_MIN_SECONDS or self.cut_milp is not None or not highs_available():
            return
        self.report(f"stage cuts' MILP (HiGHS, in the background, {seconds:.0f} s)")
        self.cut_milp_began = time.perf_counter()
        self.cut_milp = CutMilp(self.whole, self.problem.budget_bytes, self.problem.graph.persistent_bytes, seconds)

    def collect_cut_milp(self, wait: bool) -> None:
        """Take the stage cuts' MILP's bound once HiGHS has ended (``wait``: until the time
        limit at most)."""
        if self.cut_milp is None:
            return
        bound = self.cut_milp.finish(max(0.0, self.left())) if wait else self.cut_milp.poll()
        if bound is None and not wait:
            return
        self.attempts.append(
            {
                "name": "stage-cut MILP (HiGHS)",
                "nodes": self.whole.size,
                "seconds": round(time.perf_counter() - self.cut_milp_began, 3),
                "bound": bound,
            }
        )
        self.stop_cut_milp()
        self.take_bound(bound, CUT_SCOPE, self.whole)

    def stop_cut_milp(self) -> None:
        if self.cut_milp is not None:
            self.cut_milp.close()
            self.cut_milp = None

    def neighbourhoods(self, runs_per_node: int) -> None:
        """Large neighbourhood search (:func:`memplan.remat.lns.improve`) from the cheapest plan
        over the whole graph, in the time left, on graphs whose whole CP model has at least
        :data:`LNS_MIN_EVENTS` events (smaller ones the whole model searches better, and proves);
        one neighbourhood per worker at once (:func:`memplan.remat.lns.improve`'s ``threads``)."""
        start = self.best_whole
        if start is None or self.whole_events() < LNS_MIN_EVENTS:
            return
        self.searched = True
        seconds = self.left() - MARGIN_SECONDS
        if seconds < 1.0:
            return
        self.report(f"neighbourhood search on {self.whole.size} nodes ({seconds:.0f} s)")
        found = improve(
            self.problem_for(self.whole),
            self.whole,
            start,
            seconds,
            max(runs_per_node, RESTRICTED_RUNS),
            stop=lambda _: self.proven(),
            on_better=lambda plan: self.offer(plan, "neighbourhood search", self.whole),
            guide=self.cut_reruns,
            threads=self.problem.workers,
        )
        attempt = _attempt("neighbourhood search", found.plan, found.seconds, self.whole.size)
        self.attempts.append({**attempt, "rounds": found.rounds, "improvements": found.improvements})

    def moccasin(self, runs_per_node: int, seconds: float | None = None) -> None:
        """Moccasin's CP model (the whole graph, or coarsened to fit the time left), hinted with
        the best plan so far; ``seconds``: at most this long (an early try on a small model)."""
        sg = self.cp_graph()
        self.cp_nodes = sg.size
        hint, start_rows = self.hint_for(sg)
        milp_after = "checkmate" in self.formulations and self.whole.size <= MILP_NODES
        share = self.left() * (CP_SHARE if milp_after else 1.0) - MARGIN_SECONDS
        if seconds is not None:
            share = min(share, seconds)
        self.report(f"moccasin on {sg.size} nodes ({share:.0f} s)")
        problem = self.problem_for(sg)
        began = time.perf_counter()
        floor = None if self.reorder else self.bound  # the bound speaks for plans in program order
        known = self.relaxed and sg.groups == self.whole.groups
        plan, status, details = solve_moccasin(
            problem,
            sg,
            hint,
            runs_per_node,
            share,
            self.gap_limit,
            self.reorder,
            start_rows,
            floor,
            probe_cuts=not known,
            known_cut_bound=self.cut_bound if known else None,
        )
        self.attempts.append(
            {**_attempt("moccasin", plan, status.seconds, sg.size), "solver_status": status.status, **details}
        )
        self.take_bound(details.get("bound"), str(details["scope"]), sg)
        self.offer(plan, "moccasin", sg, began)
        if status.status == "optimal" and plan is not None and self.best is not None:
            # the best plan costs no more than the proven optimum of the CP model's scope
            self.proved_optimal = self.best.compute_cost <= plan.compute_cost

    def take_bound(self, bound: object, scope: str, sg: SolverGraph) -> None:
        """A solver's bound (the CP model's: its search's or its stage cuts'), when it speaks for
        plans over the whole graph and beats the one so far (at first the plain step's cost);
        a bound over a coarsened graph says nothing about finer plans."""
        if isinstance(bound, float | int) and sg.size == self.whole.size and bound > (self.bound or 0.0):
            self.bound, self.scope = float(bound), scope

    def problem_for_milp(self, seconds: float) -> RematProblem:
        """The problem over the MILP's solver graph (coarsened to :data:`MILP_NODES` nodes)."""
        return RematProblem(
            self.problem.graph,
            self.problem.budget_bytes,
            self.problem.cost,
            time_limit_seconds=seconds,
            workers=self.problem.workers,
            max_solver_nodes=MILP_NODES,
            workspace=self.problem.workspace,
        )

    def checkmate(self) -> None:
        problem = self.problem_for_milp(max(0.1, self.left() - MARGIN_SECONDS))
        sg = coarsen(problem, MILP_NODES)
        warm = self.best if self.best is not None and self._same_graph(sg) else None
        self.report(f"checkmate MILP on {sg.size} nodes ({problem.time_limit_seconds:.0f} s)")
        began = time.perf_counter()
        plan = solve_checkmate(problem, warm, gap_limit=self.gap_limit)
        attempt = _attempt("checkmate", plan, time.perf_counter() - began, sg.size)
        attempt["solver_status"] = plan.details.get("solver_status", plan.status)
        self.attempts.append(attempt)
        kept = self.offer(plan, "checkmate", sg, began)
        if kept and plan.gap is not None:
            scope = "plans in program order (Checkmate's MILP on the whole graph)"
            self.take_bound(plan.compute_cost * (1 - plan.gap), scope, sg)
        if kept and plan.details.get("solver_status") == "optimal" and sg.size == self.whole.size:
            self.proved_optimal = True

    def _same_graph(self, sg: SolverGraph) -> bool:
        source = self.best.details.get("from") if self.best is not None else None
        mine = self.sg_of.get(str(source))
        return mine is not None and mine.groups == sg.groups

    def cp_graph(self) -> SolverGraph:
        """The whole graph, or the finest coarsening whose CP model fits the time left."""
        limit = EVENTS_PER_SECOND * max(1.0, self.left())
        if self.whole_events() <= limit:
            return self.whole
        low, high = 20, self.whole.size
        best = coarsen(self.problem, low)
        while high - low > 8 and self.left() > MARGIN_SECONDS:  # each step coarsens the whole graph again
            mid = (low + high) // 2
            sg = coarsen(self.problem, mid)
            if _events(sg) <= limit:
                low, best = mid, sg
            else:
                high = mid
        self.max_nodes_of[best.groups] = low
        return best

    def problem_for(self, sg: SolverGraph) -> RematProblem:
        """The problem whose solver graph (:func:`memplan.remat.baselines.solver_graph`) is
        ``sg``: coarsened with the node limit ``sg`` was made with (its size may differ by the
        prologue of placeholders)."""
        return RematProblem(
            self.problem.graph,
            self.problem.budget_bytes,
            self.problem.cost,
            time_limit_seconds=self.problem.time_limit_seconds,
            workers=self.problem.workers,
            max_solver_nodes=self.max_nodes_of.get(sg.groups, WHOLE),
            workspace=self.problem.workspace,
        )

    def hint_for(self, sg: SolverGraph) -> tuple[list[list[int]] | None, list[list[int]] | None]:
        """Decisions over ``sg`` to start the CP model from: the best plan's (within the budget)
        and the lowest-peak plan's (for phase 1 when there is no plan yet). Over a coarsened
        graph, the quick baselines' there."""
        if sg.groups == self.whole.groups:
            best = self.best_whole.details["rows"] if self.best_whole is not None else None
            lowest = self.lowest.details.get("rows") if self.lowest is not None else None
            return best, lowest  # type: ignore[return-value]
        problem = self.problem_for(sg)
        plans = [BASELINES[name](problem) for name in QUICK_BASELINES]
        fits = [p for p in plans if p.feasible]
        best = min(fits, key=lambda p: p.compute_cost) if fits else None
        lowest = min((p for p in plans if p.steps), key=lambda p: p.peak_bytes, default=None)
        return (best.details["rows"] if best else None), (lowest.details["rows"] if lowest else None)  # type: ignore[return-value]

    def cp_proves_none(self) -> int | None:
        """``C`` when the CP model over the whole graph proved that no plan with at most ``C``
        runs of each node (in program order) fits: not a proof that no plan fits at all."""
        for attempt in self.attempts:
            if (
                attempt.get("name") == "moccasin"
                and attempt.get("solver_status") == "infeasible"
                and attempt.get("nodes") == self.whole.size
                and not self.reorder
            ):
                return int(attempt["runs_per_node"])  # type: ignore[call-overload]
        return None

    def result(self, floor_bytes: int) -> RematSchedule:
        details: dict[str, object] = {
            "attempts": self.attempts,
            "nodes_before": self.whole.size,
            "nodes_after": self.cp_nodes,
            "coarsened": self.cp_nodes < self.whole.size,
            "ops": len(self.problem.graph.ops),
            "floor_bytes": floor_bytes,
            "scope": self.scope,
            "bound": self.bound,
            "timeline": self.timeline,
        }
        if self.lowest is not None:
            details["lowest_peak_bytes"] = self.lowest.peak_bytes  # a plan that runs, over the budget or not
        if self.best is None:
            proofs = [a for a in self.attempts if a.get("status") == "infeasible"]
            if proofs:
                return _no_plan(self.problem, "infeasible", str(proofs[0]["message"]), self.start, details)
            why = f"no plan within {self.problem.budget_bytes} B found in {self.problem.time_limit_seconds:g} s"
            runs = self.cp_proves_none()
            if runs is not None:
                details["none_with_runs"] = runs
                why += f"; the CP model proved that no plan running each op at most {runs} times fits"
            return _no_plan(self.problem, "unknown", why, self.start, details)
        best = self.best
        gap = self.gap()
        # A plan below the bound is outside its scope (the lowering dropped an unread first run,
        # so the op first runs later than program order): it beats every plan of the scope,
        # which proves nothing about the plans outside it.
        plain = best.compute_cost <= best.plain_cost  # no re-run at all: optimal over every plan
        below = not plain and self.bound is not None and best.compute_cost < self.bound * (1 - 1e-9)
        optimal = plain or (not below and (self.proved_optimal or gap == 0.0))
        plan = RematSchedule(
            "portfolio",
            best.budget_bytes,
            best.steps,
            best.peak_bytes,
            best.compute_cost,
            best.plain_cost,
            "optimal" if optimal else "feasible",
            seconds=time.perf_counter() - self.start,
            gap=0.0 if optimal else gap,
            message=BELOW_BOUND if below else "",
            details={**details, "from": best.details.get("from"), "rows": best.details.get("rows")},
        )
        sg = self.sg_of.get(str(best.details.get("from")))
        if sg is not None:
            plan.details["groups"] = sg.groups
        return plan


def _lower_peak(current: RematSchedule | None, plan: RematSchedule) -> RematSchedule | None:
    """The plan with the lower peak (over budget or not): phase 1's start."""
    if not plan.steps or "rows" not in plan.details:
        return current
    return plan if current is None or plan.peak_bytes < current.peak_bytes else current


def _events(sg: SolverGraph) -> int:
    return build_events(sg, node_reads(sg)).horizon - 1


def _attempt(name: str, plan: RematSchedule | None, seconds: float, nodes: int) -> dict[str, object]:
    out: dict[str, object] = {"name": name, "nodes": nodes, "seconds": round(seconds, 3)}
    if plan is not None:
        out.update(status=plan.status, feasible=plan.feasible, gap=plan.gap, message=plan.message)
        out["overhead"] = round(plan.overhead, 6) if plan.feasible else None
    return out


def _no_plan(problem: RematProblem, status: str, why: str, start: float, details: dict[str, object]) -> RematSchedule:
    return RematSchedule(
        "portfolio",
        problem.budget_bytes,
        [],
        0,
        0.0,
        problem.plain_cost,
        status,
        seconds=time.perf_counter() - start,
        message=why,
        details=details,
    )


def solve_remat_in_order(
    graph: Graph,
    order: Sequence[int] | None,
    budget_bytes: int,
    time_limit_seconds: float = 60.0,
    *,
    cost: tuple[float, ...] = (),
    workspace: tuple[int, ...] = (),
    workers: int = 2,
    reorder: bool = False,
    progress: Progress | None = None,
    groups: Sequence[Sequence[int]] | None = None,
) -> RematSchedule:
    """:func:`solve_remat` with the stages in ``order`` (a topological order of ``graph``'s ops,
    e.g. the reordered plan's, OLLA's lifetime optimisation) instead of program order: the
    first runs keep that order, so checkpoint-all is the reordered plan and every baseline, bound
    and search starts from it (:func:`memplan.remat.baselines.peak_greedy` only has to take the
    reordered peak down to the budget). The plan's steps name ``graph``'s ops (validated on it);
    ``details["stage_order"]`` says which order the stages kept.

    A memory floor is a bound only for the plans whose first runs keep its order: the answer is
    "infeasible" only when the budget is below the floor in ``order`` *and* in program order
    (``details["floor_bytes"]``: the lower of the two); where only ``order``'s floor proves
    nothing fits, the portfolio runs again in program order.

    ``groups``: the runtime's update groups (each run as one call of the user's optimizer;
    None: as the graph shows them, :func:`memplan.remat.stage_order.call_groups`; ``()``: none).
    With groups, the stages may instead keep ``order`` with the updates moved early
    (:func:`memplan.remat.stage_order.early_update_order`), where the greedy at the peak does
    better (:func:`_choose_stage_order`; ``details["stage_order"]`` says :data:`EARLY_UPDATES`);
    a plan there that runs another op inside a group (a re-run before a group's later op) is
    not kept: the portfolio runs again in ``order`` in the time left."""
    start = time.perf_counter()

    def in_program_order() -> RematSchedule:
        return solve_remat(
            graph,
            budget_bytes,
            max(0.1, time_limit_seconds - (time.perf_counter() - start)),  # the time left
            cost=cost,
            workspace=workspace,
            workers=workers,
            reorder=reorder,
            progress=progress,
        )

    if order is None or list(order) == list(range(len(graph.ops))):
        plan = in_program_order()
        plan.details["stage_order"] = "program"
        return plan
    validate_order(graph, order)
    cost = tuple(cost or default_costs(graph))
    given = list(order)
    groups = call_groups(graph) if groups is None else groups
    order, staged, lead, label = _choose_stage_order(
        graph, given, budget_bytes, time_limit_seconds, cost, workspace, workers, groups
    )

    def in_stage_order() -> RematSchedule:
        found = solve_remat(
            staged,
            budget_bytes,
            max(0.1, time_limit_seconds - (time.perf_counter() - start)),
            cost=tuple(cost[v] for v in order),
            workspace=tuple(workspace[v] for v in order) if workspace else (),
            workers=workers,
            reorder=reorder,
            progress=progress,
            lead=lead,
        )
        found.steps = [(kind, int(order[i]) if kind == "run" else i) for kind, i in found.steps]
        return found

    plan = in_stage_order()
    if label == EARLY_UPDATES and plan.steps and broken_group(plan.steps, groups) is not None:
        order, label, lead = given, "reordered", peak_greedy  # rare: a re-run inside an update group
        staged = Graph(tuple(graph.ops[v] for v in order), graph.tensors, graph.name, dict(graph.meta))
        plan = in_stage_order()
    plan.seconds = time.perf_counter() - start
    plan.details["stage_order"] = label
    if "groups" in plan.details:
        plan.details["groups"] = tuple(tuple(int(order[v]) for v in group) for group in plan.details["groups"])  # type: ignore[union-attr]
    if plan.steps:
        validate_sequence(graph, plan.steps)
        return plan
    floor = memory_floor(RematProblem(graph, int(budget_bytes), cost, workspace=workspace)).bytes
    staged_floor = int(plan.details.get("floor_bytes") or floor)  # type: ignore[call-overload]
    plan.details["floor_bytes"] = min(floor, staged_floor)
    if plan.status == "infeasible" and budget_bytes < staged_floor and "lowest_peak_bytes" not in plan.details:
        # proven at once by the floors: the greedies at the floor name a peak a plan reaches (the
        # advice); per-block checkpoints name a far lower one on transformers (GPT-2, 12 layers,
        # batch 30: 7.03 GiB by the greedy at the peak alone, for a floor of 3.37 GiB)
        near = RematProblem(
            staged,
            max(int(budget_bytes), staged_floor),
            tuple(cost[v] for v in order),
            LEAD_SHARE * time_limit_seconds,
            workers,
            WHOLE,
            tuple(workspace[v] for v in order) if workspace else (),
        )
        reached = [p.peak_bytes for p in (peak_greedy(near), ap_kept_greedy(near)) if p.steps]
        if reached:
            plan.details["lowest_peak_bytes"] = min(reached)
    if plan.status == "infeasible" and budget_bytes >= floor:
        again = in_program_order()
        again.details["stage_order"] = "program (no plan keeps the reordered order: its memory floor)"
        lowest = [p.details.get("lowest_peak_bytes") for p in (plan, again)]
        if not again.feasible and any(lowest):
            again.details["lowest_peak_bytes"] = min(int(x) for x in lowest if x)  # type: ignore[call-overload]
        return again
    return plan


EARLY_UPDATES = "reordered, updates moved early"
"""``details["stage_order"]`` of a plan whose stages keep :func:`memplan.remat.stage_order.early_update_order`."""


def _choose_stage_order(
    graph: Graph,
    order: Sequence[int],
    budget_bytes: int,
    time_limit_seconds: float,
    cost: tuple[float, ...],
    workspace: tuple[int, ...],
    workers: int,
    groups: Sequence[Sequence[int]],
) -> tuple[list[int], Graph, Callable[[RematProblem], RematSchedule], str]:
    """The stage order :func:`solve_remat_in_order` keeps: ``order``, or (given the runtime's
    update ``groups``) the same with the updates moved as early as they may run
    (:func:`memplan.remat.stage_order.early_update_order`),
    whichever :func:`memplan.remat.baselines.peak_greedy` does better in (a plan within the
    budget, the cheaper; else the lower peak; ``order`` on a tie), each within half of
    :data:`LEAD_SHARE` of the time. Returns the order, the graph with its ops listed in it, the
    chosen greedy's plan as the portfolio's ``lead`` (not run again) and the order's label.

    Where the reordered plan's peak is in the forward or backward pass the reorderer leaves the
    optimizer's calls after the backward, every gradient held until its update; once remat
    lowers that peak, the update's is the next, and no recomputation lowers it (the Llama of
    ``bench/llama_budget.py`` at batch 2: 1.99 GiB in ``order``, budgets down to 1.72 GiB
    planned with the updates moved early)."""
    candidates = [(list(order), "reordered")]
    early = early_update_order(graph, order, groups)
    if early != list(order):
        candidates.append((early, EARLY_UPDATES))
    best: tuple[tuple[int, float], list[int], Graph, RematSchedule, str] | None = None
    share = LEAD_SHARE * time_limit_seconds / len(candidates)
    for candidate, label in candidates:
        staged = Graph(tuple(graph.ops[v] for v in candidate), graph.tensors, graph.name, dict(graph.meta))
        problem = RematProblem(
            staged,
            int(budget_bytes),
            tuple(cost[v] for v in candidate),
            share,
            workers,
            WHOLE,
            tuple(workspace[v] for v in candidate) if workspace else (),
        )
        began = time.perf_counter()
        with within(Deadline(began, began + share)):
            plan = peak_greedy(problem)
        rank = (0, plan.compute_cost) if plan.feasible else (1, float(plan.peak_bytes if plan.steps else 2**62))
        if best is None or rank < best[0]:
            best = (rank, candidate, staged, plan, label)
    assert best is not None
    _, chosen, staged, plan, label = best
    return chosen, staged, (lambda _problem: plan), label


def moccasin_strategy(problem: RematProblem) -> RematSchedule:
    """Moccasin's CP model alone (after the baselines, its warm starts), as a strategy."""
    plan = solve_remat(
        problem.graph,
        problem.budget_bytes,
        problem.time_limit_seconds,
        cost=problem.cost,
        workspace=problem.workspace,
        workers=problem.workers,
        formulations=("moccasin",),
    )
    plan.strategy = "moccasin"
    return plan


def portfolio_strategy(problem: RematProblem) -> RematSchedule:
    """:func:`solve_remat` as a strategy of :data:`memplan.remat.STRATEGIES`."""
    return solve_remat(
        problem.graph,
        problem.budget_bytes,
        problem.time_limit_seconds,
        cost=problem.cost,
        workspace=problem.workspace,
        workers=problem.workers,
    )


def solve_remat_within_overhead(
    graph: Graph,
    max_overhead: float,
    time_limit_seconds: float = 60.0,
    *,
    probes: int = 8,
    cost: tuple[float, ...] = (),
    workspace: tuple[int, ...] = (),
    workers: int = 2,
    progress: Progress | None = None,
) -> RematSchedule:
    """The plan with the lowest peak whose compute overhead is at most ``max_overhead`` (0.1:
    "at most 10% more compute"), by bisection over the budget between the memory floor and
    the checkpoint-all peak: ``probes`` calls of :func:`solve_remat`, each with an equal share
    of the time. The checkpoint-all plan (overhead 0) is the answer when nothing lower fits."""
    start = time.perf_counter()
    with within(Deadline.after(time_limit_seconds)):
        best = _lowest_within(graph, max_overhead, time_limit_seconds, probes, cost, workspace, workers, progress)
    best.seconds = time.perf_counter() - start
    best.details["max_overhead"] = max_overhead
    return best


def _lowest_within(
    graph: Graph,
    max_overhead: float,
    time_limit_seconds: float,
    probes: int,
    cost: tuple[float, ...],
    workspace: tuple[int, ...],
    workers: int,
    progress: Progress | None,
) -> RematSchedule:
    """:func:`solve_remat_within_overhead`'s bisection (its time limit set around it)."""
    from memplan.remat.baselines import checkpoint_all

    base = RematProblem(graph, 10**18, cost, workers=workers, max_solver_nodes=WHOLE, workspace=workspace)
    best = checkpoint_all(base)
    best.status, best.gap = "optimal", 0.0
    low, high = memory_floor(base).bytes, best.peak_bytes
    seconds = time_limit_seconds / max(1, probes)
    for _ in range(probes):
        if high - low <= max(1, high // 1000):
            break
        budget = (low + high) // 2
        plan = solve_remat(graph, budget, seconds, cost=cost, workspace=workspace, workers=workers, progress=progress)
        if plan.feasible and plan.overhead <= max_overhead + 1e-12:
            best, high = plan, plan.peak_bytes
        else:
            low = budget + 1
    return best
