"""The whole-turn terms of kvroute's cost: a request's own decode, and its harm to others.

Each test sets up replicas whose first-token cost favours one of them and whose decode
picture favours the other, so removing the term under test flips the decision.
"""

from __future__ import annotations

import random

import pytest

from kvroute.core.index import PrefixMatch
from kvroute.core.load import DEFAULT_DECODE_TIMING, DecodeTiming, ReplicaLoad
from kvroute.core.policy import NO_MATCH, Candidate, KvrouteCostPolicy, PolicyInput
from kvroute.core.types import ReplicaId

RATE = 25_000.0
T = DEFAULT_DECODE_TIMING  # 6 ms + 20 µs a sequence + 50 ns a context token


def load(*, decoding: int = 0, waiting: int = 0, context: int = 0, left: float = 0.0,
         waiting_context: int = 0, waiting_output: int = 0, queue: int = 0,
         scale: float = 1.0) -> ReplicaLoad:
    return ReplicaLoad(
        outstanding_prefill_tokens=queue, num_in_flight=decoding + waiting,
        num_decoding=decoding, prefill_rate_tps=RATE, decoding_context_tokens=context,
        decode_tokens_left=left, itl_scale=scale, waiting_context_tokens=waiting_context,
        waiting_output_tokens=waiting_output)


def policy(**weights: float) -> KvrouteCostPolicy:
    return KvrouteCostPolicy(random.Random(0), **weights)


def test_the_decode_term_sends_a_request_away_from_long_contexts_its_cache_hit_cannot_repay(
) -> None:
    """A holds the whole prompt but decodes 5 streams over 400k tokens of context: each of
    the request's 256 tokens would take 26 ms there against 6 ms on idle B. Its own decode
    alone is 5 s dearer on A, for 8 ms of prefill saved."""
    req = PolicyInput("r", num_prompt_tokens=200, block_size=16, expected_output_tokens=256)
    a = Candidate(ReplicaId("A"), load(decoding=5, context=400_000),
                  PrefixMatch(num_gpu_blocks=13))
    b = Candidate(ReplicaId("B"), load())
    assert policy(harm_weight=0).select(req, [a, b]).replica == "B"
    assert policy(decode_weight=0, harm_weight=0).select(req, [a, b]).replica == "A"
    decode_a, _ = policy().turn_terms_s(req, a, 8.0)
    assert decode_a == pytest.approx(256 * T.step_s(6, 400_000 + 200 + 128))


def test_the_harm_term_spares_streams_that_still_have_much_to_say() -> None:
    """A and B decode the same batch; A's streams still have 10,000 tokens to go, B's are
    ending. A holds the prompt, so its first token is cheaper, but every token of A's
    streams would get slower by the request's share of each step."""
    req = PolicyInput("r", num_prompt_tokens=1000, block_size=16, expected_output_tokens=256)
    a = Candidate(ReplicaId("A"), load(decoding=10, context=100_000, left=10_000),
                  PrefixMatch(num_gpu_blocks=62))
    b = Candidate(ReplicaId("B"), load(decoding=10, context=100_000, left=0.0))
    assert policy(decode_weight=0).select(req, [a, b]).replica == "B"
    assert policy(decode_weight=0, harm_weight=0).select(req, [a, b]).replica == "A"
    _, harm_a = policy().turn_terms_s(req, a, 8.0)
    slower = T.step_s(11, 100_000 + 1000 + 128) - T.step_s(10, 100_000)
    assert harm_a == pytest.approx(10_000 * slower + 10 * 8.0 / RATE)


def test_a_cold_prefill_costs_every_decoding_stream_its_duration() -> None:
    """The prefill runs in the steps the decoding streams wait on: 25,000 uncached tokens on
    a replica with 30 streams stall each about a second."""
    req = PolicyInput("r", num_prompt_tokens=25_000, block_size=16, expected_output_tokens=1)
    busy = Candidate(ReplicaId("busy"), load(decoding=30, context=60_000))
    _, harm = policy().turn_terms_s(req, busy, 25_000.0)
    assert harm == pytest.approx(30 * 25_000 / RATE)


def test_requests_waiting_for_their_first_token_count_in_the_batch_it_will_join() -> None:
    """C decodes nothing yet, but eight long prompts are queued there: by the time the new
    request decodes, they decode beside it."""
    req = PolicyInput("r", num_prompt_tokens=500, block_size=16, expected_output_tokens=300)
    idle = Candidate(ReplicaId("idle"), load())
    queued = Candidate(ReplicaId("queued"), load(waiting=8, waiting_context=8 * 30_000,
                                                 waiting_output=8 * 300))
    decode_idle, _ = policy().turn_terms_s(req, idle, 500.0)
    decode_queued, harm_queued = policy().turn_terms_s(req, queued, 500.0)
    assert decode_queued == pytest.approx(300 * T.step_s(9, 8 * 30_000 + 500 + 150))
    assert decode_queued > decode_idle
    assert harm_queued > 0  # the queued requests' own answers get slower too


def test_the_pools_learned_factor_scales_the_decode_but_never_splits_twins() -> None:
    """Two idle replicas of one pool whose learned factors differ by noise: the pool's
    factor (their mean) prices both, so neither is preferred for it."""
    req = PolicyInput("r", num_prompt_tokens=500, block_size=16, expected_output_tokens=100)
    a = Candidate(ReplicaId("a"), load(scale=2.0))
    b = Candidate(ReplicaId("b"), load(scale=1.0))
    assert policy().turn_terms_s(req, a, 500.0, scale=2.0)[0] == pytest.approx(
        2 * policy().turn_terms_s(req, a, 500.0)[0])
    sel = policy().select(req, [a, b])
    assert sel.scores[ReplicaId("a")] == sel.scores[ReplicaId("b")]


def test_the_predicted_output_prices_the_decode_not_the_budget() -> None:
    req = PolicyInput("r", num_prompt_tokens=500, block_size=16, expected_output_tokens=4096,
                      predicted_output_tokens=100)
    idle = Candidate(ReplicaId("idle"), load())
    assert policy().turn_terms_s(req, idle, 500.0)[0] == pytest.approx(
        100 * T.step_s(1, 500 + 50))


def test_a_pool_with_other_engines_prices_its_own_steps() -> None:
    big = DecodeTiming(fixed_s=0.02, seq_s=1e-4, context_token_s=2e-7)
    req = PolicyInput("r", num_prompt_tokens=500, block_size=16, expected_output_tokens=10,
                      decode_timing=big)
    idle = Candidate(ReplicaId("idle"), load())
    assert policy().turn_terms_s(req, idle, 500.0)[0] == pytest.approx(
        10 * big.step_s(1, 505))


def test_select_adds_exactly_the_turn_terms() -> None:
    """``select`` writes the terms out inline; its scores must be the parts added up, to the
    last bit."""
    pol = policy(decode_weight=0.7, harm_weight=0.4)
    req = PolicyInput("r", num_prompt_tokens=3000, block_size=16, expected_output_tokens=400,
                      predicted_output_tokens=250)
    cands = [
        Candidate(ReplicaId("a"), load(decoding=5, waiting=2, context=80_000, left=900.0,
                                       waiting_context=9000, waiting_output=500, queue=4000,
                                       scale=1.3), PrefixMatch(num_gpu_blocks=40)),
        Candidate(ReplicaId("b"), load(decoding=1, context=3000, left=40.0), NO_MATCH),
    ]
    sel = pol.select(req, cands)
    for c in cands:
        ttft, prefill = pol.predicted_ttft_s(req, c)
        decode, harm = pol.turn_terms_s(req, c, prefill, scale=(1.3 + 1.0) / 2)
        lo = c.load
        waiting = max(0, lo.num_in_flight - lo.num_decoding)
        base = (ttft + pol.work_weight * prefill / lo.prefill_rate_tps
                + pol.inflight_cost_s * lo.num_in_flight + pol.waiting_cost_s * waiting)
        assert sel.scores[c.replica] == base + 0.7 * decode + 0.4 * harm


def test_a_stale_rate_is_scored_at_the_best_candidates_until_sampled_again() -> None:
    """r1 learned it prefills fast; r0's rate was last sampled a minute ago. Scored at it,
    r0 would never be chosen and never learn otherwise: scored at r1's, it ties and is
    tried (it was chosen less recently)."""
    req = PolicyInput("r", num_prompt_tokens=600, block_size=16, expected_output_tokens=16)
    fresh = ReplicaLoad(prefill_rate_tps=80_000.0, itl_scale=0.4, last_chosen_s=5.0)
    stale = ReplicaLoad(prefill_rate_tps=RATE, itl_scale=1.0, last_chosen_s=1.0,
                        rate_age_s=60.0)
    cands = [Candidate(ReplicaId("r1"), fresh), Candidate(ReplicaId("r0"), stale)]
    sel = policy().select(req, cands)
    assert sel.scores[ReplicaId("r0")] == sel.scores[ReplicaId("r1")]
    assert sel.replica == "r0"
    assert policy(stale_rate_s=1e12).select(req, cands).replica == "r1"
