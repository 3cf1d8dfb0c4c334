"""``pools.<name>.kubernetes``: a pool whose engines are read from the Kubernetes API."""

from __future__ import annotations

from typing import Any

import pytest

from kvroute.config import KubernetesSource, parse_config
from kvroute.core.errors import ConfigError


def _config(pool: dict[str, Any]) -> Any:
    return parse_config({"pools": {"k": {"model": "m", **pool}},
                         "routes": {"m": {"pools": ["k"]}}}, env={})


def test_defaults_and_no_listed_replicas() -> None:
    config = _config({"kubernetes": {"namespace": "llm", "label_selector": "app=vllm"}})
    assert config.pools["k"].kubernetes == KubernetesSource(namespace="llm",
                                                            label_selector="app=vllm")
    assert config.pools["k"].replicas == ()


def test_mistakes_say_what_to_fix() -> None:
    with pytest.raises(ConfigError, match="cannot be set with kubernetes"):
        _config({"kubernetes": {"namespace": "llm", "label_selector": "app=vllm"},
                 "replicas": [{"name": "a", "url": "http://127.0.0.1:1"}]})
    with pytest.raises(ConfigError, match="namespace"):
        _config({"kubernetes": {"label_selector": "app=vllm"}})
    with pytest.raises(ConfigError, match="did you mean 'label_selector'"):
        _config({"kubernetes": {"namespace": "llm", "label_selectr": "app=vllm"}})
    with pytest.raises(ConfigError, match="kubernetes: {namespace"):
        _config({})
