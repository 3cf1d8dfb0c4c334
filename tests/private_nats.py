"""A private ``nats-server`` for tests that kill and restart NATS (loopback, a free port).

Not the shared server at ``KVROUTE_TEST_NATS_URL``: a test that SIGKILLs NATS must own it.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from ports import free_block_below_ephemeral
from required import skip_unless_required

__all__ = ["PrivateNats"]


class PrivateNats:
    """A nats-server of this test's own (JetStream, a temporary store), to stop and start."""

    def __init__(self, store: Path) -> None:
        binary = shutil.which("nats-server")
        if binary is None:
            skip_unless_required("the NATS outage test", "nats-server is not on PATH",
                                 env="KVROUTE_REQUIRE_NATS")
        self.binary = binary
        self.store = store
        self.port = free_block_below_ephemeral()  # restarted on it: tests/ports.py
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "-a", "127.0.0.1", "-p", str(self.port), "-js", "-sd", str(self.store)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"nats-server did not listen on {self.port} within 10 s")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None
