"""Free loopback ports for servers that are stopped and started again on the same port.

Drawn below the kernel's ephemeral range. While a server is down its clients keep
reconnecting to its port; inside the ephemeral range the kernel may hand that very number out
as a reconnect's own source port (a socket connected to itself) or to any other client
socket, and the restarted server's bind fails with "Address already in use". Below the range
no outgoing connection ever takes it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default when unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_block_below_ephemeral(span: int = 1, tries: int = 200) -> int:
    """A port p with p .. p+span-1 free right now, all below the ephemeral range."""
    low = ephemeral_low()
    rng = random.Random()
    for _ in range(tries):
        base = rng.randrange(max(1024, low - 12_000), low - span)
        ok = True
        for port in range(base, base + span):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError(
        f"no {span} consecutive free ports below the ephemeral range ({low}) on 127.0.0.1 "
        f"after {tries} tries")
