"""Solve one solver-neutral MILP with HiGHS, in a process of its own.

OR-Tools 9.15 and highspy 1.15 crash when both are loaded in one process, and memplan
imports OR-Tools almost everywhere. So Checkmate's MILP (section 4.5) is exported by
:mod:`memplan.remat.highs` and solved here, in a child started as
``python path/to/highs_worker.py IN.npz OUT.npz`` (by file path: ``memplan/__init__`` is never
imported). This file imports only the standard library and numpy at module level, and
highspy inside :func:`main`; the parent imports it only for the constants below.

The input (``IN.npz``, see :data:`FIELDS`): ``min c.x + offset`` subject to
``row_lower <= A x <= row_upper`` (``A`` in CSR: ``row_start``, ``row_index``, ``row_value``),
``col_lower <= x <= col_upper``, ``x_j`` integer where ``integrality[j]``, an optional
``start`` (a full MIP start, empty for none) and ``options`` (JSON: ``time_limit``,
``threads``, ``mip_rel_gap``, ``mip_abs_gap``, ``nice``: how much to lower the worker's
priority). The output (``OUT.npz``): ``x`` (empty
without a solution) and ``meta`` (JSON: ``status`` optimal/feasible/infeasible/unknown,
``objective``, ``bound``, ``gap``, ``seconds``, ``highs_status``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

MISSING_HIGHS = "HiGHS is optional: pip install highspy"
EXIT_NO_HIGHS = 3
"""Exit status of the worker when highspy cannot be imported (it prints :data:`MISSING_HIGHS`)."""

FIELDS = (
    "c",
    "offset",
    "col_lower",
    "col_upper",
    "integrality",
    "row_start",
    "row_index",
    "row_value",
    "row_lower",
    "row_upper",
    "start",
    "options",
)


def load(path: str | Path) -> dict[str, Any]:
    """The MILP arrays of ``path`` (no pickles) and its options as a dict."""
    with np.load(path, allow_pickle=False) as data:
        milp = {name: data[name] for name in FIELDS}
    milp["options"] = json.loads(str(milp["options"]))
    return milp


def build_lp(highspy: Any, milp: dict[str, Any]) -> Any:
    """A ``highspy.HighsLp`` (row-wise matrix) of the MILP."""
    lp = highspy.HighsLp()
    lp.num_col_ = len(milp["c"])
    lp.num_row_ = len(milp["row_lower"])
    lp.col_cost_ = milp["c"].astype(np.float64)
    lp.offset_ = float(milp["offset"])
    lp.col_lower_ = milp["col_lower"].astype(np.float64)
    lp.col_upper_ = milp["col_upper"].astype(np.float64)
    lp.row_lower_ = milp["row_lower"].astype(np.float64)
    lp.row_upper_ = milp["row_upper"].astype(np.float64)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_ = lp.num_col_
    lp.a_matrix_.num_row_ = lp.num_row_
    lp.a_matrix_.start_ = milp["row_start"].astype(np.int32)
    lp.a_matrix_.index_ = milp["row_index"].astype(np.int32)
    lp.a_matrix_.value_ = milp["row_value"].astype(np.float64)
    kinds = (highspy.HighsVarType.kContinuous, highspy.HighsVarType.kInteger)
    lp.integrality_ = [kinds[int(flag)] for flag in milp["integrality"]]
    return lp


def configure(highs: Any, options: dict[str, Any]) -> None:
    """Quiet, deterministic, and exact unless the parent asks for a gap."""
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("random_seed", 0)
    highs.setOptionValue("time_limit", max(0.01, float(options.get("time_limit", 60.0))))
    highs.setOptionValue("threads", max(1, int(options.get("threads", 1))))
    highs.setOptionValue("mip_rel_gap", float(options.get("mip_rel_gap", 0.0)))
    highs.setOptionValue("mip_abs_gap", float(options.get("mip_abs_gap", 1e-6)))
    if int(options.get("nice", 0)) > 0 and hasattr(os, "nice"):
        os.nice(int(options["nice"]))  # yield the cores to the parent's own search


def warm_start(highspy: Any, highs: Any, start: np.ndarray) -> None:
    """Hand HiGHS a full MIP start (it checks feasibility itself and ignores a bad one)."""
    if len(start) == 0:
        return
    solution = highspy.HighsSolution()
    solution.col_value = [float(v) for v in start]
    solution.value_valid = True
    highs.setSolution(solution)


def solve(highspy: Any, milp: dict[str, Any]) -> tuple[dict[str, Any], np.ndarray]:
    """Run HiGHS; the neutral status (section-4.5 objective, best bound, gap) and ``x``."""
    highs = highspy.Highs()
    configure(highs, milp["options"])
    highs.passModel(build_lp(highspy, milp))
    warm_start(highspy, highs, milp["start"])
    began = time.perf_counter()
    highs.run()
    seconds = time.perf_counter() - began
    model_status = highs.getModelStatus()
    info = highs.getInfo()
    has_solution = info.primal_solution_status == 2 or model_status == highspy.HighsModelStatus.kModelEmpty
    x = np.asarray(highs.getSolution().col_value, dtype=np.float64) if has_solution else np.zeros(0)
    status = neutral_status(highspy, model_status, has_solution)
    objective = bound = gap = None
    if status in ("optimal", "feasible"):
        objective = float(info.objective_function_value)
        bound = objective if status == "optimal" else float(info.mip_dual_bound)
        gap = 0.0 if status == "optimal" else relative_gap(objective, bound)
    elif status == "unknown" and math.isfinite(info.mip_dual_bound):
        bound = float(info.mip_dual_bound)  # out of time before a solution: the bound still holds
    meta = {
        "status": status,
        "objective": objective,
        "bound": bound,
        "gap": gap,
        "seconds": seconds,
        "highs_status": highs.modelStatusToString(model_status),
    }
    return meta, x


def neutral_status(highspy: Any, model_status: Any, has_solution: bool) -> str:
    """HiGHS's model status as memplan's: optimal, feasible (a solution, no proof), infeasible, unknown."""
    kinds = highspy.HighsModelStatus
    if model_status in (kinds.kOptimal, kinds.kModelEmpty):
        return "optimal"
    if model_status == kinds.kInfeasible:
        return "infeasible"
    return "feasible" if has_solution else "unknown"


def relative_gap(objective: float, bound: float) -> float:
    """``(objective - bound) / |objective|``, as :func:`memplan.solvers.solve_cp_sat` reports it."""
    if objective == 0:
        return 0.0
    return max(0.0, (objective - bound) / abs(objective))


def main(argv: list[str]) -> int:
    """``highs_worker.py IN.npz OUT.npz``; exit :data:`EXIT_NO_HIGHS` without highspy."""
    if len(argv) != 3:
        print("usage: highs_worker.py IN.npz OUT.npz", file=sys.stderr)
        return 2
    try:
        import highspy
    except ImportError:
        print(MISSING_HIGHS, file=sys.stderr)
        return EXIT_NO_HIGHS
    meta, x = solve(highspy, load(argv[1]))
    np.savez(argv[2], x=x, meta=np.array(json.dumps(meta)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
