"""The three rings stay apart: ``core`` and ``wire`` do no I/O and read no ambient state.

Checked on the syntax tree of every module, so a forbidden import inside a function is caught
as well as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvroute

PACKAGE_DIR = Path(kvroute.__file__).parent

# Modules that perform I/O, schedule tasks, or read ambient state (environment, wall clock).
FORBIDDEN_MODULES = {
    "asyncio", "socket", "ssl", "select", "selectors", "subprocess", "threading",
    "multiprocessing", "concurrent", "signal", "http", "urllib", "aiohttp", "httpx",
    "requests", "zmq", "redis", "uvicorn", "uvloop", "starlette", "fastapi", "os", "sys",
    "time", "datetime", "io", "pathlib", "shutil", "tempfile", "logging", "prometheus_client",
}
# The global random generator is ambient state; a seeded ``random.Random`` is fine.
ALLOWED_FROM_RANDOM = {"Random"}


def _modules(ring: str) -> list[Path]:
    return sorted((PACKAGE_DIR / ring).rglob("*.py"))


def _violations(path: Path, ring: str) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    forbidden_rings = {"shell", "sim", "bench", "commands", "cli", "config"}
    if ring == "core":
        forbidden_rings.add("wire")
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "random":
                bad = [a.name for a in node.names if a.name not in ALLOWED_FROM_RANDOM]
                if bad:
                    found.append(f"line {node.lineno}: from random import {bad} (global RNG)")
        for name in names:
            top = name.split(".")[0]
            if top in FORBIDDEN_MODULES:
                found.append(f"line {node.lineno}: imports {name}")
            parts = name.split(".")
            if top == "kvroute" and len(parts) > 1 and parts[1] in forbidden_rings:
                found.append(f"line {node.lineno}: imports {name} (outer ring)")
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "random"
            and node.attr not in ALLOWED_FROM_RANDOM
        ):
            found.append(f"line {node.lineno}: random.{node.attr} (global RNG)")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("open", "input", "print", "__import__", "exec", "eval")):
            found.append(f"line {node.lineno}: calls {node.func.id}()")
    return found


@pytest.mark.parametrize("ring", ["core", "wire", "engine"])
def test_pure_rings_do_no_io(ring: str) -> None:
    modules = _modules(ring)
    assert modules, f"no modules found under {ring}/"
    problems = {
        str(path.relative_to(PACKAGE_DIR)): v for path in modules if (v := _violations(path, ring))
    }
    assert not problems, f"I/O or ambient state in the pure rings: {problems}"


def test_layering_check_catches_a_violation(tmp_path: Path) -> None:
    """The checker itself must fail on the things it is meant to catch."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import asyncio\nfrom os import environ\nimport random\nx = random.random()\n"
        "from kvroute.shell import app\nopen('f')\n"
    )
    found = _violations(bad, "core")
    assert len(found) == 5, found
