"""Discovery against real HTTP servers on loopback.

``FakeVllm`` is a minimal aiohttp server that serves vLLM 0.32-shaped ``/health``,
``/v1/models`` (the card of ``tests/data/vllm-vectors-0.32.json``, ``http_examples_v0_32``) and
``/metrics`` (``wire.prom.render_vllm_metrics``, vLLM's names, labels and
``vllm:cache_config_info``), with knobs to break each of them. The last test runs against
real ``kvroute sim`` servers (``sim.server.SimServer``).

Rounds are driven with ``refresh_now()`` and a ``ManualClock`` (no sleeps); one test runs the
polling task for real, bounded in time.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import random
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvroute.config import RouterConfig, parse_config
from kvroute.core.clock import ManualClock
from kvroute.core.peer_policies import make_policy
from kvroute.core.router import PoolSpec, ReplicaSpec, RouterCore
from kvroute.core.types import PoolName, ReplicaId
from kvroute.shell.discovery import Discovery
from kvroute.shell.metrics import RouterMetrics
from kvroute.sim.launcher import Fleet, start_fleet
from kvroute.sim.launcher import ReplicaSpec as SimReplica
from kvroute.wire.prom import EngineStats, render_vllm_metrics

pytestmark = pytest.mark.integration

TEST_SECONDS = 8.0
VECTORS = Path(__file__).resolve().parents[1] / "data" / "vllm-vectors-0.32.json"
_EXAMPLES = json.loads(VECTORS.read_text())["http_examples_v0_32"]
MODELS_EXAMPLE = next(e for e in _EXAMPLES if e["path"] == "/v1/models")["response"]


class FakeVllm:
    """A vLLM-shaped HTTP server whose answers the test changes between rounds."""

    def __init__(self, model: str = "tiny", max_model_len: int = 128, block_size: int = 16,
                 hash_algo: str = "sha256") -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.hash_algo: str | None = hash_algo
        self.health_status = 200
        self.models_status = 200
        self.metrics_status = 200
        self.running = 0
        self.waiting = 0
        self.kv_usage = 0.0
        self.hang = False
        self.hits: dict[str, int] = {}
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _count(self, path: str) -> None:
        self.hits[path] = self.hits.get(path, 0) + 1
        if self.hang:
            await asyncio.sleep(30)  # longer than any probe timeout; cancelled at shutdown

    async def health(self, _: web.Request) -> web.Response:
        await self._count("/health")
        return web.Response(status=self.health_status)

    async def models(self, _: web.Request) -> web.Response:
        await self._count("/v1/models")
        body = copy.deepcopy(MODELS_EXAMPLE)
        body["data"][0]["id"] = self.model
        body["data"][0]["max_model_len"] = self.max_model_len
        lora = copy.deepcopy(body["data"][0])  # a LoRA card: parent set, no window
        lora.update(id=f"{self.model}-lora", parent=self.model, max_model_len=None)
        body["data"].append(lora)
        return web.json_response(body, status=self.models_status)

    async def metrics(self, _: web.Request) -> web.Response:
        await self._count("/metrics")
        cache_config = {"block_size": str(self.block_size), "enable_prefix_caching": "True"}
        if self.hash_algo is not None:
            cache_config["prefix_caching_hash_algo"] = self.hash_algo
        text = render_vllm_metrics(
            [EngineStats(num_requests_running=self.running, num_requests_waiting=self.waiting,
                         kv_cache_usage_perc=self.kv_usage)],
            model_name=self.model, cache_config=cache_config,
        )
        return web.Response(text=text, status=self.metrics_status,
                            content_type="text/plain", charset="utf-8")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def make_config(pools: dict[str, list[tuple[str, str]]], *, tokenizer: str = "engine",
                models: dict[str, str] | None = None, **discovery: Any) -> RouterConfig:
    doc = {
        "pools": {
            name: {
                "model": (models or {}).get(name, "tiny"),
                "tokenizer": tokenizer,
                "replicas": [{"name": r, "url": url} for r, url in reps],
            }
            for name, reps in pools.items()
        },
        "routes": {"m": {"pools": list(pools)}},
        "discovery": {"timeout_s": 3.0, "health_interval_s": 1.0, "metrics_interval_s": 1.0,
                      "models_interval_s": 30.0, "window_ttl_s": 900.0, **discovery},
    }
    return parse_config(doc, env={})


def make_core(config: RouterConfig, clock: ManualClock) -> RouterCore:
    rng = random.Random(0)
    specs = [
        PoolSpec(pool.name, tuple(ReplicaSpec(r.name) for r in pool.replicas))
        for pool in config.pools.values()
    ]
    return RouterCore(specs, lambda: make_policy("round_robin", rng), clock=clock)


@asynccontextmanager
async def fleet(n: int, **kw: Any) -> AsyncIterator[list[FakeVllm]]:
    servers = [FakeVllm(**kw) for _ in range(n)]
    for s in servers:
        await s.start()
    try:
        yield servers
    finally:
        for s in servers:
            await s.stop()


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), TEST_SECONDS))


class Rig:
    def __init__(self, config: RouterConfig, session: aiohttp.ClientSession) -> None:
        self.clock = ManualClock(1000.0)
        self.core = make_core(config, self.clock)
        self.metrics = RouterMetrics()
        self.discovery = Discovery(config, self.core, session, self.metrics, clock=self.clock)

    def outcome(self, replica: str, outcome: str) -> float:
        return self.metrics.value(
            "kvroute_discovery_total", {"replica": replica, "outcome": outcome}
        ) or 0.0


def test_start_up_round_reads_windows_hashing_and_load(caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        async with fleet(2, block_size=32) as (a, b), aiohttp.ClientSession() as session:
            a.running, a.waiting, a.kv_usage = 3, 2, 0.25
            b.max_model_len = 96
            rig = Rig(make_config({"p": [("r0", a.url), ("r1", b.url)]}), session)
            pool = PoolName("p")
            assert rig.discovery.pool_approximate("p") is True
            await rig.discovery.refresh_now()
            info = rig.discovery.replica_info("r0")
            assert (info.served_model, info.max_model_len) == ("tiny", 128)
            assert (info.block_size, info.hash_algo) == (32, "sha256")
            assert (info.running, info.waiting, info.kv_usage) == (3, 2, 0.25)
            assert info.healthy and info.last_ok_s == 1000.0 and info.consecutive_failures == 0
            assert info.models_fetched_at_s == 1000.0
            assert rig.discovery.pool_window("p") == 96  # the smaller of the two
            spec = rig.core.pool(pool)
            assert (spec.block_size, spec.hash_algo, spec.approximate) == (32, "sha256", False)
            assert rig.discovery.pool_approximate("p") is False
            assert rig.metrics.approximate("p") is False
            snap = rig.core.load.snapshot(ReplicaId("r0"))
            assert (snap.engine_running, snap.engine_waiting, snap.kv_usage) == (3, 2, 0.25)
            assert rig.metrics.value("kvroute_pool_window_tokens", {"pool": "p"}) == 96
            assert rig.outcome("r1", "models_ok") == 1

    with caplog.at_level(logging.INFO, logger="kvroute.shell.discovery"):
        run(go)
    messages = [r.getMessage() for r in caplog.records]
    assert any("pool p routes in APPROXIMATE mode" in m for m in messages)
    assert any("pool p routes on exact block hashes" in m for m in messages)


def test_hashing_is_never_assumed() -> None:
    """An engine that does not report the hash algorithm leaves the pool approximate."""

    async def go() -> None:
        async with fleet(1) as (a,), aiohttp.ClientSession() as session:
            a.hash_algo = None
            rig = Rig(make_config({"p": [("r0", a.url)]}), session)
            await rig.discovery.refresh_now()
            assert rig.discovery.pool_hashing("p") is None
            assert rig.core.pool(PoolName("p")).approximate is True
            assert rig.metrics.approximate("p") is True
            assert rig.discovery.replica_info("r0").healthy  # routable, approximately
            a.hash_algo = "sha256_cbor"
            rig.clock.advance(1.0)
            await rig.discovery.refresh_now()
            assert rig.discovery.pool_hashing("p") == (16, "sha256_cbor")
            assert rig.metrics.approximate("p") is False

    run(go)


def test_tokenizer_none_keeps_the_pool_approximate_after_hashing_is_read() -> None:
    async def go() -> None:
        async with fleet(1) as (a,), aiohttp.ClientSession() as session:
            rig = Rig(make_config({"p": [("r0", a.url)]}, tokenizer="none"), session)
            await rig.discovery.refresh_now()
            assert rig.discovery.pool_hashing("p") == (16, "sha256")
            assert rig.core.pool(PoolName("p")).approximate is True
            assert rig.metrics.approximate("p") is True

    run(go)


def test_health_flapping_needs_two_failures_and_one_success() -> None:
    async def go() -> None:
        async with fleet(2) as (a, b), aiohttp.ClientSession() as session:
            rig = Rig(make_config({"p": [("r0", a.url), ("r1", b.url)]}), session)
            d, core = rig.discovery, rig.core
            r0 = ReplicaId("r0")
            await d.refresh_now()
            assert core.is_healthy(r0)
            a.health_status = 503
            await d.refresh_now()  # one failure: still in
            assert core.is_healthy(r0) and d.replica_info("r0").consecutive_failures == 1
            assert d.healthy_replicas("p") == ["r0", "r1"]
            a.health_status = 200
            await d.refresh_now()  # a success resets the count
            assert d.replica_info("r0").consecutive_failures == 0
            a.health_status = 503
            await d.refresh_now()
            await d.refresh_now()  # two in a row: out
            assert not core.is_healthy(r0)
            assert d.healthy_replicas("p") == ["r1"]
            assert d.pool_window("p") == 128  # from r1 only
            assert rig.metrics.value("kvroute_replica_healthy", {"replica": "r0"}) == 0
            assert rig.outcome("r0", "health_error") == 3
            a.health_status = 200
            await d.refresh_now()  # one success: back in
            assert core.is_healthy(r0)
            assert rig.metrics.value("kvroute_replica_healthy", {"replica": "r0"}) == 1

    run(go)


def test_unreachable_at_start_up_is_out_at_once() -> None:
    async def go() -> None:
        async with fleet(1) as (a,), aiohttp.ClientSession() as session:
            dead = FakeVllm()
            await dead.start()
            dead_url = dead.url
            await dead.stop()  # nothing listens there any more
            rig = Rig(make_config({"p": [("r0", a.url), ("r1", dead_url)]}), session)
            await rig.discovery.refresh_now()
            assert not rig.core.is_healthy(ReplicaId("r1"))
            info = rig.discovery.replica_info("r1")
            assert not info.healthy and info.last_ok_s is None
            assert info.last_error is not None and "health_error" in info.last_error
            assert rig.core.is_healthy(ReplicaId("r0"))

    run(go)


def test_probe_timeout_is_a_failure() -> None:
    async def go() -> None:
        async with fleet(1) as (a,), aiohttp.ClientSession() as session:
            rig = Rig(make_config({"p": [("r0", a.url)]}, timeout_s=0.2), session)
            a.hang = True
            loop = asyncio.get_running_loop()
            started = loop.time()
            await rig.discovery.refresh_now()
            assert loop.time() - started < 2.0
            assert rig.outcome("r0", "health_timeout") == 1
            assert not rig.core.is_healthy(ReplicaId("r0"))

    run(go)


def test_hashing_mismatch_keeps_the_odd_replica_out() -> None:
    async def go() -> None:
        async with fleet(3) as (a, b, c), aiohttp.ClientSession() as session:
            b.block_size = 64  # the odd one: the majority (16) wins
            rig = Rig(make_config({"p": [("r0", b.url), ("r1", a.url), ("r2", c.url)]}), session)
            await rig.discovery.refresh_now()
            assert rig.discovery.pool_hashing("p") == (16, "sha256")
            assert not rig.core.is_healthy(ReplicaId("r0"))
            info = rig.discovery.replica_info("r0")
            assert not info.healthy
            assert info.excluded_reason is not None and "block_size=64" in info.excluded_reason
            assert rig.outcome("r0", "hashing_mismatch") == 1
            await rig.discovery.refresh_now()
            assert rig.outcome("r0", "hashing_mismatch") == 1  # counted once per episode
            b.block_size = 16  # fixed and restarted
            await rig.discovery.refresh_now()
            assert rig.core.is_healthy(ReplicaId("r0"))
            assert rig.discovery.replica_info("r0").excluded_reason is None

    run(go)


def test_wrong_model_keeps_the_replica_out() -> None:
    async def go() -> None:
        async with fleet(2) as (a, b), aiohttp.ClientSession() as session:
            b.model = "other"
            rig = Rig(make_config({"p": [("r0", a.url), ("r1", b.url)]}), session)
            await rig.discovery.refresh_now()
            info = rig.discovery.replica_info("r1")
            assert not info.healthy and info.served_model is None
            reason = info.excluded_reason
            assert reason is not None and "expects model 'tiny'" in reason
            assert rig.outcome("r1", "model_mismatch") == 1

    run(go)


def test_window_ttl_expiry_and_refetch() -> None:
    async def go() -> None:
        async with fleet(1) as (a,), aiohttp.ClientSession() as session:
            rig = Rig(make_config({"p": [("r0", a.url)]}, models_interval_s=30.0,
                                  window_ttl_s=900.0), session)
            d = rig.discovery
            await d.refresh_now()
            assert d.pool_window("p") == 128
            # The engine stops answering /v1/models: the window is trusted for the TTL ...
            a.models_status = 500
            rig.clock.advance(899.0)
            await d.refresh_now()
            assert d.pool_window("p") == 128
            assert rig.outcome("r0", "models_error") == 1
            # ... and dropped after it, rather than trusted forever.
            rig.clock.advance(1.0)
            assert d.pool_window("p") is None
            assert d.replica_info("r0").max_model_len is None
            # A swap slot now serves the model with another window: read on the next fetch.
            a.models_status = 200
            a.max_model_len = 4096
            await d.refresh_now()
            assert d.pool_window("p") == 4096

    run(go)


def test_models_are_polled_on_their_interval_and_on_invalidation() -> None:
    async def go() -> None:
        async with fleet(1) as (a,), aiohttp.ClientSession() as session:
            rig = Rig(make_config({"p": [("r0", a.url)]}, models_interval_s=30.0), session)
            d = rig.discovery
            await d.refresh_now()
            assert a.hits["/v1/models"] == 1
            # Non-forced rounds (what the task runs): models only when due.
            rig.clock.advance(1.0)
            await d._round(force=False)
            assert a.hits["/v1/models"] == 1 and a.hits["/metrics"] == 2
            a.max_model_len = 64
            d.invalidate_window("p")
            rig.clock.advance(1.0)
            await d._round(force=False)
            assert a.hits["/v1/models"] == 2 and d.pool_window("p") == 64
            rig.clock.advance(30.0)
            await d._round(force=False)
            assert a.hits["/v1/models"] == 3

    run(go)


def test_probes_are_staggered_across_the_interval() -> None:
    """After the start-up round (every replica at once), replica k of n is probed k/n of an
    interval later than replica 0, so later rounds each parse about one replica's answers
    instead of stalling the event loop on all of them together."""

    async def go() -> None:
        async with fleet(4) as servers, aiohttp.ClientSession() as session:
            reps = [(f"r{i}", s.url) for i, s in enumerate(servers)]
            rig = Rig(make_config({"p": reps}, health_interval_s=1.0, metrics_interval_s=1.0),
                      session)
            d = rig.discovery
            await d.refresh_now()
            assert [s.hits["/metrics"] for s in servers] == [1, 1, 1, 1]
            assert d._tick_s == pytest.approx(0.25)
            seen = []
            for _ in range(4):  # one tick of the loop at a time
                rig.clock.advance(0.25 if seen else 1.0)
                await d._round(force=False)
                seen.append([s.hits["/metrics"] for s in servers])
            assert seen == [[2, 1, 1, 1], [2, 2, 1, 1], [2, 2, 2, 1], [2, 2, 2, 2]]
            assert [s.hits["/health"] for s in servers] == [2, 2, 2, 2]

    run(go)


def test_polling_task_takes_a_dead_replica_out() -> None:
    """The real task with real time: short intervals, bounded wait."""

    async def go() -> None:
        async with fleet(2) as (a, b), aiohttp.ClientSession() as session:
            config = make_config({"p": [("r0", a.url), ("r1", b.url)]}, health_interval_s=0.05,
                                 metrics_interval_s=0.05, timeout_s=0.5)
            core = make_core(config, ManualClock())
            d = Discovery(config, core, session, RouterMetrics())
            await d.start()
            try:
                assert core.is_healthy(ReplicaId("r1"))
                b.health_status = 500
                for _ in range(100):  # at most 5 s
                    if not core.is_healthy(ReplicaId("r1")):
                        break
                    await asyncio.sleep(0.05)
                assert not core.is_healthy(ReplicaId("r1"))
                assert core.is_healthy(ReplicaId("r0"))
                assert d.num_loop_errors == 0
            finally:
                await d.stop()

    run(go)


# -- against the simulated vLLM server (``kvroute sim serve`` processes) -----------------------


@pytest.fixture(scope="module")
def sim_fleet() -> Iterator[Fleet]:
    specs = [
        SimReplica(name="s0", pool="p", model="tiny", max_model_len=512, block_size=32),
        SimReplica(name="s1", pool="p", model="tiny", max_model_len=256, block_size=32),
        SimReplica(name="s2", pool="p", model="tiny", max_model_len=512, block_size=64),
    ]
    with start_fleet(specs, timeout_s=20.0) as running:
        yield running


def test_against_sim_servers(sim_fleet: Fleet) -> None:
    """Windows, block size, algorithm, mismatch and a killed process, on real sim engines."""
    urls = {h.name: h.url for h in sim_fleet.replicas}

    async def go() -> None:
        async with aiohttp.ClientSession() as session:
            config = make_config({"p": [("s0", urls["s0"]), ("s1", urls["s1"]),
                                        ("s2", urls["s2"])]})
            rig = Rig(config, session)
            d = rig.discovery
            await d.refresh_now()
            assert d.pool_hashing("p") == (32, "sha256")  # two of three report 32
            assert rig.core.pool(PoolName("p")).block_size == 32
            assert rig.metrics.approximate("p") is False
            assert d.healthy_replicas("p") == ["s0", "s1"]
            s2 = d.replica_info("s2")
            assert s2.block_size == 64 and s2.excluded_reason is not None
            assert d.pool_window("p") == 256
            s0 = d.replica_info("s0")
            assert (s0.served_model, s0.max_model_len, s0.running, s0.waiting) == (
                "tiny", 512, 0, 0,
            )
            # Kill s1's process: two failed rounds take it out; the window follows.
            proc = sim_fleet.processes[1]
            proc.kill()
            await asyncio.get_running_loop().run_in_executor(None, proc.wait, 5.0)
            await d.refresh_now()
            assert rig.core.is_healthy(ReplicaId("s1"))
            await d.refresh_now()
            assert not rig.core.is_healthy(ReplicaId("s1"))
            assert d.pool_window("p") == 512

    run(go)
