"""Fixtures for router tests: simulated engines as real ``kvroute sim serve`` processes.

Fleets are started with ``kvroute.sim.launcher.start_fleet`` (real HTTP + ZMQ on loopback,
free ports) and always stopped. The router itself runs in the test's event loop
(``RouterRuntime``), so a test can look at its core after talking to it over HTTP.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

import pytest
from ports import free_block_below_ephemeral

from kvroute.config import RouterConfig, parse_config
from kvroute.http import server as http_server
from kvroute.sim.launcher import Fleet, ReplicaSpec, start_fleet

MODEL = "sim-model"
ROUTE = "assistant"
POOL = "small"
# Simulated step times: 1 ms per step, 50 µs per prompt token (20k tok/s), 0.2 ms per
# decoding sequence. Slow enough that queues form under a burst, fast enough for CI.
TIMING = "0.001,0.00005,0.0002,0"
PREFILL_RATE_TPS = 20_000.0


def free_base_port(span: int = 9) -> int:
    """A port p with p .. p+span-1 free right now (for replicas restarted on their ports),
    below the ephemeral range (``tests/ports.py`` says why)."""
    return free_block_below_ephemeral(span)


def specs(n: int, *, timing: str = TIMING, extra: Sequence[str] = (), replay: bool = True,
          **kwargs: Any) -> list[ReplicaSpec]:
    return [
        ReplicaSpec(name=f"s{i}", pool=POOL, model=MODEL, replay=replay,
                    extra_args=("--timing", timing, *extra), **kwargs)
        for i in range(n)
    ]


FleetFactory = Callable[..., Fleet]


@pytest.fixture
def make_fleet() -> Iterator[FleetFactory]:
    """Start fleets on demand inside a test; every one is stopped at the end."""
    started: list[Fleet] = []

    def make(n: int = 2, *, base_port: int = 0, **kwargs: Any) -> Fleet:
        fleet = start_fleet(specs(n, **kwargs), base_port=base_port, timeout_s=20.0)
        started.append(fleet)
        return fleet

    yield make
    for fleet in started:
        fleet.stop()


@pytest.fixture(scope="module")
def shared_fleet() -> Iterator[Fleet]:
    """Three engines shared by the tests of a module that do not break engines."""
    fleet = start_fleet(specs(3), timeout_s=20.0)
    try:
        yield fleet
    finally:
        fleet.stop()


def router_config(fleet: Fleet, **overrides: Any) -> RouterConfig:
    """A router config for ``fleet`` (one pool, one route), free port, quick discovery."""
    replicas = []
    for r in fleet.replicas:
        rep: dict[str, Any] = {"name": r.name, "url": r.url, "prefill_rate_tps": PREFILL_RATE_TPS}
        if r.kv_events:
            rep["kv_events"] = r.kv_events
        if r.kv_replay:
            rep["kv_replay"] = r.kv_replay
        replicas.append(rep)
    data: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {POOL: {"model": MODEL, "replicas": replicas}},
        "routes": {ROUTE: {"pools": [POOL]}},
        "policy": {"name": "kvroute", "seed": 7},
        "discovery": {"health_interval_s": 0.5, "metrics_interval_s": 0.5,
                      "models_interval_s": 5, "timeout_s": 1.0},
        "timeouts": {"connect_s": 1.0, "first_byte_s": 5.0, "total_s": 10.0},
        "log_level": "warning",
    }
    for key, value in overrides.items():
        data[key] = value
    return parse_config(data, env={})


def run(coro: Coroutine[Any, Any, None], timeout_s: float = 12.0) -> None:
    """Run one async test body with a hard deadline."""
    asyncio.run(asyncio.wait_for(coro, timeout_s))


@pytest.fixture
def config_for() -> Callable[..., RouterConfig]:
    """``router_config`` as a fixture (test modules do not import conftest)."""
    return router_config


@pytest.fixture
def sim_specs() -> Callable[..., list[ReplicaSpec]]:
    return specs


@pytest.fixture
def base_port() -> int:
    """The first of nine consecutive free ports (replicas restarted on their own ports)."""
    return free_base_port()


@pytest.fixture
def sent_writes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every write the router's HTTP server makes to a client, in order (for checking how
    an answer is cut into writes)."""
    writes: list[bytes] = []
    send = http_server._Connection.send

    def recording(self: Any, data: bytes) -> None:
        writes.append(data)
        send(self, data)

    monkeypatch.setattr(http_server._Connection, "send", recording)
    return writes
