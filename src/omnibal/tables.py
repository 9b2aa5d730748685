"""Tables as text: the one formatter of the package (command output, reports, benchmark results).

Rows are lists of cells, the first row the header. :func:`format_table` lays them out as a fixed-width
text table (a dashed rule under the header) or as a markdown table; :func:`format_cell` is the default
rendering of a number.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

__all__ = ["fixed", "format_cell", "format_table", "markdown_table", "text_table"]


def format_cell(value: Any) -> str:
    """A float with 4 decimals (none from 100 up), anything else as ``str``."""
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def fixed(value: float, decimals: int) -> str:
    """``value`` with ``decimals`` decimals, or with two significant digits where those decimals would show
    only zeros: a tiny model's 0.0043 s step must not read as 0.00."""
    text = f"{value:.{decimals}f}"
    if value == 0 or text.strip("-0.") or not value == value:  # a non-zero digit shows (or nan)
        return text
    return f"{value:.2g}"


def format_table(rows: Sequence[Sequence[Any]], *, style: Literal["text", "markdown"] = "text",
                 align: Literal["left", "right"] = "left") -> str:
    """``rows`` (header first) as a text table (columns two spaces apart, aligned by ``align``, a dashed rule
    under the header, no trailing spaces) or a markdown table (:func:`markdown_table`). Cells that are not
    strings go through :func:`format_cell`."""
    if style == "markdown":
        return markdown_table(rows)
    cells = _cells(rows)
    if not cells:
        return ""
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    pad = str.ljust if align == "left" else str.rjust
    lines = ["  ".join(pad(c, w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def text_table(rows: Sequence[Sequence[Any]], *, align: Literal["left", "right"] = "left") -> str:
    """:func:`format_table` as text."""
    return format_table(rows, style="text", align=align)


def markdown_table(rows: Sequence[Sequence[Any]], *, right: Sequence[int] = (), compact: bool = False) -> str:
    """``rows`` (header first) as a markdown table: ``| a | b |`` lines, the separator row ``| --- | --- |``
    (``|---|---|`` when ``compact``), the columns numbered in ``right`` aligned right (``---:``). Cells that are
    not strings go through :func:`format_cell`."""
    cells = _cells(rows)
    if not cells:
        return ""
    rules = ["---:" if i in right else "---" for i in range(len(cells[0]))]
    sep = "|" + "".join(f"{r}|" if compact else f" {r} |" for r in rules)
    lines = ["| " + " | ".join(cells[0]) + " |", sep]
    lines += ["| " + " | ".join(r) + " |" for r in cells[1:]]
    return "\n".join(lines)


def _cells(rows: Sequence[Sequence[Any]]) -> list[list[str]]:
    return [[c if isinstance(c, str) else format_cell(c) for c in row] for row in rows]
