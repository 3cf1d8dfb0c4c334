"""Several routers in front of one simulated fleet (``sim/routers.py``), in virtual time.

The claim of docs/reliability.md's "Several routers" row, asserted where the machine's
queueing cannot move it: three routers sharing their placements and in-flight load on a bus
(1 ms) route a loaded shared-prefix workload within 3% of one router's hit rate and mean
TTFT, and three routers sharing nothing but the engines' events measurably worse. And its
limit: siblings that reach different routers closer together than the bus delay are placed
before any of them is announced, as without the bus.
"""

from __future__ import annotations

import pytest

from kvroute.bench.workloads import generated_shared_prefix, sibling_fanout
from kvroute.core.errors import ConfigError
from kvroute.sim.fleet import DigestCache, FleetConfig, FleetResult, simulate
from kvroute.sim.profiles import get_profile
from kvroute.sim.routers import RoutersConfig, group_replicas_mean, simulate_routers
from kvroute.sim.workload import WorkloadRequest

PROFILE = get_profile("llama-3.1-8b-h100")


def _config() -> FleetConfig:
    return FleetConfig(num_replicas=8, profile=PROFILE)


def _digests() -> DigestCache:
    from kvroute.core.hashing import BlockHasher

    return DigestCache(BlockHasher("sha256", PROFILE.block_size))


def _run(workload: list[WorkloadRequest], routers: RoutersConfig | None,
         digests: DigestCache) -> FleetResult:
    if routers is None:
        return simulate(workload, _config(), digests=digests)
    return simulate_routers(workload, _config(), routers, digests=digests)


@pytest.fixture(scope="module")
def shared_prefix_runs() -> dict[str, FleetResult]:
    # 16 groups of 16 prompts sharing a 2048-token system prompt, Poisson at 50 req/s on 8
    # engines: a group's next request usually reaches another router before the engine has
    # stored the first one's blocks.
    workload = generated_shared_prefix(num_groups=16, prompts_per_group=16, rate=50.0)
    digests = _digests()
    return {
        "one": _run(workload, None, digests),
        "bus": _run(workload, RoutersConfig(count=3, bus=True, bus_delay_s=0.001), digests),
        "none": _run(workload, RoutersConfig(count=3, bus=False), digests),
    }


def test_three_routers_on_the_bus_route_within_3_percent_of_one(
        shared_prefix_runs: dict[str, FleetResult]) -> None:
    one = shared_prefix_runs["one"].summary()
    bus = shared_prefix_runs["bus"].summary()
    assert one["completed"] == bus["completed"] == one["requests"]
    for figure in ("token_hit_rate", "ttft_mean_s"):
        ratio = float(bus[figure]) / float(one[figure])
        assert abs(ratio - 1) <= 0.03, f"{figure}: 3 routers {bus[figure]} vs 1 {one[figure]}"
    counters = shared_prefix_runs["bus"].counters
    # every announcement reached both other routers and named a request they knew
    assert counters["peer_applied"] == 2 * counters["bus_announcements"] > 0
    assert counters["peer_unknown"] == counters["peer_unknown_tenant"] == 0
    assert {counters[f"routed_by_router_{i}"] for i in range(3)} <= {85, 86}


def test_three_routers_without_the_bus_are_measurably_worse(
        shared_prefix_runs: dict[str, FleetResult]) -> None:
    one = shared_prefix_runs["one"].summary()
    bus = shared_prefix_runs["bus"].summary()
    none = shared_prefix_runs["none"].summary()
    assert float(none["token_hit_rate"]) < 0.98 * min(float(one["token_hit_rate"]),
                                                      float(bus["token_hit_rate"]))
    assert float(none["ttft_mean_s"]) > 1.1 * max(float(one["ttft_mean_s"]),
                                                  float(bus["ttft_mean_s"]))
    assert shared_prefix_runs["none"].counters.get("bus_announcements", 0) == 0


def test_one_router_behind_the_front_is_the_ordinary_simulation() -> None:
    workload = sibling_fanout(num_prompts=3, fanout=4, prompt_tokens=512, interval_s=1.0)
    digests = _digests()
    plain = _run(workload, None, digests).summary()
    assert _run(workload, RoutersConfig(count=1), digests).summary() == plain


def test_a_run_of_several_routers_is_deterministic() -> None:
    workload = sibling_fanout(num_prompts=3, fanout=6, prompt_tokens=512, interval_s=1.0,
                              sibling_gap_s=0.0005)
    digests = _digests()
    routers = RoutersConfig(count=3, bus_delay_s=0.001)
    first, second = _run(workload, routers, digests), _run(workload, routers, digests)
    assert first.summary() == second.summary()
    assert [r.replica for r in first.records] == [r.replica for r in second.records]


def test_a_group_counts_the_replicas_its_requests_ran_on() -> None:
    workload = sibling_fanout(num_prompts=2, fanout=4, prompt_tokens=256, interval_s=1.0)
    result = _run(workload, RoutersConfig(count=2), _digests())
    per_group: dict[str, set[str]] = {}
    for request, record in zip(workload, result.records, strict=True):
        assert request.group is not None
        per_group.setdefault(request.group, set()).add(record.replica)
    expected = sum(len(v) for v in per_group.values()) / len(per_group)
    assert group_replicas_mean(workload, result.records) == expected >= 1.0


@pytest.mark.parametrize("bad", [
    {"count": 0}, {"bus_delay_s": -0.001}, {"batch_s": float("nan")}, {"front": "random"},
])
def test_bad_router_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        RoutersConfig(**bad)  # type: ignore[arg-type]


def test_siblings_closer_than_the_bus_delay_are_placed_as_without_the_bus() -> None:
    # 8 bursts of 3 siblings sharing a 5,000-token prompt, each sibling at the next router
    # of the round robin; the bus takes 1 ms. 0.5 ms apart, a later sibling reaches its
    # router before the first one's placement does: nothing is announced yet, so each is
    # placed exactly as without the bus. 2 ms apart, the bus has told every router, and
    # they place the burst as one router does.
    digests = _digests()

    def placed(gap_s: float, routers: RoutersConfig | None) -> tuple[list[str], float]:
        workload = sibling_fanout(num_prompts=8, fanout=3, prompt_tokens=5000,
                                  interval_s=2.0, sibling_gap_s=gap_s)
        records = _run(workload, routers, digests).records
        return [r.replica for r in records], group_replicas_mean(workload, records)

    bus, none = RoutersConfig(3, bus_delay_s=0.001), RoutersConfig(3, bus=False)
    assert placed(0.0005, bus) == placed(0.0005, none)
    one, informed, blind = placed(0.002, None), placed(0.002, bus), placed(0.002, none)
    assert informed[1] == one[1] != blind[1]
    assert informed[0] != blind[0]
