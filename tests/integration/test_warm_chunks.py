"""Chunked warm-ups against a real ``kvroute sim serve`` large engine (issue #5).

A session crossing ``warm_ahead.fraction`` of the small pool's window is warmed on the large
pool in growing prefixes of its exact token ids (``warm_ahead.chunk_tokens``), then the chat
body itself. A recording pass-through (:class:`_Recorder`) sits between the router and the
large engine, so the tests see every request the engine got, in order, with the times it
arrived and was answered; the engine's own KV events (replayed from its ROUTER socket) and
prefix-cache counters show what each chunk cached.

Timing: the large engine prefills at 0.4 ms a token (``TIMING``), so a 256-token chunk takes
about 0.1 s and the whole ≈1,500-token warm-up about 0.6 s: long enough for a request sent
when the first chunk arrives to land inside the warm-up on a loaded machine.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import string
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Self

import aiohttp
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from kvroute.config import RouterConfig, parse_config
from kvroute.core.events import BlockStored
from kvroute.core.index import TenantScope
from kvroute.core.router import RouteRequest
from kvroute.core.scenarios import version_salt
from kvroute.core.types import PoolName, ReplicaId, RequestId, TenantName
from kvroute.core.warm import chunk_bounds
from kvroute.shell.runtime import RouterRuntime
from kvroute.sim.launcher import Fleet, ReplicaHandle, ReplicaSpec, start_fleet
from kvroute.wire.vllm_events import (
    ReplayBatch,
    ReplayEnd,
    decode_replay_reply,
    encode_replay_request,
)

pytestmark = pytest.mark.integration

SMALL_MODEL = "sim-small"
LARGE_MODEL = "sim-large"
SMALL_WINDOW = 2048
LARGE_WINDOW = 8192
SMALL_TIMING = "0.001,0.00002,0.0002,0"
TIMING = "0.001,0.0004,0.0002,0"
CHUNK = 256
ROUTE = "agent"


def run(coro: Coroutine[Any, Any, None], timeout_s: float = 30.0) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout_s))


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    specs = [
        ReplicaSpec(name="s0", pool="small", model=SMALL_MODEL, max_model_len=SMALL_WINDOW,
                    extra_args=("--timing", SMALL_TIMING)),
        ReplicaSpec(name="l0", pool="large", model=LARGE_MODEL, max_model_len=LARGE_WINDOW,
                    extra_args=("--timing", TIMING)),
    ]
    with start_fleet(specs, timeout_s=30.0) as started:
        yield started


@dataclass(slots=True)
class _Seen:
    """One generation request the large engine got through the recorder."""

    path: str
    body: dict[str, Any]
    arrived_s: float
    answered_s: float | None = None
    status: int | None = None

    @property
    def is_warm(self) -> bool:
        return self.body.get("max_tokens") == 1

    @property
    def prompt_ids(self) -> list[int] | None:
        prompt = self.body.get("prompt")
        return prompt if isinstance(prompt, list) else None


@dataclass
class _Recorder:
    """A pass-through to the large engine that records its generation requests in arrival
    order and sets ``first_generation`` when the first one arrives."""

    engine_url: str
    seen: list[_Seen] = field(default_factory=list)
    first_generation: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""
    _runner: web.AppRunner | None = None
    _http: aiohttp.ClientSession | None = None

    async def _forward(self, request: web.Request) -> web.Response:
        assert self._http is not None
        raw = await request.read()
        entry = None
        if request.method == "POST" and request.path in ("/v1/completions",
                                                         "/v1/chat/completions"):
            entry = _Seen(request.path, json.loads(raw), time.monotonic())
            self.seen.append(entry)
            self.first_generation.set()
        async with self._http.request(
                request.method, self.engine_url + request.path_qs, data=raw or None,
                headers={"Content-Type": request.headers.get("Content-Type",
                                                             "application/json")}) as resp:
            body = await resp.read()
            if entry is not None:
                entry.answered_s, entry.status = time.monotonic(), resp.status
            return web.Response(body=body, status=resp.status,
                                content_type=resp.content_type or "application/json")

    async def __aenter__(self) -> Self:
        self._http = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None and self._http is not None
        await self._runner.cleanup()
        await self._http.close()


def _replica(handle: ReplicaHandle, url: str | None = None) -> dict[str, Any]:
    rep: dict[str, Any] = {"name": handle.name, "url": url or handle.url,
                           "prefill_rate_tps": 2_500.0}
    if handle.kv_events:
        rep["kv_events"] = handle.kv_events
    if handle.kv_replay:
        rep["kv_replay"] = handle.kv_replay
    return rep


def _config(fleet: Fleet, large_url: str, chunk_tokens: int, large_tokenizer: str = "engine",
            *, version_salt: bool = False) -> RouterConfig:
    small, large = fleet.by_pool("small")[0], fleet.by_pool("large")[0]
    return parse_config({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {
            "small": {"model": SMALL_MODEL, "tokenizer": "engine", "replicas": [_replica(small)]},
            "large": {"model": LARGE_MODEL, "tokenizer": large_tokenizer,
                      "replicas": [_replica(large, large_url)]},
        },
        "routes": {ROUTE: {"pools": ["small", "large"], "version_salt": version_salt}},
        "policy": {"name": "kvroute", "seed": 5},
        "discovery": {"health_interval_s": 0.5, "metrics_interval_s": 1.0,
                      "models_interval_s": 30, "timeout_s": 1.0},
        "timeouts": {"connect_s": 1.0, "first_byte_s": 10.0, "total_s": 10.0},
        "warm_ahead": {"enabled": True, "chunk_tokens": chunk_tokens, "timeout_s": 10.0},
        "log_level": "warning",
    }, env={})


def _words(rng: random.Random, n: int) -> str:
    """``n`` three-letter words: one simulated token each."""
    return " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(3))
                    for _ in range(n))


def _counter(rt: RouterRuntime, name: str, **labels: str) -> float:
    return rt.metrics.value(f"kvroute_{name}_total", dict(labels)) or 0.0


async def _wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)


async def _chat(http: aiohttp.ClientSession, url: str, messages: list[dict[str, Any]],
                session_id: str, **extra: Any) -> tuple[int, str]:
    body = {"model": ROUTE, "messages": messages, "max_tokens": 4, "stream": False, **extra}
    async with http.post(url + "/v1/chat/completions", json=body,
                         headers={"x-session-id": session_id}) as resp:
        await resp.read()
        return resp.status, resp.headers.get("x-kvroute-pool", "")


async def _engine_counters(http: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """The engine's prefix-cache (queries, hits) token counters."""
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    values = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    for line in text.splitlines():
        for name in values:
            if line.startswith((name + "{", name + " ")):
                values[name] += float(line.rsplit(" ", 1)[1])
    return values["vllm:prefix_cache_queries_total"], values["vllm:prefix_cache_hits_total"]


async def _stored_hashes(handle: ReplicaHandle) -> list[int]:
    """Every ``BlockStored`` hash the engine published, in order (its replay buffer)."""
    assert handle.kv_replay is not None
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(handle.kv_replay)
        await sock.send_multipart(encode_replay_request(0))
        out: list[int] = []
        for _ in range(100_000):
            reply = decode_replay_reply(await asyncio.wait_for(sock.recv_multipart(), 3.0))
            if isinstance(reply, ReplayEnd):
                return out
            assert isinstance(reply, ReplayBatch)
            out += [h for e in reply.batch.events if isinstance(e, BlockStored)
                    for h in e.block_hashes]
        raise AssertionError("the replay never ended")
    finally:
        sock.close()
        ctx.term()


async def _reset(http: aiohttp.ClientSession, fleet: Fleet) -> None:
    for handle in fleet.replicas:
        async with http.post(handle.url + "/reset_prefix_cache") as resp:
            assert resp.status == 200


def _with_router(fleet: Fleet, chunk_tokens: int,
                 test: Callable[[RouterRuntime, aiohttp.ClientSession, _Recorder],
                                Awaitable[None]], large_tokenizer: str = "engine", *,
                 version_salt: bool = False) -> None:
    async def main() -> None:
        large = fleet.by_pool("large")[0]
        async with _Recorder(large.url) as recorder, aiohttp.ClientSession() as http:
            await _reset(http, fleet)
            config = _config(fleet, recorder.url, chunk_tokens, large_tokenizer,
                             version_salt=version_salt)
            async with RouterRuntime(config, env={}) as rt:
                await test(rt, http, recorder)

    run(main())


def test_a_warm_up_is_sent_as_growing_prefixes_that_cache_the_chat_prompts_blocks(
        fleet: Fleet) -> None:
    """Chunks arrive one at a time, in order, each the next block-aligned prefix of the chat
    prompt's ids; each is a cache hit for everything the previous one computed (the
    engine's hit counter) and the engine stores every block of the chat prompt exactly once,
    under the hashes the router computes for the chat prompt with its salt."""
    rng = random.Random(3)
    salt = "chunk-salt"
    messages = [{"role": "user", "content": _words(rng, 1480)}]  # ≈0.73 of 2,048: warmed
    large = fleet.by_pool("large")[0]

    async def test(rt: RouterRuntime, http: aiohttp.ClientSession, rec: _Recorder) -> None:
        queries0, hits0 = await _engine_counters(http, large.url)
        stored0 = len(await _stored_hashes(large))
        status, pool = await _chat(http, rt.url, messages, "grow", cache_salt=salt)
        assert (status, pool) == (200, "small")
        await _wait_for(lambda: _counter(rt, "warm", outcome="completed", reason="large") == 1,
                        "the warm-up")
        async with http.post(large.url + "/tokenize",
                             json={"model": LARGE_MODEL, "messages": messages}) as resp:
            ids = (await resp.json())["tokens"]
        block = rt.core.pool(PoolName("large")).block_size
        ends = chunk_bounds(len(ids), block, CHUNK)
        assert len(ends) >= 5, ends  # the test is about several chunks

        seen = rec.seen
        assert [s.path for s in seen] == ["/v1/completions"] * (len(ends) - 1) + [
            "/v1/chat/completions"]
        assert [s.prompt_ids for s in seen[:-1]] == [ids[:end] for end in ends[:-1]]
        assert seen[-1].body["messages"] == messages and seen[-1].body["max_tokens"] == 1
        assert all(s.body["cache_salt"] == salt and s.body["model"] == LARGE_MODEL
                   and s.status == 200 for s in seen)
        # One at a time: each was sent after the previous one was answered.
        for before, after in itertools.pairwise(seen):
            assert before.answered_s is not None and before.answered_s <= after.arrived_s
        assert _counter(rt, "warm", outcome="chunk", reason="large") == len(ends)
        assert _counter(rt, "warm", outcome="fired", reason="large") == 1

        # Each request hit exactly what the ones before it computed.
        queries, hits = await _engine_counters(http, large.url)
        assert hits - hits0 == sum(ends[:-1])
        assert queries - queries0 == sum(ends)
        # The chat prompt's blocks, hashed by the router (salt in block 0), were each
        # stored once: the id chunks cached what the chat request and the escalation look up.
        request = RouteRequest(RequestId("check"), PoolName("large"),
                               TenantScope(TenantName("default")), len(ids),
                               prompt_token_ids=ids, cache_salt=salt)
        expected, approximate = rt.core.block_hashes(request)
        assert not approximate and len(expected) == len(ids) // block
        stored = (await _stored_hashes(large))[stored0:]
        assert [h for h in stored if h in set(expected)] == list(expected)
        assert not rt.core.load.snapshot(ReplicaId("l0")).num_in_flight

    _with_router(fleet, CHUNK, test)


@pytest.mark.parametrize("chunk_tokens", [CHUNK, 0], ids=["chunked", "one-request"])
def test_an_escalation_during_a_warm_up_is_served_between_its_chunks(
        fleet: Fleet, chunk_tokens: int) -> None:
    """Session B escalates (its prompt is over the small window) while session A's warm-up
    is on the large engine. Chunked, B enters the engine's queue between two chunks and is
    answered before the warm-up's last request; as one request (the control, and the bug
    this fixes), B waits for the whole warm-up."""
    rng = random.Random(4)
    warm_messages = [{"role": "user", "content": _words(rng, 1480)}]
    escalating = [{"role": "user", "content": _words(rng, 2100)}]

    async def test(rt: RouterRuntime, http: aiohttp.ClientSession, rec: _Recorder) -> None:
        status, pool = await _chat(http, rt.url, warm_messages, "warmed")
        assert (status, pool) == (200, "small")
        await asyncio.wait_for(rec.first_generation.wait(), 10.0)
        status, pool = await _chat(http, rt.url, escalating, "escalating")
        assert (status, pool) == (200, "large")
        await _wait_for(lambda: _counter(rt, "warm", outcome="completed", reason="large") == 1,
                        "the warm-up")
        warm = [s for s in rec.seen if s.is_warm]
        (esc,) = [s for s in rec.seen if not s.is_warm]
        last = warm[-1]
        assert esc.answered_s is not None and last.answered_s is not None
        # B arrived while the warm-up was running (else the test shows nothing).
        assert warm[0].arrived_s <= esc.arrived_s < last.answered_s
        print(f"{len(warm)} warm-up requests; B waited {esc.answered_s - esc.arrived_s:.3f}s, "
              f"answered {esc.answered_s - last.answered_s:+.3f}s from the warm-up's end")
        if chunk_tokens:
            assert len(warm) >= 5
            sent_after = [s for s in warm if s.arrived_s > esc.arrived_s]
            assert len(sent_after) >= 2, "B arrived too late to test anything"
            assert esc.answered_s < last.answered_s, (
                f"B answered {esc.answered_s - last.answered_s:+.3f}s after the warm-up's "
                "last chunk: it did not enter between chunks")
        else:
            assert len(warm) == 1
            assert esc.answered_s > last.answered_s

    _with_router(fleet, chunk_tokens, test)


def test_without_exact_token_ids_a_warm_up_is_one_request(fleet: Fleet) -> None:
    """``tokenizer: none`` on the large pool (approximate routing): a prefix of the text is
    not a prefix of the engine's tokens, so the warm-up is the chat body, once."""
    rng = random.Random(5)
    messages = [{"role": "user", "content": _words(rng, 1480)}]

    async def test(rt: RouterRuntime, http: aiohttp.ClientSession, rec: _Recorder) -> None:
        status, pool = await _chat(http, rt.url, messages, "approximate")
        assert (status, pool) == (200, "small")
        await _wait_for(lambda: _counter(rt, "warm", outcome="completed", reason="large") == 1,
                        "the warm-up")
        assert [(s.path, s.body["messages"]) for s in rec.seen] == [
            ("/v1/chat/completions", messages)]
        assert _counter(rt, "warm", outcome="chunk", reason="large") == 0

    _with_router(fleet, CHUNK, test, large_tokenizer="none")


@pytest.fixture(scope="module")
def versioned_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The same two engines, the large one serving weights that declare a version."""
    root = tmp_path_factory.mktemp("large-v2")
    (root / "config.json").write_text(json.dumps({"model_type": "sim", "version": "v2"}))
    specs = [
        ReplicaSpec(name="s0", pool="small", model=SMALL_MODEL, max_model_len=SMALL_WINDOW,
                    extra_args=("--timing", SMALL_TIMING)),
        ReplicaSpec(name="l0", pool="large", model=LARGE_MODEL, max_model_len=LARGE_WINDOW,
                    root=str(root), extra_args=("--timing", TIMING)),
    ]
    with start_fleet(specs, timeout_s=30.0) as started:
        yield started


def test_a_version_salted_route_warms_under_the_target_versions_salt(
        versioned_fleet: Fleet) -> None:
    """With ``version_salt`` the escalated request is hashed under the large version's salt,
    so the warm-up must be too: every chunk and the final chat body carry that salt (the
    final body once carried the tenant's, caching blocks the escalation never looks up),
    and the escalation's prefill is then a cache hit on the engine."""
    rng = random.Random(6)
    salt = "tenant-salt"
    messages = [{"role": "user", "content": _words(rng, 1480)}]
    large = versioned_fleet.by_pool("large")[0]
    want = version_salt("v:v2", salt)

    async def test(rt: RouterRuntime, http: aiohttp.ClientSession, rec: _Recorder) -> None:
        await _wait_for(lambda: rt.core.versions.version(ReplicaId("l0")) == "v:v2",
                        "the large engine's declared version")
        status, pool = await _chat(http, rt.url, messages, "salted", cache_salt=salt)
        assert (status, pool) == (200, "small")
        await _wait_for(lambda: _counter(rt, "warm", outcome="completed", reason="large") == 1,
                        "the warm-up")
        assert len(rec.seen) >= 2 and rec.seen[-1].path == "/v1/chat/completions"
        assert [s.body["cache_salt"] for s in rec.seen] == [want] * len(rec.seen)
        # The session grows past the small window: the escalation hits what was warmed.
        _, hits0 = await _engine_counters(http, large.url)
        grown = messages + [{"role": "assistant", "content": "ok"},
                            {"role": "user", "content": _words(rng, 700)}]
        status, pool = await _chat(http, rt.url, grown, "salted", cache_salt=salt)
        assert (status, pool) == (200, "large")
        assert rec.seen[-1].body["cache_salt"] == want
        _, hits = await _engine_counters(http, large.url)
        block = rt.core.pool(PoolName("large")).block_size
        assert hits - hits0 >= (1480 // block - 1) * block

    _with_router(versioned_fleet, CHUNK, test, version_salt=True)
