"""The rings of ``src/kvroute`` stay apart: imports point down only, and the pure rings do no I/O.

Every package and root module of ``kvroute`` is placed in one ring of ``RINGS``, lowest first.
A module may import its own ring and the rings below it, never one above (an *upward* import),
wherever the import sits: at the top, inside a function, under ``TYPE_CHECKING``. The pure
rings (``PURE_RINGS``) and the pure modules of other rings (``PURE_MODULES``) also do no I/O and
read no ambient state. A module in no ring fails, so a new package must be placed.

Checked on the syntax tree of every module, so an import inside a function is caught as well
as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvroute

PACKAGE_DIR = Path(kvroute.__file__).parent

RINGS: tuple[str, ...] = (
    "__init__",  # the package itself: a version string, imports nothing of kvroute
    "core",      # pure routing logic
    "wire",      # pure codecs between bytes and core values (core must not import wire)
    "engine",    # the pure vLLM engine model (core, wire)
    "config",    # the YAML configuration, read by the shell and everything above
    "http",      # the lean HTTP/1.1 server and client
    "tokenize",  # every tokenizer path: local HF, piece cache, engine /tokenize, sim vocabulary
    "shell",     # the router's asyncio I/O around core
    "sim",       # simulated engines over HTTP + ZMQ, the virtual-time fleet
    "bench",     # workloads, traces, drivers and reports
    "commands",  # the CLI's subcommands
    "cli",       # the CLI entry point
)
"""Every ring, lowest first: a module may import its own ring and those before it."""

PURE_RINGS: frozenset[str] = frozenset({"__init__", "core", "wire", "engine"})
PURE_MODULES: frozenset[str] = frozenset({
    "tokenize/words.py", "sim/workload.py", "sim/openai_answers.py", "sim/answer_lengths.py",
})
"""Modules outside the pure rings that are pure all the same (their docstrings say so)."""

# Modules that perform I/O, schedule tasks, or read ambient state (environment, wall clock).
FORBIDDEN_MODULES = {
    "asyncio", "socket", "ssl", "select", "selectors", "subprocess", "threading",
    "multiprocessing", "concurrent", "signal", "http", "urllib", "aiohttp", "httpx",
    "requests", "zmq", "redis", "uvicorn", "uvloop", "starlette", "fastapi", "os", "sys",
    "time", "datetime", "io", "pathlib", "shutil", "tempfile", "logging", "prometheus_client",
}
# The global random generator is ambient state; a seeded ``random.Random`` is fine.
ALLOWED_FROM_RANDOM = {"Random"}


def _all_modules() -> list[Path]:
    return sorted(PACKAGE_DIR.rglob("*.py"))


def _ring_of(path: Path) -> str:
    """The ring a module of ``src/kvroute`` is placed in: its package, or its own root name."""
    first = path.relative_to(PACKAGE_DIR).parts[0]
    return first.removesuffix(".py")


def _dotted(path: Path) -> str:
    """``kvroute.x.y`` for ``src/kvroute/x/y.py`` (a package's ``__init__`` is the package)."""
    parts = ["kvroute", *path.relative_to(PACKAGE_DIR).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(tree: ast.Module, dotted: str, is_package: bool) -> list[tuple[int, str]]:
    """Every module a tree imports, absolute, with its line (``from a import b`` gives
    ``a.b``: ``b`` may be a module; relative imports resolved against ``dotted``)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = dotted.split(".") if is_package else dotted.split(".")[:-1]
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
                   or isinstance(node.func, ast.Name)
                   and node.func.id in ("import_module", "__import__"))):
            found.append((node.lineno, node.args[0].value))
    return sorted(found)


def _upward_imports(path: Path, ring: str, dotted: str) -> list[str]:
    """The imports of rings above ``ring`` in the module at ``path`` (named ``dotted``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    level = RINGS.index(ring)
    found: list[str] = []
    for lineno, name in _imported_modules(tree, dotted, path.name == "__init__.py"):
        parts = name.split(".")
        if parts[0] != "kvroute" or len(parts) < 2:
            continue
        target = parts[1]
        if target not in RINGS:
            found.append(f"line {lineno}: imports {name} (a module in no ring)")
        elif RINGS.index(target) > level:
            found.append(f"line {lineno}: imports {name} ({target} is above {ring})")
    return found


def _io_violations(path: Path) -> list[str]:
    """I/O, ambient state and the global RNG in a module that must be pure."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
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
            if name.split(".")[0] in FORBIDDEN_MODULES:
                found.append(f"line {node.lineno}: imports {name}")
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


def _relative(path: Path) -> str:
    return path.relative_to(PACKAGE_DIR).as_posix()


def test_every_module_is_in_a_ring() -> None:
    unplaced = sorted({_relative(p) for p in _all_modules() if _ring_of(p) not in RINGS})
    assert not unplaced, f"modules in no ring (add their package to RINGS): {unplaced}"


def test_every_ring_exists() -> None:
    present = {_ring_of(p) for p in _all_modules()}
    assert set(RINGS) <= present, f"rings with no module: {set(RINGS) - present}"
    assert {path.split("/")[0] for path in PURE_MODULES} <= present
    assert all((PACKAGE_DIR / path).is_file() for path in PURE_MODULES), PURE_MODULES


def test_imports_point_down_the_rings() -> None:
    problems = {
        _relative(path): v
        for path in _all_modules()
        if _ring_of(path) in RINGS and (v := _upward_imports(path, _ring_of(path), _dotted(path)))
    }
    assert not problems, f"upward imports (a ring imports one above it): {problems}"


@pytest.mark.parametrize("ring", sorted(PURE_RINGS))
def test_pure_rings_do_no_io(ring: str) -> None:
    modules = [p for p in _all_modules() if _ring_of(p) == ring]
    assert modules, f"no modules found in {ring}"
    problems = {_relative(path): v for path in modules if (v := _io_violations(path))}
    assert not problems, f"I/O or ambient state in the pure rings: {problems}"


@pytest.mark.parametrize("module", sorted(PURE_MODULES))
def test_pure_modules_do_no_io(module: str) -> None:
    assert not _io_violations(PACKAGE_DIR / module)


def test_layering_check_catches_a_violation(tmp_path: Path) -> None:
    """The checker itself must fail on the things it is meant to catch."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import asyncio\nfrom os import environ\nimport random\nx = random.random()\n"
        "from kvroute.shell import app\nopen('f')\n"
    )
    assert len(_io_violations(bad)) == 4, _io_violations(bad)
    found = _upward_imports(bad, "core", "kvroute.core.bad")
    assert len(found) == 1 and "kvroute.shell.app" in found[0], found


def test_layering_check_catches_upward_imports(tmp_path: Path) -> None:
    """Every spelling of an upward import is caught, inside a function too; downward pass."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from kvroute.core.types import ReplicaId\n"    # own ring: fine
        "import kvroute.wire.openai\n"                 # wire is above core
        "from kvroute import engine\n"                 # the package by name
        "from ..sim import fleet\n"                    # relative
        "def late() -> None:\n"
        "    from kvroute.bench.workloads import WORKLOADS\n"
        "    import importlib\n"
        "    importlib.import_module('kvroute.cli')\n"
        "from kvroute.newring import thing\n"          # a ring that does not exist
    )
    found = _upward_imports(bad, "core", "kvroute.core.bad")
    assert [line.split(":")[0] for line in found] == [
        "line 2", "line 3", "line 4", "line 6", "line 8", "line 9",
    ], found
    assert _upward_imports(bad, "cli", "kvroute.cli_like") == [
        "line 9: imports kvroute.newring.thing (a module in no ring)"
    ]


def test_an_unplaced_package_is_caught() -> None:
    assert _ring_of(PACKAGE_DIR / "newring" / "mod.py") not in RINGS
    assert _ring_of(PACKAGE_DIR / "newmodule.py") not in RINGS
    assert _ring_of(PACKAGE_DIR / "tokenize" / "words.py") == "tokenize"
    assert _dotted(PACKAGE_DIR / "sim" / "__init__.py") == "kvroute.sim"
