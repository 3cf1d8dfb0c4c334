"""The dashboard's activity record and the feedback loop's parsing (shell/activity.py,
shell/cache_feedback.py), without sockets."""

from __future__ import annotations

import logging
import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvroute.core.cache_drift import CacheDriftSettings
from kvroute.core.clock import ManualClock
from kvroute.core.events import BlockStored, EventBatch
from kvroute.core.hashing import BlockHasher
from kvroute.core.index import TenantScope
from kvroute.core.peer_policies import make_policy
from kvroute.core.router import PoolSpec, ReplicaSpec, RouterCore, RouteRequest
from kvroute.core.types import PoolName, ReplicaId, RequestId, TenantName, to_wire_hash
from kvroute.shell.activity import Activity
from kvroute.shell.cache_feedback import CacheFeedback, reported_cached_tokens
from kvroute.wire.prom import parse_vllm_metrics


def test_decisions_per_second_count_whole_past_seconds_only() -> None:
    clock = ManualClock(100.0)
    activity = Activity(clock, horizon_s=60)
    for second in range(20):
        for _ in range(second % 3):
            activity.decided("small", "r0", 16, 64)
        clock.advance(1.0)
    activity.decided("small", "r0", 0, 64)  # the current second is not counted yet
    rates = activity.decisions_per_second(window_s=10)
    assert rates == {"small": sum(s % 3 for s in range(10, 20)) / 10}
    assert activity.predicted_hit_ratio("r0") == sum(16 * (s % 3) for s in range(20)) / (
        64 * (sum(s % 3 for s in range(20)) + 1))
    assert activity.predicted_hit_ratio("nobody") is None


def test_refusals_are_bounded_newest_first_and_short() -> None:
    clock = ManualClock()
    activity = Activity(clock, max_refusals=3)
    for i in range(5):
        activity.refused(400 + i, "p", "x" * 500)
        clock.advance(1.0)
    recent = activity.recent_refusals()
    assert [r["status"] for r in recent] == [404, 403, 402]
    assert recent[0]["age_s"] == 1.0 and len(recent[0]["reason"]) == 160


def test_reported_cached_tokens_reads_only_well_formed_usage() -> None:
    assert reported_cached_tokens({"prompt_tokens": 50, "prompt_tokens_details":
                                   {"cached_tokens": 32}}) == (50, 32)
    assert reported_cached_tokens(None) is None
    assert reported_cached_tokens({"prompt_tokens": 50}) is None  # details not enabled
    assert reported_cached_tokens({"prompt_tokens": 50, "prompt_tokens_details": None}) is None
    assert reported_cached_tokens({"prompt_tokens": 50, "prompt_tokens_details":
                                   {"cached_tokens": -1}}) is None
    assert reported_cached_tokens({"prompt_tokens": 50, "prompt_tokens_details":
                                   {"cached_tokens": True}}) is None


def test_engine_counters_reach_metrics_and_caching_off_reaches_the_core() -> None:
    core = RouterCore([PoolSpec(PoolName("p"), (ReplicaSpec(ReplicaId("r0")),))],
                      lambda: make_policy("kvroute", random.Random(0)), clock=ManualClock())
    registry = CollectorRegistry()
    feedback = CacheFeedback(core, CacheDriftSettings(), registry)
    text = ('vllm:num_requests_running{engine="0",model_name="m"} 1\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 2\n'
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 40\n'
            'vllm:num_preemptions_total{engine="0",model_name="m"} 3\n'
            'vllm:cache_config_info{block_size="16",enable_prefix_caching="False",'
            'engine="0",prefix_caching_hash_algo="sha256"} 1\n')
    parsed = parse_vllm_metrics(text, "m")
    assert parsed.num_preemptions_total == 3
    feedback.on_engine_metrics(ReplicaId("r0"), parsed)
    assert core.prefix_caching_off(ReplicaId("r0"))
    body = generate_latest(registry).decode()
    assert 'kvroute_engine_prefix_caching_enabled{replica="r0"} 0.0' in body
    assert 'kvroute_engine_kv_cache_usage{replica="r0"} 0.25' in body
    assert 'kvroute_engine_requests{replica="r0",state="waiting"} 2.0' in body
    assert 'kvroute_cache_drift_alarm{pool="p"} 0.0' in body
    feedback.forget_replica(ReplicaId("r0"))  # scale-in: the pod is gone
    body = generate_latest(registry).decode()
    assert 'replica="r0"' not in body.split("kvroute_cache_predicted_tokens")[0]


def test_the_drift_alarm_logs_on_entering_reminds_while_on_and_says_when_it_ends(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock()
    core = RouterCore([PoolSpec(PoolName("p"), (ReplicaSpec(ReplicaId("r0")),))],
                      lambda: make_policy("kvroute", random.Random(0)), clock=clock)
    feedback = CacheFeedback(core, CacheDriftSettings(window=4, min_samples=2),
                             CollectorRegistry())
    caplog.set_level(logging.WARNING, logger="kvroute.shell.cache_feedback")
    tokens = list(range(200))

    def answer(i: int, cached: int) -> None:
        clock.advance(3.0)  # the router's own predicted entries (2 s) have expired
        decision = core.route(RouteRequest(
            RequestId(f"q{i}"), PoolName("p"), TenantScope(TenantName("t")),
            num_prompt_tokens=200, prompt_token_ids=tokens, expected_output_tokens=4,
            routing_text="some words " * 30))
        feedback.on_decision(decision)
        feedback.on_answer(decision, {"prompt_tokens": 200,
                                      "prompt_tokens_details": {"cached_tokens": cached}})

    for i in range(2):
        answer(i, 192)  # the index knows nothing of it: predicted 0
    assert core.pool_drifting(PoolName("p"))
    for i in range(2, 6):
        answer(i, 192)  # still blind: the shadow prediction says 0 too
    messages = [r.getMessage() for r in caplog.records]
    assert sum("CACHE DRIFT in pool p:" in m for m in messages) == 1
    assert sum("continues after 4 more answers" in m for m in messages) == 1
    core.apply_events(ReplicaId("r0"), _stored(tokens))
    for i in range(6, 10):
        answer(i, 192)  # the exact index now agrees: the window empties of disagreement
    assert not core.pool_drifting(PoolName("p"))
    assert "agree with the engines' reports again" in caplog.records[-1].getMessage()


def _stored(tokens: list[int]) -> EventBatch:
    hashes = BlockHasher("sha256", 16).hash_blocks(tokens)
    return EventBatch(seq=0, ts=0.0, events=(BlockStored(
        block_hashes=tuple(to_wire_hash(h) for h in hashes), parent_block_hash=None,
        token_ids=tuple(tokens[: 16 * len(hashes)]), block_size=16),))
