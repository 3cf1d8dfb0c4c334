"""One NATS connection for a router: publish bytes on a subject, hand received bytes to a
callback, survive the server going away.

Small and general on purpose: the cluster's fresh placements (``shell/cluster.py``) use it,
and other users of the same server can sit beside it. It knows nothing of what the bytes say.

Failure policy, as for Redis state (``shell/state.py``): the bus is an optimisation, so it
never raises into a request. The first connection is tried in the background until it
succeeds (a router starts, and routes alone, while NATS is down; nats-py itself retries
every 0.5 s); after that nats-py reconnects on its own. ``publish`` while disconnected drops the message and counts it.
An outage is logged once when it starts and once when it ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import ConnectionClosedError, NoServersError, OutboundBufferLimitError
from nats.errors import TimeoutError as NatsTimeoutError

__all__ = ["CONNECT_RETRY_S", "NatsBus"]

log = logging.getLogger(__name__)

CONNECT_RETRY_S: Final = 1.0
"""Pause between attempts at the first connection."""


class NatsBus:
    """A NATS connection that publishes on, and listens to, one subject.

    Args:
        url: the server, ``nats://host:port``.
        subject: the subject published on and subscribed to.
        on_message: called with each message's payload (not our own: ``no_echo``).
        name: the connection's name in the server's monitoring.
    """

    def __init__(self, url: str, subject: str, on_message: Callable[[bytes], None], *,
                 name: str = "kvroute") -> None:
        self.url = url
        self.subject = subject
        self._on_message = on_message
        self._name = name
        self._nc: Client | None = None
        self._connector: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()
        self.available = True
        self._closing = False
        self.num_dropped = 0
        self.num_published = 0
        self.num_received = 0

    async def start(self, *, wait_s: float = 0.0) -> None:
        """Start connecting; wait up to ``wait_s`` for the first connection (it goes on in
        the background after that)."""
        self._connector = asyncio.create_task(self._connect_loop(), name="kvroute-nats-connect")
        if wait_s > 0:
            try:
                async with asyncio.timeout(wait_s):
                    await self.connected.wait()
            except TimeoutError:
                pass

    async def _connect_loop(self) -> None:
        while True:
            try:
                nc = await nats.connect(
                    self.url, name=self._name, no_echo=True, allow_reconnect=True,
                    max_reconnect_attempts=-1, reconnect_time_wait=0.5, connect_timeout=1.0,
                    error_cb=self._on_error, disconnected_cb=self._on_disconnected,
                    reconnected_cb=self._on_reconnected)
            except (NoServersError, OSError, NatsTimeoutError, TimeoutError) as exc:
                if self.available:
                    self.available = False
                    log.error("cluster bus (NATS %s) unavailable: %s: %s; routing continues "
                              "without peers' placements until it answers", self.url,
                              type(exc).__name__, exc)
                await asyncio.sleep(CONNECT_RETRY_S)
                continue
            try:
                await nc.subscribe(self.subject, cb=self._deliver)
                await nc.flush(timeout=5)  # the server has the subscription once this returns
            except (NatsTimeoutError, ConnectionClosedError, OSError) as exc:
                log.error("cluster bus (NATS %s): subscribing to %s failed: %s; retrying",
                          self.url, self.subject, exc)
                await nc.close()
                await asyncio.sleep(CONNECT_RETRY_S)
                continue
            self._nc = nc
            if not self.available:
                log.warning("cluster bus (NATS %s) reachable", self.url)
            self.available = True
            self.connected.set()
            return

    async def _deliver(self, msg: Msg) -> None:
        self.num_received += 1
        self._on_message(msg.data)

    async def _on_error(self, exc: Exception) -> None:
        # nats-py retries the first connection itself (max_reconnect_attempts=-1) and
        # reports each failure here: the outage starts at the first one.
        if self._nc is None and self.available:
            self.available = False
            log.error("cluster bus (NATS %s) unavailable: %s: %s; routing continues without "
                      "peers' placements until it answers", self.url, type(exc).__name__, exc)
            return
        log.debug("cluster bus (NATS %s): %s: %s", self.url, type(exc).__name__, exc)

    async def _on_disconnected(self) -> None:
        if self.available and not self._closing:
            self.available = False
            log.error("cluster bus (NATS %s) disconnected; routing continues without peers' "
                      "placements until it reconnects", self.url)

    async def _on_reconnected(self) -> None:
        self.available = True
        log.warning("cluster bus (NATS %s) reconnected", self.url)

    async def publish(self, payload: bytes) -> bool:
        """Send ``payload``; False (counted in ``num_dropped``) when not connected."""
        nc = self._nc
        if nc is None or not nc.is_connected:
            self.num_dropped += 1
            return False
        try:
            await nc.publish(self.subject, payload)
        except (ConnectionClosedError, OutboundBufferLimitError, OSError) as exc:
            self.num_dropped += 1
            log.debug("cluster bus publish dropped: %s", exc)
            return False
        self.num_published += 1
        return True

    async def close(self, *, flush_s: int = 1) -> None:
        """Flush what was published (up to ``flush_s``) and disconnect."""
        self._closing = True
        if self._connector is not None:
            self._connector.cancel()
            await asyncio.gather(self._connector, return_exceptions=True)
            self._connector = None
        nc, self._nc = self._nc, None
        if nc is None:
            return
        if nc.is_connected:
            try:
                await nc.flush(timeout=max(1, flush_s))
            except (NatsTimeoutError, ConnectionClosedError, TimeoutError):
                pass  # what could not be flushed is lost; peers expire us instead
        await nc.close()
