"""Data-parallel ranks against real vLLM 0.32 on CPU (``tests/realvllm.py``; skipped with the
reason when it is not installed): one API server with ``--data-parallel-size 2``, the router
configured with ``data_parallel_size: 2``, or without it: then discovery reads the two
ranks from the ``engine`` labels of the server's ``/metrics`` (docs/data-parallel.md).

vLLM connects each rank's PUB socket to the concrete endpoint offset by its rank (port + r),
so the router binds both ports. A prompt computed on rank 1 (sent straight to the engine with
``X-data-parallel-rank: 1``) reaches the index under ``e0.dp1`` alone; sent again through
the router it is routed to ``e0.dp1``, pinned with the header, and vLLM reports its blocks
cached. Without the header vLLM's balancer would run it on idle rank 0, which holds nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator

import aiohttp
import pytest
import realvllm
from realvllm import RealVllmEngine

from kvroute.config import RouterConfig, parse_config
from kvroute.core.types import PoolName, ReplicaId
from kvroute.shell.runtime import RouterRuntime

pytestmark = pytest.mark.realvllm

ROUTE = "assistant"
POOL = PoolName("p")
RANK0, RANK1 = ReplicaId("e0.dp0"), ReplicaId("e0.dp1")


@pytest.fixture(scope="module")
def engine() -> Iterator[RealVllmEngine]:
    with realvllm.real_vllm_engines(
        1, extra_args=("--data-parallel-size", "2", "--enable-prompt-tokens-details"),
        ready_timeout_s=900.0,  # two engine cores warm up on two shared cores
    ) as started:
        yield started[0]


def config(engine: RealVllmEngine, size: dict[str, int]) -> RouterConfig:
    return parse_config({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {POOL: {"model": engine.model, "replicas": [{
            "name": "e0", "url": engine.url, **size,
            "kv_events": engine.events_endpoint, "kv_events_bind": True,
            "kv_replay": engine.replay_endpoint, "kv_topic": engine.topic}]}},
        "routes": {ROUTE: {"pools": [POOL]}},
        "discovery": {"health_interval_s": 0.5, "metrics_interval_s": 1.0, "timeout_s": 2.0},
        "timeouts": {"connect_s": 2.0, "first_byte_s": 60.0, "total_s": 120.0},
        "log_level": "warning",
    }, env={})


def prompt(n: int) -> str:
    return f"{realvllm.nonce()} " + realvllm.filler_text(n, 60)


async def direct(session: aiohttp.ClientSession, engine: RealVllmEngine, text: str,
                 rank: str) -> None:
    body = {"model": engine.model, "max_tokens": 1,
            "messages": [{"role": "user", "content": text}]}
    async with session.post(engine.url + "/v1/chat/completions", json=body,
                            headers={"X-data-parallel-rank": rank}) as resp:
        assert resp.status == 200, await resp.text()


@pytest.mark.parametrize("size", [{"data_parallel_size": 2}, {}], ids=["configured", "found"])
def test_a_prompt_rank_1_computed_is_routed_to_rank_1_and_hits_there(
        engine: RealVllmEngine, size: dict[str, int]) -> None:
    async def body() -> None:
        async with RouterRuntime(config(engine, size), env={}) as rt, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            # found or configured, the router routes two ranks from the first request
            assert [rep.name for rep in rt.core.pool(POOL).replicas] == [RANK0, RANK1]
            # vLLM's PUBs drop what they publish before the router's SUBs are bound and
            # connected: probe each rank until its subscription has a batch.
            for rank, replica in (("0", RANK0), ("1", RANK1)):
                for n in itertools.count():
                    if rt.subscribers[replica].stats.batches > 0:
                        break
                    assert n < 40, f"no KV event of rank {rank} reached the router"
                    await direct(session, engine, prompt(n), rank)
                    await asyncio.sleep(0.25)
            assert rt.discovery is not None
            deadline = time.monotonic() + 30.0
            while rt.discovery.pool_approximate(POOL):  # block size and algorithm read
                assert time.monotonic() < deadline, "the pool never left approximate mode"
                await asyncio.sleep(0.2)

            def entries(replica: ReplicaId) -> int:
                return rt.core.index.stats().num_entries_by_replica.get(replica, 0)

            text = prompt(500)
            before = (entries(RANK0), entries(RANK1))
            await direct(session, engine, text, "1")
            deadline = time.monotonic() + 30.0
            while entries(RANK1) <= before[1]:
                assert time.monotonic() < deadline, "rank 1's BlockStored never arrived"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # the rest of the batch
            assert entries(RANK0) == before[0]  # rank 0's index did not move
            chat = {"model": ROUTE, "max_tokens": 2,
                    "messages": [{"role": "user", "content": text}]}
            async with session.post(rt.url + "/v1/chat/completions", json=chat) as resp:
                assert resp.status == 200, await resp.text()
                answer = await resp.json()
                assert resp.headers["x-kvroute-replica"] == RANK1
                assert resp.headers["x-kvroute-approximate"] == "false"
                predicted = int(resp.headers["x-kvroute-cached-tokens"])
            cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 128 and predicted >= 128, (predicted, cached)

    asyncio.run(asyncio.wait_for(body(), 300.0))

