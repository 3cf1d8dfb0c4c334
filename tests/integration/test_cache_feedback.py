"""Measured hits and the feedback loop, end to end (shell/cache_feedback.py).

Real ``kvroute sim serve`` engines (HTTP + ZMQ on loopback) that report
``usage.prompt_tokens_details.cached_tokens`` as vLLM does with
``--enable-prompt-tokens-details``, and a router in the test's event loop. Each round sends
a fresh 200-token prefix, waits until the engine's KV events for it reached the index, then
sends the same prefix again: the second request's predicted cached tokens come from the
index (predicted entries live 10 ms here), its measured ones from the engine.

* hashing that matches the engines: every comparison agrees, no alarm;
* a deliberate mismatch (the router hashes with a ``hash_seed`` the engines do not use, as a
  router and engines started with different ``PYTHONHASHSEED`` would): the alarm goes off
  loudly and the pool routes approximately; once the hashing is fixed (the core is told the
  engines' seed, what a restart with the corrected config does) the shadow predictions agree
  again and exact routing resumes;
* an engine with prefix caching off: reported on ``/metrics`` and in the log, never
  credited with a cached token, not even through the router's own predicted entries.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
import pytest

from kvroute.config import RouterConfig
from kvroute.core.types import PoolName, ReplicaId
from kvroute.shell.runtime import RouterRuntime
from kvroute.sim.launcher import Fleet
from kvroute.wire.prom import parse_exposition

pytestmark = pytest.mark.integration

POOL = PoolName("small")  # as tests/integration/conftest.py names it
ROUTE = "assistant"
FleetFactory = Callable[..., Fleet]
ConfigFor = Callable[..., RouterConfig]
DRIFT = {"min_samples": 3, "window": 6, "threshold": 0.5}


def run(coro: Coroutine[Any, Any, None], timeout_s: float = 40.0) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout_s))


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.getrandbits(40):x}" for _ in range(n))


async def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)


async def ask(session: aiohttp.ClientSession, url: str, content: str) -> tuple[dict[str, Any], str, int]:
    body = {"model": ROUTE, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        doc = json.loads(await resp.read())
        return doc, resp.headers["x-kvroute-replica"], int(resp.headers["x-kvroute-cached-tokens"])


async def metric(session: aiohttp.ClientSession, url: str, name: str,
                 **labels: str) -> float | None:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    for s in parse_exposition(text).samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return None


async def rounds(rt: RouterRuntime, session: aiohttp.ClientSession, rng: random.Random,
                 n: int) -> list[tuple[int, int]]:
    """``n`` rounds (module docstring); the second request's (predicted, reported) each."""
    out = []
    for _ in range(n):
        prefix = words(rng, 200)
        _, first, _ = await ask(session, rt.url, prefix + " " + words(rng, 3))
        replica = ReplicaId(first)
        await wait_for(lambda r=replica: rt.core.index.stats().num_entries_by_replica.get(r, 0)
                       >= 12, "the engine's KV events of the first request")
        await asyncio.sleep(0.05)  # predicted entries (10 ms) have expired
        doc, _, predicted = await ask(session, rt.url, prefix + " " + words(rng, 3))
        out.append((predicted, doc["usage"]["prompt_tokens_details"]["cached_tokens"]))
    return out


def config(fleet: Fleet, config_for: ConfigFor, **pool_overrides: Any) -> RouterConfig:
    base = config_for(fleet, cache_drift=DRIFT, predicted_ttl_s=0.01)
    if not pool_overrides:
        return base
    data: dict[str, Any] = {"pools": {POOL: {"model": base.pools[POOL].model, **pool_overrides,
                                             "replicas": [
        {"name": r.name, "url": r.url, "kv_events": r.kv_events, "kv_replay": r.kv_replay}
        for r in fleet.replicas]}}}
    return config_for(fleet, cache_drift=DRIFT, predicted_ttl_s=0.01, **data)


def test_predictions_agree_with_the_engines_and_their_hit_rates_are_exported(
        make_fleet: FleetFactory, config_for: ConfigFor) -> None:
    fleet = make_fleet(2, enable_prompt_tokens_details=True)

    async def body() -> None:
        async with RouterRuntime(config(fleet, config_for), env={}) as rt, \
                aiohttp.ClientSession() as session:
            pairs = await rounds(rt, session, random.Random(3), 4)
            assert all(p >= 192 and abs(p - m) <= 32 for p, m in pairs), pairs
            assert await metric(session, rt.url, "kvroute_cache_predictions_total",
                                pool=POOL, outcome="agree") == 8  # the firsts: 0 and 0
            assert await metric(session, rt.url, "kvroute_cache_drift_alarm", pool=POOL) == 0
            # The engines' own counters, polled by discovery every 0.5 s.
            await rt.discovery.refresh_now()  # type: ignore[union-attr]
            hits = [await metric(session, rt.url, "kvroute_engine_prefix_cache_hits_total",
                                 replica=r.name) for r in fleet.replicas]
            assert sum(h or 0 for h in hits) >= 4 * 192
            for r in fleet.replicas:
                assert await metric(session, rt.url, "kvroute_engine_prefix_caching_enabled",
                                    replica=r.name) == 1
                assert await metric(session, rt.url, "kvroute_engine_preemptions_total",
                                    replica=r.name) == 0
            # A signed histogram has no _count (OpenMetrics): its +Inf bucket is the count.
            assert await metric(session, rt.url, "kvroute_cache_prediction_error_bucket",
                                pool=POOL, le="+Inf") == 8  # the first of each round too

    run(body())


def test_a_hashing_mismatch_sets_the_drift_alarm_off_until_predictions_agree_again(
        make_fleet: FleetFactory, config_for: ConfigFor, caplog: pytest.LogCaptureFixture) -> None:
    # One engine: a blind index would otherwise send the repeat to the idle other replica,
    # where nothing is cached either (0 predicted, 0 reported: no evidence at all).
    fleet = make_fleet(1, enable_prompt_tokens_details=True)
    caplog.set_level(logging.WARNING, logger="kvroute.shell.cache_feedback")

    async def body() -> None:
        cfg = config(fleet, config_for, hash_seed="12345")
        async with RouterRuntime(cfg, env={}) as rt, aiohttp.ClientSession() as session:
            rng = random.Random(4)
            pairs = await rounds(rt, session, rng, 3)
            assert all(p == 0 and m >= 192 for p, m in pairs), pairs  # the index is blind
            assert rt.core.pool_drifting(POOL)
            assert await metric(session, rt.url, "kvroute_cache_drift_alarm", pool=POOL) == 1
            assert await metric(session, rt.url, "kvroute_cache_drift_alarms_total",
                                pool=POOL) == 1
            alarm = [r for r in caplog.records if "CACHE DRIFT" in r.getMessage()]
            assert alarm and alarm[0].levelno == logging.ERROR
            assert "hash_seed=12345" in alarm[0].getMessage()
            await ask(session, rt.url, words(rng, 50))
            assert await metric(session, rt.url, "kvroute_decisions_total",
                                approximate="true") == 1  # routed approximately
            # The fix: the router hashes like the engines again.
            spec = rt.core.pool(POOL)
            rt.core.set_pool_hashing(POOL, block_size=spec.block_size,
                                     hash_algo=spec.hash_algo, hash_seed=None)
            # Routed approximately, the answers' headers carry the text-chunk prediction; the
            # alarm compares the exact index's shadow prediction, which now agrees.
            await rounds(rt, session, rng, 3)
            assert not rt.core.pool_drifting(POOL)
            assert await metric(session, rt.url, "kvroute_cache_drift_alarm", pool=POOL) == 0
            assert any("agree with the engines' reports again" in r.getMessage()
                       for r in caplog.records)
            routed_approximately = await metric(session, rt.url, "kvroute_decisions_total",
                                                approximate="true")
            await ask(session, rt.url, words(rng, 50))
            assert await metric(session, rt.url, "kvroute_decisions_total",
                                approximate="true") == routed_approximately  # exact again

    run(body())


def test_an_engine_with_prefix_caching_off_is_reported_and_never_credited(
        make_fleet: FleetFactory, config_for: ConfigFor, caplog: pytest.LogCaptureFixture) -> None:
    fleet = make_fleet(1, enable_prompt_tokens_details=True,
                       extra=("--no-enable-prefix-caching",))
    caplog.set_level(logging.ERROR, logger="kvroute.shell.cache_feedback")

    async def body() -> None:
        # Default predicted entries (2 s): the second request would be credited through them.
        async with RouterRuntime(config_for(fleet), env={}) as rt, \
                aiohttp.ClientSession() as session:
            name = fleet.replicas[0].name
            assert rt.core.prefix_caching_off(ReplicaId(name))
            assert await metric(session, rt.url, "kvroute_engine_prefix_caching_enabled",
                                replica=name) == 0
            assert any("prefix caching OFF" in r.getMessage() and name in r.getMessage()
                       for r in caplog.records)
            prompt = words(random.Random(5), 200)
            for _ in range(3):
                doc, replica, predicted = await ask(session, rt.url, prompt)
                assert replica == name and predicted == 0
                assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    run(body())
