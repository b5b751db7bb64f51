"""The minimalloc CSV exchange format: ``id,lower,upper,size[,offset]``.

One header line, then one buffer per line. A buffer is live during the half-open interval
``[lower, upper)``; ``offset``, when present, is its place in the arena (a solution). Read
errors name the file and line, on one line.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from memplan.errors import GraphFormatError
from memplan.placement.problem import PlacementError, PlacementProblem

HEADER = ("id", "lower", "upper", "size")
HEADER_WITH_OFFSET = (*HEADER, "offset")


class PlacementFormatError(GraphFormatError):
    """A placement CSV file could not be read."""


@dataclass(frozen=True)
class CsvInstance:
    """What a CSV file holds: the problem, and offsets if the file has an offset column."""

    problem: PlacementProblem
    offsets_bytes: tuple[int, ...] | None


def read_placement_csv(path: str | Path) -> CsvInstance:
    """Read a problem (and offsets, if present) from a minimalloc CSV file."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PlacementFormatError(f"{path}: no such file") from None
    except (UnicodeDecodeError, IsADirectoryError) as err:
        raise PlacementFormatError(f"{path}: not a text file ({type(err).__name__})") from None
    return parse_placement_csv(text, str(path))


def parse_placement_csv(text: str, source: str = "<csv>") -> CsvInstance:
    rows = [(n, row) for n, row in enumerate(csv.reader(io.StringIO(text)), start=1) if any(c.strip() for c in row)]
    if not rows:
        raise PlacementFormatError(f"{source}: empty file (expected header {','.join(HEADER)}[,offset])")
    line, header = rows[0]
    header_t = tuple(c.strip().lower() for c in header)
    if header_t not in (HEADER, HEADER_WITH_OFFSET):
        raise PlacementFormatError(
            f"{source}:{line}: header is {','.join(header)!r}, expected {','.join(HEADER)}[,offset]"
        )
    has_offset = header_t == HEADER_WITH_OFFSET
    ids, lives, sizes, offsets = [], [], [], []
    seen: dict[str, int] = {}
    for line, row in rows[1:]:
        name, lower, upper, size, offset = _parse_row(row, len(header_t), source, line)
        if name in seen:
            raise PlacementFormatError(f"{source}:{line}: id {name!r} already used on line {seen[name]}")
        seen[name] = line
        ids.append(name)
        lives.append((lower, upper))
        sizes.append(size)
        offsets.append(offset)
    try:
        problem = PlacementProblem.from_intervals(sizes, lives, names=tuple(ids))
    except PlacementError as err:
        raise PlacementFormatError(f"{source}: {err}") from None
    return CsvInstance(problem, tuple(offsets) if has_offset else None)  # type: ignore[arg-type]


def _parse_row(row: list[str], width: int, source: str, line: int) -> tuple[str, int, int, int, int | None]:
    if len(row) != width:
        raise PlacementFormatError(f"{source}:{line}: expected {width} fields, got {len(row)}")
    cells = [c.strip() for c in row]
    if not cells[0]:
        raise PlacementFormatError(f"{source}:{line}: empty id")
    values = []
    for column, cell in zip(HEADER_WITH_OFFSET[1:width], cells[1:], strict=True):
        try:
            values.append(int(cell))
        except ValueError:
            raise PlacementFormatError(f"{source}:{line}: {column} {cell!r} is not an integer") from None
    lower, upper, size = values[:3]
    if lower >= upper:
        raise PlacementFormatError(f"{source}:{line}: lifetime [{lower}, {upper}) is empty (need lower < upper)")
    if size < 0 or (width == 5 and values[3] < 0):
        raise PlacementFormatError(f"{source}:{line}: size and offset must be non-negative")
    return cells[0], lower, upper, size, values[3] if width == 5 else None


def format_placement_csv(problem: PlacementProblem, offsets_bytes: Sequence[int] | None = None) -> str:
    """The CSV text of ``problem`` (which must have lifetimes), with an offset column if given."""
    if problem.lifetimes is None:
        raise PlacementFormatError("only problems with lifetimes can be written as id,lower,upper,size CSV")
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(HEADER_WITH_OFFSET if offsets_bytes is not None else HEADER)
    for i, (name, (lower, upper), size) in enumerate(
        zip(problem.names, problem.lifetimes, problem.sizes_bytes, strict=True)
    ):
        row: list[object] = [name, lower, upper, size]
        if offsets_bytes is not None:
            row.append(offsets_bytes[i])
        writer.writerow(row)
    return out.getvalue()


def write_placement_csv(
    path: str | Path, problem: PlacementProblem, offsets_bytes: Sequence[int] | None = None
) -> None:
    Path(path).write_text(format_placement_csv(problem, offsets_bytes))
