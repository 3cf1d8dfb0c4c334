"""A two-tier simulated fleet and a bounded traffic mix (a helper module, not a test file).

Shared by the observability tests (``tests/integration/test_dashboard.py``,
``tests/integration/test_prometheus.py``): pools ``small`` (two replicas, 2,048 tokens) and
``large`` (one replica, 8,192) behind one route, engines that report
``usage.prompt_tokens_details.cached_tokens``, and a mix that touches every series an
operator looks at: sessions that grow across the small window (warm-ups, escalations, cache
hits), unique prompts, and a prompt no tier can hold (a 400 refusal).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp

from kvroute.config import RouterConfig, parse_config
from kvroute.sim.launcher import Fleet, ReplicaSpec

ROUTE = "assistant"
TIMING = "0.003,0.00002,0.0002,0"  # 3 ms a step: long answers stay in flight a while


def tier_specs() -> list[ReplicaSpec]:
    common: dict[str, Any] = {"enable_prompt_tokens_details": True,
                              "extra_args": ("--timing", TIMING)}
    specs = [ReplicaSpec(name=f"small-{i}", pool="small", model="small-model",
                         max_model_len=2048, num_gpu_blocks=1024, **common) for i in range(2)]
    specs.append(ReplicaSpec(name="large-0", pool="large", model="large-model",
                             max_model_len=8192, num_gpu_blocks=2048, **common))
    return specs


def fleet_config(fleet: Fleet) -> RouterConfig:
    """The route over both tiers, a free port, quick discovery."""
    pools: dict[str, Any] = {}
    for r in fleet.replicas:
        pool = pools.setdefault(r.pool, {"model": r.model, "replicas": []})
        pool["replicas"].append({"name": r.name, "url": r.url, "kv_events": r.kv_events,
                                 "kv_replay": r.kv_replay, "prefill_rate_tps": 20_000})
    return parse_config({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": pools,
        "routes": {ROUTE: {"pools": ["small", "large"]}},
        "discovery": {"health_interval_s": 0.5, "metrics_interval_s": 0.5, "timeout_s": 1.0},
        "log_level": "warning",
    }, env={})


def words(rng: random.Random, n: int) -> str:
    """``n`` distinct words: the simulated tokenizer makes each one token."""
    return " ".join(f"w{rng.getrandbits(40):x}" for _ in range(n))


async def send(session: aiohttp.ClientSession, url: str, content: str, *, max_tokens: int = 8,
               session_id: str | None = None) -> int:
    """One streamed chat with usage; its status."""
    body = {"model": ROUTE, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"x-session-id": session_id} if session_id else {}
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
        await resp.read()
        return resp.status


async def mixed_traffic(url: str, *, seed: int = 11) -> None:
    """3 sessions growing by 350 words a turn for 6 turns (warm-ups, then escalations past
    the small window), 4 unique prompts, one prompt no tier can hold: 23 requests."""
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as session:
        texts = ["" for _ in range(3)]
        for _ in range(6):
            for i in range(3):
                texts[i] += " " + words(rng, 350)
                assert await send(session, url, texts[i], session_id=f"user-{i}") == 200
            await asyncio.sleep(0.1)  # the engines' KV events reach the index
        for _ in range(4):
            assert await send(session, url, words(rng, 120)) == 200
        assert await send(session, url, words(rng, 9000)) == 400
