"""Model-bound caches against real ``kvroute sim serve`` processes on loopback.

Each engine serves its model from a local directory (``--root``) whose ``config.json``
declares a version; the tests change the weights behind a running engine (a hot weight
update: the file changes, the process and its cache stay) or restart an engine on another
directory, and check what the router does: drop the replica's index entries, keep a session
on its version, and, with version salting, make the engine itself miss the old blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvroute.config import RouterConfig, parse_config
from kvroute.core.types import ReplicaId
from kvroute.shell.runtime import RouterRuntime
from kvroute.sim.launcher import Fleet, ReplicaSpec, start_fleet

pytestmark = pytest.mark.integration

MODEL, POOL, ROUTE = "sim-model", "small", "assistant"
TIMING = "0.001,0.00005,0.0002,0"


def model_dir(path: Path, version: str) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "sim", "version": version}))
    return str(path)


def sim_spec(i: int, root: str) -> ReplicaSpec:
    return ReplicaSpec(name=f"s{i}", pool=POOL, model=MODEL, root=root,
                       enable_prompt_tokens_details=True, extra_args=("--timing", TIMING))


@pytest.fixture
def fleets() -> Iterator[list[Fleet]]:
    started: list[Fleet] = []
    yield started
    for fleet in started:
        fleet.stop()


def config(fleet: Fleet, *, salt: bool = False, health_s: float = 0.5) -> RouterConfig:
    replicas = [{"name": r.name, "url": r.url, "kv_events": r.kv_events,
                 "kv_replay": r.kv_replay, "prefill_rate_tps": 20_000.0}
                for r in fleet.replicas]
    return parse_config({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {POOL: {"model": MODEL, "replicas": replicas}},
        "routes": {ROUTE: {"pools": [POOL], "version_salt": salt}},
        "policy": {"name": "kvroute", "seed": 7},
        "discovery": {"health_interval_s": health_s, "metrics_interval_s": 0.5,
                      "models_interval_s": 0.2, "timeout_s": 1.0, "unhealthy_after": 1},
        "timeouts": {"connect_s": 1.0, "first_byte_s": 5.0, "total_s": 10.0},
        "log_level": "warning",
    }, env={})


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(10_000)}" for _ in range(n))


async def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)


def entries(rt: RouterRuntime, replica: str) -> int:
    return rt.core.index.stats().num_entries_by_replica.get(ReplicaId(replica), 0)


class Session:
    def __init__(self, http: aiohttp.ClientSession, url: str, session_id: str) -> None:
        self.http, self.url, self.session_id = http, url, session_id

    async def ask(self, content: str) -> tuple[str, int, int]:
        """(replica, router's expected cached tokens, engine's cached tokens)."""
        body = {"model": ROUTE, "messages": [{"role": "user", "content": content}],
                "max_tokens": 2}
        async with self.http.post(self.url + "/v1/chat/completions", json=body,
                                  headers={"x-session-id": self.session_id}) as resp:
            data = await resp.json()
            assert resp.status == 200, data
            cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
            return (resp.headers["x-kvroute-replica"],
                    int(resp.headers["x-kvroute-cached-tokens"]), cached)


async def with_router(cfg: RouterConfig,
                      body: Callable[[RouterRuntime, aiohttp.ClientSession], Awaitable[None]],
                      ) -> None:
    async with RouterRuntime(cfg, env={}) as rt, aiohttp.ClientSession() as http:
        await body(rt, http)


def run(coro: Awaitable[None], timeout_s: float = 90.0) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(coro, timeout_s)
    asyncio.run(bounded())


async def warm_session(rt: RouterRuntime, s: Session, prefix: str) -> str:
    replica, _, _ = await s.ask(prefix)
    await wait_for(lambda: entries(rt, replica) >= 4, "the first answer's KV events")
    again, router_cached, engine_cached = await s.ask(prefix + " more")
    assert again == replica and router_cached > 0 and engine_cached > 0
    return replica


@pytest.mark.parametrize("salt", [False, True])
def test_a_hot_weight_update_drops_the_index_and_salting_makes_the_engine_miss(
        tmp_path: Path, fleets: list[Fleet], salt: bool) -> None:
    root = model_dir(tmp_path / "m", "v1")
    fleet = start_fleet([sim_spec(0, root)], timeout_s=120.0)
    fleets.append(fleet)
    rng = random.Random(1)

    async def body(rt: RouterRuntime, http: aiohttp.ClientSession) -> None:
        s = Session(http, rt.url, "conv-1")
        await wait_for(lambda: rt.core.versions.version(ReplicaId("s0")) == "v:v1", "v1 read")
        prefix = words(rng, 300)
        replica = await warm_session(rt, s, prefix)
        model_dir(tmp_path / "m", "v2")  # new weights behind the running engine
        await wait_for(lambda: rt.core.versions.version(ReplicaId("s0")) == "v:v2", "v2 read")
        assert entries(rt, replica) == 0
        assert rt.metrics.value("kvroute_model_identity_changes_total",
                                {"replica": "s0"}) == 1.0
        assert rt.metrics.value("kvroute_replica_version",
                                {"replica": "s0", "version": "v:v2"}) == 1.0
        _, router_cached, engine_cached = await s.ask(prefix + " more and more")
        assert router_cached == 0  # no predicted hit from the old weights' entries
        if salt:
            assert engine_cached == 0  # the v2 salt misses every v1 block: fail closed
        else:
            # vLLM's hashes do not name the model: the engine itself serves v1's blocks.
            # This is the hazard version salting closes; the router can only stop trusting.
            assert engine_cached > 0
        moved = rt.metrics.value("kvroute_recompute_tokens_total",
                                 {"route": ROUTE, "scenario": "version"})
        assert moved is not None and moved > 0

    run(with_router(config(fleet, salt=salt), body))


def test_a_replica_restarted_on_other_weights_keeps_sessions_on_their_version(
        tmp_path: Path, fleets: list[Fleet], base_port: int) -> None:
    base = base_port  # nine free ports so a replica restarts on its own
    old = model_dir(tmp_path / "old", "v1")
    fleet = start_fleet([sim_spec(0, old), sim_spec(1, old)], base_port=base, timeout_s=120.0)
    fleets.append(fleet)
    rng = random.Random(2)

    async def body(rt: RouterRuntime, http: aiohttp.ClientSession) -> None:
        await wait_for(lambda: all(rt.core.versions.version(ReplicaId(f"s{i}")) == "v:v1"
                                   for i in range(2)), "both replicas' identity")
        s = Session(http, rt.url, "conv-2")
        victim = await warm_session(rt, s, words(rng, 300))
        index = int(victim[1:])
        other = f"s{1 - index}"
        fleet.processes[index].send_signal(signal.SIGKILL)
        fleet.processes[index].wait(5)
        await wait_for(lambda: not rt.core.is_healthy(ReplicaId(victim)), "the victim out")
        new = model_dir(tmp_path / "new", "v2")
        restarted = start_fleet([sim_spec(index, new)], base_port=base + 3 * index,
                                timeout_s=120.0)
        fleets.append(restarted)
        await wait_for(lambda: rt.core.versions.version(ReplicaId(victim)) == "v:v2",
                       "the restarted replica's new identity")
        await wait_for(lambda: rt.core.is_healthy(ReplicaId(victim)), "the victim back")
        for k in range(4):  # its session stays with the version it started on
            replica, _, _ = await s.ask(f"turn {k} " + words(rng, 20))
            assert replica == other
        fresh: Any = rt.core.versions.groups([ReplicaId("s0"), ReplicaId("s1")])
        assert sorted(fresh) == ["v:v1", "v:v2"]

    run(with_router(config(fleet, health_s=0.2), body), timeout_s=200.0)


def two_pool_config(main: list[Any], other: list[Any], route: dict[str, Any],
                    **discovery: float) -> RouterConfig:
    def replicas(handles: list[Any]) -> list[dict[str, Any]]:
        return [{"name": r.name, "url": r.url, "kv_events": r.kv_events,
                 "kv_replay": r.kv_replay, "prefill_rate_tps": 20_000.0} for r in handles]
    return parse_config({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {"main": {"model": MODEL, "replicas": replicas(main)},
                  "other": {"model": MODEL, "replicas": replicas(other)}},
        "routes": {ROUTE: {"pools": ["main"], **route}},
        "policy": {"name": "kvroute", "seed": 7},
        "discovery": {"health_interval_s": 0.2, "metrics_interval_s": 0.5,
                      "models_interval_s": 1.0, "timeout_s": 1.0, "unhealthy_after": 1,
                      **discovery},
        "timeouts": {"connect_s": 1.0, "first_byte_s": 5.0, "total_s": 10.0},
        "log_level": "warning",
    }, env={})


def pool_spec(name: str, pool: str) -> ReplicaSpec:
    return ReplicaSpec(name=name, pool=pool, model=MODEL, enable_prompt_tokens_details=True,
                       extra_args=("--timing", TIMING))


def test_a_sticky_ab_split_keeps_every_session_on_one_arm_and_counts_each_arm(
        fleets: list[Fleet]) -> None:
    fleet = start_fleet([pool_spec("m0", "main"), pool_spec("o0", "other")], timeout_s=120.0)
    fleets.append(fleet)
    route = {"ab_split": {"arms": {"main": 1, "other": 1}, "sticky": True}}
    rng = random.Random(3)

    async def body(rt: RouterRuntime, http: aiohttp.ClientSession) -> None:
        arms: dict[str, set[str]] = {}
        for turn in range(3):
            for k in range(8):
                s = Session(http, rt.url, f"ab-{k}")
                replica, _, _ = await s.ask(f"session {k} turn {turn} " + words(rng, 30))
                arms.setdefault(s.session_id, set()).add(replica)
        assert all(len(a) == 1 for a in arms.values())
        assert {next(iter(a)) for a in arms.values()} == {"m0", "o0"}
        counts = [rt.metrics.value("kvroute_ab_requests_total", {"route": ROUTE, "arm": arm})
                  for arm in ("main", "other")]
        assert all(c is not None and c > 0 for c in counts) and sum(counts) == 24  # type: ignore[arg-type]
        assert rt.metrics.value("kvroute_ab_first_byte_seconds_count",
                                {"route": ROUTE, "arm": "main"}) is not None
        assert rt.metrics.value("kvroute_recompute_tokens_total",
                                {"route": ROUTE, "scenario": "ab"}) is None  # no flip, no bill

    run(with_router(two_pool_config(fleet.by_pool("main"), fleet.by_pool("other"), route),
                    body))


def primary_down(fleets: list[Fleet], base: int) -> tuple[int, Fleet, list[Any]]:
    """(the primary's base port, the running backup, the primary's handles): the primary's
    address is known and nothing answers there yet."""
    backup = start_fleet([pool_spec("o0", "other")], timeout_s=120.0)
    fleets.append(backup)
    primary = start_fleet([pool_spec("m0", "main")], base_port=base, timeout_s=120.0)
    # No KV events for it: a SUB reconnecting to a closed loopback port in the ephemeral
    # range can connect to itself and hold the port the restarted engine must bind.
    main_handles = [dataclasses.replace(h, kv_events=None, kv_replay=None)
                    for h in primary.replicas]
    primary.stop()
    return base, backup, main_handles


def test_failover_serves_every_request_from_the_backup_and_fails_back(
        fleets: list[Fleet], base_port: int) -> None:
    base, backup, main_handles = primary_down(fleets, base_port)
    route = {"failover": {"backup": "other", "back_after_s": 0.5}}
    rng = random.Random(4)

    async def body(rt: RouterRuntime, http: aiohttp.ClientSession) -> None:
        s = Session(http, rt.url, "fo-1")
        for k in range(3):
            replica, _, _ = await s.ask(f"turn {k} " + words(rng, 30))
            assert replica == "o0"
        assert rt.metrics.value("kvroute_failover_active", {"route": ROUTE}) == 1.0
        restarted = start_fleet([pool_spec("m0", "main")], base_port=base, timeout_s=120.0)
        fleets.append(restarted)
        await wait_for(lambda: rt.core.is_healthy(ReplicaId("m0")), "the primary back")
        served = []
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline:  # back once usable for back_after_s
            replica, _, _ = await s.ask("again " + words(rng, 30))
            served.append(replica)
            if replica == "m0":
                break
            await asyncio.sleep(0.2)
        assert served[-1] == "m0", served
        assert rt.metrics.value("kvroute_failover_active", {"route": ROUTE}) == 0.0
        moves = rt.metrics.value("kvroute_scenario_moves_total",
                                 {"route": ROUTE, "scenario": "failover"})
        assert moves == 1.0  # back to the primary (the first turn had no place before)

    run(with_router(two_pool_config(main_handles, backup.by_pool("other"), route), body),
        timeout_s=200.0)


def test_the_failover_switch_follows_the_primary_between_requests(
        fleets: list[Fleet], base_port: int) -> None:
    """No request is sent while the primary goes down and comes back: the switch is told
    the primary's state after every health round, so the backup takes the route and gives
    it back on the probes alone, and the first request after the hysteresis goes straight
    to the primary (it once waited for a request to start counting ``back_after_s``)."""
    base, backup, main_handles = primary_down(fleets, base_port)
    route = {"failover": {"backup": "other", "back_after_s": 0.5}}
    rng = random.Random(5)

    async def body(rt: RouterRuntime, http: aiohttp.ClientSession) -> None:
        def active() -> float | None:
            return rt.metrics.value("kvroute_failover_active", {"route": ROUTE})

        await wait_for(lambda: active() == 1.0, "the backup taking the route, no request sent")
        restarted = start_fleet([pool_spec("m0", "main")], base_port=base, timeout_s=120.0)
        fleets.append(restarted)
        await wait_for(lambda: active() == 0.0, "the primary taking the route back",
                       timeout_s=30.0)
        replica, _, _ = await Session(http, rt.url, "fo-2").ask("first " + words(rng, 30))
        assert replica == "m0"

    run(with_router(two_pool_config(main_handles, backup.by_pool("other"), route), body),
        timeout_s=200.0)
