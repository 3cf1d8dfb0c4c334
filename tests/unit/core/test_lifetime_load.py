"""Lifetime load: what a request placed now will share its decode with.

An answer that has outrun its prediction keeps going as long as answers that long do
(``AnswerLengths``), so the streams it still has to make count in the harm a newcomer does
there; and, as an option (``lifetime_stall``), a prefill stalls the requests queued ahead of
it, which decode by the time it runs.
"""

from __future__ import annotations

import math
import random

import pytest

from kvroute.core.load import (
    DEFAULT_DECODE_TIMING,
    MIN_LONGER_ANSWERS,
    AnswerLengths,
    DecodeTiming,
    LoadTracker,
    ReplicaLoad,
)
from kvroute.core.policy import Candidate, KvrouteCostPolicy, PolicyInput
from kvroute.core.types import ReplicaId, RequestId

R0, R1 = ReplicaId("r0"), ReplicaId("r1")
TEN_MS = DecodeTiming(fixed_s=0.01, seq_s=0.0, context_token_s=0.0)


def test_the_mean_residual_of_answers_longer_than_what_was_made() -> None:
    answers = AnswerLengths()
    for tokens in (100, 200, 400, 800, 1600, 3200):
        answers.add(tokens)
    # longer than 300: 400, 800, 1600, 3200 -> mean 1500, so 1200 more
    assert answers.remaining(300) == pytest.approx(1200)
    assert answers.remaining(50) == pytest.approx(sum((100, 200, 400, 800, 1600, 3200)) / 6 - 50)
    assert answers.remaining(900) == 0.0  # fewer than MIN_LONGER_ANSWERS longer
    assert MIN_LONGER_ANSWERS == 4


def tracker() -> LoadTracker:
    t = LoadTracker(rate_ewma_alpha=1.0)
    t.add_replica(R0, prefill_rate_tps=10_000.0, decode_timing=TEN_MS)
    t.add_replica(R1, prefill_rate_tps=10_000.0, decode_timing=TEN_MS)
    return t


def test_an_answer_past_its_prediction_counts_the_residual_of_answers_that_long() -> None:
    """Predicted 100 tokens, it has made 300 (3 s of 10 ms steps): with no answers known it
    counts as ending now; once the fleet saw answers of 400 to 3,200 tokens (on another
    replica) it still has 1,200 to make."""
    t = tracker()
    t.on_dispatch(R0, RequestId("long"), prefill_tokens=100, prompt_tokens=100,
                  expected_output_tokens=4096, predicted_output_tokens=100, now_s=0.0)
    t.on_first_token(R0, RequestId("long"), now_s=0.0)
    assert t.snapshot(R0, 3.0).decode_tokens_left == 0.0
    assert t.snapshot(R0, 3.0).overdue_tokens_left == 0.0
    for i, tokens in enumerate((100, 200, 400, 800, 1600, 3200)):
        rid = RequestId(f"done{i}")
        t.on_dispatch(R1, rid, prefill_tokens=10, prompt_tokens=10, expected_output_tokens=4096,
                      predicted_output_tokens=tokens, now_s=0.0)
        t.on_first_token(R1, rid, now_s=0.0)
        t.on_complete(R1, rid, now_s=0.0, output_tokens=tokens)
    snap = t.snapshot(R0, 3.0)
    assert (snap.decode_tokens_left, snap.overdue_tokens_left) == (0.0, pytest.approx(1200))
    early = t.snapshot(R0, 0.5)  # within its prediction: what it predicted, less what it made
    assert (early.decode_tokens_left, early.overdue_tokens_left) == (pytest.approx(50), 0.0)


def test_a_long_answer_still_running_repels_a_newcomer_that_would_slow_it() -> None:
    """A long-context answer on A has 1,200 tokens left by the residual of answers that
    long (its prediction said it would be done); the newcomer's 40k context would slow each
    of them. B has a 2.2 s queue. Without the residual A looks free."""
    req = PolicyInput("n", num_prompt_tokens=40_000, block_size=16, expected_output_tokens=300)
    rate = 25_000.0
    busy = ReplicaLoad(num_in_flight=1, num_decoding=1, prefill_rate_tps=rate,
                       decoding_context_tokens=50_000, overdue_tokens_left=1200.0)
    b = Candidate(ReplicaId("B"), ReplicaLoad(outstanding_prefill_tokens=55_000,
                                              prefill_rate_tps=rate))
    a = Candidate(ReplicaId("A"), busy)
    assert KvrouteCostPolicy(random.Random(0)).select(req, [a, b]).replica == "B"
    assert KvrouteCostPolicy(random.Random(0), residual_weight=0).select(req, [a, b]).replica \
        == "A"


def test_lifetime_stall_counts_the_requests_queued_ahead_and_the_decoders_that_outlast_the_wait(
) -> None:
    rate = 25_000.0
    load = ReplicaLoad(outstanding_prefill_tokens=25_000, num_in_flight=5, num_decoding=2,
                       prefill_rate_tps=rate, decode_tokens_left=200.0)
    on = KvrouteCostPolicy(random.Random(0), lifetime_stall=True, decode_slowdown=0.0)
    off = KvrouteCostPolicy(random.Random(0))
    step = 0.01
    # a 1 s wait; the two decoders have 100 tokens (1 s) left each on average
    assert on.stalled_streams(load, rate, step) == pytest.approx(3 + 2 * 0.36787944117)
    assert off.stalled_streams(load, rate, step) == 2.0
    idle_queue = load._replace(outstanding_prefill_tokens=0)
    assert on.stalled_streams(idle_queue, rate, step) == 5.0


def test_a_replica_whose_kv_is_held_makes_a_prompt_wait_for_decodes_to_end() -> None:
    """A is idle of prefill but its 396k tokens of KV are all held by 10 decoding requests
    (300k of context, 300 tokens each still to make, 6.4 s): the cold 60k-token prompt
    waits for a fifth of that context to be freed, 1.4 s. B has 15k tokens of queue (0.6 s)
    and free KV. Without the KV wait A looks 0.6 s cheaper."""
    rate = 25_000.0
    req = PolicyInput("n", num_prompt_tokens=60_000, block_size=16, expected_output_tokens=1)
    a_load = ReplicaLoad(num_in_flight=10, num_decoding=10, prefill_rate_tps=rate,
                         decoding_context_tokens=300_000, decode_tokens_left=3000.0,
                         kv_capacity_tokens=396_000, kv_used_tokens=396_000)
    a = Candidate(ReplicaId("A"), a_load)
    b = Candidate(ReplicaId("B"), ReplicaLoad(outstanding_prefill_tokens=15_000,
                                              prefill_rate_tps=rate, kv_capacity_tokens=396_000))
    policy = KvrouteCostPolicy(random.Random(0), decode_weight=0, harm_weight=0,
                               kv_wait_weight=1)
    wait = policy.kv_wait_s(a_load, 60_000.0)
    step = DEFAULT_DECODE_TIMING.step_s(10, 300_000)
    assert wait == pytest.approx(-300 * step * math.log(1 - 60_000 / 300_000))
    assert policy.kv_wait_s(b.load, 60_000.0) == 0.0
    assert policy.select(req, [a, b]).replica == "B"
    assert policy.select(req, [b, a]).replica == "B"
    assert KvrouteCostPolicy(random.Random(0), decode_weight=0, harm_weight=0,
                             kv_wait_weight=0).select(req, [a, b]).replica == "A"
