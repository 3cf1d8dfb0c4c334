"""The router with an in-process tokenizer (``tokenizer: {local: DIR}``) in front of engines
that serve the same Hugging Face tokenizer: exact prefix routing with no ``/tokenize`` call,
the piece cache doing its work, and its state on ``/metrics``."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from kvroute.config import parse_config
from kvroute.shell.runtime import RouterRuntime
from kvroute.sim.launcher import Fleet
from kvroute.tokenize.hf import bundled_tokenizer_dir

pytestmark = pytest.mark.integration


def test_local_tokenizer_routes_exactly_and_caches_pieces(
        make_fleet: Callable[..., Fleet]) -> None:
    tok = str(bundled_tokenizer_dir())
    fleet = make_fleet(2, extra=("--tokenizer", tok))
    data: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {"small": {"model": "sim-model", "tokenizer": {"local": tok}, "replicas": [
            {"name": r.name, "url": r.url, "kv_events": r.kv_events, "kv_replay": r.kv_replay}
            for r in fleet.replicas]}},
        "routes": {"assistant": {"pools": ["small"]}},
        "policy": {"name": "kvroute", "seed": 3},
        "discovery": {"health_interval_s": 0.5, "metrics_interval_s": 0.5},
        "log_level": "warning",
    }
    config = parse_config(data, env={})
    rng = random.Random(5)
    system = " ".join(f"rule{rng.getrandbits(20)}" for _ in range(120))

    def body(question: str) -> bytes:
        return json.dumps({"model": "assistant", "max_tokens": 2, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": question}]}).encode()

    async def go() -> None:
        async with RouterRuntime(config, env={}) as rt, aiohttp.ClientSession() as session:
            for _ in range(100):  # discovery reads block size and hash algorithm first
                if not rt.metrics.approximate("small"):
                    break
                await asyncio.sleep(0.05)
            headers = {"Content-Type": "application/json"}
            replicas, cached = [], []
            for i in range(4):
                async with session.post(rt.url + "/v1/chat/completions",
                                        data=body(f"question {i}?"), headers=headers) as resp:
                    assert resp.status == 200, await resp.text()
                    replicas.append(resp.headers["x-kvroute-replica"])
                    cached.append(int(resp.headers["x-kvroute-cached-tokens"]))
                await asyncio.sleep(0.2)  # the engine's KV events reach the index
            assert len(set(replicas)) == 1  # every request follows the system prompt
            assert cached[0] == 0 and min(cached[1:]) > 0
            async with session.get(rt.url + "/metrics") as resp:
                text = await resp.text()
            assert 'kvroute_token_piece_cache{pool="small",stat="enabled"} 1.0' in text
            hits = next(line for line in text.splitlines()
                        if line.startswith('kvroute_token_piece_cache{pool="small",stat="hits"}'))
            assert float(hits.split()[-1]) >= 3  # the system prompt piece, three times
            assert 'kvroute_tokenize_total{outcome="ok",pool="small"} 4.0' in text

    asyncio.run(asyncio.wait_for(go(), 30))
