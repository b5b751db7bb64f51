"""The optional HiGHS backend of Checkmate's MILP (section 4.5), run in a child process.

OR-Tools 9.15 and highspy 1.15 crash when both are loaded in one process, and this process
has OR-Tools. So highspy is never imported here: :func:`milp_from_cp_model` exports the very
model that :mod:`memplan.remat.milp` builds for CP-SAT (same variables, constraints 4.3b-c,
(1)-(6), the budget row and the objective 4.3) as a solver-neutral MILP, and
:func:`solve_milp` solves it in ``python highs_worker.py`` (see
:mod:`memplan.remat.highs_worker`, which imports only the standard library, numpy and
highspy). CP-SAT's enforced bool-and ``Free => l_1 and ... and l_m`` becomes the rows
``Free <= l_j``, i.e. the linear form of Checkmate's (4)-(6) in the posted direction.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from memplan.errors import MemplanError
from memplan.remat.highs_worker import EXIT_NO_HIGHS, MISSING_HIGHS
from memplan.solvers import INT_MAX, INT_MIN, SolveStatus

WORKER = Path(__file__).with_name("highs_worker.py")
GRACE_SECONDS = 60.0
"""Time the child may take beyond the solver's limit (start-up, loading the model)."""


@dataclass
class Milp:
    """``min c.x + offset`` s.t. ``row_lower <= A x <= row_upper``, column bounds, integrality.

    ``rows`` hold ``A`` as sparse rows ``(indices, coefficients)``; ``start`` is a full MIP
    start or None.
    """

    c: np.ndarray
    offset: float
    col_lower: np.ndarray
    col_upper: np.ndarray
    integrality: np.ndarray
    rows: list[tuple[list[int], list[float]]] = field(default_factory=list)
    row_lower: list[float] = field(default_factory=list)
    row_upper: list[float] = field(default_factory=list)
    start: np.ndarray | None = None

    @property
    def num_cols(self) -> int:
        return len(self.c)

    def add_row(self, terms: dict[int, float], lower: float, upper: float) -> None:
        """``lower <= sum terms[j] x_j <= upper`` (zero coefficients dropped)."""
        kept = {j: a for j, a in terms.items() if a}
        self.rows.append((list(kept), list(kept.values())))
        self.row_lower.append(lower)
        self.row_upper.append(upper)

    def evaluate(self, x: np.ndarray) -> float:
        return float(self.c @ x + self.offset)

    def violation(self, x: np.ndarray) -> float:
        """The largest bound or row violation of ``x`` (0 for a feasible point)."""
        worst = max(0.0, float(np.max(self.col_lower - x, initial=0)), float(np.max(x - self.col_upper, initial=0)))
        for (index, value), lo, hi in zip(self.rows, self.row_lower, self.row_upper, strict=True):
            activity = float(np.dot(value, x[index])) if index else 0.0
            worst = max(worst, lo - activity, activity - hi)
        return worst

    def arrays(self, options: dict[str, Any]) -> dict[str, np.ndarray]:
        """The worker's input (:data:`memplan.remat.highs_worker.FIELDS`)."""
        lengths = [len(index) for index, _ in self.rows]
        return {
            "c": self.c,
            "offset": np.array(self.offset),
            "col_lower": self.col_lower,
            "col_upper": self.col_upper,
            "integrality": self.integrality.astype(np.int8),
            "row_start": np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64),
            "row_index": np.array([j for index, _ in self.rows for j in index], dtype=np.int64),
            "row_value": np.array([a for _, value in self.rows for a in value], dtype=np.float64),
            "row_lower": np.array(self.row_lower, dtype=np.float64),
            "row_upper": np.array(self.row_upper, dtype=np.float64),
            "start": self.start if self.start is not None else np.zeros(0),
            "options": np.array(json.dumps(options)),
        }


def highs_available() -> bool:
    """highspy is installed (looked up, never imported: it must not load next to OR-Tools)."""
    return importlib.util.find_spec("highspy") is not None


def require_highs() -> None:
    """Raise the one-line :class:`MemplanError` when highspy is missing."""
    if not highs_available():
        raise MemplanError(MISSING_HIGHS)


def _bound(value: int) -> float:
    return -np.inf if value <= INT_MIN else np.inf if value >= INT_MAX else float(value)


def _literal(ref: int) -> tuple[int, float, float]:
    """A CP-SAT literal as ``coefficient * x_var + constant`` (a negative ref is ``1 - x``)."""
    return (ref, 1.0, 0.0) if ref >= 0 else (-ref - 1, -1.0, 1.0)


def milp_from_cp_model(proto: Any, continuous: Iterable[int] = ()) -> Milp:
    """Export a CP-SAT model of linear constraints and enforced bool-ands (what
    :func:`memplan.remat.milp.build_model` posts) as a :class:`Milp`. Variables in
    ``continuous`` lose integrality (Checkmate's ``U``: equal to an integer expression)."""
    domains = [list(v.domain) for v in proto.variables]
    if any(len(d) != 2 for d in domains):
        raise MemplanError("HiGHS export: only interval domains are supported")
    integrality = np.ones(len(domains), dtype=bool)
    integrality[list(continuous)] = False
    milp = Milp(
        np.zeros(len(domains)),
        0.0,
        np.array([_bound(d[0]) for d in domains]),
        np.array([_bound(d[1]) for d in domains]),
        integrality,
    )
    for constraint in proto.constraints:
        _export_constraint(milp, constraint)
    _export_objective(milp, proto)
    milp.start = _export_hint(proto, len(domains))
    return milp


def _export_constraint(milp: Milp, constraint: Any) -> None:
    enforcement = list(constraint.enforcement_literal)
    if constraint.has_linear():
        if enforcement:
            raise MemplanError("HiGHS export: enforced linear constraints are not supported")
        _export_linear(
            milp, list(constraint.linear.vars), list(constraint.linear.coeffs), list(constraint.linear.domain)
        )
    elif constraint.has_bool_and():
        for lit in constraint.bool_and.literals:
            _export_implication(milp, enforcement, lit)
    elif constraint.has_bool_or() and not enforcement:
        literals = list(constraint.bool_or.literals)
        _export_linear(milp, literals, [1] * len(literals), [1, len(literals)])
    else:
        raise MemplanError(f"HiGHS export: unsupported constraint {str(constraint).split()[0]}")


def _export_linear(milp: Milp, refs: Sequence[int], coeffs: Sequence[int], domain: Sequence[int]) -> None:
    if len(domain) != 2:
        raise MemplanError("HiGHS export: only interval domains are supported")
    terms: dict[int, float] = {}
    shift = 0.0
    for ref, a in zip(refs, coeffs, strict=True):
        var, sign, constant = _literal(ref)
        terms[var] = terms.get(var, 0.0) + a * sign
        shift += a * constant
    milp.add_row(terms, _bound(domain[0]) - shift, _bound(domain[1]) - shift)


def _export_implication(milp: Milp, enforcement: Sequence[int], lit: int) -> None:
    """``and(enforcement) => lit`` as ``sum(enforcement) - lit <= len(enforcement) - 1``."""
    terms: dict[int, float] = {}
    shift = 0.0
    for ref, sign in [*((e, 1.0) for e in enforcement), (lit, -1.0)]:
        var, a, constant = _literal(ref)
        terms[var] = terms.get(var, 0.0) + sign * a
        shift += sign * constant
    milp.add_row(terms, -np.inf, len(enforcement) - 1 - shift)


def _export_objective(milp: Milp, proto: Any) -> None:
    objective = proto.objective
    if proto.has_floating_point_objective() or list(objective.domain) or objective.scaling_factor not in (0, 1):
        raise MemplanError("HiGHS export: only an integer objective to minimise is supported")
    for ref, a in zip(objective.vars, objective.coeffs, strict=True):
        var, sign, constant = _literal(ref)
        milp.c[var] += a * sign
        milp.offset += a * constant
    milp.offset += objective.offset


def _export_hint(proto: Any, num_cols: int) -> np.ndarray | None:
    """CP-SAT's solution hint as a MIP start, if it sets every variable."""
    hint = proto.solution_hint
    if len(set(hint.vars)) != num_cols:
        return None
    start = np.zeros(num_cols)
    start[list(hint.vars)] = list(hint.values)
    return start


def solve_milp(
    milp: Milp, time_limit_seconds: float, *, threads: int = 1, mip_abs_gap: float = 1e-6
) -> tuple[SolveStatus, np.ndarray | None]:
    """Solve ``milp`` with HiGHS in a child process; the status (as CP-SAT's) and ``x``."""
    with MilpInBackground(milp, time_limit_seconds, threads=threads, mip_abs_gap=mip_abs_gap) as child:
        return child.finish(time_limit_seconds + GRACE_SECONDS, strict=True)


class MilpInBackground:
    """:func:`solve_milp` started in a child process that runs while this one goes on (one
    core each: HiGHS's branch and bound is mostly serial). :meth:`poll` answers without
    waiting, :meth:`finish` waits; leaving the ``with`` block kills a child still running.
    Out of time before a solution, the status is "unknown" and ``bound`` is HiGHS's bound.
    ``nice``: the child lowers its priority by this much (Linux), to use what this process
    leaves idle."""

    def __init__(
        self, milp: Milp, time_limit_seconds: float, *, threads: int = 1, mip_abs_gap: float = 1e-6, nice: int = 0
    ) -> None:
        require_highs()
        options = {"time_limit": time_limit_seconds, "threads": threads, "mip_rel_gap": 0.0, "mip_abs_gap": mip_abs_gap}
        options["nice"] = nice
        self._tmp = tempfile.TemporaryDirectory(prefix="memplan-highs-")
        folder = Path(self._tmp.name)
        self._src, self._dst = folder / "milp.npz", folder / "solution.npz"
        np.savez(self._src, **milp.arrays(options))
        self._stderr = (folder / "stderr.txt").open("w+")
        command = [sys.executable, str(WORKER), str(self._src), str(self._dst)]
        self._process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self._stderr, text=True)
        self._answer: tuple[SolveStatus, np.ndarray | None] | None = None
        self._strict = False

    def __enter__(self) -> MilpInBackground:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def poll(self) -> tuple[SolveStatus, np.ndarray | None] | None:
        """The answer once the child has ended, else None (never waits)."""
        if self._answer is None and self._process.poll() is not None:
            self._answer = self._read()
        return self._answer

    def finish(self, wait_seconds: float, strict: bool = False) -> tuple[SolveStatus, np.ndarray | None]:
        """The answer, waiting up to ``wait_seconds`` (then the child is killed: "unknown").
        ``strict``: a failed worker (or one without highspy) raises its one-line
        :class:`MemplanError`; else, as with :meth:`poll`, its answer is "unknown"."""
        self._strict = strict
        try:
            self._process.wait(timeout=max(0.0, wait_seconds))
        except subprocess.TimeoutExpired:
            self.close()
            return SolveStatus("unknown", None, None, None, wait_seconds), None
        answer = self.poll()
        assert answer is not None
        return answer

    def close(self) -> None:
        """Kill the child if it still runs; remove its files."""
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._stderr.close()
        self._tmp.cleanup()

    def _read(self) -> tuple[SolveStatus, np.ndarray | None]:
        code = self._process.returncode
        if code == EXIT_NO_HIGHS and self._strict:
            raise MemplanError(MISSING_HIGHS)
        if code != 0:
            self._stderr.seek(0)
            last = (self._stderr.read().strip().splitlines() or [f"exit status {code}"])[-1]
            if self._strict:
                raise MemplanError(f"HiGHS worker failed: {last}")
            return SolveStatus("unknown", None, None, None, 0.0), None
        with np.load(self._dst, allow_pickle=False) as out:
            meta, x = json.loads(str(out["meta"])), out["x"]
        status = SolveStatus(meta["status"], meta["objective"], meta["bound"], meta["gap"], meta["seconds"])
        return status, (x if len(x) else None)


def solve_highs(
    model: Any, time_limit_seconds: float, *, continuous: Iterable[int] = (), threads: int = 1
) -> tuple[SolveStatus, np.ndarray | None]:
    """Export the CP-SAT ``model`` (:func:`milp_from_cp_model`) and solve it with HiGHS.

    With integer coefficients on integer variables only, an absolute gap below 1 already
    proves optimality (Checkmate's objective 4.3 after :mod:`memplan.remat.milp`'s scaling).
    """
    milp = milp_from_cp_model(model.proto, continuous)
    integral = bool(np.all(milp.c == np.round(milp.c)) and np.all(milp.integrality[milp.c != 0]))
    return solve_milp(milp, time_limit_seconds, threads=threads, mip_abs_gap=0.999 if integral else 1e-6)


__all__ = [
    "MISSING_HIGHS",
    "Milp",
    "MilpInBackground",
    "highs_available",
    "milp_from_cp_model",
    "require_highs",
    "solve_highs",
    "solve_milp",
]
