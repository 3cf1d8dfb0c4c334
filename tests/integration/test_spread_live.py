"""Spread-ahead live (core/spread.py, shell/shadow_warm.py, wire/turn_copy.py), end to end.

Two real ``kvroute sim serve`` engines (HTTP + ZMQ on loopback) and a router in the test's
event loop (``RouterRuntime``). Two chat sessions share a long system prompt, so both rest
on one replica (home); the other replica has nothing to do. When the second session's turn
ends beside the first, spread-ahead copies its context, prompt plus streamed answer, to the
idle replica (the policy's ``spread_overlap: 0`` and ``spread_min_tokens: 16`` make the
decision certain). Checked on the engine side (the idle engine's KV events reach the index,
the router counts one ``spread`` shadow warm-up sent) and by the next turn: sent as a client
would (the last messages, the answer as an assistant message, a new user message), it is
placed on the copy's replica and finds there its prefix cached, answer included, as both the
router's ``x-kvroute-cached-tokens`` and the engine's ``cached_tokens`` say.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
import pytest

from kvroute.config import RouterConfig
from kvroute.core.types import ReplicaId
from kvroute.shell.runtime import RouterRuntime
from kvroute.sim.launcher import Fleet

pytestmark = pytest.mark.integration

ROUTE = "assistant"
FleetFactory = Callable[..., Fleet]
ConfigFor = Callable[..., RouterConfig]
BLOCK = 16  # the simulated engines' block size


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


async def ask(http: aiohttp.ClientSession, url: str, session: str,
              messages: list[dict[str, Any]], *, stream: bool = False,
              max_tokens: int = 40) -> tuple[str, dict[str, Any], ReplicaId, int]:
    """One turn: (answer text, usage, replica, router's predicted cached tokens)."""
    body: dict[str, Any] = {"model": ROUTE, "messages": messages, "max_tokens": max_tokens,
                            "ignore_eos": True}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    async with http.post(url + "/v1/chat/completions", json=body,
                         headers={"x-session-id": session}) as resp:
        assert resp.status == 200, await resp.text()
        replica = ReplicaId(resp.headers["x-kvroute-replica"])
        cached = int(resp.headers["x-kvroute-cached-tokens"])
        raw = await resp.read()
    if not stream:
        doc = json.loads(raw)
        return doc["choices"][0]["message"]["content"], doc["usage"], replica, cached
    text: list[str] = []
    usage: dict[str, Any] = {}
    for line in raw.decode().splitlines():
        if not line.startswith("data:") or line.strip() == "data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        for choice in chunk.get("choices") or ():
            text.append(choice.get("delta", {}).get("content") or "")
        usage = chunk.get("usage") or usage
    return "".join(text), usage, replica, cached


async def spread_sent(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if (line.startswith("kvroute_shadow_warm_total{") and 'scenario="spread"' in line
                and 'outcome="sent"' in line):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_crowded_session_is_copied_with_its_answer_and_its_next_turn_hits_there(
        make_fleet: FleetFactory, config_for: ConfigFor) -> None:
    fleet = make_fleet(2, enable_prompt_tokens_details=True)
    config = config_for(fleet, policy={"name": "kvroute", "seed": 7, "params": {
        "spread_overlap": 0, "spread_min_tokens": 16}})
    rng = random.Random(11)
    system = {"role": "system", "content": words(rng, 300)}

    async def body() -> None:
        async with RouterRuntime(config, env={}) as rt, aiohttp.ClientSession() as http:
            names = [ReplicaId(r.name) for r in fleet.replicas]
            await wait_for(lambda: all(
                rt.core.is_healthy(n)
                and rt.core.load.snapshot(n, rt.clock.now(), None).kv_capacity_tokens > 0
                for n in names), "both engines healthy with their KV capacity scraped")

            first = [system, {"role": "user", "content": words(rng, 20)}]
            _, _, home, _ = await ask(http, rt.url, "session-aaaa", first)
            await wait_for(lambda: rt.core.index.stats().num_entries_by_replica.get(home, 0)
                           >= 300 // BLOCK, "the first session's KV events")
            idle = next(n for n in names if n != home)
            assert rt.core.index.stats().num_entries_by_replica.get(idle, 0) == 0

            second = [system, {"role": "user", "content": words(rng, 20)}]
            answer, usage, placed, _ = await ask(http, rt.url, "session-bbbb", second,
                                                 stream=True)
            assert placed == home, "the shared system prompt keeps the second session home"
            await wait_for(lambda: rt.core.index.stats().num_entries_by_replica.get(idle, 0)
                           > 0, "the copy's KV events from the idle engine")
            for _ in range(200):  # bounded: the sender counts once the engine answered
                if await spread_sent(http, rt.url) >= 1:
                    break
                await asyncio.sleep(0.02)
            assert await spread_sent(http, rt.url) == 1
            copied = (usage["prompt_tokens"] + usage["completion_tokens"]) // BLOCK * BLOCK

            third = [*second, {"role": "assistant", "content": answer},
                     {"role": "user", "content": words(rng, 20)}]
            _, usage3, placed3, predicted = await ask(http, rt.url, "session-bbbb", third)
            assert placed3 == idle
            measured = usage3["prompt_tokens_details"]["cached_tokens"]
            # the answer's blocks too, not the prompt's alone (the last may be partial)
            assert measured >= copied - BLOCK > usage["prompt_tokens"], (measured, usage)
            assert predicted >= copied - BLOCK, (predicted, copied)

    run(body())
