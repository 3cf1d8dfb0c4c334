"""Starting, reading and stopping a benchmark's child processes (``bench/processes.py``)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

from kvroute.bench.processes import free_port, kvroute_command, log_tail, stop_process


def _python(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)


def test_kvroute_command_runs_the_cli_with_this_interpreter() -> None:
    cmd = kvroute_command("--help")
    assert cmd[0] == sys.executable and cmd[-1] == "--help"
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "kvroute" in done.stdout


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_log_tail_keeps_the_end(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_bytes(b"start\n" + b"x" * 50 + b"\xff end")
    assert log_tail(log, 5) == "\ufffd end"
    assert log_tail(log, 10_000).startswith("start")
    assert log_tail(tmp_path / "missing.log", 100) == "(no log)"


def test_stop_terminates_then_reaps() -> None:
    proc = _python("import sys, time; print('up', flush=True); time.sleep(60)")
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    stop_process(proc, grace_s=10.0)
    assert proc.returncode == -signal.SIGTERM
    proc.stdout.close()


def test_stop_kills_a_child_that_ignores_sigterm() -> None:
    proc = _python("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "print('up', flush=True); time.sleep(60)")
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    stop_process(proc, grace_s=0.2)
    assert proc.returncode == -signal.SIGKILL
    proc.stdout.close()


def test_stop_leaves_an_exited_child_alone() -> None:
    proc = _python("pass")
    proc.wait(30)
    stop_process(proc)
    assert proc.returncode == 0
    assert proc.stdout is not None
    proc.stdout.close()
