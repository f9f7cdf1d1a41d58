"""Rows of dicts as a Markdown table, for notebook pages (rendered as an HTML table in
the book).

markdown_table([{"ranks": 2, "MB": 82.21}], formats={"MB": "{:.1f}"})
"""

from __future__ import annotations


def markdown_table(rows: list[dict], formats: dict[str, str] | None = None):
    """An ``IPython.display.Markdown`` table; columns from the first row, in
    its order."""
    from IPython.display import Markdown

    if not rows:
        raise ValueError("markdown_table needs at least one row")
    formats = formats or {}
    columns = list(rows[0])

    def cell(column: str, value) -> str:
        text = formats[column].format(value) if column in formats else str(value)
        return text.replace("|", "\\|")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += [
        "| " + " | ".join(cell(c, row[c]) for c in columns) + " |" for row in rows
    ]
    return Markdown("\n".join(lines))


def format_bytes(n: float) -> str:
    """Decimal units, as the ZeRO paper uses: 1 GB = 1e9 bytes."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            v = n / size
            # as the page's fmt()
            return f"{v:.{0 if v >= 100 else 1 if v >= 10 else 2}f} {unit}"
    return f"{n:.0f} B"
