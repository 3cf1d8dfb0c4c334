"""RouterMetrics: its own registry, exact series values, and a parseable exposition."""

from __future__ import annotations

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvroute.shell.metrics import TOKENIZER_MODES, RouterMetrics


def samples(metrics: RouterMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the rendered body, parsed back by prometheus_client's own parser."""
    body, _ = metrics.render()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_registries_are_private() -> None:
    a, b = RouterMetrics(), RouterMetrics()  # a second instance must not clash
    a.retry("r0")
    assert a.value("kvroute_retries_total", {"replica": "r0"}) == 1
    assert b.value("kvroute_retries_total", {"replica": "r0"}) is None
    default = prometheus_client.REGISTRY
    assert default.get_sample_value("kvroute_retries_total", {"replica": "r0"}) is None


def test_decision_counts_tokens_and_latency() -> None:
    m = RouterMetrics()
    m.decision("p", "r0", "cache", cached_tokens=96, prompt_tokens=128,
               routing_latency_s=0.00003, approximate=False)
    m.decision("p", "r1", "load", cached_tokens=0, prompt_tokens=50,
               routing_latency_s=0.002, approximate=True)
    s = samples(m)
    assert s[("kvroute_decisions_total", (("approximate", "false"), ("pool", "p"),
                                          ("reason", "cache"), ("replica", "r0")))] == 1
    assert s[("kvroute_decisions_total", (("approximate", "true"), ("pool", "p"),
                                          ("reason", "load"), ("replica", "r1")))] == 1
    assert s[("kvroute_prompt_tokens_total", (("pool", "p"),))] == 178
    assert s[("kvroute_cached_tokens_total", (("pool", "p"),))] == 96
    assert s[("kvroute_routing_latency_seconds_count", (("pool", "p"),))] == 2
    assert s[("kvroute_routing_latency_seconds_bucket", (("le", "5e-05"), ("pool", "p")))] == 1
    assert s[("kvroute_routing_latency_seconds_bucket", (("le", "0.0025"), ("pool", "p")))] == 2


def test_event_counters_and_index_size() -> None:
    m = RouterMetrics()
    m.events("r0", applied=5, gaps=1)
    m.events("r0", applied=2, replays=1, resets=1, malformed=3)
    value = m.value
    assert value("kvroute_kv_event_batches_applied_total", {"replica": "r0"}) == 7
    assert value("kvroute_kv_event_gaps_total", {"replica": "r0"}) == 1
    assert value("kvroute_kv_event_replays_total", {"replica": "r0"}) == 1
    assert value("kvroute_kv_event_resets_total", {"replica": "r0"}) == 1
    assert value("kvroute_kv_event_malformed_total", {"replica": "r0"}) == 3
    with pytest.raises(ValueError, match="only go up"):
        m.events("r0", applied=-1)
    m.set_index_size(entries=10, hashes=4)
    m.set_index_size(entries=8, hashes=3)
    assert (value("kvroute_index_entries"), value("kvroute_index_hashes")) == (8, 3)
    m.set_replaying("r0", True)
    m.set_replaying("r1", False)
    assert samples(m)[("kvroute_kv_event_replaying", (("replica", "r0"),))] == 1
    m.set_replaying("r0", False)
    assert value("kvroute_kv_event_replaying", {"replica": "r0"}) == 0
    assert value("kvroute_kv_event_replaying", {"replica": "r1"}) == 0


def test_gc_pauses_by_generation() -> None:
    m = RouterMetrics()
    m.gc_pause(0, 0.00002)
    m.gc_pause(2, 0.120)
    m.gc_pause(2, 0.004)
    value = m.value
    assert value("kvroute_gc_pause_seconds_count", {"generation": "0"}) == 1
    assert value("kvroute_gc_pause_seconds_count", {"generation": "2"}) == 2
    assert value("kvroute_gc_pause_seconds_sum", {"generation": "2"}) == pytest.approx(0.124)
    assert value("kvroute_gc_pause_seconds_bucket", {"generation": "2", "le": "0.05"}) == 1
    assert value("kvroute_gc_pause_seconds_count", {"generation": "1"}) == 0


def test_event_loop_lag_is_a_histogram_of_wake_ups() -> None:
    m = RouterMetrics()
    for late in (0.0002, 0.0003, 0.120):
        m.loop_lag(late)
    value = m.value
    assert value("kvroute_event_loop_lag_seconds_count") == 3
    assert value("kvroute_event_loop_lag_seconds_bucket", {"le": "0.05"}) == 2
    assert value("kvroute_event_loop_lag_seconds_sum") == pytest.approx(0.1205)


def test_fleet_gauges() -> None:
    m = RouterMetrics()
    assert m.approximate("p") is None
    m.set_approximate("p", True)
    assert m.approximate("p") is True
    m.set_approximate("p", False)
    assert m.approximate("p") is False
    m.set_tokenizer_mode("p", "local")
    m.set_tokenizer_mode("p", "approximate")
    assert {mode: m.value("kvroute_tokenizer_mode", {"pool": "p", "mode": mode})
            for mode in TOKENIZER_MODES} == {"engine": 0, "local": 0, "approximate": 1}
    with pytest.raises(ValueError, match="tokenizer mode must be one of"):
        m.set_tokenizer_mode("p", "exact")
    m.set_replica_healthy("r0", False)
    m.set_pool_window("p", 4096)
    m.set_pool_window("q", None)
    assert m.value("kvroute_replica_healthy", {"replica": "r0"}) == 0
    assert m.value("kvroute_pool_window_tokens", {"pool": "p"}) == 4096
    assert m.value("kvroute_pool_window_tokens", {"pool": "q"}) == 0


def test_outcome_counters() -> None:
    m = RouterMetrics()
    m.tokenize("p", "ok")
    m.tokenize("p", "ok")
    m.discovery("r0", "health_timeout")
    m.upstream_error("r0", "connect")
    m.admission_reject("queue_full")
    m.state_error("redis", "get_pin")
    m.warm("fired")
    m.warm("skipped", "unknown_model")
    m.escalation("small", "large", "reactive")
    m.cut_short("small")
    s = samples(m)
    assert s[("kvroute_tokenize_total", (("outcome", "ok"), ("pool", "p")))] == 2
    assert s[("kvroute_discovery_total", (("outcome", "health_timeout"), ("replica", "r0")))] == 1
    assert s[("kvroute_upstream_errors_total", (("kind", "connect"), ("replica", "r0")))] == 1
    assert s[("kvroute_admission_rejects_total", (("reason", "queue_full"),))] == 1
    assert s[("kvroute_state_errors_total", (("backend", "redis"), ("op", "get_pin")))] == 1
    assert s[("kvroute_warm_total", (("outcome", "fired"), ("reason", "")))] == 1
    assert s[("kvroute_warm_total", (("outcome", "skipped"), ("reason", "unknown_model")))] == 1
    assert s[("kvroute_escalations_total", (("from_pool", "small"), ("kind", "reactive"),
                                            ("to_pool", "large")))] == 1
    assert s[("kvroute_cut_short_total", (("pool", "small"),))] == 1


def test_render_content_type_and_help() -> None:
    m = RouterMetrics()
    m.set_approximate("p", True)
    body, content_type = m.render()
    assert content_type == prometheus_client.CONTENT_TYPE_LATEST
    text = body.decode()
    assert "# TYPE kvroute_pool_approximate gauge" in text
    assert 'kvroute_pool_approximate{pool="p"} 1.0' in text


def test_token_piece_cache_state_is_exported() -> None:
    m = RouterMetrics()
    m.set_token_piece_cache("p", enabled=True, hits=7, misses=3, cached_tokens=120,
                            mismatches=0, checks=1, checks_dropped=0, checks_failed=0)
    m.set_token_piece_cache("p", enabled=False, hits=9, misses=4, cached_tokens=0,
                            mismatches=1, checks=2, checks_dropped=3, checks_failed=4)
    text = m.render()[0].decode()
    assert 'kvroute_token_piece_cache{pool="p",stat="enabled"} 0.0' in text
    assert 'kvroute_token_piece_cache{pool="p",stat="hits"} 9.0' in text
    assert 'kvroute_token_piece_cache{pool="p",stat="mismatches"} 1.0' in text
    assert 'kvroute_token_piece_cache{pool="p",stat="checks"} 2.0' in text
    assert 'kvroute_token_piece_cache{pool="p",stat="checks_dropped"} 3.0' in text
    assert 'kvroute_token_piece_cache{pool="p",stat="checks_failed"} 4.0' in text


def test_a_replica_that_left_exports_no_gauge() -> None:
    """Scale-in: the replica's ``replica_healthy`` series goes away instead of staying at 0,
    which would fire the "replica down" alert for a pod that no longer exists."""
    m = RouterMetrics()
    m.set_replica_healthy("r0", True)
    m.set_replica_healthy("r1", True)
    m.forget_replica("r0")
    m.forget_replica("never-seen")
    assert m.value("kvroute_replica_healthy", {"replica": "r0"}) is None
    assert m.value("kvroute_replica_healthy", {"replica": "r1"}) == 1
    assert b'replica="r0"' not in m.render()[0].split(b"kvroute_replica_healthy", 1)[1]


def test_cluster_seq_outbox_and_peer_seqs_are_exported() -> None:
    """What a client needs to tell that one router's announcements reached another: this
    router's last batch and outbox, its id, and per peer the last batch applied; a peer no
    longer heard loses its series."""
    m = RouterMetrics()
    m.set_cluster({"seq": 7, "outbox": 2}, router_id="r0", peer_seqs={"r1": 3, "r2": 5})
    got = samples(m)
    assert got[("kvroute_cluster", (("stat", "seq"),))] == 7
    assert got[("kvroute_cluster", (("stat", "outbox"),))] == 2
    assert got[("kvroute_cluster_info", (("router_id", "r0"),))] == 1
    assert got[("kvroute_cluster_peer_seq", (("peer", "r1"),))] == 3
    m.set_cluster({"seq": 8, "outbox": 0}, router_id="r0", peer_seqs={"r2": 6})
    got = samples(m)
    assert got[("kvroute_cluster", (("stat", "seq"),))] == 8
    assert got[("kvroute_cluster", (("stat", "outbox"),))] == 0
    assert got[("kvroute_cluster_peer_seq", (("peer", "r2"),))] == 6
    assert ("kvroute_cluster_peer_seq", (("peer", "r1"),)) not in got
