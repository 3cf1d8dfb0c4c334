"""The background sender of shadow warm-ups (shell/shadow_warm.py), against a real HTTP
engine stand-in on loopback (aiohttp, a free port picked at run time).

* at most ``MAX_NOTES`` notes run at once; a note beyond them is dropped, counted, and its
  items are reported done;
* an engine's error answer, a timeout, a refused connection and an exception while building
  the copy are each logged and counted as ``failed``, never raised, and the note's other
  items are still sent;
* a spread copy carries the session's answer as an assistant message and the session's salt.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from ports import free_block_below_ephemeral

from kvroute.config import RouterConfig, parse_config
from kvroute.core.clock import ManualClock
from kvroute.core.scenarios import HotSession
from kvroute.core.types import PoolName, ReplicaId
from kvroute.core.walk import ShadowWarm, Walker, WalkSettings
from kvroute.core.warm import WarmPlanner
from kvroute.http.client import EngineClient
from kvroute.shell.metrics import RouterMetrics
from kvroute.shell.proxy import Upstream
from kvroute.shell.runtime import build_core
from kvroute.shell.shadow_warm import MAX_NOTES, ShadowWarmSender
from kvroute.wire.openai import parse_request
from kvroute.wire.turn_copy import SessionTurn

POOL = PoolName("small")
ROUTE = "assistant"
MESSAGES = [{"role": "user", "content": "list the files"}]


@dataclass
class Engine:
    """A loopback engine stand-in: answers 200, or ``status``, or holds every request until
    ``release`` is set; records bodies and the most requests it held at once."""

    status: int = 200
    hold: bool = False
    release: asyncio.Event = field(default_factory=asyncio.Event)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    running: int = 0
    most: int = 0

    async def chat(self, request: web.Request) -> web.Response:
        self.bodies.append(json.loads(await request.read()))
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            if self.hold:
                await self.release.wait()
        finally:
            self.running -= 1
        if self.status != 200:
            return web.json_response({"error": {"message": "boom"}}, status=self.status)
        return web.json_response({"choices": [{"index": 0, "message": {"content": "x"},
                                               "finish_reason": "length"}],
                                  "usage": {"completion_tokens": 1}})


@asynccontextmanager
async def serving(engine: Engine) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", engine.chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        engine.release.set()
        await runner.cleanup()


def config(url: str) -> RouterConfig:
    return parse_config({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {POOL: {"model": "sim-model", "replicas": [{"name": "s0", "url": url}]}},
        "routes": {ROUTE: {"pools": [POOL]}},
        "policy": {"name": "kvroute", "seed": 7},
        "timeouts": {"connect_s": 1.0, "first_byte_s": 5.0, "total_s": 10.0},
    }, env={})


class CountingWalker(Walker):
    """A walker that also records each ``shadow_done`` (every item must be reported)."""

    __slots__ = ("done",)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.done: list[ShadowWarm] = []

    def shadow_done(self, warm: ShadowWarm) -> None:
        self.done.append(warm)
        super().shadow_done(warm)


@dataclass
class Rig:
    sender: ShadowWarmSender
    metrics: RouterMetrics
    done: list[ShadowWarm]
    failures: list[tuple[ReplicaId, str]]

    def count(self, outcome: str, scenario: str = "spread") -> float:
        value = self.metrics.registry.get_sample_value(
            "kvroute_shadow_warm_total",
            {"route": ROUTE, "scenario": scenario, "outcome": outcome})
        return value or 0.0


@asynccontextmanager
async def rig(url: str, timeout_s: float = 5.0) -> AsyncIterator[Rig]:
    cfg = config(url)
    core = build_core(cfg, clock=ManualClock())
    walker = CountingWalker(core, WarmPlanner(), WalkSettings(), ManualClock())
    done = walker.done
    client = EngineClient(connect_timeout_s=1.0, total_timeout_s=10.0)
    metrics = RouterMetrics()
    failures: list[tuple[ReplicaId, str]] = []
    sender = ShadowWarmSender(cfg, walker, Upstream(client, cfg.timeouts), metrics,
                              lambda rep, why: failures.append((rep, why)))
    sender.timeout_s = timeout_s
    try:
        yield Rig(sender, metrics, done, failures)
    finally:
        await sender.close()
        await client.close()


def item(answer: str | None = "a.py b.py", salt: str | None = "tenant-salt",
         key: str = "k") -> HotSession:
    parsed = parse_request(json.dumps({"model": ROUTE, "messages": MESSAGES,
                                       "max_tokens": 100}).encode(), "chat")
    return HotSession(key=key, pool=POOL, tokens=40, token_ids=None, tenant="default",
                      tenant_salt=salt, payload=SessionTurn(parsed, answer), last_seen_s=0.0)


def note(*items: HotSession) -> ShadowWarm:
    return ShadowWarm(ROUTE, "spread", POOL, None, items, frozenset({ReplicaId("s0")}))


async def settle(sender: ShadowWarmSender) -> None:
    for _ in range(500):  # bounded: each round yields to the loop
        if not sender.tasks:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(sender.tasks)} shadow warm-up notes still running")


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20.0))


def test_a_spread_copy_carries_the_answer_and_the_sessions_salt() -> None:
    async def body() -> None:
        engine = Engine()
        async with serving(engine) as url, rig(url) as r:
            r.sender.fire(note(item()))
            await settle(r.sender)
            assert r.count("sent") == 1 and len(r.done) == 1
            sent = engine.bodies[0]
            assert sent["messages"] == [*MESSAGES, {"role": "assistant", "content": "a.py b.py"}]
            assert sent["add_generation_prompt"] is False and sent["max_tokens"] == 1
            assert sent["cache_salt"] == "tenant-salt" and sent["model"] == "sim-model"
    run(body())


def test_notes_beyond_the_bound_are_dropped_counted_and_reported_done() -> None:
    async def body() -> None:
        engine = Engine(hold=True)
        async with serving(engine) as url, rig(url) as r:
            for i in range(MAX_NOTES + 3):
                r.sender.fire(note(item(key=f"k{i}"), item(key=f"k{i}b")))
            assert len(r.sender.tasks) == MAX_NOTES
            assert r.count("dropped") == 3 * 2 and len(r.done) == 3 * 2
            for _ in range(500):  # bounded: until every running note has its request in
                if engine.running == MAX_NOTES:
                    break
                await asyncio.sleep(0.01)
            engine.release.set()
            await settle(r.sender)
            assert engine.most == MAX_NOTES  # one item at a time within a note
            assert r.count("sent") == MAX_NOTES * 2 and len(r.done) == (MAX_NOTES + 3) * 2
    run(body())


def test_an_engine_error_is_logged_and_counted_and_the_next_item_still_goes(
        caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        engine = Engine(status=500)
        async with serving(engine) as url, rig(url) as r:
            r.sender.fire(note(item(key="a"), item(key="b")))
            await settle(r.sender)
            assert len(engine.bodies) == 2 and r.count("failed") == 2 and r.count("sent") == 0
            assert len(r.done) == 2 and r.failures == []  # an error answer: the engine is up
    with caplog.at_level(logging.WARNING, logger="kvroute.scenarios"):
        run(body())
    assert sum("shadow warm-up to s0 failed" in m for m in caplog.messages) == 2


def test_a_timeout_fails_the_copy_only() -> None:
    async def body() -> None:
        engine = Engine(hold=True)
        async with serving(engine) as url, rig(url, timeout_s=0.05) as r:
            r.sender.fire(note(item()))
            await settle(r.sender)
            assert r.count("failed") == 1 and len(r.done) == 1
    run(body())


def test_a_refused_connection_reports_the_replica() -> None:
    async def body() -> None:
        url = f"http://127.0.0.1:{free_block_below_ephemeral(1)}"  # nothing listens there
        async with rig(url) as r:
            r.sender.fire(note(item()))
            await settle(r.sender)
            assert r.count("failed") == 1 and len(r.done) == 1
            assert [rep for rep, _ in r.failures] == ["s0"]
    run(body())


def test_an_exception_building_a_copy_is_logged_never_raised(
        caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        engine = Engine()
        async with serving(engine) as url, rig(url) as r:
            r.sender.fire(note(item(salt="x" * 5000, key="bad"), item(key="good")))
            await settle(r.sender)
            assert r.count("failed") == 1 and r.count("sent") == 1 and len(r.done) == 2
            assert len(engine.bodies) == 1
    with caplog.at_level(logging.ERROR, logger="kvroute.scenarios"):
        run(body())
    assert any("shadow warm-up of pool 'small' (spread) failed" in m for m in caplog.messages)
