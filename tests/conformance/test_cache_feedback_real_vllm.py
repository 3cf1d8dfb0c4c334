"""The feedback loop against real vLLM 0.32 on CPU (``tests/realvllm.py``; skipped with the
reason when it is not installed).

Two engines started in parallel, both with ``--enable-prompt-tokens-details``: ``e0`` with
prefix caching (vLLM's default), ``e1`` with ``--no-enable-prefix-caching``.

* A router in front of ``e0`` that hashes with a ``hash_seed`` the engine does not use (the
  engine runs without ``PYTHONHASHSEED``; the router is told ``12345``): every repeated prefix
  is reported cached by vLLM and predicted as 0 by the router; the drift alarm goes on, is
  logged and exported, and the pool routes approximately.
* A router in front of ``e1``: the engine is reported (log, ``/metrics``) and the same prompt
  sent three times is never credited with a cached token, while vLLM reports none either.

Prompts: a fresh nonce and ~600 tokens of filler each, so several 128-token CPU blocks are
cacheable and no test depends on an earlier one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import realvllm
from realvllm import RealVllmEngine

from kvroute.config import RouterConfig, parse_config
from kvroute.core.types import PoolName, ReplicaId
from kvroute.shell.runtime import RouterRuntime
from kvroute.wire.prom import parse_exposition

pytestmark = pytest.mark.realvllm

ROUTE = "assistant"
POOL = PoolName("p")


@pytest.fixture(scope="module")
def engines() -> Iterator[list[RealVllmEngine]]:
    """``[e0 (prefix caching on), e1 (off)]``, both reporting prompt-token details."""
    with realvllm.real_vllm_engines(
        2, extra_args=("--enable-prompt-tokens-details",),
        per_engine_args=((), ("--no-enable-prefix-caching",)),
    ) as started:
        yield started


def config(engine: RealVllmEngine, *, predicted_ttl_s: float = 0.01,
           **pool_extra: Any) -> RouterConfig:
    return parse_config({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {POOL: {"model": engine.model, **pool_extra, "replicas": [{
            "name": engine.name, "url": engine.url, "kv_events": engine.events_endpoint,
            "kv_events_bind": True, "kv_replay": engine.replay_endpoint,
            "kv_topic": engine.topic}]}},
        "routes": {ROUTE: {"pools": [POOL]}},
        "discovery": {"health_interval_s": 0.5, "metrics_interval_s": 1.0, "timeout_s": 2.0},
        "timeouts": {"connect_s": 2.0, "first_byte_s": 60.0, "total_s": 120.0},
        "cache_drift": {"min_samples": 3, "window": 6},
        "predicted_ttl_s": predicted_ttl_s,
        "log_level": "warning",
    }, env={})


async def chat(session: aiohttp.ClientSession, url: str, content: str) -> tuple[int, int]:
    """(predicted, reported) cached tokens of one answer through the router."""
    body = {"model": ROUTE, "messages": [{"role": "user", "content": content}],
            "max_tokens": 2}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        doc = await resp.json()
        return (int(resp.headers["x-kvroute-cached-tokens"]),
                doc["usage"]["prompt_tokens_details"]["cached_tokens"])


async def metric(session: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    values = [s.value for s in parse_exposition(text).samples
              if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert values, f"{name}{labels} is not on /metrics"
    return values[0]


async def until(predicate: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(0.05)


def prompt(n: int) -> str:
    return f"{realvllm.nonce()} " + realvllm.filler_text(n, 60)


async def events_live(rt: RouterRuntime, session: aiohttp.ClientSession,
                      engine: RealVllmEngine) -> None:
    """vLLM's PUB drops what it publishes before the router's SUB is connected: send probes
    straight to the engine until a batch arrived."""
    sub = rt.subscribers[ReplicaId(engine.name)]
    for n in itertools.count():
        if sub.stats.batches > 0:
            return
        assert n < 40, f"no KV event reached the router from {engine.events_endpoint}"
        body = {"model": engine.model, "max_tokens": 1,
                "messages": [{"role": "user", "content": prompt(n)}]}
        async with session.post(engine.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
        await asyncio.sleep(0.25)


def test_a_hash_seed_mismatch_with_real_vllm_sets_the_drift_alarm_off(
        engines: list[RealVllmEngine], caplog: pytest.LogCaptureFixture) -> None:
    engine = engines[0]
    caplog.set_level(logging.ERROR, logger="kvroute.shell.cache_feedback")

    async def body() -> None:
        async with RouterRuntime(config(engine, hash_seed="12345"), env={}) as rt, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            await events_live(rt, session, engine)
            pairs = []
            replica = ReplicaId(engine.name)

            def entries() -> int:
                return rt.core.index.stats().num_entries_by_replica.get(replica, 0)

            for n in range(3):
                text = prompt(100 + n)
                before = entries()
                await chat(session, rt.url, text)
                await until(lambda b=before: entries() > b, "the engine's BlockStored events")
                await asyncio.sleep(0.3)  # all of them
                pairs.append(await chat(session, rt.url, text))
            assert all(p == 0 and m >= 128 for p, m in pairs), pairs
            assert rt.core.pool_drifting(POOL)
            assert await metric(session, rt.url, "kvroute_cache_drift_alarm", pool=POOL) == 1
            assert any("CACHE DRIFT" in r.getMessage() for r in caplog.records)

    asyncio.run(asyncio.wait_for(body(), 240))


def test_real_vllm_without_prefix_caching_is_reported_and_never_credited(
        engines: list[RealVllmEngine], caplog: pytest.LogCaptureFixture) -> None:
    engine = engines[1]
    caplog.set_level(logging.ERROR, logger="kvroute.shell.cache_feedback")

    async def body() -> None:
        # Default predicted entries (2 s): without the rule the repeats would be credited.
        async with RouterRuntime(config(engine, predicted_ttl_s=2.0), env={}) as rt, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            assert rt.core.prefix_caching_off(ReplicaId(engine.name))
            assert await metric(session, rt.url, "kvroute_engine_prefix_caching_enabled",
                                replica=engine.name) == 0
            assert any("prefix caching OFF" in r.getMessage() for r in caplog.records)
            text = prompt(200)
            for _ in range(3):
                assert await chat(session, rt.url, text) == (0, 0)

    asyncio.run(asyncio.wait_for(body(), 240))
