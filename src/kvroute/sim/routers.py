"""Several routers in front of one simulated fleet, in virtual time.

Live, three ``kvroute serve`` replicas behind a round-robin front share session records
through Redis and announce their fresh placements and in-flight load to each other on NATS
(``shell/cluster.py``). Wall-clock measurements of that set-up move by about 10% with the
machine's queueing (docs/benchmarks.md, "Several routers: one against three"); this module
runs the same arrangement on ``sim/fleet.py``'s virtual clock, where a run is deterministic
and a 3% difference can be asserted.

What each router is and shares, as live:

* every router is its own ``RouterCore`` (index, load tracker, policy with its own seeded
  random draws) and ``Walker`` (output-length memory, spread-ahead budget). Each receives
  every engine's KV events (``FleetConfig.event_latency_s`` after the step, as each live
  router subscribes to every engine) and scrapes every engine's metrics;
* the session records are one table every router reads and writes (Redis live), and so is
  the warm-ahead planner's cooldown view (Redis live);
* a front sends each new request to a router: ``round_robin`` over arrivals (each turn of a
  session may reach another router), or ``session`` (a session's turns reach one router,
  chosen by a stable hash of its id; requests without a session round-robin);
* with ``bus`` on, each router's ``RouterCore.announce`` queues its ``Placed``, ``FirstToken``
  and ``Done`` announcements (``core/peers.py``). The queue is sent as one batch
  ``batch_s`` after its first item (0: as soon as the current instant's work is done, as
  the live publisher sends once its loop is free), and every other router merges the batch
  ``bus_delay_s`` later with the live code: ``core/peer_names.py`` conceals the names with
  the cluster pseudonyms on the way out and reveals the tenants on the way in,
  ``core/peers.PeerView.apply`` merges the batch into the receiving core. Routers key their
  sessions by the same pseudonyms (``RouterCore.session_names``) as live; a ``FirstToken``
  carries the prefill rate sample its router learned and a ``Done`` its inter-token
  sample, and the others learn them too. The
  bus loses nothing and nobody leaves, so peers never expire (heartbeats are not modelled);
* with ``bus`` off (the control), routers share only what the engines publish and the
  session table: what one router has just placed is invisible to the others until the
  engine's ``BlockStored`` arrives.

``SeveralRoutersSimulation.run`` returns the ordinary ``FleetResult``: its figures are the
engines' and the requests', so one router and several compare column for column. Its
``counters`` gain ``bus_batches``, ``bus_announcements``, ``bus_rate_samples`` and
``bus_itl_samples`` (first tokens and ends sent with a sample) and ``peer_applied`` /
``peer_unknown`` / ``peer_rate_samples`` / ``peer_itl_samples`` / ``peer_bad_samples``
(summed over routers), and ``routed_by_router_<i>`` per router.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Final, cast

from kvroute.core.errors import ConfigError
from kvroute.core.peer_names import conceal, reveal
from kvroute.core.peers import Announcement, Done, FirstToken, PeerView
from kvroute.core.pseudonyms import Pseudonyms
from kvroute.core.walk import Walker
from kvroute.sim.fleet import (
    DEFAULT_TENANT,
    DigestCache,
    FleetConfig,
    FleetResult,
    FleetSimulation,
    RequestRecord,
)
from kvroute.sim.workload import WorkloadRequest

__all__ = [
    "DEFAULT_BUS_DELAY_S",
    "FRONTS",
    "RoutersConfig",
    "SeveralRoutersSimulation",
    "group_replicas_mean",
    "simulate_routers",
]

FRONTS: Final = ("round_robin", "session")
"""How the front in front of the routers spreads requests (module docstring)."""

DEFAULT_BUS_DELAY_S: Final = 0.001
"""Publish-to-merge delay of one batch: the order of NATS on loopback with a router's loop
turn around it (p50 175 us measured publish to receive, docs/benchmarks.md "Several
routers"), rounded up to 1 ms."""

SIM_CLUSTER_SECRET: Final = "kvroute-simulated-cluster-secret"
"""The simulated routers' shared cluster secret (the pseudonyms' key; nothing secret here)."""

_BUS_SEND: Final = 100
_BUS_RECEIVE: Final = 101


@dataclass(frozen=True, slots=True)
class RoutersConfig:
    """The routers in front of a simulated fleet.

    Attributes:
        count: routers (1: the ordinary single router, behind the same front).
        bus: routers announce placements, first tokens and ends to each other.
        bus_delay_s: from a batch's send to its merge by every other router.
        batch_s: from an announcement queued on an empty outbox to the batch's send.
        front: ``round_robin`` or ``session`` (``FRONTS``).
    """

    count: int = 3
    bus: bool = True
    bus_delay_s: float = DEFAULT_BUS_DELAY_S
    batch_s: float = 0.0
    front: str = "round_robin"

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError(f"routers: count must be >= 1, got {self.count}")
        for name in ("bus_delay_s", "batch_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"routers: {name} must be a finite number of seconds >= 0, "
                                  f"got {value!r}")
        if self.front not in FRONTS:
            raise ConfigError(f"routers: front {self.front!r} is not one of {', '.join(FRONTS)}")

    def label(self) -> str:
        """How a benchmark row names this arrangement, e.g. ``3 routers, bus 1 ms``."""
        if self.count == 1:
            return "1 router"
        if not self.bus:
            return f"{self.count} routers, no bus"
        batch = f" + batch {self.batch_s * 1e3:g} ms" if self.batch_s else ""
        return f"{self.count} routers, bus {self.bus_delay_s * 1e3:g} ms{batch}"


class SeveralRoutersSimulation(FleetSimulation):
    """One run of a workload through several routers in front of one simulated fleet
    (module docstring)."""

    def __init__(
        self,
        config: FleetConfig,
        workload: Sequence[WorkloadRequest],
        routers: RoutersConfig,
        *,
        digests: DigestCache | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(config, workload, digests=digests, progress=progress)
        self.routers_config = routers
        for i in range(1, routers.count):
            core = self._new_router(random.Random(f"{config.seed}/router-{i}"))
            self.walkers.append(self._new_walker(core))
        tenants = {DEFAULT_TENANT, *(r.tenant for r in self.workload if r.tenant)}
        self.pseudonyms = Pseudonyms(SIM_CLUSTER_SECRET, sorted(tenants))
        self.views: list[PeerView] = []
        self._outboxes: list[list[Announcement]] = [[] for _ in self.walkers]
        self._next_router = 0
        self._num_unknown_tenant = 0
        if routers.count > 1:
            for i, walker in enumerate(self.walkers):
                walker.core.session_names = self.pseudonyms
                if routers.bus:
                    walker.core.announce = partial(self._queue, i)
                    self.views.append(PeerView(walker.core, clock=self.clock,
                                               expiry_s=math.inf))

    def _walker_for(self, request: WorkloadRequest) -> Walker:
        """The front: the router this new request reaches."""
        count = len(self.walkers)
        if self.routers_config.front == "session" and request.session_id is not None:
            i = zlib.crc32(request.session_id.encode("utf-8")) % count
        else:
            i = self._next_router % count
            self._next_router += 1
        self._counters[f"routed_by_router_{i}"] += 1
        return self.walkers[i]

    def _queue(self, sender: int, item: Announcement) -> None:
        """``RouterCore.announce`` of router ``sender``: into its outbox, sent as a batch."""
        outbox = self._outboxes[sender]
        if not outbox:
            self._push(self.clock.now() + self.routers_config.batch_s, _BUS_SEND, sender)
        if type(item) is FirstToken and item.rate_sample is not None:
            self._counters["bus_rate_samples"] += 1
        elif type(item) is Done and item.itl_sample is not None:
            self._counters["bus_itl_samples"] += 1
        outbox.append(conceal(self.pseudonyms, item))

    def _on_event(self, kind: int, data: object) -> None:
        now = self.clock.now()
        if kind == _BUS_SEND:
            sender = cast("int", data)
            items, self._outboxes[sender] = self._outboxes[sender], []
            self._counters["bus_batches"] += 1
            self._counters["bus_announcements"] += len(items)
            for receiver in range(len(self.walkers)):
                if receiver != sender:
                    self._push(now + self.routers_config.bus_delay_s, _BUS_RECEIVE,
                               (sender, receiver, items))
        elif kind == _BUS_RECEIVE:
            sender, receiver, items = cast("tuple[int, int, list[Announcement]]", data)
            revealed, unknown = reveal(self.pseudonyms, items)
            self._num_unknown_tenant += unknown
            self.views[receiver].apply(f"router-{sender}", revealed)
        else:
            super()._on_event(kind, data)

    def run(self) -> FleetResult:
        result = super().run()
        counters = result.counters
        counters["peer_applied"] = sum(view.stats.num_applied for view in self.views)
        counters["peer_unknown"] = sum(view.stats.num_unknown for view in self.views)
        counters["peer_rate_samples"] = sum(view.stats.num_rate_samples for view in self.views)
        counters["peer_itl_samples"] = sum(view.stats.num_itl_samples for view in self.views)
        counters["peer_bad_samples"] = sum(view.stats.num_bad_samples for view in self.views)
        counters["peer_unknown_tenant"] = self._num_unknown_tenant
        return result


def simulate_routers(workload: Sequence[WorkloadRequest], config: FleetConfig,
                     routers: RoutersConfig, *,
                     digests: DigestCache | None = None) -> FleetResult:
    """Run ``workload`` through ``routers`` in front of a fleet built from ``config``."""
    return SeveralRoutersSimulation(config, workload, routers, digests=digests).run()


def group_replicas_mean(workload: Sequence[WorkloadRequest],
                        records: Sequence[RequestRecord]) -> float:
    """Over the workload's groups of two requests or more (siblings sharing a prefix by
    construction, ``WorkloadRequest.group``), the mean number of replicas a group's requests
    ran on: 1.0 when every group stayed together; 0.0 without such groups."""
    replica_of = {r.request_id: r.replica for r in records if r.replica}
    groups: dict[str, set[str]] = {}
    sizes: dict[str, int] = {}
    for request in workload:
        if request.group is None or request.request_id not in replica_of:
            continue
        groups.setdefault(request.group, set()).add(replica_of[request.request_id])
        sizes[request.group] = sizes.get(request.group, 0) + 1
    spread = [len(replicas) for group, replicas in groups.items() if sizes[group] > 1]
    return sum(spread) / len(spread) if spread else 0.0
