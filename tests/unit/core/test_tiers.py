"""Tier choice, clamping, the reactive plan, window learning and cut-short counting."""

from __future__ import annotations

from typing import Any

import pytest

from kvroute.core.errors import ConfigError
from kvroute.core.tiers import (
    AttemptState,
    CutShort,
    Escalate,
    GiveUp,
    GiveUpReason,
    NeedExactCount,
    NoFit,
    NoPool,
    OverflowNumbers,
    OverflowPart,
    Place,
    PlaceReason,
    Retry,
    SkipReason,
    TierPlan,
    TierPool,
    learn_window,
    openai_overflow_message,
    plan_recovery,
    plan_tier,
    was_cut_short,
)
from kvroute.core.tokens import TokenEstimate, estimate_request

SMALL = TierPool("small", 16_384, 0.0, served_model="qwen3-8b")
LARGE = TierPool("large", 131_072, 0.0, served_model="qwen3-27b")
POOLS = (SMALL, LARGE)

LITELLM_MARKER = "this model's maximum context length is"


def exact(n: int) -> TokenEstimate:
    return TokenEstimate.exact_count(n)


def band(low: int, high: int) -> TokenEstimate:
    return TokenEstimate(low=low, high=high)


def plan(estimate: TokenEstimate, requested: int | None, pools: tuple[TierPool, ...] = POOLS,
         *, now_s: float = 10.0, **kw: Any) -> TierPlan:  # fmt: skip
    return plan_tier(pools, estimate, requested, now_s=now_s, **kw)


# --- proactive: the issue's cases --------------------------------------------------------------


def test_issue_log_line_for_an_escalation() -> None:
    p = plan(band(59_863, 79_818), None)
    assert isinstance(p, Place)
    assert (p.pool_index, p.reason, p.clamped_max_tokens, p.escalated) == (
        1, PlaceReason.ESCALATED, None, True)  # fmt: skip
    assert p.log_line == (
        "[CONTEXT-ROUTE] proactive: est≈59863tok + 256 output floor exceeds window 16384 of "
        "'small' → 'large'"
    )
    assert [(s.pool_name, s.reason) for s in p.skipped] == [("small", SkipReason.TOO_SMALL)]


def test_seed_case_12289_plus_4096_in_16384() -> None:
    # ~49 KB of text: the band straddles the small window → ask /tokenize first.
    body = {"messages": [{"role": "user", "content": "x" * 48_968}]}
    est = estimate_request(body)
    assert (est.low, est.high) == (12_250, 16_331)
    first = plan(est, 4096)
    assert first == NeedExactCount(0, "small", 16_384, (
        "[CONTEXT-ROUTE] proactive: est≈12250..16331tok + 256 output floor straddles window "
        "16384 of 'small' → /tokenize"))  # fmt: skip
    # /tokenize says 12,289: it fits the small pool with the output clamped by one token.
    second = plan(exact(12_289), 4096)
    assert isinstance(second, Place)
    assert (second.pool_index, second.clamped_max_tokens, second.reason) == (
        0, 4095, PlaceReason.FITS)  # fmt: skip
    assert second.log_line == (
        "[CONTEXT-ROUTE] proactive: exact 12289tok + 256 output floor fits window 16384 of "
        "'small'; max_tokens 4096 → 4095"
    )
    assert second.clamped_max_tokens is not None
    assert 12_289 + second.clamped_max_tokens == 16_384  # never over the window
    # If the answer stops at the clamp, it is counted as cut short by the router.
    assert was_cut_short(4096, 4095, "length", 4095) is CutShort.ROUTER_CLAMP


def test_seed_case_without_an_exact_count_stays_fast_with_the_floor() -> None:
    p = plan(band(12_250, 16_331), 4096, exact_count_available=False)
    assert isinstance(p, Place)
    assert (p.pool_index, p.reason, p.clamped_max_tokens) == (0, PlaceReason.UNCERTAIN, 256)
    assert "straddles, no exact count" in p.log_line


def test_exact_count_over_the_small_window_escalates() -> None:
    p = plan(exact(16_200), 4096)
    assert isinstance(p, Place)
    assert (p.pool_index, p.clamped_max_tokens) == (1, None)
    assert p.log_line == (
        "[CONTEXT-ROUTE] proactive: exact 16200tok + 256 output floor exceeds window 16384 of "
        "'small' → 'large'"
    )


def test_fits_surely_clamps_with_the_over_estimate() -> None:
    p = plan(band(9_000, 12_000), 8_000)
    assert isinstance(p, Place)
    assert (p.pool_index, p.clamped_max_tokens, p.reason) == (0, 16_384 - 12_000,
                                                              PlaceReason.FITS)
    q = plan(band(9_000, 12_000), 1_000)
    assert isinstance(q, Place) and q.clamped_max_tokens is None


def test_just_over_the_under_estimate_is_worth_an_exact_count() -> None:
    est = band(16_500, 22_000)  # 16500 * 0.8 + 256 <= 16384 < 16500 + 256
    assert isinstance(plan(est, None), NeedExactCount)
    p = plan(est, None, exact_count_available=False)
    assert isinstance(p, Place) and p.pool_index == 1
    far = plan(band(30_000, 40_000), None)
    assert isinstance(far, Place) and far.pool_index == 1
    no_margin = plan(est, None, tokenize_margin=0.0)
    assert isinstance(no_margin, Place) and no_margin.pool_index == 1


def test_a_small_requested_output_lowers_the_floor() -> None:
    p = plan(exact(16_383), 1)  # a warm-up: one output token is all it needs
    assert isinstance(p, Place)
    assert (p.pool_index, p.clamped_max_tokens) == (0, None)
    assert "+ 1 output floor" in p.log_line


def test_three_pools_log_every_window_passed_over() -> None:
    pools = (SMALL, TierPool("medium", 32_768, 0.0), LARGE)
    p = plan(exact(40_000), None, pools)
    assert isinstance(p, Place) and p.pool_index == 2
    assert p.log_line == (
        "[CONTEXT-ROUTE] proactive: exact 40000tok + 256 output floor exceeds window 16384 of "
        "'small', window 32768 of 'medium' → 'large'"
    )


def test_a_session_pinned_to_the_large_pool_does_not_flap_back() -> None:
    p = plan(exact(1_000), None, min_pool_index=1)
    assert isinstance(p, Place)
    assert (p.pool_index, p.escalated) == (1, False)
    assert [(s.pool_index, s.reason) for s in p.skipped] == [(0, SkipReason.SESSION_PINNED)]
    assert p.log_line == (
        "[CONTEXT-ROUTE] proactive: exact 1000tok + 256 output floor fits window 131072 of "
        "'large'; skipped 'small': session pinned to a larger pool"
    )


# --- no fit ------------------------------------------------------------------------------------


def test_no_fit_answers_in_openai_words() -> None:
    p = plan(exact(140_000), None)
    assert isinstance(p, NoFit)
    assert (p.largest_window, p.input_tokens, p.requested_output_tokens) == (131_072, 140_000, 256)
    assert p.message == (
        "This model's maximum context length is 131072 tokens. However, your messages "
        "resulted in 140000 tokens. Please reduce the length of the messages."
    )
    assert LITELLM_MARKER in p.message.lower()
    assert p.log_line.endswith("window 131072 of 'large' → 400 (no pool fits)")


def test_no_fit_when_the_prompt_fits_but_not_with_its_output() -> None:
    p = plan(exact(131_000), 4096)
    assert isinstance(p, NoFit)
    assert p.message == (
        "This model's maximum context length is 131072 tokens. However, you requested 135096 "
        "tokens (131000 in the messages, 4096 in the completion). Please reduce the length of "
        "the messages or completion."
    )
    assert LITELLM_MARKER in p.message.lower()
    assert openai_overflow_message(100, 100, 5).startswith(
        "This model's maximum context length is 100 tokens. However, your messages resulted")


# --- windows: stale, unknown, learned ------------------------------------------------------------


def test_stale_window_is_used_but_said_and_listed() -> None:
    p = plan(exact(1_000), None, now_s=1_000.0)
    assert isinstance(p, Place)
    assert (p.pool_index, p.stale_pools) == (0, (0,))
    assert p.log_line == (
        "[CONTEXT-ROUTE] proactive: exact 1000tok + 256 output floor fits window 16384 of "
        "'small'; window of 'small' stale (1000s old), refresh pending"
    )
    fresh = plan(exact(1_000), None, now_s=900.0)
    assert isinstance(fresh, Place) and fresh.stale_pools == ()


def test_unknown_window_is_taken_optimistically_and_flagged() -> None:
    pools = (TierPool("small"), LARGE)
    p = plan(exact(50_000), 4096, pools)
    assert isinstance(p, Place)
    assert (p.pool_index, p.reason, p.clamped_max_tokens, p.stale_pools) == (
        0, PlaceReason.WINDOW_UNKNOWN, None, (0,))  # fmt: skip
    assert "window of 'small' unknown, refresh pending" in p.log_line


def test_learn_window_corrects_a_stale_window() -> None:
    swapped = TierPool("small", 32_768, 0.0)
    learned = learn_window(swapped, 16_384, now_s=500.0)
    assert (learned.window, learned.window_fetched_at_s, learned.name) == (16_384, 500.0, "small")
    with pytest.raises(ValueError, match=">= 1"):
        learn_window(swapped, 0, now_s=1.0)
    with pytest.raises(ConfigError, match="positive token count"):
        TierPool("bad", 0)


# --- external pools ------------------------------------------------------------------------------


def cloud(catalog: frozenset[str] | None, served: str | None = None) -> TierPool:
    return TierPool("cloud", 1_000_000, 0.0, external=True, catalog=catalog, served_model=served)


def test_external_pool_used_when_the_model_is_in_its_catalog() -> None:
    pools = (SMALL, cloud(frozenset({"qwen3-27b", "x"})))
    p = plan(exact(50_000), None, pools, request_model="qwen3-27b")
    assert isinstance(p, Place) and p.pool_index == 1


@pytest.mark.parametrize(
    ("catalog", "served", "model", "reason", "words"),
    [(frozenset({"other"}), None, "qwen3-27b", SkipReason.NOT_IN_CATALOG,
      "model 'qwen3-27b' not in the catalog of 'cloud'"),
     (None, None, "qwen3-27b", SkipReason.CATALOG_UNKNOWN, "catalog of 'cloud' unknown"),
     (frozenset({"x"}), None, None, SkipReason.NO_MODEL,
      "no model mapping for 'cloud' (set its served_model)")],
)  # fmt: skip
def test_external_pool_skipped_with_a_reason_and_the_request_stays_local(
    catalog: frozenset[str] | None, served: str | None, model: str | None,
    reason: SkipReason, words: str,
) -> None:
    pools = (SMALL, cloud(catalog, served), LARGE)
    p = plan(exact(50_000), None, pools, request_model=model)
    assert isinstance(p, Place) and p.pool_index == 2
    assert [(s.pool_index, s.reason) for s in p.skipped] == [
        (0, SkipReason.TOO_SMALL), (1, reason)]  # fmt: skip
    assert f"skipped 'cloud': {words}" in p.log_line


def test_served_model_mapping_is_what_the_catalog_is_checked_against() -> None:
    pools = (SMALL, cloud(frozenset({"Qwen/Qwen3-235B"}), served="Qwen/Qwen3-235B"))
    p = plan(exact(50_000), None, pools, request_model="assistant")
    assert isinstance(p, Place) and p.pool_index == 1


def test_no_eligible_pool_at_all() -> None:
    p = plan(exact(10), None, (cloud(frozenset({"a"})),), request_model="b")
    assert isinstance(p, NoPool)
    assert "model 'b' not in the catalog of 'cloud'" in p.message


def test_bad_arguments_raise_config_errors() -> None:
    with pytest.raises(ConfigError, match="at least one pool"):
        plan(exact(1), None, ())
    with pytest.raises(ConfigError, match="output_floor"):
        plan(exact(1), None, output_floor=0)
    with pytest.raises(ConfigError, match="tokenize_margin"):
        plan(exact(1), None, tokenize_margin=1.0)


# --- reactive ------------------------------------------------------------------------------------


def start(pool_index: int = 0, sent: int | None = 4096, requested: int | None = 4096,
          high: int = 13_000) -> AttemptState:  # fmt: skip
    return AttemptState(pool_index, sent, requested, high)


def test_total_overflow_clamps_once_then_escalates() -> None:
    numbers = OverflowNumbers(OverflowPart.TOTAL, 16_384, 12_289, False, 4096)
    r = plan_recovery(start(), numbers, POOLS)
    assert isinstance(r, Retry)
    assert (r.pool_index, r.max_tokens, r.learned_window) == (0, 4095, None)
    assert r.log_line == (
        "[CONTEXT-ROUTE] reactive: 'small' rejected 12289tok + 4096 > window 16384 → retry "
        "'small' with max_tokens 4095"
    )
    assert (r.state.num_attempts, r.state.clamped_pools) == (2, frozenset({0}))
    again = plan_recovery(r.state, OverflowNumbers(OverflowPart.TOTAL, 16_384, 12_289, False,
                                                   4095), POOLS)  # fmt: skip
    assert isinstance(again, Escalate)
    assert (again.pool_index, again.max_tokens, again.state.num_attempts) == (1, 4096, 3)


def test_prompt_overflow_escalates_past_pools_the_numbers_rule_out() -> None:
    pools = (SMALL, TierPool("medium", 32_768, 0.0), LARGE)
    numbers = OverflowNumbers(OverflowPart.PROMPT, 16_384, 40_000)
    e = plan_recovery(start(sent=None, requested=None), numbers, pools)
    assert isinstance(e, Escalate)
    assert (e.pool_index, e.max_tokens) == (2, None)
    assert e.log_line == (
        "[CONTEXT-ROUTE] reactive: 'small' rejected 40000tok > window 16384 → 'large'"
    )


def test_lower_bound_clamps_from_our_over_estimate_not_the_floor() -> None:
    numbers = OverflowNumbers(OverflowPart.TOTAL, 16_384, 12_289, True, 4096)
    r = plan_recovery(start(high=13_000), numbers, POOLS)
    assert isinstance(r, Retry) and r.max_tokens == 16_384 - 13_000
    assert "≥12289tok" in r.log_line
    # When our over-estimate leaves less than the floor, escalate instead.
    e = plan_recovery(start(high=16_300), numbers, POOLS)
    assert isinstance(e, Escalate) and e.pool_index == 1
    assert e.max_tokens == 4096  # no exact prompt: the client's max_tokens as sent


def test_engine_window_is_learned_when_the_cache_was_stale() -> None:
    stale = (TierPool("small", 32_768, 0.0), LARGE)
    numbers = OverflowNumbers(OverflowPart.PROMPT, 16_384, 20_000)
    e = plan_recovery(start(), numbers, stale)
    assert isinstance(e, Escalate) and e.learned_window == 16_384
    same = plan_recovery(start(), numbers, POOLS)
    assert same.learned_window is None


def test_give_up_from_the_largest_pool_in_openai_words() -> None:
    numbers = OverflowNumbers(OverflowPart.PROMPT, 131_072, 140_000)
    g = plan_recovery(start(pool_index=1), numbers, POOLS)
    assert isinstance(g, GiveUp) and g.reason is GiveUpReason.NO_LARGER_POOL
    assert g.message == openai_overflow_message(131_072, 140_000, 4096)
    assert LITELLM_MARKER in g.message.lower()
    unknown = plan_recovery(start(pool_index=1), OverflowNumbers(), (SMALL, TierPool("large")))
    assert isinstance(unknown, GiveUp) and LITELLM_MARKER in unknown.message.lower()


def test_attempt_budget_is_enforced() -> None:
    spent = AttemptState(0, 4096, 4096, 1_000, num_attempts=4)
    g = plan_recovery(spent, OverflowNumbers(OverflowPart.TOTAL, 16_384, 12_000, False, 4096),
                      POOLS)  # fmt: skip
    assert isinstance(g, GiveUp) and g.reason is GiveUpReason.ATTEMPTS_EXHAUSTED


def test_escalation_skips_ineligible_external_pools() -> None:
    pools = (SMALL, cloud(frozenset({"other"})), LARGE)
    e = plan_recovery(start(), OverflowNumbers(OverflowPart.PROMPT, 16_384, 20_000), pools,
                      request_model="qwen3-27b")  # fmt: skip
    assert isinstance(e, Escalate) and e.pool_index == 2


def test_first_state_from_a_placement() -> None:
    p = plan(exact(12_289), 4096)
    assert isinstance(p, Place)
    state = AttemptState.first(p, exact(12_289), 4096)
    assert (state.pool_index, state.max_tokens, state.requested_max_tokens,
            state.estimate_high, state.num_attempts) == (0, 4095, 4096, 12_289, 1)  # fmt: skip
    with pytest.raises(ValueError, match="points at pool 5"):
        plan_recovery(AttemptState(5, None, None, 0), OverflowNumbers(), POOLS)


# --- cut short -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "clamped", "finish", "completion", "expected"),
    [(4096, 4095, "length", 4095, CutShort.ROUTER_CLAMP),
     (4096, None, "length", 3000, CutShort.ENGINE_CLAMP),  # vLLM >= 0.32 shortened silently
     (4096, 4095, "length", 2000, CutShort.ENGINE_CLAMP),  # below even our clamp
     (4096, None, "length", 4096, None),                   # got all it asked for
     (4096, 4095, "stop", 100, None),                      # ended by itself
     (None, None, "length", 9000, None)],                  # asked for nothing in particular
)  # fmt: skip
def test_was_cut_short(requested: int | None, clamped: int | None, finish: str,
                       completion: int, expected: CutShort | None) -> None:  # fmt: skip
    assert was_cut_short(requested, clamped, finish, completion) is expected
