"""The commit a benchmark report records (``bench/provenance.py``), and None when unknown."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvroute.bench import provenance
from kvroute.bench.provenance import git_sha

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _checkout(path: Path) -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              cwd=path, capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    git("commit", "-q", "--allow-empty", "-m", "first")
    return git("rev-parse", "HEAD")


def test_full_and_short_commit_of_a_checkout(tmp_path: Path) -> None:
    head = _checkout(tmp_path)
    assert git_sha(cwd=tmp_path) == head
    short = git_sha(short=True, cwd=tmp_path)
    assert short is not None and 4 <= len(short) < len(head) and head.startswith(short)


def test_outside_a_checkout_it_is_none(tmp_path: Path) -> None:
    assert git_sha(cwd=tmp_path) is None


def test_without_git_it_is_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no git there
    assert git_sha(cwd=tmp_path) is None


def test_a_git_that_hangs_past_the_timeout_gives_none(monkeypatch: pytest.MonkeyPatch) -> None:
    def hang(*args: Any, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        raise subprocess.TimeoutExpired(args[0], kwargs["timeout"])

    monkeypatch.setattr(provenance.subprocess, "run", hang)
    assert git_sha(timeout_s=0.01) is None
