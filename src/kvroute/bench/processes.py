"""The child processes a live benchmark starts: their command line, port, log and shutdown.

Shared by the routers under test (``bench/live_routers.py``) and the tier benchmark's router
(``bench/tiers_live.py``), so every benchmark starts ``kvroute`` the same way, reads the same
tail of a failed child's log, and stops a child the same way: SIGTERM, a grace period, then
SIGKILL, and always reaped. Reading CPU time and pinning from ``/proc`` is ``bench/procfs.py``.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Final

__all__ = ["free_port", "kvroute_command", "log_tail", "stop_process"]

_KVROUTE_ENTRY: Final = "import sys; from kvroute.cli import main; sys.argv[0] = 'kvroute'; main()"
"""The CLI's entry point run with ``-c``: needs no ``kvroute`` script on PATH, only the package
importable by this interpreter."""


def kvroute_command(*args: str) -> list[str]:
    """The command line that runs ``kvroute <args>`` with this interpreter."""
    return [sys.executable, "-c", _KVROUTE_ENTRY, *args]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (bound once by the kernel's choice, then freed).

    For programs that must be told a port up front; another process may take it before the
    child binds it (the usual bind-to-0 race).
    """
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def log_tail(path: Path, limit: int) -> str:
    """The last ``limit`` characters of a child's log, for an error message; ``(no log)``
    when it cannot be read."""
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return "(no log)"


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM ``proc`` if it runs, wait up to ``grace_s``, then SIGKILL; it is reaped.

    Only ``proc`` itself is signalled (by PID): a child that forks stops its own children,
    or the caller kills them by PID.

    Raises:
        subprocess.TimeoutExpired: it was not reaped within 5 s of the SIGKILL.
    """
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
