"""``pools.<name>.policy_params``: one pool's own policy weights, over ``policy.params``."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvroute.config import parse_config
from kvroute.core.clock import ManualClock
from kvroute.core.errors import ConfigError
from kvroute.core.policy import KvrouteCostPolicy
from kvroute.shell.runtime import build_core

CONFIG: dict[str, Any] = {
    "pools": {
        "chat": {"model": "qwen3-8b", "replicas": [{"name": "c0", "url": "http://127.0.0.1:8101"}]},
        "agents": {"model": "qwen3-8b",
                   "replicas": [{"name": "a0", "url": "http://127.0.0.1:8102"}],
                   "policy_params": {"decode_weight": 1.5, "harm_weight": 1}},
    },
    "routes": {"chat": {"pools": ["chat"]}, "coder": {"pools": ["agents"]}},
    "policy": {"name": "kvroute", "params": {"harm_weight": 0.25, "work_weight": 0.4}},
}


def test_a_pools_params_override_the_global_ones_for_that_pool_only() -> None:
    config = parse_config(CONFIG, env={})
    assert dict(config.pools["agents"].policy_params) == {"decode_weight": 1.5, "harm_weight": 1}
    assert dict(config.pools["chat"].policy_params) == {}
    core = build_core(config, clock=ManualClock())
    agents, chat = core.policy_of("agents"), core.policy_of("chat")
    assert isinstance(agents, KvrouteCostPolicy) and isinstance(chat, KvrouteCostPolicy)
    assert (agents.decode_weight, agents.harm_weight, agents.work_weight) == (1.5, 1, 0.4)
    assert (chat.decode_weight, chat.harm_weight, chat.work_weight) == (1.0, 0.25, 0.4)


def test_a_parameter_the_policy_does_not_take_is_refused_with_its_path() -> None:
    data = copy.deepcopy(CONFIG)
    data["pools"]["agents"]["policy_params"] = {"decode_wieght": 1.5}
    with pytest.raises(ConfigError) as info:
        parse_config(data, env={})
    message = str(info.value)
    assert "pools.agents.policy_params.decode_wieght" in message
    assert "Did you mean 'decode_weight'" in message


def test_a_value_that_is_not_a_number_is_refused() -> None:
    data = copy.deepcopy(CONFIG)
    data["pools"]["agents"]["policy_params"] = {"decode_weight": "high"}
    with pytest.raises(ConfigError, match="pools.agents.policy_params.decode_weight"):
        parse_config(data, env={})
