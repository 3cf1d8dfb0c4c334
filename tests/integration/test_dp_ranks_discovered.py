"""Data-parallel ranks discovered, not configured: the router config names the engine
without ``data_parallel_size``, discovery reads the rank count from the ``engine`` labels of
the simulated vLLM server's ``/metrics``, and the replica becomes one target per rank, each
followed on its own event port and named by ``X-data-parallel-rank``; an engine restarted
with one rank folds them back (real HTTP + ZMQ on loopback; docs/data-parallel.md).

As in ``test_dp_ranks_live.py``, the engine's balancer puts an unpinned request on idle rank
0, so a hit on rank 1 through the router needs the header the discovered rank carries.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import aiohttp
import pytest
from dp_engine import block_hashes, chat

from kvroute.config import RouterConfig, parse_config
from kvroute.core.index import TenantScope
from kvroute.core.types import PoolName, ReplicaId, TenantName
from kvroute.engine.model import StepTiming
from kvroute.shell.runtime import RouterRuntime
from kvroute.sim.server import SimServer, SimServerConfig

pytestmark = pytest.mark.integration

MODEL = "sim-model"
ROUTE = "assistant"
SCOPE = TenantScope(TenantName("default"))

E0, RANK0, RANK1 = ReplicaId("e0"), ReplicaId("e0.dp0"), ReplicaId("e0.dp1")


def _engine(base_port: int, ranks: int) -> SimServer:
    return SimServer(SimServerConfig(
        model=MODEL, data_parallel_size=ranks, num_gpu_blocks=400, max_model_len=2048,
        port=base_port + 8,
        kv_events=f"tcp://127.0.0.1:{base_port}", kv_replay=f"tcp://127.0.0.1:{base_port + 4}",
        kv_topic="", enable_prompt_tokens_details=True,
        timing=StepTiming(fixed_s=0.001, prefill_token_s=0.00005, decode_seq_s=0.0002,
                          context_token_s=0.0),
    ))


def _router_config(base_port: int) -> RouterConfig:
    return parse_config({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {"main": {"model": MODEL, "replicas": [{
            "name": "e0", "url": f"http://127.0.0.1:{base_port + 8}",  # no data_parallel_size
            "kv_events": f"tcp://127.0.0.1:{base_port}",
            "kv_replay": f"tcp://127.0.0.1:{base_port + 4}",
            "prefill_rate_tps": 20_000.0,
        }]}},
        "routes": {ROUTE: {"pools": ["main"]}},
        "policy": {"name": "kvroute", "seed": 7},
        "discovery": {"health_interval_s": 0.2, "metrics_interval_s": 0.2,
                      "models_interval_s": 5, "timeout_s": 1.0},
        "log_level": "warning",
    }, env={})


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.getrandbits(40):x}" for _ in range(n))


def _members(rt: RouterRuntime) -> list[ReplicaId]:
    return [rep.name for rep in rt.core.pool(PoolName("main")).replicas]


async def _until(what: str, done: Callable[[], bool], timeout_s: float = 20.0) -> None:
    """Wait (bounded) until ``done()``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.05)


def _on_rank1_alone(rt: RouterRuntime, hashes: list[int]) -> bool:
    found = rt.core.index.match(hashes, SCOPE)
    here = found.get(RANK1)
    return here is not None and here.num_gpu_blocks == len(hashes) and RANK0 not in found


def test_ranks_found_on_metrics_are_routed_by_header_and_fold_back_on_restart(
        base_port: int) -> None:
    rng = random.Random(11)
    first = [{"role": "user", "content": _words(rng, 300)}]

    async def body() -> None:
        async with RouterRuntime(_router_config(base_port), env={}) as rt, \
                aiohttp.ClientSession() as session:
            async with _engine(base_port, 2) as engine:
                # Discovery reads two engine labels and expands e0 into its ranks.
                await _until("e0 expanded into two ranks", lambda: (
                    _members(rt) == [RANK0, RANK1] and set(rt.subscribers) == {RANK0, RANK1}
                    and rt.core.is_healthy(RANK0) and rt.core.is_healthy(RANK1)))
                assert rt.discovery is not None and rt.discovery.dp_size("e0") == 2
                assert rt.subscribers[RANK1].endpoint == f"tcp://127.0.0.1:{base_port + 1}"
                # The session's first prompt runs on rank 1, past the router; its blocks
                # reach the index under rank 1 alone, read on rank 1's own port.
                await chat(session, engine.url, MODEL, first, {"X-data-parallel-rank": "1"})
                hashes = await block_hashes(session, engine.url, MODEL, first)
                await _until("the prompt indexed on rank 1 alone",
                             lambda: _on_rank1_alone(rt, hashes))
                hits_before = [e.metrics().prefix_cache_hits_total for e in engine.engines]
                turn = [*first, {"role": "assistant", "content": "ok ok"},
                        {"role": "user", "content": _words(rng, 40)}]
                headers, answer = await chat(session, rt.url, ROUTE, turn,
                                              {"X-Session-ID": "dp-found"})
                assert headers["x-kvroute-replica"] == RANK1
                assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 18 * 16
                hits = [e.metrics().prefix_cache_hits_total - before
                        for e, before in zip(engine.engines, hits_before, strict=True)]
                assert hits[0] == 0 and hits[1] >= 18 * 16, hits
            # The engine restarts with one rank: the ranks leave (their entries with them)
            # and e0 comes back as one target, followed on the base port.
            async with _engine(base_port, 1) as engine:
                await _until("the ranks folded back into e0", lambda: (
                    _members(rt) == [E0] and set(rt.subscribers) == {E0}
                    and rt.core.is_healthy(E0)))
                assert rt.discovery is not None and rt.discovery.dp_size("e0") == 1
                found = rt.core.index.match(hashes, SCOPE)
                assert found == {}, found  # rank 1's entries left with it
                headers, _ = await chat(session, rt.url, ROUTE, first)
                assert headers["x-kvroute-replica"] == E0

    asyncio.run(asyncio.wait_for(body(), 90))


def test_an_engine_up_before_the_router_is_routed_by_rank_from_the_first_request(
        base_port: int) -> None:
    async def body() -> None:
        async with _engine(base_port, 2), \
                RouterRuntime(_router_config(base_port), env={}) as rt:
            # start-up's probe rounds found the ranks and probed them: no wait
            assert _members(rt) == [RANK0, RANK1]
            assert rt.core.is_healthy(RANK0) and rt.core.is_healthy(RANK1)
            assert {name: sub.endpoint for name, sub in rt.subscribers.items()} == {
                RANK0: f"tcp://127.0.0.1:{base_port}",
                RANK1: f"tcp://127.0.0.1:{base_port + 1}"}

    asyncio.run(asyncio.wait_for(body(), 60))
