"""Router-side load accounting and the learned prefill rate."""

from __future__ import annotations

import pytest

from kvroute.core.load import LoadTracker
from kvroute.core.types import ReplicaId, RequestId

R = ReplicaId("r0")


def tracker() -> LoadTracker:
    t = LoadTracker(rate_ewma_alpha=0.5)
    t.add_replica(R, prefill_rate_tps=1000.0)
    return t


def test_dispatch_first_token_complete_cycle() -> None:
    t = tracker()
    t.on_dispatch(R, RequestId("a"), prefill_tokens=800, prompt_tokens=1000,
                  expected_output_tokens=100, now_s=0.0)
    snap = t.snapshot(R)
    assert (snap.outstanding_prefill_tokens, snap.num_in_flight, snap.num_decoding) == (800, 1, 0)
    assert snap.active_kv_tokens == 1100
    t.on_first_token(R, RequestId("a"), now_s=0.4)
    snap = t.snapshot(R)
    assert (snap.outstanding_prefill_tokens, snap.num_decoding) == (0, 1)
    # 800 tokens in 0.4 s = 2000 tok/s; EWMA with alpha 0.5 from 1000 -> 1500.
    assert snap.prefill_rate_tps == pytest.approx(1500.0)
    t.on_complete(R, RequestId("a"))
    snap = t.snapshot(R)
    assert (snap.num_in_flight, snap.num_decoding, snap.active_kv_tokens) == (0, 0, 0)


def test_queue_ahead_counts_in_the_rate_sample() -> None:
    t = tracker()
    t.on_dispatch(R, RequestId("a"), prefill_tokens=1000, prompt_tokens=1000,
                  expected_output_tokens=0, now_s=0.0)
    t.on_dispatch(R, RequestId("b"), prefill_tokens=1000, prompt_tokens=1000,
                  expected_output_tokens=0, now_s=0.0)
    t.on_first_token(R, RequestId("a"), now_s=1.0)   # 1000 tok/s: unchanged
    t.on_first_token(R, RequestId("b"), now_s=2.0)   # 2000 tokens (1000 ahead) in 2 s
    assert t.snapshot(R).prefill_rate_tps == pytest.approx(1000.0)


def test_complete_before_first_token_releases_the_prefill() -> None:
    t = tracker()
    t.on_dispatch(R, RequestId("a"), prefill_tokens=500, prompt_tokens=500,
                  expected_output_tokens=10, now_s=0.0)
    t.on_complete(R, RequestId("a"))
    assert t.snapshot(R).outstanding_prefill_tokens == 0


def test_unknown_and_duplicate_events_are_harmless() -> None:
    t = tracker()
    t.on_complete(R, RequestId("nope"))
    t.on_first_token(R, RequestId("nope"), now_s=1.0)
    assert t.num_unknown_completions == 1
    t.on_dispatch(R, RequestId("a"), prefill_tokens=10, prompt_tokens=10,
                  expected_output_tokens=0, now_s=0.0)
    t.on_dispatch(R, RequestId("a"), prefill_tokens=10, prompt_tokens=10,
                  expected_output_tokens=0, now_s=0.0)
    assert t.snapshot(R).outstanding_prefill_tokens == 10


def test_engine_waiting_count_is_a_floor_for_the_queue() -> None:
    t = tracker()
    t.on_dispatch(R, RequestId("a"), prefill_tokens=100, prompt_tokens=2000,
                  expected_output_tokens=0, now_s=0.0)
    t.on_engine_metrics(R, running=4, waiting=3, kv_usage=0.5)
    snap = t.snapshot(R)
    assert snap.outstanding_prefill_tokens == 6000
    assert (snap.engine_running, snap.engine_waiting, snap.kv_usage) == (4, 3, 0.5)


def test_rate_samples_are_clamped() -> None:
    t = tracker()
    t.on_dispatch(R, RequestId("a"), prefill_tokens=10_000, prompt_tokens=10_000,
                  expected_output_tokens=0, now_s=0.0)
    t.on_first_token(R, RequestId("a"), now_s=1e-6)
    assert t.snapshot(R).prefill_rate_tps <= 1000.0 * 10


def test_reset_and_unknown_replica() -> None:
    t = tracker()
    t.on_dispatch(R, RequestId("a"), prefill_tokens=100, prompt_tokens=100,
                  expected_output_tokens=0, now_s=0.0)
    t.reset_replica(R)
    assert t.snapshot(R).num_in_flight == 0
    with pytest.raises(KeyError, match="add_replica"):
        t.snapshot(ReplicaId("other"))
    with pytest.raises(ValueError, match="prefill_rate_tps"):
        t.add_replica(ReplicaId("x"), prefill_rate_tps=0)


def test_backlog_drains_at_the_learned_rate_between_events() -> None:
    t = tracker()  # 1000 tok/s
    t.on_dispatch(R, RequestId("a"), prefill_tokens=4000, prompt_tokens=4000,
                  expected_output_tokens=0, now_s=0.0)
    assert t.snapshot(R).outstanding_prefill_tokens == 4000
    assert t.snapshot(R, 1.0).outstanding_prefill_tokens == 3000
    assert t.snapshot(R, 10.0).outstanding_prefill_tokens == 0
    # a new dispatch adds to what is left, not to the original count
    t.on_dispatch(R, RequestId("b"), prefill_tokens=1000, prompt_tokens=1000,
                  expected_output_tokens=0, now_s=2.0)
    assert t.snapshot(R, 2.0).outstanding_prefill_tokens == 3000
    # progress reports re-anchor it, never above the outstanding count
    t.on_first_token(R, RequestId("a"), now_s=2.5)
    assert t.snapshot(R, 2.5).outstanding_prefill_tokens == 1000
