"""Plain-text tables for the command lines (cachectl's views of servers and the manager)."""
from __future__ import annotations

from collections.abc import Sequence


def table(rows: list[Sequence[object]], header: Sequence[str] | None = None, indent: str = "  ") -> str:
    """Rows as aligned columns: numbers right-aligned (the header follows its column), text left."""
    rows = [[str(c) for c in r] for r in rows]
    if not rows:
        return ""
    ncols = max(len(r) for r in rows)
    numeric = [all(_is_number(r[i]) for r in rows if i < len(r) and r[i]) for i in range(ncols)]
    if header:
        rows.insert(0, list(header))
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(ncols)]
    lines = []
    for r in rows:
        cells = [c.rjust(widths[i]) if numeric[i] else c.ljust(widths[i]) for i, c in enumerate(r)]
        lines.append(indent + "  ".join(cells).rstrip())
    return "\n".join(lines)


def _is_number(c: str) -> bool:
    return c.lstrip("-").replace(".", "", 1).replace("%", "").replace(",", "").isdigit()
