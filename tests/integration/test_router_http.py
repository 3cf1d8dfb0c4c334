"""kvroute end to end: real HTTP and ZMQ on loopback, ``kvroute sim serve`` engines.

Each test starts its own router (``RouterRuntime``) in the test's event loop, talks to it
over HTTP with aiohttp, and looks at the router's core or the engines to check where
requests went and why. Engines that tests break (kill, restart) are started per test.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import gc
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from settling import settled

from kvroute.config import RouterConfig, TokenizerConfig
from kvroute.core.session import session_key
from kvroute.core.types import ReplicaId
from kvroute.shell.runtime import RouterRuntime
from kvroute.sim.launcher import Fleet, start_fleet
from kvroute.wire.prom import parse_exposition
from kvroute.wire.sse import SSEDecoder

pytestmark = pytest.mark.integration

MODEL = "sim-model"  # as tests/integration/conftest.py starts the engines
POOL = "small"
ROUTE = "assistant"
FleetFactory = Callable[..., Fleet]
ConfigFor = Callable[..., RouterConfig]


def run(coro: Coroutine[Any, Any, None], timeout_s: float = 12.0) -> None:
    """Run one async test body with a hard deadline."""
    asyncio.run(asyncio.wait_for(coro, timeout_s))

HEADERS = ("x-kvroute-replica", "x-kvroute-pool", "x-kvroute-cached-tokens")


def words(rng: random.Random, n: int, tag: str = "w") -> str:
    """``n`` distinct words: the simulated tokenizer makes each one token."""
    return " ".join(f"{tag}{rng.getrandbits(40):x}" for _ in range(n))


def chat(content: str, *, stream: bool = False, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    body = {"model": ROUTE, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "stream": stream}
    body.update(extra)
    return body


class Client:
    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session = session
        self.url = url

    async def post(self, body: Any, *, path: str = "/v1/chat/completions",
                   headers: Mapping[str, str] | None = None,
                   raw: bytes | None = None) -> tuple[int, Mapping[str, str], bytes]:
        data = raw if raw is not None else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        async with self.session.post(self.url + path, data=data, headers=hdrs) as resp:
            return resp.status, resp.headers.copy(), await resp.read()

    async def get(self, path: str, headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
        async with self.session.get(self.url + path, headers=headers or {}) as resp:
            return resp.status, await resp.read()


async def wait_for(predicate: Any, timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` until true; the timeout is only a bound for a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)


async def wait_for_async(read: Callable[[], Awaitable[Any]], want: Any, timeout_s: float = 5.0,
                         what: str = "condition") -> None:
    """Poll the coroutine ``read()`` until it returns ``want`` (the timeout is a bound)."""
    deadline = time.monotonic() + timeout_s
    while (got := await read()) != want:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}: "
                                 f"{got!r}, not {want!r}")
        await asyncio.sleep(0.02)


def entries(rt: RouterRuntime, replica: str) -> int:
    return rt.core.index.stats().num_entries_by_replica.get(ReplicaId(replica), 0)


async def with_router(config: RouterConfig, body: Any, env: Mapping[str, str] | None = None) -> None:
    async with RouterRuntime(config, env=env or {}) as rt, aiohttp.ClientSession() as session:
        await body(rt, Client(session, rt.url))


# --------------------------------------------------------------------------------------------
# Placement
# --------------------------------------------------------------------------------------------


def test_requests_sharing_a_prefix_land_where_it_is_cached(shared_fleet: Fleet, config_for: ConfigFor) -> None:
    rng = random.Random(1)

    async def body(rt: RouterRuntime, c: Client) -> None:
        for _ in range(4):
            prefix = words(rng, 200)
            status, h1, _ = await c.post(chat(prefix + " " + words(rng, 5)))
            assert status == 200
            first = h1["x-kvroute-replica"]
            await wait_for(lambda first=first: entries(rt, first) > 0, what="KV events of the first request")
            await asyncio.sleep(0.1)  # the first request's blocks are all reported
            for _ in range(2):
                status, h2, _ = await c.post(chat(prefix + " " + words(rng, 5)))
                assert status == 200
                assert h2["x-kvroute-replica"] == first
                assert int(h2["x-kvroute-cached-tokens"]) >= 192  # 12 of the 13 prefix blocks

    run(with_router(config_for(shared_fleet), body))


def test_unique_prompts_sent_one_after_another_use_every_idle_replica(
        make_fleet: FleetFactory, config_for: ConfigFor) -> None:
    """Nothing in flight, nothing cached: every idle replica is as good as any other. A rate
    learned once on one replica must not keep the others out (they are scored at the
    fastest rate until they have a sample of their own), so the prompts use both. The engines
    take no time, so the first replica's first sample says it is ten times faster than
    configured: without that rule, it would take every prompt."""
    fleet = make_fleet(2, timing="0,0,0,0")
    rng = random.Random(20)

    async def body(rt: RouterRuntime, c: Client) -> None:
        served = []
        for _ in range(12):
            status, h, _ = await c.post(chat(words(rng, 400)))
            assert status == 200
            served.append(h["x-kvroute-replica"])
        counts = {r.name: served.count(r.name) for r in fleet.replicas}
        assert min(counts.values()) >= 4, served  # a fair share each, not one straggler

    run(with_router(config_for(fleet), body), timeout_s=30.0)


def test_a_burst_of_siblings_colocates(shared_fleet: Fleet, config_for: ConfigFor) -> None:
    rng = random.Random(2)

    async def body(rt: RouterRuntime, c: Client) -> None:
        prefix = words(rng, 400)
        results = await asyncio.gather(
            *(c.post(chat(prefix + " " + words(rng, 3))) for _ in range(6))
        )
        placed = collections.Counter(h["x-kvroute-replica"] for _, h, _ in results)
        assert all(status == 200 for status, _, _ in results)
        assert len(placed) == 1, f"siblings were split: {placed}"

    run(with_router(config_for(shared_fleet), body))


def test_a_hot_prefix_spreads_once_queues_build(shared_fleet: Fleet, config_for: ConfigFor) -> None:
    rng = random.Random(3)

    async def body(rt: RouterRuntime, c: Client) -> None:
        prefix = words(rng, 300)
        # While no queue builds, the prefix stays where it is cached (a balancer would not).
        status, h, _ = await c.post(chat(prefix + " " + words(rng, 5)))
        assert status == 200
        home = h["x-kvroute-replica"]
        await wait_for(lambda: entries(rt, home) >= 18, what="the prefix's events")
        await settled(lambda: entries(rt, home))  # a first catch-up may still be delivering
        for _ in range(3):
            status, h, _ = await c.post(chat(prefix + " " + words(rng, 5)))
            assert status == 200 and h["x-kvroute-replica"] == home
            assert int(h["x-kvroute-cached-tokens"]) >= 288  # 18 of the prefix's 19 blocks
        # Long distinct suffixes: each request brings 1,500 tokens of its own prefill, so
        # queueing them all behind the cached replica soon costs more than recomputing the
        # 300-token prefix elsewhere.
        results = await asyncio.gather(
            *(c.post(chat(prefix + " " + words(rng, 1500))) for _ in range(12))
        )
        assert all(status == 200 for status, _, _ in results)
        placed = collections.Counter(h["x-kvroute-replica"] for _, h, _ in results)
        assert len(placed) >= 2, f"a hot prefix stayed on one replica: {placed}"
        assert placed[home] >= 1, f"the burst never used the replica holding the prefix: {placed}"
        # Those sent elsewhere were expected to recompute the prefix: they went for speed.
        elsewhere = [int(h["x-kvroute-cached-tokens"]) for _, h, _ in results
                     if h["x-kvroute-replica"] != home]
        assert elsewhere and min(elsewhere) < 288

    run(with_router(config_for(shared_fleet), body))


def test_unique_prompts_balance(shared_fleet: Fleet, config_for: ConfigFor) -> None:
    rng = random.Random(4)

    async def body(rt: RouterRuntime, c: Client) -> None:
        placed: collections.Counter[str] = collections.Counter()
        for _ in range(4):
            results = await asyncio.gather(
                *(c.post(chat(words(rng, 300))) for _ in range(6))
            )
            for status, h, _ in results:
                assert status == 200
                placed[h["x-kvroute-replica"]] += 1
        assert set(placed) == {"s0", "s1", "s2"}
        assert max(placed.values()) - min(placed.values()) <= 4, placed

    run(with_router(config_for(shared_fleet), body))


def test_an_approximate_pool_routes_on_text_and_says_so(shared_fleet: Fleet,
                                                       config_for: ConfigFor) -> None:
    """``tokenizer: none``: no token ids, so no block hashes to match against the engines'
    events; the router matches text chunks against its own predicted entries (TTL
    ``approx_predicted_ttl_s``) and says so on every answer and in ``/metrics``."""
    rng = random.Random(12)
    base = config_for(shared_fleet)
    pool = dataclasses.replace(base.pools[POOL], tokenizer=TokenizerConfig("none"))
    config = dataclasses.replace(base, pools={POOL: pool})

    async def body(rt: RouterRuntime, c: Client) -> None:
        for _ in range(3):
            prefix = words(rng, 300)
            status, h, _ = await c.post(chat(prefix + " " + words(rng, 5)))
            assert status == 200 and h["x-kvroute-approximate"] == "true"
            home = h["x-kvroute-replica"]
            for _ in range(2):  # followers find the prefix's text where it was sent
                status, h, _ = await c.post(chat(prefix + " " + words(rng, 5)))
                assert status == 200 and h["x-kvroute-replica"] == home
                assert h["x-kvroute-approximate"] == "true"
        prefix = words(rng, 400)
        results = await asyncio.gather(*(c.post(chat(prefix + " " + words(rng, 3)))
                                         for _ in range(6)))
        placed = collections.Counter(h["x-kvroute-replica"] for _, h, _ in results)
        assert len(placed) == 1, f"siblings were split: {placed}"
        assert rt.metrics is not None
        assert rt.metrics.value("kvroute_pool_approximate", {"pool": POOL}) == 1

    run(with_router(config, body))


# --------------------------------------------------------------------------------------------
# Sessions
# --------------------------------------------------------------------------------------------


def test_a_session_follows_its_pin_and_the_pin_lives_while_the_session_does(
        shared_fleet: Fleet, config_for: ConfigFor) -> None:
    """The session id is read in LiteLLM's header order; the replica that served a session
    is pinned (TTL refreshed by every request), and the ``session`` policy follows the pin
    rather than its hash once the fleet has changed under it."""
    rng = random.Random(13)
    ttl_s = 2.0
    config = config_for(shared_fleet, policy={"name": "session", "seed": 7},
                        state={"backend": "memory", "session_ttl_s": ttl_s},
                        discovery={"health_interval_s": 30, "metrics_interval_s": 30})
    session_id = "sess-0123456789"
    # x-litellm-session-id comes before x-session-id in LiteLLM's order.
    headers = {"x-litellm-session-id": session_id, "x-session-id": "not-this-one"}
    key = session_key("default", ROUTE, session_id)

    async def body(rt: RouterRuntime, c: Client) -> None:
        assert rt.state is not None
        state = rt.state

        async def pin(of: str = key) -> str | None:
            record = await state.get_session(of)
            return None if record is None else record.pin

        async def ask() -> str:
            status, h, _ = await c.post(chat(words(rng, 30)), headers=headers)
            assert status == 200
            return h["x-kvroute-replica"]

        first = await ask()
        await wait_for_async(lambda: pin(), first, what="the pin")
        assert await pin(session_key("default", ROUTE, "not-this-one")) is None
        # The fleet changes: the pinned replica leaves, the session moves and is pinned anew.
        rt.core.set_healthy(ReplicaId(first), False)
        moved = await ask()
        assert moved != first
        await wait_for_async(lambda: pin(), moved, what="the new pin")
        # The first replica comes back. Rendezvous hashing alone would send the session back
        # to it (it won the hash before); the pin keeps it where its cache now is.
        rt.core.set_healthy(ReplicaId(first), True)
        for _ in range(3):
            assert await ask() == moved
        # Every request refreshes the TTL: past the first request's TTL the pin still holds.
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.sleep(0.6 * ttl_s)
        assert await ask() == moved
        await asyncio.sleep(max(0.0, started + 1.2 * ttl_s - loop.time()))
        assert await pin() == moved
        # Left alone, the pin expires.
        await wait_for_async(lambda: pin(), None, timeout_s=3 * ttl_s, what="the pin to expire")

    run(with_router(config, body), timeout_s=20.0)


# --------------------------------------------------------------------------------------------
# Streaming, headers, failures
# --------------------------------------------------------------------------------------------


def sse_events(raw: bytes) -> list[str]:
    decoder = SSEDecoder()
    return [e.data for e in decoder.feed(raw) + decoder.flush()]


def test_stream_is_relayed_and_every_answer_carries_the_headers(
        shared_fleet: Fleet, config_for: ConfigFor, sent_writes: list[bytes]) -> None:
    rng = random.Random(5)
    writes = sent_writes

    async def body(rt: RouterRuntime, c: Client) -> None:
        status, h, raw = await c.post(chat(words(rng, 50), stream=True, max_tokens=6))
        assert status == 200
        # The head went out with the engine's first event, in one write.
        assert writes[0].startswith(b"HTTP/1.1 200") and b"\r\n\r\n" in writes[0]
        assert b"data: " in writes[0].split(b"\r\n\r\n", 1)[1]
        assert b"".join(writes).endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        assert h["Content-Type"].startswith("text/event-stream")
        events = sse_events(raw)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert len(chunks) >= 6 and all(ch["object"] == "chat.completion.chunk" for ch in chunks)
        assert chunks[0]["model"] == MODEL  # the route name was mapped to the served model
        for name in HEADERS:
            assert name in h
        status, h, raw = await c.post(
            {"model": ROUTE, "prompt": words(rng, 20), "max_tokens": 3}, path="/v1/completions")
        assert status == 200 and json.loads(raw)["object"] == "text_completion"
        assert h["x-kvroute-pool"] == POOL and h["x-kvroute-replica"] in {"s0", "s1", "s2"}
        status, h, _ = await c.post({"model": "nope", "messages": [{"role": "user", "content": "x"}]})
        assert status == 404 and all(name in h for name in HEADERS)

    run(with_router(config_for(shared_fleet), body))


def test_the_router_times_its_own_share_of_each_answer(shared_fleet: Fleet,
                                                      config_for: ConfigFor) -> None:
    """``router_time_seconds``: one observation per answered request in each stage, each
    stage a positive part of the latency the client saw, ``total`` their sum."""
    rng = random.Random(11)

    async def body(rt: RouterRuntime, c: Client) -> None:
        assert rt.metrics is not None
        elapsed = 0.0
        for stream in (True, False):
            started = time.perf_counter()
            status, _, raw = await c.post(chat(words(rng, 40), stream=stream, max_tokens=3))
            elapsed += time.perf_counter() - started
            assert status == 200 and raw
        status, _, _ = await c.post({"model": "nope", "messages": []})  # refused: not timed
        assert status in (400, 404)
        stages = {stage: (rt.metrics.value("kvroute_router_time_seconds_count", {"stage": stage}),
                          rt.metrics.value("kvroute_router_time_seconds_sum", {"stage": stage}))
                  for stage in ("before_engine", "after_engine", "total")}
        assert all(count == 2 for count, _ in stages.values()), stages
        before, after, total = (stages[s][1] for s in ("before_engine", "after_engine", "total"))
        assert before > 0 and after > 0
        assert total == pytest.approx(before + after)
        assert total < elapsed  # a share of what the client waited, not more

    run(with_router(config_for(shared_fleet), body))


def test_engine_killed_mid_stream_ends_with_an_error_event(make_fleet: FleetFactory, config_for: ConfigFor) -> None:
    fleet = make_fleet(2)
    rng = random.Random(6)

    async def body(rt: RouterRuntime, c: Client) -> None:
        request = chat(words(rng, 20), stream=True, max_tokens=4000)
        async with c.session.post(c.url + "/v1/chat/completions", json=request) as resp:
            assert resp.status == 200
            victim = resp.headers["x-kvroute-replica"]
            received = await resp.content.readany()
            index = [r.name for r in fleet.replicas].index(victim)
            fleet.processes[index].send_signal(signal.SIGKILL)
            received += await resp.content.read()
        events = sse_events(received)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert victim in error["message"] and error["code"] == 502
        for data in events[:-2]:
            assert json.loads(data)["object"] == "chat.completion.chunk"

    run(with_router(config_for(fleet), body))


def test_engine_killed_before_first_byte_is_retried_elsewhere(make_fleet: FleetFactory, config_for: ConfigFor) -> None:
    fleet = make_fleet(2)
    rng = random.Random(7)
    # Slow health probes: the router must find out from the failed request itself.
    config = config_for(fleet, discovery={"health_interval_s": 30, "metrics_interval_s": 30})

    async def body(rt: RouterRuntime, c: Client) -> None:
        prefix = words(rng, 200)
        status, h, _ = await c.post(chat(prefix))
        victim = h["x-kvroute-replica"]
        await wait_for(lambda: entries(rt, victim) > 0, what="events")
        index = [r.name for r in fleet.replicas].index(victim)
        fleet.processes[index].send_signal(signal.SIGKILL)
        fleet.processes[index].wait(5)
        for stream in (False, True):
            status, h, raw = await c.post(chat(prefix + " " + words(rng, 3), stream=stream))
            assert status == 200, raw
            assert h["x-kvroute-replica"] != victim
        # The first refused connection takes the replica out of routing at once
        # (Discovery.report_failure), so only the first request had to be retried.
        retries = rt.metrics.value("kvroute_retries_total", {"replica": victim})
        assert retries == 1.0
        assert rt.metrics.value("kvroute_upstream_errors_total",
                                {"replica": victim, "kind": "connect"}) == 1.0
        assert not rt.core.is_healthy(ReplicaId(victim))

    run(with_router(config, body))


def test_engine_restart_resets_its_index(make_fleet: FleetFactory, config_for: ConfigFor,
                                         base_port: int, sim_specs: Callable[..., Any]) -> None:
    fleet = make_fleet(2, base_port=base_port)
    rng = random.Random(8)
    # NOTE: vLLM's publisher has no epoch, so a restart is only visible in the event stream
    # if the new process's first batch reaches the SUB socket (the subscriber's docstring);
    # discovery's health probes are the guaranteed path, and the one this test pins down.
    config = config_for(fleet, discovery={"health_interval_s": 0.2, "unhealthy_after": 1,
                                          "metrics_interval_s": 30, "timeout_s": 0.5})

    async def body(rt: RouterRuntime, c: Client) -> None:
        prefix = words(rng, 200)
        status, h, _ = await c.post(chat(prefix))
        assert status == 200
        victim = ReplicaId(h["x-kvroute-replica"])
        await wait_for(lambda: entries(rt, victim) >= 12, what="events")
        index = [r.name for r in fleet.replicas].index(victim)
        fleet.processes[index].send_signal(signal.SIGKILL)
        fleet.processes[index].wait(5)
        await wait_for(lambda: not rt.core.is_healthy(victim), what="the replica taken out")
        assert entries(rt, victim) == 0
        # Same ports, fresh process with an empty cache.
        restarted = start_fleet([sim_specs(2)[index]], base_port=base_port + 3 * index,
                                timeout_s=20.0)
        try:
            await wait_for(lambda: rt.core.is_healthy(victim), what="the replica back")
            status, h, _ = await c.post(chat(prefix + " " + words(rng, 3)))
            assert status == 200
            assert int(h["x-kvroute-cached-tokens"]) == 0  # nobody holds the old blocks
            # The index follows the new process: its events arrive and are applied. A batch
            # published before the router's SUB has reconnected is lost (ZMQ's slow joiner)
            # and recovered by replay only once another follows, so send until one arrives.
            engine = restarted.replicas[0]
            async with aiohttp.ClientSession() as direct:
                for _ in range(5):
                    async with direct.post(engine.url + "/v1/chat/completions",
                                           json={**chat(words(rng, 200)), "model": MODEL}) as resp:
                        assert resp.status == 200
                    deadline = time.monotonic() + 1.0
                    while entries(rt, victim) < 12 and time.monotonic() < deadline:
                        await asyncio.sleep(0.02)
                    if entries(rt, victim) >= 12:
                        break
            assert entries(rt, victim) >= 12, "the restarted engine's events never arrived"
        finally:
            restarted.stop()

    run(with_router(config, body), timeout_s=14.0)


def test_events_missed_before_subscribing_are_replayed(make_fleet: FleetFactory, config_for: ConfigFor) -> None:
    fleet = make_fleet(2)
    rng = random.Random(9)
    prefix = words(rng, 200)

    async def body(rt: RouterRuntime, c: Client) -> None:
        engine = fleet.replicas[1]
        sub = rt.subscribers[ReplicaId(engine.name)]
        async with aiohttp.ClientSession() as direct:
            # Nothing reaches the router's SUB until a new batch is published: one more
            # request makes the engine publish seq > 0, and the router replays 0..seq-1.
            # A batch published before the subscription is in place is lost (ZMQ's slow
            # joiner), so send until one arrives (bounded).
            for _ in range(10):
                async with direct.post(engine.url + "/v1/chat/completions",
                                       json=chat(words(rng, 30)) | {"model": MODEL}) as resp:
                    assert resp.status == 200
                try:
                    await wait_for(lambda: sub.stats.replayed_batches > 0, timeout_s=1.0)
                    break
                except AssertionError:
                    continue
        await wait_for(lambda: sub.stats.replayed_batches > 0, what="a replay")
        status, h, _ = await c.post(chat(prefix + " " + words(rng, 3)))
        assert status == 200
        assert h["x-kvroute-replica"] == engine.name
        assert int(h["x-kvroute-cached-tokens"]) >= 192

    async def main() -> None:
        # The engine serves (and publishes) before the router exists.
        async with aiohttp.ClientSession() as direct, direct.post(
                fleet.replicas[1].url + "/v1/chat/completions",
                json=chat(prefix) | {"model": MODEL}) as resp:
            assert resp.status == 200
        await with_router(config_for(fleet), body)

    run(main())


# --------------------------------------------------------------------------------------------
# Bad input: one test each, exact status and message fragment, nothing sent to an engine
# --------------------------------------------------------------------------------------------

BAD_INPUTS: list[tuple[str, dict[str, Any], int, str]] = [
    ("malformed_json", {"raw": b'{"model": "assistant", "messages": ['}, 400, "not valid JSON"),
    ("not_an_object", {"raw": b'[1, 2]'}, 400, "must be a JSON object"),
    ("unknown_model", {"body": {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}},
     404, "The model `gpt-9` does not exist. This router serves: assistant"),
    ("missing_model", {"body": {"messages": [{"role": "user", "content": "x"}]}}, 400,
     "Missing 'model'"),
    ("missing_messages", {"body": {"model": ROUTE}}, 400, "Missing 'messages'"),
    ("missing_prompt", {"body": {"model": ROUTE}, "path": "/v1/completions"}, 400,
     "Missing 'prompt'"),
    ("wrong_type_max_tokens", {"body": chat("x", max_tokens="10")}, 400,
     "'max_tokens' must be an integer, got string \"10\""),
    ("zero_max_tokens", {"body": chat("x", max_tokens=0)}, 400, "max_tokens must be at least 1"),
    ("wrong_type_stream", {"body": chat("x", stream="yes")}, 400, "'stream' must be true or false"),
    ("message_without_role", {"body": {"model": ROUTE, "messages": [{"content": "x"}]}}, 400,
     "messages[0] has no 'role'"),
    ("bad_cache_salt", {"body": chat("x", cache_salt="a/b")}, 400, "Parameter 'cache_salt'"),
    ("oversized_body", {"body": chat("x" * 5000)}, 413, "over this router's limit of 4096 bytes"),
]


@pytest.mark.parametrize(("case", "request_", "status", "fragment"), BAD_INPUTS,
                         ids=[case for case, *_ in BAD_INPUTS])
def test_bad_input(shared_fleet: Fleet, case: str, request_: dict[str, Any], status: int,
                   fragment: str, config_for: ConfigFor) -> None:
    config = config_for(shared_fleet, max_body_bytes=4096)

    async def body(rt: RouterRuntime, c: Client) -> None:
        got, headers, raw = await c.post(request_.get("body"), raw=request_.get("raw"),
                                         path=request_.get("path", "/v1/chat/completions"))
        assert got == status, raw
        error = json.loads(raw)["error"]
        assert fragment in error["message"]
        assert error["code"] == status and isinstance(error["type"], str)
        assert headers["x-kvroute-replica"] == "none"
        assert rt.metrics.value("kvroute_decisions_total", {
            "pool": POOL, "replica": "s0", "reason": "cost", "approximate": "false"}) is None

    run(with_router(config, body))


# --------------------------------------------------------------------------------------------
# Admission, tenants, admin
# --------------------------------------------------------------------------------------------


def test_admission_overload_answers_429_with_retry_after(shared_fleet: Fleet, config_for: ConfigFor) -> None:
    rng = random.Random(10)
    config = config_for(shared_fleet, admission={
        "max_in_flight": 1, "max_queue": 1, "queue_timeout_s": 0.3, "retry_after_s": 2})

    async def body(rt: RouterRuntime, c: Client) -> None:
        long = chat(words(rng, 10), stream=True, max_tokens=1500)  # holds the one slot ~1.5 s
        async with c.session.post(c.url + "/v1/chat/completions", json=long) as held:
            assert held.status == 200
            queued = asyncio.ensure_future(c.post(chat(words(rng, 10))))
            await wait_for(lambda: rt.app is not None and rt.core is not None
                           and rt.metrics is not None and _queued(rt) == 1, what="a waiter")
            status, h, raw = await c.post(chat(words(rng, 10)))  # queue full
            assert status == 429 and h["Retry-After"] == "2"
            assert "at its limit of 1 requests in flight and 1 waiting" in json.loads(raw)["error"]["message"]
            status, h, raw = await queued  # waited 0.3 s, then gave up
            assert status == 429 and "waited 0.3s" in json.loads(raw)["error"]["message"]
            await held.read()
        assert rt.metrics.value("kvroute_admission_rejects_total", {"reason": "queue_full"}) == 1
        assert rt.metrics.value("kvroute_admission_rejects_total", {"reason": "queue_timeout"}) == 1
        status, _, _ = await c.post(chat(words(rng, 10)))
        assert status == 200

    run(with_router(config, body))


def _queued(rt: RouterRuntime) -> int:
    assert rt.app is not None
    return rt.app.router.admission.queued


TENANT_ENV = {"ACME_KEY": "key-acme", "BETA_KEY": "key-beta", "ADMIN_KEY": "key-admin",
              "KVROUTE_SALT_SECRET": "test-secret"}
TENANTS = [{"name": "acme", "api_key_env": "ACME_KEY", "routing_headers": True},
           {"name": "beta", "api_key_env": "BETA_KEY"}]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_tenant_salts_are_injected_and_isolate_caches(shared_fleet: Fleet, config_for: ConfigFor) -> None:
    rng = random.Random(11)
    config = config_for(shared_fleet, tenants=TENANTS, admin_key_env="ADMIN_KEY")

    async def body(rt: RouterRuntime, c: Client) -> None:
        prefix = words(rng, 200)
        status, _, raw = await c.post(chat(prefix))
        assert status == 401 and "Missing API key" in json.loads(raw)["error"]["message"]
        status, _, raw = await c.post(chat(prefix), headers=bearer("key-wrong"))
        assert status == 401 and "Invalid API key" in json.loads(raw)["error"]["message"]

        status, h, _ = await c.post(chat(prefix), headers=bearer("key-acme"))
        assert status == 200
        home = h["x-kvroute-replica"]
        await wait_for(lambda: entries(rt, home) >= 12, what="acme's blocks")
        # Same prompt, another tenant: acme's salted blocks are invisible to beta, and beta
        # (not allowed the routing headers) is not told where anything is cached.
        status, h, _ = await c.post(chat(prefix), headers=bearer("key-beta"))
        assert status == 200 and not [k for k in h if k.lower().startswith("x-kvroute-")]
        # acme sees its own blocks; the engine confirms the hit on its salted hashes.
        request = chat(prefix + " " + words(rng, 3))
        status, h, raw = await c.post(request, headers=bearer("key-acme"))
        assert status == 200 and h["x-kvroute-replica"] == home
        assert int(h["x-kvroute-cached-tokens"]) >= 192

    run(with_router(config, body, env=TENANT_ENV))


def test_salt_reaches_the_engine(make_fleet: FleetFactory, config_for: ConfigFor) -> None:
    fleet = make_fleet(1, extra=("--enable-prompt-tokens-details",))
    rng = random.Random(12)
    config = config_for(fleet, tenants=TENANTS)
    prefix = words(rng, 200)

    async def body(rt: RouterRuntime, c: Client) -> None:
        status, _, raw = await c.post(chat(prefix), headers=bearer("key-acme"))
        assert status == 200
        # Unsalted, straight to the engine: no hit on the tenant's salted blocks.
        async with aiohttp.ClientSession() as direct, direct.post(
                fleet.replicas[0].url + "/v1/chat/completions",
                json=chat(prefix) | {"model": MODEL}) as resp:
            usage = (await resp.json())["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        status, _, raw = await c.post(chat(prefix), headers=bearer("key-acme"))
        assert json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] >= 192

    run(with_router(config, body, env=TENANT_ENV))


def test_admin_endpoints_need_the_admin_key(shared_fleet: Fleet, config_for: ConfigFor) -> None:
    config = config_for(shared_fleet, tenants=TENANTS, admin_key_env="ADMIN_KEY")

    async def body(rt: RouterRuntime, c: Client) -> None:
        for path in ("/admin/index", "/admin/state"):
            status, raw = await c.get(path)
            assert status == 401, raw
            status, raw = await c.get(path, bearer("key-acme"))
            assert status == 403 and "not the admin key" in json.loads(raw)["error"]["message"]
            status, raw = await c.get(path, bearer("key-admin"))
            assert status == 200
        _, raw = await c.get("/admin/state", bearer("key-admin"))
        state = json.loads(raw)
        assert set(state["replicas"]) == {"s0", "s1", "s2"}
        assert all(r["healthy"] for r in state["replicas"].values())
        assert set(state["kv_events"]) == {"s0", "s1", "s2"}
        _, raw = await c.get("/admin/index?hashes=1,2", bearer("key-admin"))
        assert "num_entries" in json.loads(raw) and "match" in json.loads(raw)

    run(with_router(config, body, env=TENANT_ENV))

    async def disabled(rt: RouterRuntime, c: Client) -> None:
        status, raw = await c.get("/admin/state", bearer("anything"))
        assert status == 404 and "admin_key_env" in json.loads(raw)["error"]["message"]

    run(with_router(config_for(shared_fleet), disabled))


def test_models_health_and_metrics(shared_fleet: Fleet, config_for: ConfigFor) -> None:
    async def body(rt: RouterRuntime, c: Client) -> None:
        status, raw = await c.get("/v1/models")
        cards = json.loads(raw)["data"]
        assert status == 200 and [card["id"] for card in cards] == [ROUTE]
        assert cards[0]["root"] == MODEL and cards[0]["max_model_len"] == 131072
        status, raw = await c.get("/health")
        assert status == 200 and json.loads(raw)["healthy_replicas"] == {POOL: 3}
        _, h, _ = await c.post(chat("hello there " * 20))
        await wait_for(lambda: entries(rt, h["x-kvroute-replica"]) > 0, what="events")
        await settled(lambda: rt.core.index.stats().num_entries)
        status, raw = await c.get("/metrics")
        assert status == 200 and b"kvroute_decisions_total{" in raw
        assert b"kvroute_kv_event_batches_applied_total{" in raw
        # The index's size is read when /metrics is scraped.
        stats = rt.core.index.stats()
        assert stats.num_entries > 0
        scraped = {s.name: s.value for s in parse_exposition(
            raw.decode(), names=("kvroute_index_",)).samples}
        assert scraped["kvroute_index_entries"] == stats.num_entries
        assert scraped["kvroute_index_hashes"] == stats.num_hashes
        # The router's garbage collections are timed while it runs.
        assert rt.metrics is not None
        full = rt.metrics.value("kvroute_gc_pause_seconds_count", {"generation": "2"}) or 0
        gc.collect()
        assert rt.metrics.value("kvroute_gc_pause_seconds_count", {"generation": "2"}) == full + 1
        # And its event loop's wake-ups (a stall of the whole loop shows there, in none of
        # the requests' own times).
        await wait_for(lambda: (rt.metrics.value("kvroute_event_loop_lag_seconds_count") or 0)
                       > 0, what="a loop-lag observation")

    callbacks = len(gc.callbacks)
    run(with_router(config_for(shared_fleet), body))
    assert len(gc.callbacks) == callbacks  # and no longer once it has stopped


@pytest.mark.parametrize("log_format", ["json", "kv"])
def test_one_structured_log_line_per_decision(shared_fleet: Fleet, config_for: ConfigFor,
                                              caplog: pytest.LogCaptureFixture,
                                              log_format: str) -> None:
    """Every routed request leaves exactly one ``kvroute.decision`` line that says where it
    went and why, matching the answer's headers; refused input leaves none."""
    rng = random.Random(14)
    config = config_for(shared_fleet, log_format=log_format)

    def parse(line: str) -> dict[str, Any]:
        if log_format == "json":
            return dict(json.loads(line))
        return dict(field.split("=", 1) for field in line.split(" "))

    async def body(rt: RouterRuntime, c: Client) -> None:
        answers = {}
        for i, stream in enumerate((False, True, False)):
            rid = f"req-{log_format}-{i}"
            status, h, _ = await c.post(chat(words(rng, 40), stream=stream),
                                        headers={"x-request-id": rid,
                                                 "x-session-id": "s-abcdef12" if i == 2 else ""})
            assert status == 200
            answers[rid] = h
        status, _, _ = await c.post({"model": ROUTE, "messages": "not a list"})
        assert status == 400
        lines = [parse(r.getMessage()) for r in caplog.records if r.name == "kvroute.decision"]
        assert len(lines) == 3, lines
        for line in lines:
            h = answers[str(line["request_id"])]
            assert str(line["replica"]) == h["x-kvroute-replica"]
            assert str(line["pool"]) == h["x-kvroute-pool"] == POOL
            assert int(line["cached_tokens"]) == int(h["x-kvroute-cached-tokens"])
            assert str(line["route"]) == ROUTE and str(line["outcome"]) == "ok"
            assert str(line["policy"]) == "kvroute" and str(line["reason"]) == "cost"
            assert int(line["prompt_tokens"]) >= 40 and float(line["routing_us"]) > 0
            assert int(line["retries"]) == 0 and str(line["tenant"]) == "default"
            assert str(line["approximate"]) in ("False", "false")
        sessions = [str(line["session"]) for line in lines]
        assert sessions.count("True") + sessions.count("true") == 1

    with caplog.at_level(logging.INFO, logger="kvroute.decision"):
        run(with_router(config, body))


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def test_kvroute_serve_command(shared_fleet: Fleet, tmp_path: Path) -> None:
    replicas = [{"name": r.name, "url": r.url, "kv_events": r.kv_events} for r in shared_fleet.replicas]
    path = tmp_path / "kvroute.yaml"
    path.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {POOL: {"model": MODEL, "replicas": replicas}},
        "routes": {ROUTE: {"pools": [POOL]}},
        "log_level": "warning",
    }))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    proc = subprocess.Popen(
        [sys.executable, "-c", "from kvroute.cli import main; main()", "serve", "-c", str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        info = json.loads(line)
        assert info["ready"] is True

        async def talk() -> None:
            async with aiohttp.ClientSession() as session:
                status, h, _ = await Client(session, info["url"]).post(chat("hi there"))
                assert status == 200 and h["x-kvroute-replica"] in {"s0", "s1", "s2"}

        run(talk())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_kvroute_serve_rejects_a_bad_config(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("pools: {small: {model: m, replicas: [{name: s0, url: 'ftp://x'}]}}\n"
                    "routes: {a: {pools: [small]}}\n")
    done = subprocess.run(
        [sys.executable, "-c", "from kvroute.cli import main; main()", "serve", "-c", str(path)],
        check=False, capture_output=True, text=True, timeout=30,
    )
    assert done.returncode == 2
    assert "pools.small.replicas[0].url" in done.stderr and "http(s)" in done.stderr
