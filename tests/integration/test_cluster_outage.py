"""Two routers sharing placements over a NATS that is away: at start, and in mid-traffic.

Real parts on loopback: two simulated engines (``kvroute sim serve``), two in-process
``RouterRuntime``s with ``cluster: {bus: nats}`` and a private ``nats-server`` of this test
(``tests/private_nats.py``) that is started late, or SIGKILLed and started again. The routers
do not read the engines' KV events, so what one knows of the other's placements can only
come over the bus: a sibling sent to router b after a's first request is routed to a's
replica with the prefix counted as cached (``x-kvroute-cached-tokens``) only when the bus
carried a's placement. The same pair of requests while NATS is away is the control: b routes
blind (0 cached tokens), which shows the check can fail.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from private_nats import PrivateNats

from kvroute.config import RouterConfig, parse_config
from kvroute.shell.runtime import RouterRuntime
from kvroute.sim.launcher import Fleet

pytestmark = pytest.mark.integration

POOL = "small"  # as tests/integration/conftest.py names it
ROUTE = "assistant"
MAX_REQUESTS = 400
"""Bound on the background traffic of the mid-traffic outage."""


def run(coro: Coroutine[Any, Any, None], timeout_s: float = 90.0) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout_s))


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.getrandbits(40):x}" for _ in range(n))


async def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)


def config(fleet: Fleet, nats_url: str, subject: str, router_id: str) -> RouterConfig:
    """A router of ``fleet`` without the engines' KV events (the bus is its only news)."""
    return parse_config({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {POOL: {"model": "sim-model", "replicas": [
            {"name": r.name, "url": r.url, "prefill_rate_tps": 20_000.0}
            for r in fleet.replicas]}},
        "routes": {ROUTE: {"pools": [POOL]}},
        "policy": {"name": "kvroute", "seed": 7},
        "discovery": {"health_interval_s": 0.5, "metrics_interval_s": 0.5,
                      "models_interval_s": 5, "timeout_s": 1.0},
        "timeouts": {"connect_s": 1.0, "first_byte_s": 5.0, "total_s": 10.0},
        "cluster": {"bus": "nats", "url": nats_url, "subject": subject,
                    "router_id": router_id, "heartbeat_s": 0.1, "peer_expiry_s": 0.5,
                    "secret": "cluster-secret-for-tests-" + "0" * 16},
        "log_level": "warning",
    }, env={})


async def ask(session: aiohttp.ClientSession, rt: RouterRuntime, content: str
              ) -> tuple[str, int]:
    """(the replica that served, the cached tokens the router counted)."""
    body = {"model": ROUTE, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    async with session.post(rt.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["x-kvroute-replica"], int(resp.headers["x-kvroute-cached-tokens"])


def hears(rt: RouterRuntime, peer: str) -> bool:
    assert rt.cluster is not None
    return peer in rt.cluster.view.peers()


async def siblings(session: aiohttp.ClientSession, a: RouterRuntime, b: RouterRuntime,
                   rng: random.Random, *, bus_up: bool) -> tuple[str, str, int]:
    """A first request at a, then a sibling (same 200-word prefix) at b once a's
    placement had time to arrive: (a's replica, b's replica, b's cached tokens)."""
    assert a.cluster is not None and b.cluster is not None
    prefix = words(rng, 200)
    received = b.cluster.bus.num_received
    first, _ = await ask(session, a, prefix + " " + words(rng, 3))
    if bus_up:
        await wait_for(lambda: b.cluster is not None
                       and b.cluster.bus.num_received > received, "a's placement at b")
    else:
        await asyncio.sleep(0.3)  # as long as it would have taken, and more
    second, cached = await ask(session, b, prefix + " " + words(rng, 3))
    return first, second, cached


def test_routers_started_while_nats_is_down_share_once_it_is_up(
        make_fleet: Callable[..., Fleet], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    fleet = make_fleet(2)
    nats_server = PrivateNats(tmp_path / "js")
    subject = f"kvroute.test.{secrets.token_hex(4)}"
    rng = random.Random(3)

    async def main() -> None:
        async with (RouterRuntime(config(fleet, nats_server.url, subject, "a")) as a,
                    RouterRuntime(config(fleet, nats_server.url, subject, "b")) as b,
                    aiohttp.ClientSession() as session):
            assert a.cluster is not None and b.cluster is not None
            # NATS down: both route alone, and what they would announce is counted.
            first, second, cached = await siblings(session, a, b, rng, bus_up=False)
            assert cached == 0, "b cannot know a's placement with NATS down"
            assert a.cluster.stats()["connected"] == 0 and a.cluster.stats()["dropped"] >= 1
            nats_server.start()
            await wait_for(lambda: hears(a, "b") and hears(b, "a"),
                           "the routers to hear each other once NATS is up")
            assert a.cluster.stats()["connected"] == 1
            first, second, cached = await siblings(session, a, b, rng, bus_up=True)
            assert second == first and cached > 0, (first, second, cached)

    try:
        with caplog.at_level(logging.WARNING, logger="kvroute.shell.nats_bus"):
            run(main())
    finally:
        nats_server.kill()
    down = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(down) == 2, "logged once per router, not per attempt"
    assert sum("reachable" in r.getMessage() for r in caplog.records) == 2


def test_nats_killed_and_restarted_mid_traffic_through_two_routers(
        make_fleet: Callable[..., Fleet], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    fleet = make_fleet(2)
    nats_server = PrivateNats(tmp_path / "js")
    nats_server.start()
    subject = f"kvroute.test.{secrets.token_hex(4)}"
    rng = random.Random(5)

    async def main() -> None:
        async with (RouterRuntime(config(fleet, nats_server.url, subject, "a")) as a,
                    RouterRuntime(config(fleet, nats_server.url, subject, "b")) as b,
                    aiohttp.ClientSession() as session):
            assert a.cluster is not None and b.cluster is not None
            await wait_for(lambda: hears(a, "b") and hears(b, "a"), "the routers to meet")
            statuses: list[int] = []
            stop = asyncio.Event()

            async def traffic() -> None:  # alternating, one at a time, bounded
                for i in range(MAX_REQUESTS):
                    if stop.is_set():
                        return
                    rt = a if i % 2 == 0 else b
                    body = {"model": ROUTE, "max_tokens": 4,
                            "messages": [{"role": "user", "content": words(rng, 40)}]}
                    async with session.post(rt.url + "/v1/chat/completions",
                                            json=body) as resp:
                        await resp.read()
                        statuses.append(resp.status)

            sender = asyncio.create_task(traffic())
            await wait_for(lambda: len(statuses) >= 20 or sender.done(), "traffic")
            dropped = a.cluster.stats()["dropped"]
            nats_server.kill()
            # Alone: each router's view of the other expires with the other's load.
            await wait_for(lambda: not hears(a, "b") and not hears(b, "a"),
                           "peers expired while NATS is away")
            assert a.cluster.stats()["connected"] == 0
            assert a.cluster.stats()["peer_requests"] == 0
            during = len(statuses)
            await wait_for(lambda: len(statuses) >= during + 20 or sender.done(),
                           "traffic while NATS is away")
            assert a.cluster.stats()["dropped"] > dropped, "announcements dropped and counted"
            _, _, cached = await siblings(session, a, b, rng, bus_up=False)
            assert cached == 0, "the control: b routes blind while NATS is away"
            nats_server.start()
            back = time.monotonic()
            await wait_for(lambda: hears(a, "b") and hears(b, "a"),
                           "the routers to hear each other again")
            recovered_s = time.monotonic() - back
            first, second, cached = await siblings(session, a, b, rng, bus_up=True)
            assert second == first and cached > 0, (first, second, cached)
            stop.set()
            await sender
            assert statuses and all(s == 200 for s in statuses), statuses
            assert not sender.exception()
            logging.getLogger(__name__).warning(
                "NATS outage mid-traffic: %d requests, all 200; peers heard again %.2f s after "
                "NATS restarted; a: %s", len(statuses), recovered_s, a.cluster.stats())

    try:
        with caplog.at_level(logging.WARNING):
            run(main())
    finally:
        nats_server.kill()
    lost = [r for r in caplog.records if "disconnected" in r.getMessage()
            and r.name == "kvroute.shell.nats_bus"]
    assert len(lost) == 2, "logged once per router, not per attempt"
    print(*(r.getMessage() for r in caplog.records if r.name == __name__), sep="\n")
