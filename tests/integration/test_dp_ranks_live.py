"""Data-parallel ranks end to end: one simulated vLLM API server in front of two engine ranks
(``data_parallel_size: 2``), each publishing its KV events on its own port (the base port + r,
as vLLM offsets them) over real ZMQ, and the real router routing to a rank with
``X-data-parallel-rank`` over real HTTP on loopback (docs/data-parallel.md).

The engine's own load balancer sends an unpinned request to rank 0 when both ranks are idle
(vLLM's lowest ``4 × waiting + running``, first rank on ties), so a prefix that rank 1 holds
is only hit when the router names rank 1: every hit on rank 1 below needs the header.
"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import pytest
import zmq
import zmq.asyncio
from dp_engine import block_hashes, chat

from kvroute.config import RouterConfig, parse_config
from kvroute.core.index import TenantScope
from kvroute.core.types import ReplicaId, TenantName
from kvroute.engine.model import StepTiming
from kvroute.shell.runtime import RouterRuntime
from kvroute.sim.server import SimServer, SimServerConfig
from kvroute.wire.prom import parse_vllm_metrics
from kvroute.wire.vllm_events import decode_message

pytestmark = pytest.mark.integration

MODEL = "sim-model"
ROUTE = "assistant"
SCOPE = TenantScope(TenantName("default"))
RANK0, RANK1 = ReplicaId("e0.dp0"), ReplicaId("e0.dp1")


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.getrandbits(40):x}" for _ in range(n))


def _engine(base_port: int) -> SimServer:
    return SimServer(SimServerConfig(
        model=MODEL, data_parallel_size=2, num_gpu_blocks=400, max_model_len=2048,
        kv_events=f"tcp://127.0.0.1:{base_port}", kv_replay=f"tcp://127.0.0.1:{base_port + 4}",
        kv_topic="", enable_prompt_tokens_details=True,
        timing=StepTiming(fixed_s=0.001, prefill_token_s=0.00005, decode_seq_s=0.0002,
                          context_token_s=0.0),
    ))


def _router_config(engine: SimServer, base_port: int) -> RouterConfig:
    return parse_config({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {"main": {"model": MODEL, "replicas": [{
            "name": "e0", "url": engine.url, "data_parallel_size": 2,
            "kv_events": f"tcp://127.0.0.1:{base_port}",
            "kv_replay": f"tcp://127.0.0.1:{base_port + 4}",
            "prefill_rate_tps": 20_000.0,
        }]}},
        "routes": {ROUTE: {"pools": ["main"]}},
        "policy": {"name": "kvroute", "seed": 7},
        "discovery": {"health_interval_s": 0.5, "metrics_interval_s": 0.5,
                      "models_interval_s": 5, "timeout_s": 1.0},
        "log_level": "warning",
    }, env={})


async def _until_indexed(rt: RouterRuntime, hashes: list[int], on: ReplicaId,
                         off: ReplicaId) -> None:
    """Wait (bounded) until the index holds ``hashes`` on rank ``on`` and none on ``off``."""
    deadline = time.monotonic() + 20.0
    while True:
        found = rt.core.index.match(hashes, SCOPE)
        here, there = found.get(on), found.get(off)
        if here is not None and here.num_gpu_blocks == len(hashes) and there is None:
            return
        assert time.monotonic() < deadline, f"index never showed the prompt on {on}: {found}"
        await asyncio.sleep(0.05)


def test_each_rank_publishes_on_its_offset_port_and_a_session_returns_to_its_rank(
        base_port: int) -> None:
    rng = random.Random(5)
    first = [{"role": "user", "content": _words(rng, 300)}]
    other = [{"role": "user", "content": _words(rng, 300)}]

    async def body() -> None:
        async with _engine(base_port) as engine:
            assert engine.kv_events_endpoints == [f"tcp://127.0.0.1:{base_port}",
                                                  f"tcp://127.0.0.1:{base_port + 1}"]
            async with RouterRuntime(_router_config(engine, base_port), env={}) as rt, \
                    aiohttp.ClientSession() as session:
                assert set(rt.subscribers) == {RANK0, RANK1}
                # Straight to the engine, past the router: the session's first prompt runs
                # on rank 1, another prompt on rank 0. Each rank's events reach the index
                # under that rank alone (two subscriptions, base port and base port + 1).
                await chat(session, engine.url, MODEL, first, {"X-data-parallel-rank": "1"})
                await chat(session, engine.url, MODEL, other, {"X-data-parallel-rank": "0"})
                await _until_indexed(
                    rt, await block_hashes(session, engine.url, MODEL, first), RANK1, RANK0)
                await _until_indexed(
                    rt, await block_hashes(session, engine.url, MODEL, other), RANK0, RANK1)
                hits_before = [e.metrics().prefix_cache_hits_total for e in engine.engines]
                # The session's next turns through the router: the walk picks rank 1 of e0,
                # the forwarder names it, and rank 1 serves them from its cache.
                turn = [*first, {"role": "assistant", "content": "ok ok"},
                        {"role": "user", "content": _words(rng, 40)}]
                session_header = {"X-Session-ID": "dp-session"}
                for _ in range(2):
                    headers, answer = await chat(session, rt.url, ROUTE, turn, session_header)
                    assert headers["x-kvroute-replica"] == RANK1
                    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                    assert cached >= 18 * 16, answer["usage"]  # the first prompt's blocks
                    turn = [*turn, {"role": "assistant", "content": "ok ok"},
                            {"role": "user", "content": _words(rng, 40)}]
                hits = [e.metrics().prefix_cache_hits_total - before
                        for e, before in zip(engine.engines, hits_before, strict=True)]
                assert hits[0] == 0 and hits[1] >= 2 * 18 * 16, hits
                # Load is kept per rank: rank 1 was chosen, and its resting session is
                # counted there; rank 0 was never chosen.
                assert rt.core.load.snapshot(RANK0).last_chosen_s == float("-inf")
                assert rt.core.load.snapshot(RANK1).resting_session_tokens > 0
                assert rt.core.load.snapshot(RANK0).resting_session_tokens == 0

    asyncio.run(asyncio.wait_for(body(), 60.0))


def test_a_gap_in_one_ranks_stream_is_replayed_on_that_rank_only(base_port: int) -> None:
    rng = random.Random(6)

    async def body() -> None:
        async with _engine(base_port) as engine, \
                RouterRuntime(_router_config(engine, base_port), env={}) as rt, \
                aiohttp.ClientSession() as session:
            warm = [{"role": "user", "content": _words(rng, 40)}]
            for rank in ("0", "1"):  # both subscriptions see a first batch
                await chat(session, engine.url, MODEL, warm, {"X-data-parallel-rank": rank})
            await _until_delivered(rt, RANK0, 1)
            await _until_delivered(rt, RANK1, 1)
            engine.faults.apply({"drop_events": 1})  # rank 1's next batch is lost
            lost = [{"role": "user", "content": _words(rng, 200)}]
            await chat(session, engine.url, MODEL, lost, {"X-data-parallel-rank": "1"})
            later = [{"role": "user", "content": _words(rng, 200)}]
            await chat(session, engine.url, MODEL, later, {"X-data-parallel-rank": "1"})
            # Rank 1's subscriber sees the gap and replays the lost batch; the lost
            # prompt is then indexed on rank 1; rank 0's stream has no gap.
            await _until_indexed(rt, await block_hashes(session, engine.url, MODEL, lost), RANK1, RANK0)
            assert rt.subscribers[RANK1].stats.gaps == 1
            assert rt.subscribers[RANK1].stats.replayed_batches >= 1
            assert rt.subscribers[RANK0].stats.gaps == 0

    asyncio.run(asyncio.wait_for(body(), 60.0))


async def _until_delivered(rt: RouterRuntime, replica: ReplicaId, batches: int) -> None:
    deadline = time.monotonic() + 20.0
    while rt.subscribers[replica].stats.batches < batches:
        assert time.monotonic() < deadline, f"{replica}: no batch delivered"
        await asyncio.sleep(0.05)


def test_the_dp_engines_api_server_behaves_as_vllms(base_port: int) -> None:
    """Rank r's batches carry ``data_parallel_rank`` r on rank r's port; a rank outside the
    engine's is a 400; unpinned, an idle server runs the request on rank 0 (vLLM's balancer);
    ``/metrics`` has one ``engine`` label per rank; ``/kv_event_sources`` lists each rank."""
    async def body() -> None:
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        async with _engine(base_port) as engine, aiohttp.ClientSession() as session:
            try:
                sub.connect(f"tcp://127.0.0.1:{base_port + 1}")
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                prompt = [{"role": "user", "content": "one two three " * 20}]
                deadline = time.monotonic() + 20.0
                while True:  # a SUB socket joins late: send until rank 1's batch arrives
                    await chat(session, engine.url, MODEL, prompt, {"X-data-parallel-rank": "1"})
                    try:
                        frames = await asyncio.wait_for(sub.recv_multipart(), 0.5)
                        break
                    except TimeoutError:
                        assert time.monotonic() < deadline, "rank 1 published nothing"
                assert decode_message(frames).data_parallel_rank == 1
            finally:
                sub.close(linger=0)
                ctx.term()
            body_ = {"model": MODEL, "messages": prompt, "max_tokens": 2}
            async with session.post(engine.url + "/v1/chat/completions", json=body_,
                                    headers={"X-data-parallel-rank": "2"}) as resp:
                assert resp.status == 400
                assert "out of range [0, 2)" in await resp.text()
            before = engine.engines[0].metrics().prefix_cache_queries_total
            await chat(session, engine.url, MODEL, [{"role": "user", "content": "x y z"}])
            assert engine.engines[0].metrics().prefix_cache_queries_total > before
            async with session.get(engine.url + "/metrics") as resp:
                text = await resp.text()
            assert parse_vllm_metrics(text, MODEL).engines == ("0", "1")
            async with session.get(engine.url + "/kv_event_sources") as resp:
                sources = await resp.json()
            assert {rank: s["endpoint"] for rank, s in sources.items()} == {
                "0": f"tcp://127.0.0.1:{base_port}", "1": f"tcp://127.0.0.1:{base_port + 1}"}
            assert sources["1"]["replay_endpoint"] == f"tcp://127.0.0.1:{base_port + 5}"

    asyncio.run(asyncio.wait_for(body(), 60.0))


def test_a_subscription_that_reads_another_ranks_stream_drops_it(base_port: int) -> None:
    """The router is given rank 1's port as the engine's base: its rank-0 subscription then
    reads batches that say rank 1; they are dropped (and counted), not indexed as rank 0's."""
    rng = random.Random(9)
    prompt = [{"role": "user", "content": _words(rng, 200)}]

    async def body() -> None:
        async with _engine(base_port) as engine:
            config = _router_config(engine, base_port + 1)  # off by one rank
            async with RouterRuntime(config, env={}) as rt, aiohttp.ClientSession() as session:
                deadline = time.monotonic() + 20.0
                while not rt.wrong_rank_batches.get(RANK0):
                    await chat(session, engine.url, MODEL, prompt, {"X-data-parallel-rank": "1"})
                    assert time.monotonic() < deadline, "rank 1's batches never reached dp0"
                    await asyncio.sleep(0.1)
                hashes = await block_hashes(session, engine.url, MODEL, prompt)
                assert rt.core.index.match(hashes, SCOPE) == {}

    asyncio.run(asyncio.wait_for(body(), 60.0))
