"""config.py: YAML → frozen tree; every error names the key, the value and the fix."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvroute.config import (
    DEFAULT_TENANT,
    RouterConfig,
    derive_cache_salt,
    load_config,
    parse_config,
    resolve_secrets,
)
from kvroute.core.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kvroute.yaml"

MINIMAL: dict[str, Any] = {
    "pools": {"small": {"model": "qwen3-8b", "replicas": [
        {"name": "s0", "url": "http://127.0.0.1:8101", "kv_events": "tcp://127.0.0.1:5601",
         "kv_replay": "tcp://127.0.0.1:5602"},
        {"name": "s1", "url": "http://127.0.0.1:8102/"},
    ]}},
    "routes": {"assistant": {"pools": ["small"]}},
}


def with_(path: str, value: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of ``base`` (MINIMAL) with ``value`` set at a dotted path (ints index lists)."""
    data = copy.deepcopy(base if base is not None else MINIMAL)
    node: Any = data
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    last = keys[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return data


def error_of(data: Any, env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, env=env or {})
    return str(info.value)


def test_example_file_loads_with_the_documented_values() -> None:
    config = load_config(EXAMPLE, env={})
    assert list(config.pools) == ["small"]
    pool = config.pools["small"]
    assert pool.model == "qwen3-8b"
    assert [r.name for r in pool.replicas] == ["s0", "s1"]
    assert pool.replicas[0].kv_replay == "tcp://127.0.0.1:5602"
    assert pool.replicas[1].kv_replay is None
    assert config.routes["assistant"].pools == ("small",)
    assert config.policy.name == "kvroute"
    assert config.state.backend == "memory"
    assert config.tenants == ()
    assert config.warm_ahead.enabled is True
    assert config.warm_ahead.fraction == 0.6
    assert config.listen.port == 8000


def test_config_is_frozen_all_the_way_down() -> None:
    config = parse_config(MINIMAL, env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.log_level = "debug"  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.pools["x"] = config.pools["small"]  # type: ignore[index]


def test_defaults_and_url_normalisation() -> None:
    config = parse_config(MINIMAL, env={})
    assert config.pools["small"].replicas[1].url == "http://127.0.0.1:8102"
    assert config.pools["small"].tokenizer.mode == "auto"
    assert config.timeouts.connect_s == 2.0
    assert config.retries.max_retries == 2
    assert config.admission.max_in_flight == 256
    assert config.replica("s1").url == "http://127.0.0.1:8102"


@pytest.mark.parametrize(
    ("value", "mode", "path"),
    [("engine", "engine", None), ("auto", "auto", None), ("none", "none", None),
     ({"local": "/m/qwen"}, "local", "/m/qwen")],
)
def test_tokenizer_forms(value: Any, mode: str, path: str | None) -> None:
    config = parse_config(with_("pools.small.tokenizer", value), env={})
    assert config.pools["small"].tokenizer.mode == mode
    assert config.pools["small"].tokenizer.path == path


@pytest.mark.parametrize(
    ("data", "fragments"),
    [
        (with_("max_inflight", 3), ["max_inflight", "unknown key"]),
        (with_("admission.max_inflight", 3), ["admission.max_inflight", "did you mean 'max_in_flight'"]),
        (with_("polcy", {"name": "kvroute"}), ["did you mean 'policy'"]),
        (with_("pools.small.replicas.0.kv_event", "tcp://x:1"), ["did you mean 'kv_events'"]),
        (with_("pools.small.replicas.0.url", "ftp://h:1"), ["pools.small.replicas[0].url", "'ftp://h:1'", "http(s)"]),
        (with_("pools.small.replicas.0.url", "http://h:1/v1"), ["must not end in /v1", "base URL"]),
        (with_("pools.small.replicas.1.name", "s0"), ["pools.small.replicas[1].name", "already used", "unique"]),
        (with_("pools.small.replicas.0.kv_events", "127.0.0.1:5601"), ["kv_events", "ZMQ endpoint", "tcp://"]),
        (with_("pools.small.replicas", []), ["pools.small.replicas", "non-empty list"]),
        (with_("pools.small.model", 7), ["pools.small.model", "non-empty string", "7"]),
        (with_("pools.small.tokenizer", "hf"), ["pools.small.tokenizer", "'hf'", "auto", "{local: DIR}"]),
        (with_("routes.assistant.pools", ["smal"]), ["routes.assistant.pools[0]", "'smal'", "Did you mean 'small'"]),
        (with_("routes", {}), ["routes", "at least one route"]),
        (with_("pools", {}), ["pools", "at least one pool"]),
        (with_("policy.name", "kvrout"), ["policy.name", "'kvrout'", "Did you mean 'kvroute'"]),
        (with_("state", {"backend": "redis"}), ["state.url", "redis://"]),
        (with_("state", {"backend": "etcd"}), ["state.backend", "'etcd'", "memory or redis"]),
        (with_("timeouts", {"first_byte_s": 700, "total_s": 600}), ["timeouts.first_byte_s", "total_s"]),
        (with_("timeouts.connect_s", 0), ["timeouts.connect_s", "must be > 0"]),
        (with_("timeouts.connect_s", "2s"), ["timeouts.connect_s", "'2s'", "must be a number"]),
        (with_("admission.max_in_flight", 0), ["admission.max_in_flight", ">= 1"]),
        (with_("warm_ahead.fraction", 1.2), ["warm_ahead.fraction", "below 1"]),
        (with_("warm_ahead.enabled", "yes"), ["warm_ahead.enabled", "true or false"]),
        (with_("warm_ahead.max_in_flight_per_replica", 0), ["warm_ahead.max_in_flight_per_replica", "(got 0)", ">= 1", "warm_ahead.enabled: false"]),
        (with_("warm_ahead.max_in_flight_per_replica", 1.5), ["warm_ahead.max_in_flight_per_replica", "(got 1.5)", "whole number"]),
        (with_("warm_ahead.max_in_flight_per_replica", True), ["warm_ahead.max_in_flight_per_replica", "(got True)", "integer"]),
        (with_("warm_ahead.chunk_tokens", -1), ["warm_ahead.chunk_tokens", "(got -1)", ">= 0", "0 to send each warm-up as one request"]),
        (with_("warm_ahead.chunk_tokens", 512.0), ["warm_ahead.chunk_tokens", "(got 512.0)", "integer", "e.g. 512"]),
        (with_("warm_ahead.chunk_tokens", False), ["warm_ahead.chunk_tokens", "(got False)", "integer"]),
        (with_("warm_ahead.chunk_token", 512), ["warm_ahead.chunk_token", "did you mean 'chunk_tokens'"]),
        (with_("tenants", [{"name": "a", "api_key_env": "sk-123abc"}]), ["tenants[0].api_key_env", "environment variable name"]),
        (with_("tenants", [{"name": "a", "api_key_env": "K"}, {"name": "a", "api_key_env": "L"}]), ["tenants[1].name", "defined twice"]),
        (with_("tenants", [{"name": "a", "api_key_env": "K"}, {"name": "b", "api_key_env": "K"}]), ["tenants[1].api_key_env", "already tenant 'a'"]),
        (with_("tenants", [{"name": "a", "api_key_env": "K", "cache_salt": "no"}]), ["tenants[0].cache_salt", "true or false"]),
        (with_("tenants", [{"name": "a", "api_key_env": "K", "routing_header": True}]), ["tenants[0].routing_header", "did you mean 'routing_headers'"]),
        (with_("timeouts.stall_s", 0), ["timeouts.stall_s", "(got 0)", "must be > 0"]),
        (with_("http", {"header_timeout_s": 0}), ["http.header_timeout_s", "(got 0)", "must be > 0"]),
        (with_("http", {"max_connections": 0}), ["http.max_connections", "(got 0)", ">= 1"]),
        (with_("http", {"max_header_bytes": 100}), ["http.max_header_bytes", "(got 100)", ">= 1024"]),
        (with_("http", {"idle_timeout": 5}), ["http.idle_timeout", "did you mean 'idle_timeout_s'"]),
        (with_("http", [1]), ["http", "mapping"]),
        (with_("log_level", "loud"), ["log_level", "'loud'", "debug, info"]),
        (with_("routes.admin", {"pools": ["small"]}), ["routes.admin", "reserved"]),
        (with_("listen.port", 70000), ["listen.port", "65535"]),
        ([1, 2], ["(top level)", "mapping"]),
    ],
)
def test_every_bad_value_names_key_value_and_fix(data: Any, fragments: list[str]) -> None:
    message = error_of(data)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_warm_ahead_per_replica_bound_default_and_value() -> None:
    assert parse_config(MINIMAL, env={}).warm_ahead.max_in_flight_per_replica == 1
    data = with_("warm_ahead.max_in_flight_per_replica", 3)
    assert parse_config(data, env={}).warm_ahead.max_in_flight_per_replica == 3


def test_warm_ahead_chunk_tokens_default_and_values() -> None:
    assert parse_config(MINIMAL, env={}).warm_ahead.chunk_tokens == 512
    for value in (0, 16, 4096):
        assert parse_config(with_("warm_ahead.chunk_tokens", value),
                            env={}).warm_ahead.chunk_tokens == value


def test_warm_ahead_env_override() -> None:
    assert parse_config(MINIMAL, env={"KVROUTE_WARM_AHEAD": "0"}).warm_ahead.enabled is False
    off = with_("warm_ahead", {"enabled": False})
    assert parse_config(off, env={"KVROUTE_WARM_AHEAD": "1"}).warm_ahead.enabled is True
    assert parse_config(off, env={}).warm_ahead.enabled is False
    message = error_of(MINIMAL, env={"KVROUTE_WARM_AHEAD": "off"})
    assert "KVROUTE_WARM_AHEAD" in message and "'off'" in message and "0 or 1" in message


def test_load_config_reports_unreadable_and_invalid_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml", env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, env={})
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(MINIMAL))
    assert isinstance(load_config(good, env={}), RouterConfig)


TENANTS = with_("tenants", [
    {"name": "acme", "api_key_env": "ACME_KEY"},
    {"name": "beta", "api_key_env": "BETA_KEY", "cache_salt": False},
], base=with_("admin_key_env", "ADMIN_KEY"))


def test_tenants_are_salted_and_hidden_from_routing_headers_unless_told() -> None:
    acme, beta = parse_config(TENANTS, env={}).tenants
    assert acme.cache_salt is True and beta.cache_salt is False
    assert acme.routing_headers is False and beta.routing_headers is False
    shown = with_("tenants", [{"name": "ops", "api_key_env": "OPS_KEY", "routing_headers": True}])
    assert parse_config(shown, env={}).tenants[0].routing_headers is True


def test_stall_timeout_defaults_to_nginx_proxy_read_timeout() -> None:
    assert parse_config(MINIMAL, env={}).timeouts.stall_s == 60.0
    assert parse_config(with_("timeouts.stall_s", 5), env={}).timeouts.stall_s == 5.0


def test_http_limits_default_to_nginx_and_envoy_and_can_be_set() -> None:
    limits = parse_config(MINIMAL, env={}).http
    assert (limits.max_header_bytes, limits.header_timeout_s, limits.body_timeout_s,
            limits.send_timeout_s, limits.idle_timeout_s, limits.max_connections) == (
        60 * 1024, 60.0, 60.0, 60.0, 75.0, 4096)
    data = with_("http", {"header_timeout_s": 5, "max_connections": 10, "max_header_bytes": 8192})
    limits = parse_config(data, env={}).http
    assert (limits.header_timeout_s, limits.max_connections, limits.max_header_bytes) == (
        5.0, 10, 8192)


def test_secrets_resolve_keys_salts_and_admin() -> None:
    config = parse_config(TENANTS, env={})
    env = {"ACME_KEY": "ka", "BETA_KEY": "kb", "ADMIN_KEY": "root", "KVROUTE_SALT_SECRET": "s3"}
    secrets = resolve_secrets(config, env)
    assert dict(secrets.api_keys) == {"ka": "acme", "kb": "beta"}
    assert secrets.admin_key == "root"
    assert dict(secrets.cache_salts) == {"acme": derive_cache_salt("s3", "acme")}
    assert "ka" not in repr(secrets) and "root" not in repr(secrets)


def test_no_tenants_means_no_keys() -> None:
    secrets = resolve_secrets(parse_config(MINIMAL, env={}), {})
    assert not secrets.api_keys and secrets.admin_key is None
    assert DEFAULT_TENANT == "default"


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"BETA_KEY": "kb", "ADMIN_KEY": "r", "KVROUTE_SALT_SECRET": "s"}, "ACME_KEY (tenant 'acme') is unset"),
        ({"ACME_KEY": "k", "BETA_KEY": "k", "ADMIN_KEY": "r", "KVROUTE_SALT_SECRET": "s"}, "same key as tenant 'acme'"),
        ({"ACME_KEY": "ka", "BETA_KEY": "kb", "ADMIN_KEY": "r"}, "KVROUTE_SALT_SECRET (salt_secret_env) is unset"),
        ({"ACME_KEY": "ka", "BETA_KEY": "kb", "ADMIN_KEY": "r"}, "or write cache_salt: false"),
        ({"ACME_KEY": "ka", "BETA_KEY": "kb", "KVROUTE_SALT_SECRET": "s"}, "ADMIN_KEY is unset"),
        ({"ACME_KEY": "ka", "BETA_KEY": "kb", "ADMIN_KEY": "ka", "KVROUTE_SALT_SECRET": "s"}, "must differ from every tenant key"),
    ],
)
def test_secret_errors(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_secrets(parse_config(TENANTS, env={}), env)
    assert fragment in str(info.value)


def test_derived_salt_is_stable_distinct_and_valid_for_vllm() -> None:
    a = derive_cache_salt("secret", "acme")
    assert a == derive_cache_salt("secret", "acme")
    assert a != derive_cache_salt("secret", "beta")
    assert a != derive_cache_salt("other", "acme")
    assert len(a) == 32 and all(c in "0123456789abcdef" for c in a)


def test_kv_events_bind_for_engines_that_connect() -> None:
    from kvroute.config import parse_config
    from kvroute.core.errors import ConfigError

    base = {"pools": {"p": {"model": "m", "replicas": [
        {"name": "r0", "url": "http://127.0.0.1:8101", "kv_events": "tcp://127.0.0.1:5601",
         "kv_events_bind": True}]}}, "routes": {"a": {"pools": ["p"]}}}
    cfg = parse_config(base, env={})
    assert cfg.pools["p"].replicas[0].kv_events_bind is True
    bad = {**base, "pools": {"p": {"model": "m", "replicas": [
        {"name": "r0", "url": "http://127.0.0.1:8101", "kv_events_bind": "yes"}]}}}
    with pytest.raises(ConfigError, match="kv_events_bind"):
        parse_config(bad, env={})


def test_a_pool_names_its_engines_decode_step_or_gets_the_8b_h100_one() -> None:
    from kvroute.core.load import DEFAULT_DECODE_TIMING, DecodeTiming

    pool = {"model": "m", "replicas": [{"name": "r0", "url": "http://127.0.0.1:9"}]}
    plain = parse_config({"pools": {"p": pool}, "routes": {"m": {"pools": ["p"]}}}, env={})
    assert plain.pools["p"].decode_timing == DEFAULT_DECODE_TIMING
    timed = parse_config({"pools": {"p": {**pool, "decode_timing": {"fixed_s": 0.02,
                                                                     "context_token_s": 0}}},
                          "routes": {"m": {"pools": ["p"]}}}, env={})
    assert timed.pools["p"].decode_timing == DecodeTiming(0.02, DEFAULT_DECODE_TIMING.seq_s, 0.0)
    with pytest.raises(ConfigError, match="decode_timing.seq_s"):
        parse_config({"pools": {"p": {**pool, "decode_timing": {"seq_s": "fast"}}},
                      "routes": {"m": {"pools": ["p"]}}}, env={})


def test_cache_drift_settings_parse_and_bad_ones_say_what_to_fix() -> None:
    config = parse_config(with_("cache_drift", {"threshold": 0.3, "min_samples": 4,
                                                "approximate_on_alarm": False}), env={})
    drift = config.cache_drift
    assert (drift.threshold, drift.min_samples, drift.window) == (0.3, 4, 64)
    assert drift.approximate_on_alarm is False
    assert parse_config(MINIMAL, env={}).cache_drift.enabled is True
    assert "cache_drift.threshold" in error_of(with_("cache_drift.threshold", 2))
    assert "cache_drift.window" in error_of(with_("cache_drift.window", "many"))
    assert "min_samples" in error_of(with_("cache_drift", {"min_samples": 100, "window": 10}))
    assert "limit" in error_of(with_("cache_drift.limit", 1))


def test_kv_stream_is_off_by_default_and_parses_with_its_limits() -> None:
    assert parse_config(MINIMAL, env={}).kv_stream is None
    config = parse_config(with_("kv_stream", {"url": "nats://10.0.0.9:4222", "relay": True,
                                              "max_age_s": 3600, "max_bytes": 1 << 28,
                                              "snapshot_every": 2000}), env={})
    stream = config.kv_stream
    assert stream is not None
    assert (stream.url, stream.relay, stream.max_age_s, stream.max_bytes,
            stream.snapshot_every) == ("nats://10.0.0.9:4222", True, 3600.0, 1 << 28, 2000)
    assert (stream.name, stream.subject_prefix) == ("KVROUTE_KV_EVENTS", "kvroute.kv")


@pytest.mark.parametrize(("stream", "fragments"), [
    ({"url": "redis://127.0.0.1:6379"}, ["kv_stream.url", "nats://"]),
    ({"name": "kv.events"}, ["kv_stream.name", "no dots"]),
    ({"subject_prefix": "kvroute.*"}, ["kv_stream.subject_prefix", "wildcards"]),
    ({"max_bytes": 1000}, ["kv_stream.max_bytes", ">= 1048576"]),
    ({"snapshot_every": 0}, ["kv_stream.snapshot_every", ">= 1"]),
    ({"relay": "yes"}, ["kv_stream.relay", "true or false"]),
    ({"snapshot": 10}, ["kv_stream.snapshot", "did you mean 'snapshot_every'"]),
])
def test_bad_kv_stream_values_say_what_to_fix(stream: dict[str, Any],
                                              fragments: list[str]) -> None:
    message = error_of(with_("kv_stream", stream))
    for fragment in fragments:
        assert fragment in message


def test_cluster_sharing_is_off_by_default_and_takes_a_nats_url() -> None:
    assert parse_config(MINIMAL, env={}).cluster.bus == "none"
    cluster = parse_config(with_("cluster", {"bus": "nats", "url": "nats://127.0.0.1:4222",
                                             "router_id": "router-a"}), env={}).cluster
    assert (cluster.bus, cluster.url, cluster.router_id) == (
        "nats", "nats://127.0.0.1:4222", "router-a")
    assert cluster.subject == "kvroute.cluster" and cluster.peer_expiry_s == 3.0


@pytest.mark.parametrize(("cluster", "expected"), [
    ({"bus": "kafka"}, "cluster.bus: must be none or nats"),
    ({"bus": "nats"}, "cluster.url: must be a non-empty string"),
    ({"bus": "nats", "url": "redis://127.0.0.1:6379"}, "cluster.url: must be a nats:// URL"),
    ({"url": "nats://127.0.0.1:4222"}, "cluster.url: is only used with bus: nats"),
    ({"bus": "nats", "url": "nats://h:4222", "subject": "kvroute.*"},
     "cluster.subject: must be dot-separated tokens"),
    ({"bus": "nats", "url": "nats://h:4222", "router_id": "a.b"},
     "cluster.router_id: must be letters"),
    ({"bus": "nats", "url": "nats://h:4222", "heartbeat_s": 1.0, "peer_expiry_s": 1.5},
     "cluster.peer_expiry_s: must be at least twice heartbeat_s"),
    ({"bus": "nats", "url": "nats://h:4222", "heartbeat_s": 0}, "cluster.heartbeat_s"),
    ({"bus": "nats", "url": "nats://h:4222", "peers": []}, "peers"),
])
def test_bad_cluster_settings_name_the_key_and_the_fix(cluster: dict[str, Any],
                                                       expected: str) -> None:
    assert expected in error_of(with_("cluster", cluster))


NATS_CLUSTER = {"bus": "nats", "url": "nats://127.0.0.1:4222"}
REDIS_STATE = {"backend": "redis", "url": "redis://127.0.0.1:6379/0"}
GOOD_SECRET = "a-long-random-cluster-secret-0123456789"


def secret_error(data: dict[str, Any], env: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_secrets(parse_config(data, env={}), env)
    return str(info.value)


def test_a_cluster_needs_its_secret_and_the_error_says_how_to_set_it() -> None:
    """Routers sharing state over NATS or Redis refuse to start without the cluster secret
    (tenant and session ids go there only as keyed pseudonyms); the secret is never shown."""
    message = secret_error(with_("cluster", NATS_CLUSTER), {})
    for fragment in ("cluster.bus is nats", "KVROUTE_CLUSTER_SECRET", "cluster.secret_env",
                     "the same on every router", "token_hex", "cluster.secret"):
        assert fragment in message
    assert "state.backend is redis" in secret_error(with_("state", REDIS_STATE), {})
    named = with_("cluster", {**NATS_CLUSTER, "secret_env": "FLEET_SECRET"})
    assert "FLEET_SECRET" in secret_error(named, {"KVROUTE_CLUSTER_SECRET": GOOD_SECRET})
    short = "short-secret"
    message = secret_error(with_("cluster", NATS_CLUSTER), {"KVROUTE_CLUSTER_SECRET": short})
    assert "at least 16" in message and short not in message
    assert "at least 16" in error_of(with_("cluster", {**NATS_CLUSTER, "secret": short}))
    assert short not in error_of(with_("cluster", {**NATS_CLUSTER, "secret": short}))
    # set: from the environment, from the file; shown by no repr
    secrets = resolve_secrets(parse_config(named, env={}), {"FLEET_SECRET": GOOD_SECRET})
    assert secrets.cluster_secret == GOOD_SECRET and GOOD_SECRET not in repr(secrets)
    inline = parse_config(with_("cluster", {**NATS_CLUSTER, "secret": GOOD_SECRET}), env={})
    assert GOOD_SECRET not in repr(inline)
    assert resolve_secrets(inline, {}).cluster_secret == GOOD_SECRET
    # one router sharing nothing needs none
    assert resolve_secrets(parse_config(MINIMAL, env={}), {}).cluster_secret is None
