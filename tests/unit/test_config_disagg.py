"""``pools.<name>.disaggregation`` and the replicas' ``role``: parsed, checked, explained."""

from __future__ import annotations

from typing import Any

import pytest

from kvroute.config import parse_config
from kvroute.core.disagg import DisaggSpec
from kvroute.core.errors import ConfigError


def config(pool: dict[str, Any]) -> dict[str, Any]:
    return {"pools": {"p": {"model": "m", **pool}}, "routes": {"m": {"pools": ["p"]}}}


REPLICAS = [{"name": "a", "url": "http://127.0.0.1:8101", "role": "prefill"},
            {"name": "b", "url": "http://127.0.0.1:8102", "role": "decode"}]


def test_a_disaggregated_pool_is_read_with_its_link() -> None:
    parsed = parse_config(config({"replicas": REPLICAS, "disaggregation": {
        "mode": "auto", "link_gbps": 25, "kv_bytes_per_token": 100_000}}), env={})
    pool = parsed.pools["p"]
    assert [r.role for r in pool.replicas] == ["prefill", "decode"]
    assert pool.disaggregation == DisaggSpec("auto", 100_000 / 25e9)


@pytest.mark.parametrize(("pool", "words"), [
    ({"replicas": REPLICAS}, "disaggregation: is needed: replica 'a' has role 'prefill'"),
    ({"replicas": [{**REPLICAS[0], "role": "prefil"}]}, "role: must be one of both, prefill"),
    ({"replicas": REPLICAS, "disaggregation": {"mode": "sometimes"}}, "mode: must be one of"),
    ({"replicas": REPLICAS, "disaggregation": {"link_gbps": 0}}, "link_gbps"),
])
def test_bad_disaggregation_settings_say_what_to_write(pool: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        parse_config(config(pool), env={})
