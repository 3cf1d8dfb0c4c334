"""``shell/cluster.py`` over a real NATS server: two routers' cores, one subject.

Each test uses its own subject, so runs never see each other's messages. The routers are
``ClusterSharing`` objects around real ``RouterCore``s in this event loop (no engines: the
placements are the core's own ``route`` calls), so a test can read both cores.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
from collections.abc import Callable
from typing import Any

import pytest
from required import NATS_URL, require_nats

from kvroute.config import ClusterConfig
from kvroute.core.index import TenantScope
from kvroute.core.peer_policies import make_policy
from kvroute.core.router import PoolSpec, ReplicaSpec, RouterCore, RouteRequest
from kvroute.core.types import PoolName, ReplicaId, RequestId, TenantName
from kvroute.shell.cluster import ClusterSharing
from kvroute.shell.nats_bus import NatsBus
from kvroute.shell.state import MonotonicClock

pytestmark = pytest.mark.integration

POOL = PoolName("p")
PROMPT = list(range(100, 420))
TENANT = TenantName("t")
SECRET = "cluster-secret-for-tests-" + "0" * 16


@pytest.fixture(autouse=True)
def nats_up() -> None:
    require_nats(NATS_URL)


def make_core(seed: int) -> RouterCore:
    rng = random.Random(seed)
    return RouterCore([PoolSpec(POOL, tuple(ReplicaSpec(ReplicaId(f"r{i}")) for i in range(4)),
                                block_size=16)],
                      lambda: make_policy("kvroute", rng), clock=MonotonicClock())


def request(rid: str, tokens: list[int]) -> RouteRequest:
    return RouteRequest(RequestId(rid), POOL, TenantScope(TenantName("t")),
                        num_prompt_tokens=len(tokens), prompt_token_ids=tokens,
                        expected_output_tokens=16)


def config(subject: str, router_id: str, url: str = NATS_URL) -> ClusterConfig:
    return ClusterConfig(bus="nats", url=url, subject=subject, router_id=router_id,
                         heartbeat_s=0.1, peer_expiry_s=0.5)


def share(cluster: ClusterConfig, core: RouterCore, secret: str = SECRET) -> ClusterSharing:
    """A router's cluster side around ``core``, knowing the one tenant ``TENANT``."""
    return ClusterSharing(cluster, core, clock=MonotonicClock(), secret=secret, tenants=[TENANT])


async def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.01)


def run(coro: Any) -> None:
    asyncio.run(asyncio.wait_for(coro, 30.0))


def test_a_placement_reaches_the_peer_and_its_end_releases_the_load() -> None:
    async def main() -> None:
        subject = f"kvroute.test.{secrets.token_hex(4)}"
        a_core, b_core = make_core(1), make_core(2)
        a = share(config(subject, "a"), a_core)
        b = share(config(subject, "b"), b_core)
        await a.start()
        await b.start()
        try:
            await wait_for(lambda: "a" in b.view.peers() and "b" in a.view.peers(),
                           "the routers to hear each other")
            first = a_core.route(request("x", PROMPT + [1]))
            await wait_for(lambda: b.view.in_flight("a") == 1, "the placement at b")
            assert b_core.load.snapshot(first.replica).num_in_flight == 1
            sibling = b_core.route(request("y", PROMPT + [2]))
            assert sibling.replica == first.replica
            assert sibling.expected_cached_tokens == len(PROMPT)
            await wait_for(lambda: a.view.in_flight("b") == 1, "b's placement at a")
            a_core.on_complete(first.replica, RequestId("x"), output_tokens=16)
            await wait_for(lambda: b.view.in_flight("a") == 0, "the end at b")
            assert b_core.load.snapshot(first.replica).num_in_flight == 1  # b's own
            assert a.state()["gaps"] == 0 and b.state()["bad"] == 0
        finally:
            await a.stop()
        # A router that stops says so: its load leaves b at once, not at expiry.
        await wait_for(lambda: b.view.peers() == [], "a's goodbye")
        assert b.view.stats.num_expired_peers == 1
        await b.stop()

    run(main())


def test_a_first_token_and_an_end_teach_the_peer_what_the_origin_learned() -> None:
    async def main() -> None:
        subject = f"kvroute.test.{secrets.token_hex(4)}"
        a_core, b_core = make_core(1), make_core(2)
        a = share(config(subject, "a"), a_core)
        b = share(config(subject, "b"), b_core)
        await a.start()
        await b.start()
        try:
            await wait_for(lambda: "a" in b.view.peers() and "b" in a.view.peers(),
                           "the routers to hear each other")
            first = a_core.route(request("x", PROMPT))
            await wait_for(lambda: b.view.in_flight("a") == 1, "the placement at b")
            await asyncio.sleep(0.05)  # at least 50 ms to the first token: a rate sample
            a_core.on_first_token(first.replica, RequestId("x"))
            learned = a_core.load.snapshot(first.replica).prefill_rate_tps
            assert learned < 10_000.0  # 320 tokens in 50 ms or more, against the configured
            await wait_for(lambda: b.state()["rate_samples"] == 1, "the sample at b")
            # exactly the origin's sample: when the news arrived does not enter it
            assert b_core.load.snapshot(first.replica).prefill_rate_tps == learned
            # and the end's inter-token sample likewise
            await asyncio.sleep(0.05)
            a_core.on_complete(first.replica, RequestId("x"), output_tokens=64)
            itl_scale = a_core.load.snapshot(first.replica).itl_scale
            assert itl_scale != 1.0
            await wait_for(lambda: b.state()["itl_samples"] == 1, "the end's sample at b")
            assert b_core.load.snapshot(first.replica).itl_scale == itl_scale
            assert b.state()["bad_samples"] == 0
        finally:
            await a.stop()
            await b.stop()

    run(main())


def test_seq_outbox_and_peer_seq_say_when_a_placement_has_reached_a_peer() -> None:
    """The stats ``bench/several_routers.py`` paces sibling requests on: a placement sits in
    the outbox until the publisher's turn, then goes out in batch ``seq``; the peer's
    ``peer_seqs()`` reaches that number once it has applied the batch, and by then the
    placement is in its core."""
    async def main() -> None:
        subject = f"kvroute.test.{secrets.token_hex(4)}"
        a_core, b_core = make_core(1), make_core(2)
        a = share(config(subject, "a"), a_core)
        b = share(config(subject, "b"), b_core)
        await a.start()
        await b.start()
        try:
            await wait_for(lambda: "a" in b.view.peers(), "b to hear a")
            before = a.stats()["seq"]
            first = a_core.route(request("x", PROMPT + [1]))
            assert a.stats()["outbox"] == 1  # queued; the publisher has not run yet
            await wait_for(lambda: a.stats()["outbox"] == 0, "a's outbox to empty")
            sent = int(a.stats()["seq"])
            assert sent > before
            await wait_for(lambda: b.peer_seqs().get("a", 0) >= sent, "b to apply a's batch")
            assert b.view.in_flight("a") == 1
            assert b.state()["peer_seq"] == b.peer_seqs()
            sibling = b_core.route(request("y", PROMPT + [2]))
            assert sibling.replica == first.replica
            assert sibling.expected_cached_tokens == len(PROMPT)
        finally:
            await a.stop()
            await b.stop()

    run(main())


def test_a_router_that_goes_silent_is_expired_with_its_load() -> None:
    async def main() -> None:
        subject = f"kvroute.test.{secrets.token_hex(4)}"
        a_core, b_core = make_core(1), make_core(2)
        a = share(config(subject, "a"), a_core)
        b = share(config(subject, "b"), b_core)
        await a.start()
        await b.start()
        try:
            await wait_for(lambda: "a" in b.view.peers(), "b to hear a")
            placed = a_core.route(request("x", PROMPT))
            await wait_for(lambda: b.view.in_flight("a") == 1, "the placement at b")
            # Silence a without a goodbye, as a killed process would be.
            for task in a._tasks:
                task.cancel()
            await a.bus.close()
            await wait_for(lambda: "a" not in b.view.peers(), "a's expiry", timeout_s=3.0)
            assert b_core.load.snapshot(placed.replica).num_in_flight == 0
            assert b.view.stats.num_expired_requests == 1
        finally:
            await b.stop()

    run(main())


def test_no_nats_at_start_is_logged_and_routing_goes_on(caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    async def main() -> None:
        import socket

        with socket.socket() as probe:  # a port nothing listens on
            probe.bind(("127.0.0.1", 0))
            url = f"nats://127.0.0.1:{probe.getsockname()[1]}"
        core = make_core(1)
        sharing = share(config("kvroute.test.none", "a", url), core)
        await sharing.start(wait_s=0.5)
        try:
            assert core.route(request("x", PROMPT)).replica  # routing is not held up
            await asyncio.sleep(0.05)
            assert sharing.bus.num_dropped >= 1 and not sharing.bus.available
        finally:
            await sharing.stop()

    with caplog.at_level(logging.ERROR, logger="kvroute.shell.nats_bus"):
        run(main())
    assert any("cluster bus (NATS" in r.getMessage() and "unavailable" in r.getMessage()
               for r in caplog.records)


def test_garbage_on_the_subject_is_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        subject = f"kvroute.test.{secrets.token_hex(4)}"
        core = make_core(1)
        sharing = share(config(subject, "a"), core)
        await sharing.start()
        other = NatsBus(NATS_URL, subject, lambda data: None, name="kvroute-test-garbage")
        await other.start(wait_s=5.0)
        try:
            assert await other.publish(b"not msgpack at all")
            await wait_for(lambda: sharing.num_bad == 1, "the bad message")
        finally:
            await other.close()
            await sharing.stop()

    with caplog.at_level(logging.ERROR, logger="kvroute.shell.cluster"):
        run(main())
    assert any("not a kvroute peer batch" in r.getMessage() for r in caplog.records)


def test_the_bus_carries_no_tenant_session_or_request_id() -> None:
    """A subscriber on the real subject without the secret reads no tenant, session or
    request id; a router with the secret still places the sibling on the predicted prefix
    and knows the peer's session for its own; one with another secret learns neither."""
    tenant, session, rid = TenantName("tenant-acme-7f3"), "session-alice-42", "request-own-99"

    def ask(core: RouterCore, request_id: str, tail: int, session_id: str) -> Any:
        tokens = PROMPT + [tail]
        return core.route(RouteRequest(
            RequestId(request_id), POOL, TenantScope(tenant), num_prompt_tokens=len(tokens),
            prompt_token_ids=tokens, expected_output_tokens=16, session_id=session_id))

    async def main() -> None:
        subject = f"kvroute.test.{secrets.token_hex(4)}"
        raw: list[bytes] = []
        spy = NatsBus(NATS_URL, subject, raw.append, name="kvroute-test-spy")
        await spy.start(wait_s=5.0)
        a_core, b_core, c_core = make_core(1), make_core(2), make_core(3)
        a = ClusterSharing(config(subject, "a"), a_core, clock=MonotonicClock(), secret=SECRET,
                           tenants=[tenant])
        b = ClusterSharing(config(subject, "b"), b_core, clock=MonotonicClock(), secret=SECRET,
                           tenants=[tenant])
        c = ClusterSharing(config(subject, "c"), c_core, clock=MonotonicClock(),
                           secret="another-fleet-secret-0123456789", tenants=[tenant])
        for router in (a, b, c):
            await router.start()
        try:
            await wait_for(lambda: "a" in b.view.peers() and "a" in c.view.peers(),
                           "b and c to hear a")
            first = ask(a_core, rid, 1, session)
            await wait_for(lambda: b.view.in_flight("a") == 1 and c.view.in_flight("a") == 1,
                           "the placement at b and c")
            sibling = ask(b_core, "b-1", 2, "session-bob-1")
            assert (sibling.replica, sibling.expected_cached_tokens) == (first.replica,
                                                                          len(PROMPT))
            stranger = ask(c_core, "c-1", 2, "session-carol-1")
            assert stranger.expected_cached_tokens == 0 and c.num_unknown_tenant == 1
            a_core.on_complete(first.replica, RequestId(rid), output_tokens=16)
            await wait_for(lambda: b.view.in_flight("a") == 0 and c.view.in_flight("a") == 0,
                           "the end at b and c")
            # The session rests on a's replica in b's view, under the key b gives it too.
            key = f"{tenant}\x1f{session}"
            at_b = b_core.load.snapshot(first.replica, None, b.names.session(key))
            assert (b_core.load.snapshot(first.replica).resting_sessions,
                    at_b.resting_sessions) == (1, 0)
            at_c = c_core.load.snapshot(first.replica, None, c.names.session(key))
            assert at_c.resting_sessions == 1  # another secret: not recognised
            await wait_for(lambda: len(raw) >= 3, "the spy to read the announcements")
        finally:
            for router in (a, b, c):
                await router.stop()
            await spy.close()
        seen = b"".join(raw)
        assert a.names.tenant(tenant).encode() in seen  # the spy did read the placement
        for clear in (tenant, session, rid, "session-bob-1", "b-1"):
            assert clear.encode() not in seen, f"{clear!r} on the bus in clear"

    run(main())
