"""Several routers as one: what each has just placed, merged into the others' view.

Two routers in front of one fleet each see the engines' KV events and ``/metrics``, but
neither sees the other's *fresh* placements: the blocks it predicted on a replica a moment
ago (before the engine's ``BlockStored`` confirms them) and the requests it has running there.
Without them, sibling requests of one burst that reach different routers scatter (each router
sees no prefix anywhere yet), and each router underestimates every replica's load.

This module owns that merge, as pure state (no IO): the shell (``shell/cluster.py``) carries
the announcements over a bus.

* A router's ``RouterCore`` reports what it does through ``RouterCore.announce``: a request
  ``Placed`` on a replica (its prefill, prompt and output sizes, its session, and the block
  hashes it wrote as predicted entries), its ``FirstToken``, and its ``Done``.
* ``PeerView.apply`` replays a peer's announcements into the local ``RouterCore``: a ``Placed``
  becomes a dispatch in the load tracker (under the id ``<peer>/<request id>``, so it can never
  collide with a local request) and predicted entries in the tenant's scope; ``FirstToken``
  and ``Done`` move it on as they would a local request. Times are the local clock's at
  arrival: routers share no clock, and the bus adds well under a millisecond (docs/
  benchmarks.md, "Several routers"). Nothing is learned from announcement arrival times
  (two of them often share one batch): the prefill rate is learned from the sample the
  origin router timed itself, which its ``FirstToken`` carries (``rate_sample``: work
  tokens and time to first token, no id), folded in by ``LoadTracker.learn_rate`` with the
  clamp and smoothing of a local sample; the inter-token factor likewise from the sample
  a ``Done`` carries (``itl_sample``: observed step over predicted, folded in by
  ``LoadTracker.learn_itl_scale``), and the answer lengths from its output count. A
  ``FirstToken`` or ``Done`` without a sample (a split's decode half, a short prefill, or a
  peer of a version that sends none) teaches nothing; one whose sample is no measurement
  (negative, zero or non-finite) is applied without it and counted in ``num_bad_samples``.
* Expiry: every batch a peer sends (a heartbeat when it has nothing else) refreshes it;
  ``PeerView.expire`` drops a peer silent for ``expiry_s``, completing everything it had in
  flight, so a dead router's load vanishes. Its predicted entries expire on their own TTL.

Invariants: a peer request is counted at most once (a repeated ``Placed`` is ignored); a
``FirstToken`` or ``Done`` for a request not known is a no-op (the ``Placed`` was lost, or
came before this router started), counted in ``num_unknown``; at most ``max_requests_per_peer``
requests are held per peer (the oldest completed first beyond it), so a peer that never
sends ``Done`` cannot grow memory without bound.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from kvroute.core.clock import Clock
from kvroute.core.index import TenantScope
from kvroute.core.load import RateSample
from kvroute.core.types import ReplicaId, RequestId, TenantName, WireHash

if TYPE_CHECKING:
    from kvroute.core.router import RouterCore

__all__ = [
    "DEFAULT_MAX_REQUESTS_PER_PEER",
    "Announcement",
    "Done",
    "FirstToken",
    "PeerStats",
    "PeerView",
    "Placed",
]

DEFAULT_MAX_REQUESTS_PER_PEER: Final = 65_536


@dataclass(frozen=True, slots=True)
class Placed:
    """A router sent ``request_id`` to ``replica``.

    Attributes:
        hashes: the blocks it wrote as predicted entries there (empty: none), in the tenant's
            scope; ``approximate``: they are text-chunk hashes (the approximate index's).
        tenant: the tenant whose scope sees the predicted entries (None: none written).
        session: the load tracker's session key (``tenant\\x1fsession id``), if any.
    """

    request_id: str
    replica: ReplicaId
    prefill_tokens: int
    prompt_tokens: int
    expected_output_tokens: int
    predicted_output_tokens: int | None = None
    session: str | None = None
    tenant: TenantName | None = None
    hashes: tuple[WireHash, ...] = ()
    approximate: bool = False


@dataclass(frozen=True, slots=True)
class FirstToken:
    """``request_id`` produced its first token on ``replica``; ``rate_sample``: the prefill
    rate sample the origin router learned from it (None: it learned none)."""

    request_id: str
    replica: ReplicaId
    rate_sample: RateSample | None = None


@dataclass(frozen=True, slots=True)
class Done:
    """``request_id`` ended on ``replica`` (finished, failed, cancelled or moved away);
    ``itl_sample``: the inter-token sample the origin router learned from it (observed step
    over predicted, ``LoadTracker.on_complete``; None: none)."""

    request_id: str
    replica: ReplicaId
    output_tokens: int | None = None
    itl_sample: float | None = None


Announcement = Placed | FirstToken | Done


@dataclass(slots=True)
class PeerStats:
    """Counters of the merge, for ``/metrics`` and tests."""

    num_applied: int = 0
    num_unknown: int = 0
    """``FirstToken``/``Done`` for a request never placed (lost, or before our start)."""
    num_unknown_replica: int = 0
    """Announcements naming a replica this router does not have (configs differ)."""
    num_rate_samples: int = 0
    """Peers' prefill rate samples folded into the learned rates here."""
    num_itl_samples: int = 0
    """Peers' inter-token samples folded into the learned factors here."""
    num_bad_samples: int = 0
    """Peers' rate or inter-token samples refused: not a measurement."""
    num_expired_peers: int = 0
    num_expired_requests: int = 0
    num_evicted: int = 0


@dataclass(slots=True)
class _Peer:
    last_seen_s: float
    in_flight: OrderedDict[RequestId, ReplicaId] = field(default_factory=OrderedDict)


class PeerView:
    """Peers' fresh placements and in-flight load, merged into one ``RouterCore``.

    Args:
        core: the local router core; peers' requests enter its load tracker and index.
        clock: monotonic seconds (arrival times, expiry).
        expiry_s: a peer silent this long is dropped (``expire``).
        max_requests_per_peer: bound on the requests held per peer.
    """

    __slots__ = ("_clock", "_core", "_expiry_s", "_max", "_peers", "stats")

    def __init__(self, core: RouterCore, *, clock: Clock, expiry_s: float,
                 max_requests_per_peer: int = DEFAULT_MAX_REQUESTS_PER_PEER) -> None:
        if not expiry_s > 0:
            raise ValueError(f"expiry_s must be > 0 seconds, got {expiry_s!r}")
        if max_requests_per_peer < 1:
            raise ValueError(f"max_requests_per_peer must be >= 1, got {max_requests_per_peer}")
        self._core = core
        self._clock = clock
        self._expiry_s = float(expiry_s)
        self._max = max_requests_per_peer
        self._peers: dict[str, _Peer] = {}
        self.stats = PeerStats()

    def peers(self) -> list[str]:
        """The peers heard from within the expiry, in the order first heard."""
        return list(self._peers)

    def in_flight(self, peer: str) -> int:
        """Requests ``peer`` has in flight as far as this router knows."""
        record = self._peers.get(peer)
        return 0 if record is None else len(record.in_flight)

    def apply(self, peer: str, announcements: Iterable[Announcement]) -> None:
        """Merge one batch from ``peer`` (an empty batch is a heartbeat)."""
        now = self._clock.now()
        record = self._peers.get(peer)
        if record is None:
            record = self._peers[peer] = _Peer(now)
        record.last_seen_s = now
        core = self._core
        load = core.load
        for item in announcements:
            if not core.has_replica(item.replica):
                self.stats.num_unknown_replica += 1
                continue
            rid = RequestId(f"{peer}/{item.request_id}")
            if type(item) is Placed:
                if rid in record.in_flight:
                    continue
                load.on_dispatch(
                    item.replica, rid, prefill_tokens=item.prefill_tokens,
                    prompt_tokens=item.prompt_tokens,
                    expected_output_tokens=item.expected_output_tokens, now_s=now,
                    predicted_output_tokens=item.predicted_output_tokens, session=item.session)
                record.in_flight[rid] = item.replica
                if item.hashes and item.tenant is not None:
                    index = core.approx_index if item.approximate else core.index
                    index.add_predicted(item.replica, item.hashes, TenantScope(item.tenant))
                while len(record.in_flight) > self._max:
                    old, replica = record.in_flight.popitem(last=False)
                    load.on_complete(replica, old)
                    self.stats.num_evicted += 1
            elif type(item) is FirstToken:
                if record.in_flight.get(rid) != item.replica:
                    self.stats.num_unknown += 1
                    continue
                load.on_first_token(item.replica, rid, now_s=now, learn=False)
                sample = item.rate_sample
                if sample is not None:
                    if sample.problem() is not None:
                        self.stats.num_bad_samples += 1
                    elif load.learn_rate(item.replica, sample, now_s=now):
                        self.stats.num_rate_samples += 1
            else:
                assert type(item) is Done
                if record.in_flight.get(rid) != item.replica:
                    self.stats.num_unknown += 1
                    continue
                del record.in_flight[rid]
                # The answer's count (the session rests here with it), but no inter-token
                # factor from the arrival times of two announcements (often in one batch):
                # the origin's own sample, if any.
                load.on_complete(item.replica, rid, now_s=now, output_tokens=item.output_tokens,
                                 learn_itl=False)
                itl = item.itl_sample
                if itl is not None:
                    if not (math.isfinite(itl) and itl >= 0.0):
                        self.stats.num_bad_samples += 1
                    elif load.learn_itl_scale(item.replica, itl):
                        self.stats.num_itl_samples += 1
            self.stats.num_applied += 1

    def expire(self) -> list[str]:
        """Drop every peer silent for ``expiry_s`` with all it had in flight; their names."""
        cutoff = self._clock.now() - self._expiry_s
        gone = [name for name, record in self._peers.items() if record.last_seen_s <= cutoff]
        for name in gone:
            self.forget(name)
        return gone

    def forget(self, peer: str) -> None:
        """Drop ``peer`` now (it said goodbye, or expired): its requests no longer count."""
        record = self._peers.pop(peer, None)
        if record is None:
            return
        self.stats.num_expired_peers += 1
        self.stats.num_expired_requests += len(record.in_flight)
        for rid, replica in record.in_flight.items():
            # No end time: a request that vanished with its router teaches nothing and
            # leaves no session resting.
            self._core.load.on_complete(replica, rid)
