"""Model-bound cache scenarios in the simulated fleet: the walk's version groups, upgrade,
A/B split and failover carried out in virtual time (``sim/fleet.py``)."""

from __future__ import annotations

from collections import defaultdict

import pytest

from kvroute.bench import workloads as W
from kvroute.core.errors import ConfigError
from kvroute.core.scenarios import (
    AbArm,
    AbSplitSettings,
    FailoverSettings,
    RouteScenarios,
    UpgradeSettings,
)
from kvroute.core.types import PoolName
from kvroute.sim.fleet import FleetConfig, FleetResult, Outage, Restart, SimPool, simulate
from kvroute.sim.profiles import get_profile

H100 = get_profile("llama-3.1-8b-h100")


def sessions(n: int = 12) -> list[W.WorkloadRequest]:
    return W.growing_sessions(num_sessions=n, window_tokens=6000, system_prompt_tokens=512,
                              user_tokens=256, output_tokens=64, think_time_s=2.0,
                              session_interval_s=0.5)


def per_session(result: FleetResult, attr: str) -> dict[str, list[object]]:
    out: dict[str, list[object]] = defaultdict(list)
    for r in sorted(result.records, key=lambda r: r.arrival_s):
        if r.session_id is not None and r.finish_s is not None:
            out[r.session_id].append(getattr(r, attr))
    return out


def upgrade_run(budget: int) -> FleetResult:
    restarts = (Restart("r0", 6.0, "v2"), Restart("r1", 6.0, "v2"))
    return simulate(sessions(), FleetConfig(
        num_replicas=4, profile=H100, restarts=restarts,
        scenarios=RouteScenarios(upgrade=UpgradeSettings(warm_budget_tokens=budget))))


def test_a_restart_on_other_weights_moves_its_sessions_once_and_never_back() -> None:
    restarts = (Restart("r0", 6.0, "v2", down_s=2.0), Restart("r1", 14.0, "v2", down_s=2.0))
    result = simulate(sessions(), FleetConfig(num_replicas=2, profile=H100, restarts=restarts))
    assert result.counters["restarts"] == 2
    assert all(r.finish_s is not None and not r.rejected for r in result.records)
    for versions in per_session(result, "version").values():
        assert versions == sorted(versions, key=lambda v: str(v).endswith("v2"))  # no return
    assert result.counters.get("moves_version", 0) >= 1
    assert result.counters["recompute_tokens_version"] > 0


def test_an_upgrade_warmed_in_shadow_bills_fewer_tokens_than_a_cold_one() -> None:
    cold, warm = upgrade_run(0), upgrade_run(200_000)
    for result in (cold, warm):
        assert all(r.finish_s is not None and not r.rejected for r in result.records)
    assert "shadow_warm_tokens_upgrade" not in cold.counters
    assert warm.counters["shadow_warm_tokens_upgrade"] > 0
    assert warm.counters["recompute_tokens_upgrade"] < cold.counters["recompute_tokens_upgrade"]
    for versions in per_session(warm, "version").values():
        assert versions == sorted(versions, key=lambda v: str(v).endswith("v2"))


def ab_run(sticky: bool) -> FleetResult:
    pools = (SimPool("a", H100, 2), SimPool("b", H100, 2))
    split = AbSplitSettings((AbArm(PoolName("a"), 1.0), AbArm(PoolName("b"), 1.0)),
                            sticky=sticky)
    return simulate(sessions(), FleetConfig.tiered(pools, tier_mode="none",
                                                   scenarios=RouteScenarios(ab_split=split)))


def test_a_sticky_split_never_flips_a_session_and_a_per_request_split_pays_for_flips() -> None:
    sticky, loose = ab_run(True), ab_run(False)
    arms = per_session(sticky, "arm")
    assert all(len(set(a)) == 1 for a in arms.values())
    assert {a[0] for a in arms.values()} == {"a", "b"}
    assert sticky.counters.get("recompute_tokens_ab", 0) == 0
    assert loose.counters["recompute_tokens_ab"] > 0
    assert any(len(set(a)) > 1 for a in per_session(loose, "arm").values())


def failover_run(budget: int) -> FleetResult:
    pools = (SimPool("main", H100, 2), SimPool("backup", H100, 2))
    outages = (Outage("main-r0", 8.0, 20.0), Outage("main-r1", 8.0, 20.0))
    failover = FailoverSettings(PoolName("main"), PoolName("backup"), back_after_s=5.0,
                                warm_budget_tokens=budget, warm_interval_s=2.0)
    return simulate(sessions(), FleetConfig.tiered(
        pools, tier_mode="none", outages=outages,
        scenarios=RouteScenarios(failover=failover)))


def test_failover_and_failback_fail_no_request_and_warming_lowers_the_bill() -> None:
    cold, warm = failover_run(0), failover_run(100_000)
    for result in (cold, warm):
        assert all(r.finish_s is not None and not r.rejected for r in result.records)
        pools = [r.pool for r in sorted(result.records, key=lambda r: r.arrival_s)]
        assert "backup" in pools and pools[-1] == "main"  # over, and back after the outage
    assert warm.counters["shadow_warm_tokens_failover"] > 0
    assert (warm.counters["recompute_tokens_failover"]
            < cold.counters["recompute_tokens_failover"])


def test_a_restart_of_an_unknown_replica_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown replica 'zz'"):
        simulate(sessions(2), FleetConfig(num_replicas=2, profile=H100,
                                          restarts=(Restart("zz", 1.0, "v2"),)))
