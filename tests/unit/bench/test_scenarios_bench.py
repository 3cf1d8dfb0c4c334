"""``kvroute bench scenarios`` (``bench/scenarios_bench.py``): its fleets and its report."""

from __future__ import annotations

import pytest

from kvroute.bench.scenarios_bench import (
    VARIANTS,
    ScenariosBenchSpec,
    _fleet,
    format_table,
    run_scenarios_bench,
)
from kvroute.core.errors import ConfigError


def test_each_variant_builds_the_fleet_it_describes() -> None:
    spec = ScenariosBenchSpec(replicas=4, switch_s=10.0, outage_s=5.0, warm_budget_tokens=7)
    cold, warm = _fleet(spec, "upgrade cold"), _fleet(spec, "upgrade warm")
    assert [r.replica for r in cold.restarts] == ["r0", "r1"]  # half the pool
    assert cold.scenarios is not None and cold.scenarios.upgrade is not None
    assert cold.scenarios.upgrade.warm_budget_tokens == 0
    assert warm.scenarios is not None and warm.scenarios.upgrade is not None
    assert warm.scenarios.upgrade.warm_budget_tokens == 7
    sticky, loose = _fleet(spec, "ab sticky"), _fleet(spec, "ab per-request")
    assert sticky.scenarios is not None and sticky.scenarios.ab_split is not None
    assert sticky.scenarios.ab_split.sticky
    assert loose.scenarios is not None and loose.scenarios.ab_split is not None
    assert not loose.scenarios.ab_split.sticky
    failover = _fleet(spec, "failover warm")
    assert [(o.replica, o.start_s, o.end_s) for o in failover.outages] == [
        ("primary-r0", 10.0, 15.0), ("primary-r1", 10.0, 15.0)]
    assert [p.name for p in failover.pools] == ["primary", "backup"]


def test_bad_specs_say_what_to_fix() -> None:
    with pytest.raises(ConfigError, match="even number"):
        ScenariosBenchSpec(replicas=3).validate()
    with pytest.raises(ConfigError, match="unknown variants"):
        ScenariosBenchSpec(variants=("upgrade hot",)).validate()
    with pytest.raises(ConfigError, match="carries no sessions"):
        run_scenarios_bench(ScenariosBenchSpec(trace="mooncake_synthetic", limit=5,
                                               variants=("ab sticky",)))


def test_a_short_replay_reports_every_variant_asked_for() -> None:
    report = run_scenarios_bench(ScenariosBenchSpec(limit=40, replicas=4, switch_s=0.0,
                                                    variants=("ab sticky", "ab per-request")))
    rows = format_table(report)
    assert rows[0][0] == "variant" and [r[0] for r in rows[1:]] == ["ab sticky",
                                                                     "ab per-request"]
    sticky, loose = report["variants"]
    assert sticky["requests"] == loose["requests"] == 40
    assert sticky["failed"] == 0 and sticky["moves"] == 0 and sticky["recompute_tokens"] == 0
    assert set(sticky["by_arm"]) <= {"a", "b"}
    assert loose["failed"] == 0 and len(VARIANTS) == 6
