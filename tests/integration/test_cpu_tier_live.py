"""A CPU tier end to end: ``kvroute sim serve --cpu-offload-blocks`` engines publish
``BlockStored``/``BlockRemoved`` with ``medium="CPU"`` over real ZMQ, the router's index keeps
them apart from the GPU's, and a prompt that only a replica's CPU tier still holds is routed
there with a hit discounted by its load time (docs/kv-tiers.md).

vLLM 0.32's CPU backend refuses native offloading at start-up (docs/kv-tiers.md quotes it),
so this is proved on the simulated engine, whose tier follows vLLM's OffloadingConnector.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from kvroute.config import RouterConfig
from kvroute.core.hashing import BlockHasher
from kvroute.core.index import TenantScope
from kvroute.core.policy import CPU_LOAD_S_PER_TOKEN, tier_credit
from kvroute.core.types import ReplicaId, TenantName
from kvroute.shell.runtime import RouterRuntime
from kvroute.sim.launcher import Fleet

pytestmark = pytest.mark.integration

ROUTE = "assistant"
MODEL = "sim-model"
RATE = 20_000.0  # tests/integration/conftest.py's PREFILL_RATE_TPS


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.getrandbits(40):x}" for _ in range(n))


async def _post(session: aiohttp.ClientSession, url: str, model: str,
                content: str) -> tuple[dict[str, str], dict[str, Any]]:
    body = {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": 2}
    async with session.post(url + "/v1/chat/completions", data=json.dumps(body),
                            headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 200, await resp.text()
        return dict(resp.headers), json.loads(await resp.read())


def test_a_prompt_only_a_cpu_tier_holds_is_routed_there_and_loaded(
        make_fleet: Callable[..., Fleet], config_for: Callable[..., RouterConfig]) -> None:
    # 39 usable GPU blocks of 16 tokens; a CPU tier of 400 blocks.
    fleet = make_fleet(2, num_gpu_blocks=40, max_model_len=512,
                       enable_prompt_tokens_details=True,
                       extra=("--cpu-offload-blocks", "400", "--cpu-load-s-per-block", "1e-4"))
    rng = random.Random(3)
    prompt = _words(rng, 200)  # about 13 whole blocks

    async def body() -> None:
        async with RouterRuntime(config_for(fleet), env={}) as rt, \
                aiohttp.ClientSession() as session:
            headers, _ = await _post(session, rt.url, ROUTE, prompt)
            home = headers["x-kvroute-replica"]
            url = next(r.url for r in fleet.replicas if r.name == home)
            # Fill the home engine's GPU straight, past the router: the prompt's GPU blocks
            # are evicted, its CPU copies stay.
            for _ in range(3):
                await _post(session, url, MODEL, _words(rng, 300))
            # The router's index: the prompt's blocks on the home replica's CPU, none left on
            # its GPU (the engine's BlockRemoved GPU and BlockStored CPU events, over ZMQ).
            async with session.post(url + "/tokenize", data=json.dumps(
                    {"model": MODEL, "messages": [{"role": "user", "content": prompt}]})) as r:
                ids = (await r.json())["tokens"]
            hashes = BlockHasher("sha256", 16).wire_hashes(ids)
            scope = TenantScope(TenantName("default"))
            deadline = time.monotonic() + 20.0
            while True:
                match = rt.core.index.match(hashes, scope).get(ReplicaId(home))
                if match is not None and match.num_gpu_blocks == 0 \
                        and match.num_cpu_blocks == len(hashes):
                    break
                assert time.monotonic() < deadline, f"index never showed CPU only: {match}"
                await asyncio.sleep(0.05)
            headers, answer = await _post(session, rt.url, ROUTE, prompt)
            assert headers["x-kvroute-replica"] == home
            expected = int(headers["x-kvroute-cached-tokens"])
            loaded = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert loaded >= 12 * 16  # the engine loaded the prefix from its CPU tier
            # the router credited it as a CPU hit: less than a GPU hit of the same blocks
            assert 0 < expected < loaded
            assert expected == pytest.approx(loaded * tier_credit(CPU_LOAD_S_PER_TOKEN, RATE),
                                             abs=16)

    asyncio.run(asyncio.wait_for(body(), 60.0))
