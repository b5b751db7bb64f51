"""Collect every measured table (bench/results/*.md) into docs/results.md.

python bench/report.py
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORDER = [
    "core",
    "capture",
    "reorder",
    "placement",
    "placement_hard",
    "run-b1",
    "run-b1-time",
    "run-b1-idle",
    "run-b32",
    "run-b32-partial",
    "run-b32-time",
    "rss-b32",
    "optimizers",
    "loops",
    "architectures",
    "remat",
    "remat_maxbatch",
    "remat_run",
    "remat_portfolio",
    "remat_portfolio_subset",
    "remat_portfolio_rest",
    "remat_portfolio_gap1",
    "remat_portfolio_n250_60s",
    "remat_scale",
    "remat_proofs",
    "remat_proofs_resnet50",
    "remat_joint",
    "budget",
    "fit",
    "fit.unet",
    "fit.gpt2",
    "fit.llama-0.3b",
    "first_step",
    "first_step_reproducible",
    "eager_repro",
    "step_overhead",
    "step_overhead_views",
    "step_overhead_budget",
    "cuda",
    "gpu_suite",
    "cuda_budget",
    "streams",
    "ddp",
    "fsdp",
    "fsdp_4ranks",
    "fsdp_budget",
    "fsdp_mp",
    "export",
]


LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s#]+)")


def relink(text: str, source: Path, target: Path) -> str:
    """Rewrite the relative links of ``text``, written in folder ``source``, to work from folder ``target``."""

    def fix(match: re.Match[str]) -> str:
        link = match.group(2)
        if re.match(r"[a-z]+:", link) or link.startswith("/"):
            return match.group(0)
        return match.group(1) + os.path.relpath((source / link).resolve(), target)

    return LINK.sub(fix, text)


def table_names() -> list[str]:
    """The stems of bench/results/*.md in the page's order: ORDER first, then the rest by name."""
    results = ROOT / "bench" / "results"
    names = [n for n in ORDER if (results / f"{n}.md").exists()]
    return names + sorted(p.stem for p in results.glob("*.md") if p.stem not in ORDER)


def build() -> str:
    """docs/results.md's text: docs/results-intro.md, then every table with its headings demoted."""
    results = ROOT / "bench" / "results"
    parts = [(ROOT / "docs" / "results-intro.md").read_text().rstrip() + "\n"]
    for name in table_names():
        text = relink((results / f"{name}.md").read_text().rstrip(), results, ROOT / "docs")
        demoted = "\n".join("#" + line if line.startswith("#") else line for line in text.splitlines())
        parts.append("\n" + demoted + "\n")
    return "\n".join(parts)


def main() -> None:
    (ROOT / "docs" / "results.md").write_text(build())
    print(f"wrote docs/results.md from {', '.join(table_names())}")


if __name__ == "__main__":
    main()
