"""Human-readable numbers for tables."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """``1536 -> '1.50 KiB'``; binary units, three significant decimals."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def format_percent(fraction: float) -> str:
    return f"{100 * fraction:.1f}%"
