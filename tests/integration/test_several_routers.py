"""Three ``kvroute serve`` processes behind a round-robin front act as one router.

Real processes on loopback: three ``kvroute sim serve`` engines, ``kvroute serve`` routers
started as ``kvroute.bench.several_routers.start_routers`` does (session records in Redis,
fresh placements and in-flight load on NATS, each run under its own namespace and subject),
and the bench's round-robin front (a refused connection is retried on the next router).

* The same bounded session workload (16 sessions × 10 turns, three bursts of three siblings
  sharing a 5,000-token prefix in one session, each sibling sent to a different router:
  ``kvroute.bench.several_routers.Workload``) through one router and through three. With the
  bus, a later sibling is sent once its router has applied the batch that announced the first
  one's placement (read from the routers' ``/metrics``: ``kvroute_cluster{stat="seq"}``,
  ``{stat="outbox"}``, ``kvroute_cluster_peer_seq``), so what is asserted does not depend on
  the machine's speed: every burst landed on one replica, the engines' own prefix-cache hit rate (their
  ``vllm:prefix_cache_*`` counters, not a timing) of three routers at least 90% of one's
  (the 3% of issue #26 holds over rounds, not on every single run: see the test), every
  later sibling routed knowing the first one's placement (``x-kvroute-cached-tokens``), and,
  as the control that shows the check can fail, three routers without the bus (siblings
  200 ms apart) route some later sibling blind. TTFT is only held to a generous bound (the machine is shared).
* One router SIGKILLed a third of the way through: every request that had not reached it is
  answered (failed, hung = 0; a request it held when killed is ``cut``), and its peers drop
  its load once it is silent for ``peer_expiry_s``.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from required import require_nats, require_redis

from kvroute.bench.live_routers import RunningRouter
from kvroute.bench.several_routers import (
    RoutersResult,
    Workload,
    kill_router,
    run_workload,
    start_routers,
)
from kvroute.sim.launcher import Fleet, ReplicaSpec, start_fleet

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REDIS_URL = "redis://127.0.0.1:6379/0"
NATS_URL = "nats://127.0.0.1:4222"
TIMING = "0.001,0.0001,0.0002,0"  # 10k prefill tokens/s: a burst's prefix takes 500 ms
ADMIN_ENV = "KVROUTE_TEST_ROUTERS_ADMIN_KEY"
WORKLOAD = Workload(seed=3)
TOTAL = WORKLOAD.num_requests


def _require_services() -> None:
    require_nats(NATS_URL)
    require_redis(REDIS_URL)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    _require_services()
    specs = [ReplicaSpec(name=f"e{i}", pool="sim", model="sim-model", replay=True,
                         extra_args=("--timing", TIMING)) for i in range(3)]
    with start_fleet(specs, timeout_s=30.0,
                     log_dir=tmp_path_factory.mktemp("engines")) as running:
        yield running


RoutersFactory = Callable[..., list[RunningRouter]]


@pytest.fixture
def routers(fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
            ) -> Iterator[RoutersFactory]:
    """Start routers in front of ``fleet``; all stopped (and their Redis keys deleted) after."""
    monkeypatch.setenv(ADMIN_ENV, secrets.token_hex(16))
    started: list[RunningRouter] = []
    namespaces: list[str] = []

    def make(n: int, *, bus: bool) -> list[RunningRouter]:
        ns = f"test-{secrets.token_hex(4)}"
        namespaces.append(ns)
        group = start_routers(n, fleet.replicas, work_dir=tmp_path / ns, redis_url=REDIS_URL,
                              nats_url=NATS_URL if bus else None, namespace=ns,
                              extra=f"admin_key_env: {ADMIN_ENV}\n")
        started.extend(group)
        return group

    yield make
    for router in started:
        router.stop()
    client = redis.Redis.from_url(REDIS_URL)
    for ns in namespaces:
        for key in client.scan_iter(f"{ns}:*"):
            client.delete(key)
    client.close()


def run(group: list[RunningRouter], fleet: Fleet, **kwargs: object) -> RoutersResult:
    result = asyncio.run(asyncio.wait_for(
        run_workload([r.targets[0] for r in group], fleet.replicas, WORKLOAD, **kwargs),  # type: ignore[arg-type]
        120.0))
    print(json.dumps(result.summary()))
    return result


def informed(result: RoutersResult) -> int:
    """Later siblings (not the first of a burst) routed knowing the burst's prefix was placed:
    expected to hit at least 90% of it."""
    return sum(1 for landing in result.burst_landings for where in landing[1:]
               if where and int(where.split(":")[1] or 0) >= 0.9 * WORKLOAD.burst_words)


def cluster_state(router: RunningRouter) -> dict[str, object]:
    req = urllib.request.Request(router.targets[0] + "/admin/state",
                                 headers={"authorization": f"Bearer {os.environ[ADMIN_ENV]}"})
    with urllib.request.urlopen(req, timeout=5.0) as resp:  # loopback only
        state = json.loads(resp.read())
    cluster = state["cluster"]
    assert isinstance(cluster, dict)
    return cluster


def test_three_routers_hit_and_co_locate_as_one(fleet: Fleet, routers: RoutersFactory) -> None:
    one = run(routers(1, bus=False), fleet)
    three = run(routers(3, bus=True), fleet)
    control = run(routers(3, bus=False), fleet)
    for result in (one, three, control):
        assert (result.ok, result.failed, result.hung, result.cut) == (TOTAL, 0, 0, 0), (
            result.errors)
        assert result.queries > 0
    assert one.bursts == three.bursts == WORKLOAD.num_bursts
    # Siblings paced on the bus when there is one (none waited past the bound), by the clock
    # in the control and for one router (no cluster stats).
    assert three.paced and three.unpaced == 0, three.unpaced_why
    assert not one.paced and not control.paced
    assert one.bursts_together == one.bursts
    assert three.bursts_together == three.bursts, "siblings at different routers scattered"
    # One run of each varies by about ±3% on a loaded machine, one router's as much as three's
    # (the cost model moves a session off a replica a burst has just filled: a timing-
    # dependent choice; docs/benchmarks.md "Several routers"): the bound here is 10%, the 3%
    # is measured over rounds there. A router that missed its peers' placements loses more:
    # a scattered burst alone costs two prefixes, 6% of the workload's prompt tokens.
    assert three.hit_rate >= 0.9 * one.hit_rate, (one.hit_rate, three.hit_rate)
    # Every later sibling's router knew the first one's prefix was placed (its expected cached
    # tokens, x-kvroute-cached-tokens, cover the 5,000-token prefix)...
    assert informed(three) == (WORKLOAD.siblings - 1) * WORKLOAD.num_bursts, three.burst_landings
    # ...which, without the bus (the control), the routers do not: they may still land
    # together by chance (the same replica chosen blind), never by knowing.
    assert informed(control) < (WORKLOAD.siblings - 1) * WORKLOAD.num_bursts, (
        control.burst_landings)
    # Generous: three routers must not make first tokens many times slower (not a benchmark).
    mean = lambda xs: sum(xs) / len(xs)
    assert mean(three.ttft_s) <= 3 * mean(one.ttft_s) + 0.5


def test_a_router_killed_mid_run_fails_no_request_that_had_not_reached_it(
        fleet: Fleet, routers: RoutersFactory) -> None:
    group = routers(3, bus=True)
    victim = group[1]
    deadline = time.monotonic() + 10.0
    while set(cluster_state(group[0])["peers"]) != {"r1", "r2"}:  # type: ignore[call-overload]
        assert time.monotonic() < deadline, "the routers never heard of each other"
        time.sleep(0.1)
    killed_at: list[float] = []

    def kill() -> None:
        kill_router(victim)
        killed_at.append(time.monotonic())

    result = run(group, fleet, kill_after=TOTAL // 3, kill=kill)
    assert killed_at and victim.process is not None and victim.process.poll() is not None
    assert (result.failed, result.hung) == (0, 0), result.errors
    assert result.ok + result.cut == TOTAL
    assert result.refused_retried > 0  # the front did meet the dead router
    # Only requests the killed router held can be cut: at most its share in flight at once.
    assert result.cut <= WORKLOAD.sessions + WORKLOAD.siblings
    # Its peers drop it (and its load) once it has been silent for peer_expiry_s (1 s).
    deadline = time.monotonic() + 10.0
    for survivor in (group[0], group[2]):
        while "r1" in cluster_state(survivor)["peers"]:  # type: ignore[operator]
            assert time.monotonic() < deadline, "a dead router's load never expired"
            time.sleep(0.1)
        state = cluster_state(survivor)
        assert state["expired_peers"] == 1 and state["peer_requests"] == 0
        with urllib.request.urlopen(survivor.targets[0] + "/metrics", timeout=5.0) as resp:
            metrics = resp.read().decode()
        assert 'kvroute_cluster{stat="peers"} 1.0' in metrics
        assert 'kvroute_cluster{stat="expired_peers"} 1.0' in metrics
        # The dead router's last batch number left with it; the live peer's is there.
        assert 'kvroute_cluster_peer_seq{peer="r1"}' not in metrics
        other = "r2" if survivor is group[0] else "r0"
        assert f'kvroute_cluster_peer_seq{{peer="{other}"}}' in metrics
        assert state["peer_seq"].keys() == {other}  # type: ignore[attr-defined]
