"""Several routers as one fleet view: carry ``core/peers`` announcements over NATS.

``ClusterSharing`` is started by ``RouterRuntime`` when ``cluster.bus`` is ``nats``:

* it sets ``RouterCore.announce`` to queue every placement, first token and end, and a
  publisher task sends what is queued as one batch (``wire/peer_announcements.py``) as soon
  as the loop is free: under load several announcements share a message, and alone one goes
  out within the same loop turn (publish-to-receive p50 175 µs on loopback, docs/
  benchmarks.md "Several routers");
* every ``heartbeat_s`` it sends an empty batch if nothing else went out, and expires peers
  silent for ``peer_expiry_s`` (``PeerView.expire``): a dead router's load vanishes;
* each batch received is merged into the local core by ``PeerView.apply``; a router that
  stops says ``bye`` and its peers drop its load at once;
* batches are numbered (``seq``): ``stats()`` gives this router's last number and its outbox
  (announcements not yet in a batch), ``peer_seqs()`` the last number applied per peer, so a
  client can wait until one router's placement has reached another instead of guessing a
  delay (``bench/several_routers.py`` paces sibling requests so).

Core NATS publish/subscribe, not JetStream: these announcements are only worth anything for
the seconds until the engines' own KV events confirm them, so nothing is stored, nothing is
acknowledged, and a router that (re)starts needs none of the past ones. The figures behind the
choice (NATS against Redis pub/sub and streams) are in docs/benchmarks.md.

NATS away (at start or in mid-traffic, ``shell/nats_bus.py``): each router routes alone, its
announcements are dropped and counted (``dropped``), its peers' load expires after
``peer_expiry_s`` without their heartbeats, and sharing resumes by itself once NATS answers
(nats-py reconnects and resubscribes; a peer heard again after expiry joins afresh).
Tested with a private ``nats-server`` started late and SIGKILLed mid-traffic
(``tests/integration/test_cluster_outage.py``, docs/reliability.md).

What goes on the subject names no tenant, session or request in clear: each is a keyed
BLAKE2b pseudonym under the cluster secret (``core/pseudonyms.py``, applied to announcements
by ``core/peer_names.py``, which the simulator of several routers, ``sim/routers.py``, runs
too; ``cluster.secret`` or ``cluster.secret_env``, required with ``bus: nats``). The core
itself keys its sessions by their pseudonyms (``RouterCore.session_names``), so a peer's
session and the same session arriving here are one key; a tenant's pseudonym is mapped back
to one of the configured tenants on arrival (one it cannot map, e.g. from a router with
another secret or tenants, writes no predicted entries and is counted in
``unknown_tenant``). A subscriber without the secret sees replica names, sizes and block
hashes, never who sent what
(``tests/integration/test_cluster_bus.py::test_the_bus_carries_no_tenant_session_or_request_id``).

Prefill rates: a ``FirstToken`` carries the rate sample its origin timed (work tokens and
time to first token, ``core/load.RateSample``) and peers fold it into their learned rate
(``rate_samples``; one that is no measurement is refused and counted in ``bad_samples``), so
three routers each learn from every first token, not a third of them; a ``Done`` likewise
carries the origin's inter-token sample (``itl_samples``). A peer that sends no sample (an
older version) teaches nothing.

Ordering: NATS keeps one publisher's messages in order on one connection, so a request's
``Placed``, ``FirstToken`` and ``Done`` arrive in that order. A batch lost in a reconnect is
counted (``seq`` gaps) and can leave a peer request counted after it ended, until that peer
is expired or ``PeerView``'s bound evicts it. A peer whose ``seq`` starts again restarted
under the same id: what it had in flight is dropped first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
from collections.abc import Iterable
from typing import Any

from kvroute.config import ClusterConfig
from kvroute.core.clock import Clock
from kvroute.core.peer_names import conceal, reveal
from kvroute.core.peers import Announcement, PeerView
from kvroute.core.pseudonyms import Pseudonyms
from kvroute.core.router import RouterCore
from kvroute.core.types import TenantName
from kvroute.shell.nats_bus import NatsBus
from kvroute.wire.peer_announcements import PeerMessageError, decode_batch, encode_batch

__all__ = ["ClusterSharing", "default_router_id"]

log = logging.getLogger(__name__)


def default_router_id() -> str:
    """``<hostname>-<pid>``, with characters a router id may not hold replaced by ``-``."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", f"{socket.gethostname()}-{os.getpid()}")


class ClusterSharing:
    """This router's side of the cluster bus (module docstring).

    Args:
        config: the ``cluster`` section (``bus: nats``).
        core: the local router core (announces through it; peers merge into it).
        clock: the core's clock (arrival times and expiry).
        secret: the cluster secret (``Secrets.cluster_secret``): the pseudonyms' key.
        tenants: the configured tenants (a peer's tenant pseudonym maps back to one of them).
    """

    def __init__(self, config: ClusterConfig, core: RouterCore, *, clock: Clock, secret: str,
                 tenants: Iterable[TenantName]) -> None:
        if config.bus != "nats" or not config.url:
            raise ValueError(f"ClusterSharing needs cluster.bus: nats with a url, got {config!r}")
        self.config = config
        self.router_id = config.router_id or default_router_id()
        self.names = Pseudonyms(secret, tenants)
        self.core = core
        core.session_names = self.names
        self.view = PeerView(core, clock=clock, expiry_s=config.peer_expiry_s)
        self.bus = NatsBus(config.url, config.subject, self._on_message,
                           name=f"kvroute-{self.router_id}")
        self._outbox: list[Announcement] = []
        self._wake = asyncio.Event()
        self._sent_since_beat = False
        self._seq = 0
        self._last_seq: dict[str, int] = {}
        self.num_gaps = 0
        self.num_bad = 0
        self.num_unknown_tenant = 0
        """Peers' placements whose tenant pseudonym names no tenant configured here."""
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, *, wait_s: float = 2.0) -> None:
        """Connect (waiting up to ``wait_s``; the rest goes on in the background) and start
        announcing."""
        self.core.announce = self._queue
        await self.bus.start(wait_s=wait_s)
        self._tasks = [
            asyncio.create_task(self._publisher(), name="kvroute-cluster-publish"),
            asyncio.create_task(self._heartbeat(), name="kvroute-cluster-heartbeat"),
        ]
        log.info("cluster: router %s sharing placements on %s subject %s", self.router_id,
                 self.config.url, self.config.subject)

    async def stop(self) -> None:
        """Say goodbye (peers drop our load now) and disconnect."""
        self.core.announce = None
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._outbox.clear()
        await self.bus.publish(encode_batch(self.router_id, self._next_seq(), [], bye=True))
        await self.bus.close()

    def state(self) -> dict[str, Any]:
        """What ``/admin/state`` shows of the cluster."""
        return {
            **self.stats(),
            "router_id": self.router_id,
            "peers": {peer: self.view.in_flight(peer) for peer in self.view.peers()},
            "peer_seq": self.peer_seqs(),
        }

    def peer_seqs(self) -> dict[str, int]:
        """Per peer heard from (router id: not a secret), the ``seq`` of its last batch
        applied here: with the peer's own ``seq`` stat, how a client tells that what a
        router announced up to a point has reached another (``bench/several_routers.py``
        paces sibling requests on it)."""
        return dict(self._last_seq)

    def stats(self) -> dict[str, float]:
        """The counters ``kvroute_cluster{stat=...}`` exports."""
        stats = self.view.stats
        peers = self.view.peers()
        return {
            "connected": int(self.bus.available and self.bus.connected.is_set()),
            "peers": len(peers),
            "peer_requests": sum(self.view.in_flight(peer) for peer in peers),
            "published": self.bus.num_published,
            "dropped": self.bus.num_dropped,
            "received": self.bus.num_received,
            "applied": stats.num_applied,
            "unknown": stats.num_unknown,
            "unknown_replica": stats.num_unknown_replica,
            "rate_samples": stats.num_rate_samples,
            "itl_samples": stats.num_itl_samples,
            "bad_samples": stats.num_bad_samples,
            "expired_peers": stats.num_expired_peers,
            "expired_requests": stats.num_expired_requests,
            "gaps": self.num_gaps,
            "bad": self.num_bad,
            "unknown_tenant": self.num_unknown_tenant,
            # The last batch this router published (or tried to: a dropped one counts) and
            # the announcements not yet in a batch: once ``outbox`` is 0, everything
            # announced so far went out in a batch numbered at most ``seq``.
            "seq": self._seq,
            "outbox": len(self._outbox),
        }

    # -- sending ------------------------------------------------------------------------------

    def _queue(self, item: Announcement) -> None:
        self._outbox.append(item)
        self._wake.set()

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    async def _publisher(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            items, self._outbox = self._outbox, []
            if items:
                self._sent_since_beat = True
                await self.bus.publish(encode_batch(self.router_id, self._next_seq(),
                                                    [self._conceal(item) for item in items]))

    def _conceal(self, item: Announcement) -> Announcement:
        """``item`` as it goes on the bus (``core/peer_names.py``)."""
        return conceal(self.names, item)

    def _reveal(self, items: list[Announcement]) -> list[Announcement]:
        """A peer's announcements with tenant pseudonyms mapped back to tenant names
        (``core/peer_names.py``); a tenant unknown here is counted and warned of once."""
        out, unknown = reveal(self.names, items)
        if unknown:
            if self.num_unknown_tenant == 0:
                log.warning("cluster: a peer's placement names a tenant unknown here; "
                            "do all routers share the cluster secret and the tenants?")
            self.num_unknown_tenant += unknown
        return out

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            if not self._sent_since_beat:
                await self.bus.publish(encode_batch(self.router_id, self._next_seq(), []))
            self._sent_since_beat = False
            for peer in self.view.expire():
                self._last_seq.pop(peer, None)
                log.warning("cluster: peer %s silent for %.1f s; its load dropped", peer,
                            self.config.peer_expiry_s)

    # -- receiving ----------------------------------------------------------------------------

    def _on_message(self, data: bytes) -> None:
        try:
            batch = decode_batch(data)
        except PeerMessageError as exc:
            self.num_bad += 1
            if self.num_bad == 1 or self.num_bad % 1000 == 0:
                log.error("cluster: %s on subject %s (%d so far); is another program "
                          "publishing there?", exc, self.config.subject, self.num_bad)
            return
        peer = batch.sender
        if peer == self.router_id:
            return  # a second router configured with our id would be a config error
        last = self._last_seq.get(peer)
        if last is None:
            log.info("cluster: peer %s joined", peer)
        elif batch.seq <= last:
            self.view.forget(peer)  # restarted under the same id: its old requests are gone
            log.info("cluster: peer %s restarted", peer)
        elif batch.seq > last + 1:
            self.num_gaps += batch.seq - last - 1
        self._last_seq[peer] = batch.seq
        if batch.bye:
            self.view.forget(peer)
            self._last_seq.pop(peer, None)
            log.info("cluster: peer %s left", peer)
            return
        self.view.apply(peer, self._reveal(batch.announcements()))
