"""RedisState against the real Redis on 127.0.0.1:6379, and its behaviour during an outage.

Two ``RedisState`` instances with separate clients stand for two router processes. Every test
uses its own key prefix (a uuid) and deletes its keys afterwards.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from required import skip_unless_required

from kvroute.bench.processes import free_port
from kvroute.config import parse_config
from kvroute.core.session import SessionRecord, SessionUsage, session_key
from kvroute.core.types import ReplicaId
from kvroute.shell.metrics import RouterMetrics
from kvroute.shell.state import RedisState, build_state

pytestmark = pytest.mark.integration

REDIS_URL = "redis://127.0.0.1:6379/0"
TEST_SECONDS = 8.0



async def set_pin(state: RedisState, key: str, replica: str, ttl_s: float) -> None:
    await state.put_session(key, SessionRecord(pin=ReplicaId(replica)), ttl_s)


async def get_pin(state: RedisState, key: str) -> str | None:
    record = await state.get_session(key)
    return None if record is None else record.pin


def _redis_reachable() -> str | None:
    try:
        client = redis.Redis.from_url(REDIS_URL, socket_timeout=0.5, socket_connect_timeout=0.5)
        client.ping()
        client.close()
    except (redis.RedisError, OSError) as exc:
        return f"Redis is not reachable at {REDIS_URL} ({exc}); start redis-server to run this"
    return None


_REDIS_MISSING = _redis_reachable()


@pytest.fixture
def redis_reachable() -> None:
    """Skip without Redis (fail under CI: ``tests/required.py``)."""
    if _REDIS_MISSING is not None:
        skip_unless_required("the Redis suite", _REDIS_MISSING, env="KVROUTE_REQUIRE_REDIS")


needs_redis = pytest.mark.usefixtures("redis_reachable")


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), TEST_SECONDS))


@asynccontextmanager
async def two_routers(metrics: RouterMetrics | None = None) -> AsyncIterator[
    tuple[RedisState, RedisState, str]
]:
    """Two independent RedisState instances and a unique key prefix; cleans up its keys."""
    prefix = f"test-{uuid.uuid4().hex}"
    a = RedisState.from_url(REDIS_URL, metrics=metrics, timeout_s=1.0)
    b = RedisState.from_url(REDIS_URL, metrics=metrics, timeout_s=1.0)
    try:
        yield a, b, prefix
    finally:
        await a.close()
        await b.close()
        admin = aioredis.Redis.from_url(REDIS_URL)
        keys = [k async for k in admin.scan_iter(match=f"kvroute:*:{prefix}*", count=100)]
        if keys:
            await admin.delete(*keys)
        await admin.aclose()


@needs_redis
def test_two_routers_agree_on_session_records_and_ttl_refresh() -> None:
    async def go() -> None:
        async with two_routers() as (a, b, prefix):
            key = f"{prefix}-s1"
            assert await get_pin(a, key) is None
            await set_pin(a, key, "r3", ttl_s=30)
            assert await get_pin(b, key) == "r3"
            await set_pin(b, key, "r1", ttl_s=30)
            assert await get_pin(a, key) == "r1"
            # The key is namespaced as documented and carries the TTL, refreshed by each write.
            raw = aioredis.Redis.from_url(REDIS_URL)
            try:
                assert await raw.get(f"kvroute:session:{key}") == b'{"pin":"r1"}'
                await raw.pexpire(f"kvroute:session:{key}", 5000)
                await set_pin(a, key, "r1", ttl_s=30)
                ttl_ms = await raw.pttl(f"kvroute:session:{key}")
                assert 25_000 < ttl_ms <= 30_000
            finally:
                await raw.aclose()

    run(go)


@needs_redis
def test_session_record_expires() -> None:
    async def go() -> None:
        async with two_routers() as (a, b, prefix):
            key = f"{prefix}-short"
            await set_pin(a, key, "r0", ttl_s=0.15)
            assert await get_pin(b, key) == "r0"
            deadline = time.monotonic() + 3.0
            while await get_pin(b, key) is not None:  # bounded: Redis expiry is ~ms accurate
                assert time.monotonic() < deadline, "the record did not expire within 3 s"
                await asyncio.sleep(0.05)

    run(go)


@needs_redis
def test_warm_cooldown_is_claimed_once_across_routers() -> None:
    async def go() -> None:
        async with two_routers() as (a, b, prefix):
            key = f"{prefix}-w"
            # 20 concurrent attempts from two processes: exactly one wins.
            results = await asyncio.gather(
                *[(a if i % 2 else b).try_start_warm(key, cooldown_s=30) for i in range(20)]
            )
            assert sorted(results) == [False] * 19 + [True]
            assert await a.try_start_warm(f"{prefix}-other", cooldown_s=30) is True
            # After the cooldown the key can be claimed again.
            short = f"{prefix}-short"
            assert await a.try_start_warm(short, cooldown_s=0.1) is True
            assert await b.try_start_warm(short, cooldown_s=0.1) is False
            deadline = time.monotonic() + 3.0
            while not await b.try_start_warm(short, cooldown_s=0.1):
                assert time.monotonic() < deadline, "cooldown did not expire within 3 s"
                await asyncio.sleep(0.05)

    run(go)


def test_outage_degrades_to_no_pin_and_no_warm_and_is_counted() -> None:
    """Nothing listens on the port: every call degrades, is counted, and never raises."""
    metrics = RouterMetrics()
    port = free_port()
    config = parse_config(
        {
            "pools": {"p": {"model": "m", "replicas": [{"name": "r0", "url": "http://127.0.0.1:9"}]}},
            "routes": {"m": {"pools": ["p"]}},
            "state": {"backend": "redis", "url": f"redis://127.0.0.1:{port}/0"},
        },
        env={},
    )
    state = build_state(config, metrics=metrics)
    assert isinstance(state, RedisState)

    async def go() -> None:
        await set_pin(state, "s", "r0", ttl_s=10)
        assert await get_pin(state, "s") is None
        assert await state.try_start_warm("s", cooldown_s=10) is False
        assert state.available is False
        await state.close()

    run(go)
    assert state.num_errors == 3
    for op in ("put_session", "get_session", "try_start_warm"):
        assert metrics.value("kvroute_state_errors_total", {"backend": "redis", "op": op}) == 1


def test_hung_server_is_bounded_by_the_timeout() -> None:
    """A server that accepts and never answers costs one timeout per call, not a hang."""
    metrics = RouterMetrics()

    async def go() -> None:
        accepted: list[asyncio.StreamWriter] = []

        async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(writer)

        server = await asyncio.start_server(hold, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        state = RedisState.from_url(
            f"redis://127.0.0.1:{port}/0", timeout_s=0.2, metrics=metrics
        )
        started = time.monotonic()
        assert await get_pin(state, "s") is None
        assert await state.try_start_warm("s", 10) is False
        elapsed = time.monotonic() - started
        assert elapsed < 1.5, f"two calls took {elapsed:.2f}s with a 0.2s timeout"
        await state.close()
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()

    run(go)
    assert metrics.value("kvroute_state_errors_total", {"backend": "redis", "op": "get_session"}) == 1


@needs_redis
def test_recovers_after_outage() -> None:
    """A state that failed flips back to available on the first successful call."""

    async def go() -> None:
        async with two_routers() as (a, _b, prefix):
            a.available = False  # as after an outage
            await set_pin(a, f"{prefix}-x", "r0", ttl_s=5)
            assert a.available is True
            assert await get_pin(a, f"{prefix}-x") == "r0"

    run(go)


@needs_redis
def test_a_whole_session_record_is_shared_and_a_foreign_value_reads_as_none() -> None:
    async def go() -> None:
        async with two_routers() as (a, b, prefix):
            key = f"{prefix}-rec"
            record = SessionRecord(pin=ReplicaId("r2"), tier=1, usage=SessionUsage(4000, 90, 9))
            await a.put_session(key, record, ttl_s=30)
            assert await b.get_session(key) == record
            raw = aioredis.Redis.from_url(REDIS_URL)
            try:
                await raw.set(f"kvroute:session:{key}", b"r3")  # an older router's pin value
            finally:
                await raw.aclose()
            assert await b.get_session(key) is None
            assert b.available  # a value it cannot read is not an outage

    run(go)


@needs_redis
def test_keys_are_pseudonyms_shared_only_by_routers_with_the_secret() -> None:
    """With the cluster secret, no Redis key or value holds the tenant, route or session id;
    two routers with the secret share the record and the warm claim, one with another
    secret sees neither."""
    namespace = f"test-{uuid.uuid4().hex}"
    tenant, route, session = "tenant-acme-7f3", "route-chat", "session-alice-42"
    key = session_key(tenant, route, session)
    secret = "cluster-secret-for-tests-" + "0" * 16

    async def go() -> None:
        a, b, c = (RedisState.from_url(REDIS_URL, namespace=namespace, timeout_s=1.0,
                                       secret=s)
                   for s in (secret, secret, "another-fleet-secret-0123456789"))
        admin = aioredis.Redis.from_url(REDIS_URL)
        try:
            await set_pin(a, key, "r3", ttl_s=30)
            assert await a.try_start_warm(key, cooldown_s=30)
            assert await get_pin(b, key) == "r3"
            assert not await b.try_start_warm(key, cooldown_s=30)
            assert await get_pin(c, key) is None
            assert await c.try_start_warm(key, cooldown_s=30)
            keys = [k async for k in admin.scan_iter(match=f"{namespace}:*", count=100)]
            assert len(keys) == 3
            stored = b"".join(keys) + b"".join([await admin.get(k) or b"" for k in keys])
            for clear in (tenant, route, session):
                assert clear.encode() not in stored, f"{clear!r} in Redis in clear"
        finally:
            keys = [k async for k in admin.scan_iter(match=f"{namespace}:*", count=100)]
            if keys:
                await admin.delete(*keys)
            await admin.aclose()
            for state in (a, b, c):
                await state.close()

    run(go)
