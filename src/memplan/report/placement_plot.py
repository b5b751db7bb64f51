"""Draw a placement as OLLA Figure 6 does: time on x, address on y, one rectangle per buffer."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.collections import PatchCollection
from matplotlib.patches import Rectangle

from memplan.placement.problem import Placement, PlacementProblem, lower_bound_bytes


def plot_placement(problem: PlacementProblem, placement: Placement, path: str | Path) -> None:
    """Write a time x address picture of ``placement`` to ``path`` (format from its suffix).

    Without lifetimes (a general conflict relation) buffer ``i`` takes the x range ``[i, i+1)``.
    Dashed lines mark the lower bound and, if set, the capacity.
    """
    lives = problem.lifetimes or tuple((i, i + 1) for i in range(problem.num_buffers))
    scale, unit = _scale(max(placement.arena_bytes, 1))
    rects = [
        Rectangle((start, offset / scale), end - start, size / scale)
        for (start, end), offset, size in zip(lives, placement.offsets_bytes, problem.padded_sizes_bytes, strict=True)
        if size > 0
    ]
    fig, ax = plt.subplots(figsize=(10, 5))
    colors = [plt.cm.tab20(i % 20) for i in range(len(rects))]
    ax.add_collection(PatchCollection(rects, facecolor=colors, edgecolor="black", linewidth=0.3))
    t_min = min((s for s, _ in lives), default=0)
    t_max = max((e for _, e in lives), default=1)
    ax.set_xlim(t_min, t_max)
    ax.set_ylim(0, max(placement.arena_bytes, problem.capacity_bytes or 0, 1) / scale * 1.05)
    ax.axhline(lower_bound_bytes(problem) / scale, color="green", linestyle="--", label="lower bound")
    if problem.capacity_bytes is not None:
        ax.axhline(problem.capacity_bytes / scale, color="red", linestyle="--", label="capacity")
    ax.set_xlabel("timestep" if problem.lifetimes else "buffer")
    ax.set_ylabel(f"address ({unit})")
    ax.set_title(f"{placement.method}: arena {placement.arena_bytes / scale:.4g} {unit}, {placement.status}")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _scale(arena_bytes: int) -> tuple[float, str]:
    for factor, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if arena_bytes >= factor:
            return float(factor), unit
    return 1.0, "bytes"
