"""How benchmark commands end (``commands/results.py``): JSON report file, RouterError → exit 2."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import typer
from rich.console import Console

from kvroute.commands.results import exit_on_router_error, write_json_report
from kvroute.core.errors import ConfigError


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=200, color_system=None), buf


def test_a_router_error_is_one_line_and_exit_2() -> None:
    console, buf = _console()
    with pytest.raises(typer.Exit) as info, exit_on_router_error(console):
        raise ConfigError("limit must be positive")
    assert info.value.exit_code == 2
    assert isinstance(info.value.__cause__, ConfigError)
    assert buf.getvalue() == "error: limit must be positive\n"


def test_other_errors_and_success_pass_through() -> None:
    console, buf = _console()
    with exit_on_router_error(console):
        pass
    with pytest.raises(ValueError), exit_on_router_error(console):
        raise ValueError("a bug, not a RouterError")
    assert buf.getvalue() == ""


def test_the_report_is_indented_json_in_a_new_directory(tmp_path: Path) -> None:
    console, buf = _console()
    path = tmp_path / "a" / "b" / "report.json"
    write_json_report(path, {"x": [1, 2]}, console)
    assert path.read_text() == json.dumps({"x": [1, 2]}, indent=2) + "\n"
    assert buf.getvalue() == f"wrote {path}\n"
    write_json_report(path, {"y": None})  # no console: nothing said
    assert json.loads(path.read_text()) == {"y": None}
    assert buf.getvalue() == f"wrote {path}\n"
