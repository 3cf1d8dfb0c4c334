"""Rich tables for the commands' reports: one place that turns rows of strings into a table."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from rich.console import Console
from rich.table import Table

__all__ = ["rows_table", "wide_console"]


def rows_table(title: str, rows: Sequence[Sequence[str]], *,
               left: Collection[str] = ()) -> Table:
    """A table of ``rows``, whose first row is the header; the columns named in ``left`` are
    aligned left (names, labels), every other column right (numbers)."""
    table = Table(title=title)
    for head in rows[0]:
        table.add_column(head, justify="left" if head in left else "right")
    for row in rows[1:]:
        table.add_row(*row)
    return table


def wide_console(min_width: int = 150) -> Console:
    """A console at least ``min_width`` wide, so report tables are not folded in narrow
    terminals or pipes."""
    return Console(width=max(Console().width, min_width))
