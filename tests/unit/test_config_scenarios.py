"""Route scenarios in the configuration (``config.py``, ``routes.<name>``)."""

from __future__ import annotations

from typing import Any

import pytest

from kvroute.config import parse_config
from kvroute.core.errors import ConfigError
from kvroute.core.scenarios import AbArm


def conf(route: dict[str, Any]) -> dict[str, Any]:
    rep = {"url": "http://127.0.0.1:9"}
    return {"pools": {"main": {"model": "m", "replicas": [{"name": "a", **rep}]},
                      "cand": {"model": "m2", "replicas": [{"name": "b", **rep}]},
                      "spare": {"model": "m", "replicas": [{"name": "c", **rep}]}},
            "routes": {"chat": route}}


def test_every_scenario_parses_with_its_defaults() -> None:
    cfg = parse_config(conf({
        "pools": ["main"], "version_salt": True,
        "upgrade": {"warm_budget_tokens": 1000},
        "ab_split": {"arms": {"main": 3, "cand": 1}},
        "failover": {"backup": "spare", "back_after_s": 10},
    }), env={})
    s = cfg.routes["chat"].scenarios
    assert s.version_salt and s.upgrade is not None and s.upgrade.move_sessions
    assert s.ab_split is not None and s.ab_split.sticky
    assert s.ab_split.arms == (AbArm("main", 3.0), AbArm("cand", 1.0))
    assert s.failover is not None and s.failover.primary == "main"
    assert s.failover.back_after_s == 10.0 and s.failover.saturated_waiting == 8
    assert not parse_config(conf({"pools": ["main"]}), env={}).routes["chat"].scenarios.any


@pytest.mark.parametrize(("route", "message"), [
    ({"pools": ["main"], "ab_split": {"arms": {"main": 1}}}, "needs at least two arms"),
    ({"pools": ["main"], "ab_split": {"arms": {"main": 1, "nope": 1}}},
     "ab_split.arms.nope: is not a pool"),
    ({"pools": ["spare"], "ab_split": {"arms": {"main": 1, "cand": 1}}},
     "must be exactly one of the A/B arms"),
    ({"pools": ["main"], "failover": {"backup": "main"}}, "already one of the route's pools"),
    ({"pools": ["main"], "failover": {"backup": "spare", "primary": "cand"}},
     "is not one of the route's pools"),
    ({"pools": ["main"], "upgrade": {"warm_budget": 5}}, "did you mean 'warm_budget_tokens'"),
    ({"pools": ["main"], "upgrade": {"ready_share": 1.5}}, "must be at most 1"),
    ({"pools": ["main"], "failover": {"backup": "spare", "saturated_waiting": 0}},
     "must be >= 1"),
])
def test_a_bad_scenario_names_its_key_and_the_fix(route: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(conf(route), env={})
