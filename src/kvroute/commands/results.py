"""How the benchmark and demo commands end: the report as a JSON file, a failure as exit 2.

Every ``kvroute bench ...`` command (and ``kvroute demo``) writes its report the same way
(``--json PATH``: indented JSON, parent directories created, ``wrote PATH`` on stderr) and
turns a ``RouterError`` (a bad option value, a process that would not start) into one red
line and exit code 2 instead of a traceback; one definition keeps them alike.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from kvroute.core.errors import RouterError

__all__ = ["exit_on_router_error", "write_json_report"]


@contextmanager
def exit_on_router_error(console: Console) -> Iterator[None]:
    """Inside the block, a ``RouterError`` is printed as ``error: ...`` on ``console`` and
    ends the command with exit code 2 (``typer.Exit``)."""
    try:
        yield
    except RouterError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc


def write_json_report(path: Path, report: Any, console: Console | None = None) -> None:
    """Write ``report`` to ``path`` as indented JSON (creating its directory); say so on
    ``console`` when one is given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    if console is not None:
        console.print(f"wrote {path}")
