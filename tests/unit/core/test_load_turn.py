"""The load tracker's view of decoding: remaining output, the batch a request joins, the
learned inter-token factor, and prefill rates that cannot lock in."""

from __future__ import annotations

import pytest

from kvroute.core.load import RATE_STALE_HALF_LIFE_S, DecodeTiming, LoadTracker
from kvroute.core.types import ReplicaId, RequestId

R = ReplicaId("r0")
TEN_MS = DecodeTiming(fixed_s=0.01, seq_s=0.0, context_token_s=0.0)


def tracker(alpha: float = 1.0, rate: float = 10_000.0) -> LoadTracker:
    t = LoadTracker(rate_ewma_alpha=alpha)
    t.add_replica(R, prefill_rate_tps=rate, decode_timing=TEN_MS)
    return t


def dispatch(t: LoadTracker, rid: str, *, prompt: int = 100, prefill: int = 100,
             predicted: int = 50, now: float = 0.0) -> None:
    t.on_dispatch(R, RequestId(rid), prefill_tokens=prefill, prompt_tokens=prompt,
                  expected_output_tokens=4096, predicted_output_tokens=predicted, now_s=now)


def test_remaining_output_drains_at_the_predicted_step_and_stops_at_zero() -> None:
    t = tracker()
    dispatch(t, "a", predicted=100)
    t.on_first_token(R, RequestId("a"), now_s=1.0)
    assert t.snapshot(R, 1.0).decode_tokens_left == pytest.approx(100)
    assert t.snapshot(R, 1.5).decode_tokens_left == pytest.approx(50)  # 50 steps of 10 ms
    assert t.snapshot(R, 3.0).decode_tokens_left == 0.0


def test_a_request_counts_as_waiting_until_its_first_token_then_as_decoding() -> None:
    t = tracker()
    dispatch(t, "a", prompt=1000, predicted=200)
    snap = t.snapshot(R, 0.0)
    assert (snap.waiting_context_tokens, snap.waiting_output_tokens) == (1100, 200)
    assert snap.decoding_context_tokens == 0
    t.on_first_token(R, RequestId("a"), now_s=0.5)
    snap = t.snapshot(R, 0.5)
    assert (snap.waiting_context_tokens, snap.waiting_output_tokens) == (0, 0)
    assert (snap.decoding_context_tokens, snap.num_decoding) == (1100, 1)
    t.on_complete(R, RequestId("a"), now_s=0.6)
    snap = t.snapshot(R, 0.6)
    assert (snap.decoding_context_tokens, snap.num_decoding, snap.decode_tokens_left) == (0, 0, 0)


def test_a_request_that_ends_before_its_first_token_leaves_nothing_behind() -> None:
    t = tracker()
    dispatch(t, "a", prompt=1000, predicted=200)
    t.on_complete(R, RequestId("a"))
    snap = t.snapshot(R, 0.0)
    assert (snap.waiting_context_tokens, snap.waiting_output_tokens) == (0, 0)


def test_the_inter_token_factor_is_learned_from_answers_with_their_token_count() -> None:
    t = tracker()
    dispatch(t, "a")
    t.on_first_token(R, RequestId("a"), now_s=1.0)
    t.on_complete(R, RequestId("a"), now_s=1.0 + 99 * 0.02, output_tokens=100)
    assert t.snapshot(R, 3.0).itl_scale == pytest.approx(2.0)  # 20 ms a token, 10 modelled


def test_prefill_sent_meanwhile_is_not_blamed_on_the_decode_model() -> None:
    """2,000 prefill tokens sent there during the answer ran in its steps: 0.2 s at the
    replica's 10,000 tokens/s, taken out of the observed time before learning."""
    t = tracker()
    dispatch(t, "a")
    t.on_first_token(R, RequestId("a"), now_s=1.0)
    dispatch(t, "b", prompt=2000, prefill=2000, now=1.1)
    t.on_complete(R, RequestId("a"), now_s=1.0 + 99 * 0.02, output_tokens=100)
    assert t.snapshot(R, 3.0).itl_scale == pytest.approx((99 * 0.02 - 0.2) / 99 / 0.01)


def test_short_or_uncounted_answers_teach_nothing() -> None:
    t = tracker()
    for rid, tokens in (("a", None), ("b", 3)):
        dispatch(t, rid)
        t.on_first_token(R, RequestId(rid), now_s=1.0)
        t.on_complete(R, RequestId(rid), now_s=5.0, output_tokens=tokens)
    assert t.snapshot(R, 6.0).itl_scale == 1.0


def test_a_rate_learned_below_the_configured_one_decays_back_to_it() -> None:
    """One bad sample must not keep a replica out of routing for good: without a new sample
    its rate is halfway back after the half-life."""
    t = tracker()
    dispatch(t, "a", prefill=1000)
    t.on_first_token(R, RequestId("a"), now_s=0.2)  # 1,000 tokens in 0.2 s: 5,000/s
    assert t.snapshot(R, 0.2).prefill_rate_tps == pytest.approx(5_000)
    assert t.snapshot(R, 0.2 + RATE_STALE_HALF_LIFE_S).prefill_rate_tps == pytest.approx(7_500)
    assert t.snapshot(R, 0.2 + 2 * RATE_STALE_HALF_LIFE_S).prefill_rate_tps == pytest.approx(
        8_750)


def test_a_rate_learned_above_the_configured_one_stays() -> None:
    t = tracker()
    dispatch(t, "a", prefill=1000)
    t.on_first_token(R, RequestId("a"), now_s=0.05)  # 20,000/s
    assert t.snapshot(R, 1000.0).prefill_rate_tps == pytest.approx(20_000)


def test_a_first_token_sooner_than_a_step_teaches_no_rate() -> None:
    """Mostly HTTP and fixed costs: taken as a rate, 400 tokens in 2 ms would say 200,000
    tokens/s and keep every other replica out."""
    t = tracker()
    dispatch(t, "a", prefill=400)
    t.on_first_token(R, RequestId("a"), now_s=0.002)
    assert t.snapshot(R, 0.002).prefill_rate_tps == 10_000.0



def test_the_prefill_sent_to_a_replica_is_its_prefill_duty() -> None:
    """150,000 prefill tokens sent at once to a replica of 10,000 tokens/s are 15 s of its
    next 30 s: a duty of 0.5, decaying as ``exp(−age / PREFILL_DUTY_WINDOW_S)``, and never
    above ``PREFILL_DUTY_MAX``."""
    import math

    from kvroute.core.load import PREFILL_DUTY_MAX, PREFILL_DUTY_WINDOW_S

    t = tracker()
    assert t.snapshot(R, 0.0).prefill_duty == 0.0
    dispatch(t, "a", prompt=150_000, prefill=150_000, now=1.0)
    assert t.snapshot(R, 1.0).prefill_duty == pytest.approx(0.5)
    later = t.snapshot(R, 1.0 + PREFILL_DUTY_WINDOW_S).prefill_duty
    assert later == pytest.approx(0.5 / math.e)
    dispatch(t, "b", prompt=1_000_000, prefill=1_000_000, now=2.0)
    assert t.snapshot(R, 2.0).prefill_duty == PREFILL_DUTY_MAX
