"""Waiting for a child's ready line (``sim/launcher.read_ready_line``), as launchers of both
``kvroute sim serve`` and ``kvroute serve`` do."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvroute.sim.launcher import read_ready_line


@pytest.fixture
def spawn() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()


def _child(procs: list[subprocess.Popen[bytes]], code: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    procs.append(proc)
    return proc


def test_other_lines_are_skipped_until_the_ready_object(
        spawn: list[subprocess.Popen[bytes]]) -> None:
    proc = _child(spawn, "import time; print('starting'); print('[1]'); "
                         "print('{\"ready\": false}'); "
                         "print('{\"ready\": true, \"url\": \"http://x\"}', flush=True); "
                         "time.sleep(60)")
    info = read_ready_line(proc, time.monotonic() + 30)
    assert info == {"ready": True, "url": "http://x"}


def test_a_child_that_exits_first_gives_none(spawn: list[subprocess.Popen[bytes]]) -> None:
    proc = _child(spawn, "print('no ready line here')")
    assert read_ready_line(proc, time.monotonic() + 30) is None
    assert proc.wait(30) == 0


def test_a_silent_child_gives_none_at_the_deadline(
        spawn: list[subprocess.Popen[bytes]]) -> None:
    proc = _child(spawn, "import time; time.sleep(60)")
    started = time.monotonic()
    assert read_ready_line(proc, started + 0.3) is None
    assert 0.3 <= time.monotonic() - started < 10
    assert proc.poll() is None
