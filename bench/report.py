"""Collect every measured table (bench/results/*.md) into docs/results.md.

python bench/report.py
"""

from __future__ import annotations

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
    "budget",
    "cuda",
    "cuda_budget",
    "streams",
    "ddp",
    "export",
]


def main() -> None:
    results = ROOT / "bench" / "results"
    parts = [(ROOT / "docs" / "results-intro.md").read_text().rstrip() + "\n"]
    names = [n for n in ORDER if (results / f"{n}.md").exists()]
    names += sorted(p.stem for p in results.glob("*.md") if p.stem not in ORDER)
    for name in names:
        text = (results / f"{name}.md").read_text().rstrip()
        demoted = "\n".join("#" + line if line.startswith("#") else line for line in text.splitlines())
        parts.append("\n" + demoted + "\n")
    (ROOT / "docs" / "results.md").write_text("\n".join(parts))
    print(f"wrote docs/results.md from {', '.join(names)}")


if __name__ == "__main__":
    main()
