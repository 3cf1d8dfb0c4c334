"""Waiting for a router's view of the engines to settle, shared by integration tests.

An engine publishes a request's KV events in several batches, and a router that meets an
engine for the first time replays its buffer before it applies the new batch, so a count
that has just moved may move again. ``settled`` waits for it to stop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def settled(read: Callable[[], int], quiet_s: float = 0.3, timeout_s: float = 5.0) -> int:
    """Wait until ``read()`` has not changed for ``quiet_s`` (at most ``timeout_s``, a bound
    for a loaded machine); return the settled value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    value, since = read(), loop.time()
    while loop.time() - since < quiet_s and loop.time() < deadline:
        await asyncio.sleep(0.02)
        now = read()
        if now != value:
            value, since = now, loop.time()
    return value
