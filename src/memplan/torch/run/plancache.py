"""A plan cache on disk: a restarted process (the next job, a rerun) skips the solvers.

An entry is keyed by a hash of what decides the plan, so a key can only be found again by a
step that would be planned alike:

* the captured step: the graph memplan plans (ops, tensors, sizes, lifetimes' order), the fx
  program the runtime runs (its code, every value's shape, stride, dtype and device), each op's
  phase and call region, the batch's structure and fixed leaves, the optimizer state eager's
  step leaves (what the self-check holds the first step to);
* the options that change a plan: allocator, reorder, time limit, executor, copies recomputed,
  alignment, device;
* the code: memplan's version and a digest of its sources, torch's and Python's versions.

An entry holds the graph plan (the order and, with arena views, the offsets: OLLA eq. 1-8's
solution) and, once the planned CPU allocator placed a recorded step, its traces and their
offsets (Sekiyama et al. 3's profile-guided placement). Nothing is trusted on load: the order
is validated against this step's graph, the offsets by the placement validators (OLLA eq. 6,
per branch), and a replayed step is still checked allocation by allocation by the planned
allocator (size, stream, and every planned free done before an offset is reused), so a trace
that does not match what this step allocates sends the rest of the step to the ordinary
allocator (correct, only not planned) and is recorded and placed again.

A file that cannot be read, is not JSON, or is another format or key is ignored with one
warning and rewritten; every write is atomic (a temporary file renamed over the entry).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from memplan.errors import MemplanError
from memplan.graph.io import graph_to_dict
from memplan.pipeline import MemoryPlan
from memplan.placement import InvalidPlacement
from memplan.torch.run.allocator import AllocationTrace

FORMAT = "memplan-plan-cache"
VERSION = 1
ENV_DIR = "MEMPLAN_CACHE_DIR"
DEFAULT_PLAN_CACHE = False  # off unless asked for (plan_cache=True or a folder): see docs in api.compile


class PlanCacheWarning(UserWarning):
    """A cache entry was ignored (unreadable, corrupt, foreign or stale) or could not be written."""


def cache_dir(setting: bool | str | os.PathLike | None) -> Path | None:
    """The folder of ``plan_cache=setting``: None when off; for True ``plans`` in
    ``$MEMPLAN_CACHE_DIR``, else in ``$XDG_CACHE_HOME/memplan`` or ``~/.cache/memplan`` (where
    memplan's C kernels are cached too; as torch.compile's caches)."""
    if setting is None:
        setting = DEFAULT_PLAN_CACHE
    if setting is False:
        return None
    if setting is True:
        from memplan.compiled import cache_dir as kernels_dir  # the same root as the C kernels' cache

        return kernels_dir() / "plans"
    if isinstance(setting, (str, os.PathLike)):
        return Path(setting)
    raise MemplanError(f"plan_cache must be True, False or a folder, not {type(setting).__name__}")


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """memplan's version and sources, torch's and Python's versions: a plan made by other
    code is another plan."""
    import memplan

    root = Path(memplan.__file__).parent
    digest = hashlib.sha256(f"{memplan.__version__}|{torch.__version__}|{sys.version}".encode())
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".h", ".c", ".cpp") and path.is_file():
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _value_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("t", tuple(value.shape), tuple(value.stride()), str(value.dtype), str(value.device))
    if isinstance(value, (list, tuple)):
        return [_value_meta(v) for v in value]
    return type(value).__name__ if value is not None else None


def graph_fingerprint(capture: Any) -> str:
    """A hash of the captured step (:class:`memplan.torch.capture.Capture`): everything the
    plan and the runtime's program are made from."""
    digest = hashlib.sha256()
    graph = graph_to_dict(capture.graph)
    graph["meta"] = {k: v for k, v in graph.get("meta", {}).items() if not k.endswith("seconds")}  # timings
    digest.update(json.dumps(graph, sort_keys=True, default=str).encode())
    digest.update(capture.gm.code.encode())
    for node in capture.gm.graph.nodes:
        digest.update(repr((node.name, node.op, str(node.target), _value_meta(node.meta.get("val")))).encode())
    parts = (
        capture.mode,
        capture.op_phase,
        capture.node_of_op,
        capture.op_region,
        [(r.kind, r.method) for r in capture.regions],
        sorted(capture.grad_storage_by_param),
        str(capture.batch_spec),
        sorted((k, repr(v)) for k, v in capture.batch_constants.items()),
        repr(capture.mask_guards),
        capture.recomputed,
        sorted((k, repr(v)) for k, v in capture.optimizer_state_meta.items()),
        capture.optimizer_scalar_stand_ins,
        [type(o).__name__ for o in capture.optimizers],
        capture.scaler is not None,
    )
    digest.update(repr(parts).encode())
    return digest.hexdigest()


def plan_key(capture: Any, options: dict[str, Any]) -> str:
    """The entry's key: the captured step, the options that change the plan, and the code."""
    text = json.dumps({"graph": graph_fingerprint(capture), "options": options, "code": code_digest()}, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def steady_key(parts: Any) -> str:
    """The key of a steady-state record (:mod:`memplan.torch.capture.steady`, kept in the
    cache's ``steady`` folder): what is known of the step before capture, and the code."""
    text = json.dumps({"step": parts, "code": code_digest()}, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:40]


@dataclass(frozen=True)
class CachedReplay:
    """A placed recording (one trace per branch) and its offsets, buffer index -> offset."""

    traces: tuple[AllocationTrace, ...]
    offsets: dict[int, int]
    arena_bytes: int
    seconds: float  # what placing it cost when it was solved
    observed: int | None = None  # the branch of the observed first step


class PlanCache:
    """The entries in one folder, one JSON file per key."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.hits = 0
        self.misses = 0

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def load(self, key: str) -> dict[str, Any] | None:
        """The entry of ``key``, or None (no entry; an unusable one is ignored with a warning)."""
        path = self.path(key)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as error:
            return self._ignored(path, f"cannot be read ({error.strerror})")
        try:
            entry = json.loads(text)
        except ValueError:
            return self._ignored(path, "is not JSON (a partial or corrupt file)")
        if not isinstance(entry, dict) or entry.get("format") != FORMAT or entry.get("version") != VERSION:
            return self._ignored(path, "is not a memplan plan-cache entry of this version")
        if entry.get("key") != key:
            return self._ignored(path, "belongs to another key")
        return entry

    def store(self, key: str, entry: dict[str, Any]) -> None:
        """Write ``entry`` atomically (a temporary file renamed over the old one); a failure is
        a warning, never an error: training goes on without the cache."""
        entry = {"format": FORMAT, "version": VERSION, "key": key, **entry}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=self.directory)
            try:
                with os.fdopen(fd, "w") as out:
                    json.dump(entry, out, separators=(",", ":"))
                os.replace(tmp, self.path(key))
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except (OSError, TypeError, ValueError) as error:
            message = f"memplan: plan cache entry {self.path(key)} not written ({error})"
            warnings.warn(message, PlanCacheWarning, stacklevel=3)

    def _ignored(self, path: Path, why: str) -> None:
        message = f"memplan: plan cache entry {path} {why}: ignored, it will be rewritten"
        warnings.warn(message, PlanCacheWarning, stacklevel=3)
        return None


def plan_to_json(plan: MemoryPlan) -> dict[str, Any]:
    """The graph plan as JSON (offsets' keys as strings; the report through ``default=str``)."""
    report = json.loads(json.dumps(plan.report, default=str))
    return {
        "order": [int(v) for v in plan.order],
        "offsets": {str(t): int(o) for t, o in plan.offsets.items()},
        "arena_bytes": int(plan.arena_bytes),
        "report": report,
    }


def plan_from_json(data: Any) -> MemoryPlan:
    """The inverse of :func:`plan_to_json`; raises ValueError (or KeyError, TypeError) on a
    malformed entry. Validated by the caller against this step's graph."""
    order = [int(v) for v in data["order"]]
    offsets = {int(t): int(o) for t, o in data["offsets"].items()}
    report = dict(data["report"])
    return MemoryPlan(order, offsets, int(data["arena_bytes"]), report)


def replay_to_json(
    traces: Any, offsets: dict[int, int], arena_bytes: int, seconds: float, observed: int | None = None
) -> dict[str, Any]:
    return {
        "observed": observed,
        "traces": [
            {
                "sizes": list(t.sizes),
                "alloc_at": list(t.alloc_at),
                "free_at": [-1 if f is None else f for f in t.free_at],
                "streams": list(t.streams),
                "alignment_bytes": t.alignment_bytes,
            }
            for t in traces
        ],
        "offsets": [[int(i), int(o)] for i, o in sorted(offsets.items())],
        "arena_bytes": int(arena_bytes),
        "seconds": float(seconds),
    }


def replay_from_json(data: Any) -> CachedReplay:
    """The inverse of :func:`replay_to_json`; raises on a malformed entry (validated by the caller)."""
    traces = tuple(
        AllocationTrace(
            tuple(int(v) for v in t["sizes"]),
            tuple(int(v) for v in t["alloc_at"]),
            tuple(None if int(f) < 0 else int(f) for f in t["free_at"]),
            tuple(int(v) for v in t["streams"]),
            int(t["alignment_bytes"]),
        )
        for t in data["traces"]
    )
    if not traces or any(len({len(t.sizes), len(t.alloc_at), len(t.free_at)}) != 1 for t in traces):
        raise ValueError("malformed traces")
    offsets = {int(i): int(o) for i, o in data["offsets"]}
    observed = data.get("observed")
    observed = None if observed is None else int(observed)
    return CachedReplay(traces, offsets, int(data["arena_bytes"]), float(data["seconds"]), observed)


def validated_plan(capture: Any, plan: MemoryPlan, groups: Any, exclude: Any, alignment_bytes: int) -> MemoryPlan:
    """``plan`` if it is a valid plan of this step's graph, as :func:`memplan.pipeline.make_plan`
    checks its own: a topological order with each update group contiguous, and offsets for
    exactly the planned tensors that no two tensors live together overlap in (OLLA eq. 6);
    raises otherwise."""
    from memplan.graph.check import validate_order
    from memplan.pipeline import _check_no_overlap, make_groups_contiguous
    from memplan.placement import Placement, problem_from_graph, validate_placement

    graph = capture.graph
    validate_order(graph, plan.order)
    if make_groups_contiguous(plan.order, groups) != list(plan.order):
        raise ValueError("an update group is not contiguous in the cached order")
    problem = problem_from_graph(graph, plan.order, alignment=alignment_bytes, exclude=exclude)
    index = graph.tensor_index
    tensors = [index[name] for name in problem.names]
    if sorted(tensors) != sorted(plan.offsets):
        raise ValueError("the cached offsets are for other tensors")
    offsets = tuple(plan.offsets[t] for t in tensors)
    validate_placement(problem, Placement(offsets, plan.arena_bytes, "cached", "feasible", 0.0, 0.0, 0))
    _check_no_overlap(graph, plan.order, plan.offsets)
    return plan


UNUSABLE = (ValueError, KeyError, TypeError, IndexError, AssertionError, MemplanError)


class StepCache:
    """The plan cache as a compiled step uses it: the graph plan on capture, the placed
    recording once the planned allocator placed one."""

    def __init__(self, cache: PlanCache) -> None:
        self.cache = cache
        self.records = PlanCache(cache.directory / "steady")  # capture's records (see steady_record)
        # per key: the plan's JSON text (rewritten with each placement) and, until a runner takes
        # it, the entry's placed recording (not kept: a large step's traces are megabytes)
        self._plan_text: dict[str, str] = {}
        self._replay_data: dict[str, Any] = {}

    def plan(self, capture: Any, options: dict[str, Any], make: Any, groups: Any, exclude: Any, alignment: int):
        """The cached plan of this step when there is a valid one (else ``make()``'s, stored);
        ``plan.report["first_steps"]`` says which, and the report's ``plan_cache`` the key."""
        start = time.perf_counter()
        key = plan_key(capture, {**options, "alignment_bytes": alignment})
        entry = self.cache.load(key) or {}
        plan = None
        if "plan" in entry:
            try:
                plan = validated_plan(capture, plan_from_json(entry["plan"]), groups, exclude, alignment)
            except UNUSABLE as error:
                self.cache._ignored(self.cache.path(key), f"does not fit this step ({type(error).__name__}: {error})")
                entry = {}
        source = "cached"
        if plan is None:
            source, plan = "planned", make()
            entry = {"plan": plan_to_json(plan)}
            self.cache.store(key, entry)
            self.cache.misses += 1
        else:
            self.cache.hits += 1
        self._plan_text[key] = json.dumps(entry["plan"], separators=(",", ":"))
        self._replay_data[key] = entry.get("replay")
        seconds = round(time.perf_counter() - start, 3)  # solving and storing, or reading and validating
        info = {"key": key, "folder": str(self.cache.directory), "plan": source, "seconds": seconds, "id": id(plan)}
        info["fake_runs"] = capture.fake_runs  # 1: traced once (a restart's record, or another shape's capture)
        plan.report["plan_cache"] = info
        return plan

    def steady_record(self, parts: Any) -> Any:
        """The record of a full capture's untraced run for a step known by ``parts``
        (:func:`memplan.torch.capture.steady.record_key_parts`), or None."""
        from memplan.torch.capture.steady import SteadyRecord

        key = steady_key(parts)
        entry = self.records.load(key)
        if entry is None:
            return None
        try:
            return SteadyRecord.from_json(entry["steady"])
        except UNUSABLE as error:
            self.records._ignored(self.records.path(key), f"holds a malformed record ({type(error).__name__})")
            return None

    def keep_steady_record(self, parts: Any, record: Any) -> None:
        """Store ``record`` for the step known by ``parts`` (a restarted process traces it once)."""
        self.records.store(steady_key(parts), {"steady": record.to_json()})

    def fingerprint(self, capture: Any) -> str:
        """:func:`graph_fingerprint`: what a record's capture must give again."""
        return graph_fingerprint(capture)

    def attach(self, runner: Any, plan: MemoryPlan) -> None:
        """Give ``runner`` (a :class:`memplan.torch.run.replay.ReplayedStep` of ``plan``) the
        entry's placed recording if there is a valid one, and store the ones it places."""
        key = _own_key(plan)
        if key is None:  # a plan reused from another shape's (run/shapes.py): not this entry's
            return
        cached = self.replay(key)
        if cached is not None:
            try:
                runner.preload(cached.traces, cached.offsets, cached.arena_bytes, cached.observed)
            except (*UNUSABLE, InvalidPlacement) as error:
                self.cache._ignored(self.cache.path(key), f"holds an invalid placement ({type(error).__name__})")

        def placed(step: Any, offsets: dict[int, int]) -> None:
            seconds, observed = step.placement.seconds, step.observed_branch
            self.store_replay(key, step.traces, offsets, step.plan.arena_bytes, seconds, observed)

        runner.on_placed = placed

    def replay(self, key: str) -> CachedReplay | None:
        """The placed recording of ``key``'s entry, if it has a readable one."""
        data = self._replay_data.pop(key, None)
        if data is None:
            return None
        try:
            return replay_from_json(data)
        except UNUSABLE as error:
            self.cache._ignored(self.cache.path(key), f"holds a malformed placement ({type(error).__name__})")
            return None

    def store_replay(
        self, key: str, traces: Any, offsets: dict[int, int], arena_bytes: int, seconds: float, observed: int | None
    ) -> None:
        if key not in self._plan_text:
            return
        replay = replay_to_json(traces, offsets, arena_bytes, seconds, observed)
        self.cache.store(key, {"plan": json.loads(self._plan_text[key]), "replay": replay})


def open_plan_cache(setting: bool | str | os.PathLike | None) -> StepCache | None:
    """The cache of ``plan_cache=setting`` (see :func:`cache_dir`), None when off."""
    directory = cache_dir(setting)
    return None if directory is None else StepCache(PlanCache(directory))


def _own_key(plan: MemoryPlan) -> str | None:
    """The cache key of a plan this process looked up for its own capture (None for a copy)."""
    info = plan.report.get("plan_cache")
    return info["key"] if isinstance(info, dict) and info.get("id") == id(plan) else None


def account_first_steps(runner: Any, plan: MemoryPlan, seconds: float, capture_seconds: float) -> None:
    """``plan.report["first_steps"]``: which plan this step shape uses (``cached``: from the
    plan cache; ``planned``: solved now; ``reused``: another shape's, run/shapes.py), what
    capture and planning cost, and, filled in as the steps run, the recorded step's placement
    (``cached`` or ``solved``, ``placing_seconds``) and ``visits_before_replay``: the steps run
    before the first one served from the placed plan throughout (0 with arena views: the plan
    runs from the first step); with the cache, ``fake_runs``: the capture's runs of the step on
    fakes (1 where a restart's record stood for the untraced one, :mod:`memplan.torch.capture.steady`)."""
    if _own_key(plan) is not None:
        source = plan.report["plan_cache"]["plan"]
        extra = {"plan_seconds": plan.report["plan_cache"]["seconds"]}
        extra["fake_runs"] = plan.report["plan_cache"].get("fake_runs")
    else:
        plan.report.pop("plan_cache", None)
        source = "reused" if plan.report.get("placement", {}).get("method") == "reused" else "planned"
        extra = {}
    first = {"plan": source, "capture_seconds": round(capture_seconds, 3), "planning_seconds": round(seconds, 3)}
    first |= extra
    own = getattr(runner, "first_steps", None)
    if isinstance(own, dict):  # a replayed step: it fills in the rest as it runs
        first.update(own)
        runner.first_steps = first
    else:
        first["visits_before_replay"] = 0
    plan.report["first_steps"] = first
