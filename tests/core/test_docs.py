"""The README and docs/: short enough to read, their links resolve, results.md is what the benches wrote."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
README_MAX_LINES = 150


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _relative_links(text: str) -> list[str]:
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_readme_fits_on_a_few_screens_and_starts_with_the_two_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}"
    first_block = README.read_text().split("```")[1]
    assert "make demo" in first_block and "make test" in first_block


def test_every_relative_link_in_readme_and_docs_resolves() -> None:
    broken = [
        f"{md.relative_to(ROOT)} -> {target}"
        for md in _markdown_files()
        for target in _relative_links(md.read_text())
        if not (md.parent / target.partition("#")[0]).exists()
    ]
    assert not broken, f"links to missing files: {broken}"


def test_link_check_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md) [gone](missing.md) [web](https://example.org) ![img](img/x.png)")
    targets = _relative_links(page.read_text())
    assert targets == ["page.md", "missing.md", "img/x.png"]
    assert [t for t in targets if not (tmp_path / t).exists()] == ["missing.md", "img/x.png"]


def test_results_page_is_what_bench_report_builds() -> None:
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "bench" / "report.py")
    assert spec is not None and spec.loader is not None
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    built = report.build()
    assert built == (DOCS / "results.md").read_text(), "docs/results.md is stale: run `python bench/report.py`"
