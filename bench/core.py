"""Speed of the framework-free core on large random graphs (no torch).

python bench/core.py          # writes bench/results/core.md
"""

from __future__ import annotations

import time
from pathlib import Path

from memplan.graph.analysis import Reachability, alap_levels, asap_levels, peak_lower_bound
from memplan.graph.generate import random_dag
from memplan.graph.liveness import peak_bytes


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def row(num_ops: int) -> str:
    g = random_dag(1, num_ops, max_inputs=2)
    reach = Reachability.of(g)
    queries = seconds(lambda: [reach.is_ancestor(i, (i * 7919) % num_ops) for i in range(num_ops)])
    return (
        f"| {num_ops} | {g.num_tensors} | {seconds(lambda: Reachability.of(g)):.2f} | {1e3 * queries:.1f} "
        f"| {seconds(lambda: (asap_levels(g), alap_levels(g))):.2f} "
        f"| {seconds(lambda: peak_bytes(g, g.program_order())):.3f} "
        f"| {seconds(lambda: peak_lower_bound(g, reach)):.2f} |"
    )


def main() -> None:
    lines = [
        "# Core analysis speed (random DAGs, no torch)",
        "",
        "Regenerate: `python bench/core.py`",
        "",
        "| ops | tensors | reachability s | n queries ms | ASAP+ALAP s | estimator s | lower bound s |",
        "|---|---|---|---|---|---|---|",
        *(row(n) for n in (1_000, 5_000, 20_000)),
    ]
    out = Path(__file__).parent / "results" / "core.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
