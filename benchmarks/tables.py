"""Markdown tables, shared by the benchmarks' stdout and the suite's report (no torch here)."""

from __future__ import annotations

from collections.abc import Sequence


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table; floats to 3 significant digits, ``|`` in a cell escaped."""
    def cell(v: object) -> str:
        text = f"{v:.3g}" if isinstance(v, float) else "-" if v is None else str(v)
        return text.replace("|", "\\|")

    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
