"""The request walk (``core/walk.py``): every step as facts in, the next action out."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from kvroute.core.clock import ManualClock
from kvroute.core.peer_policies import make_policy
from kvroute.core.router import PoolSpec, ReplicaSpec, RouterCore
from kvroute.core.session import SessionRecord, SessionUsage, session_key
from kvroute.core.tiers import OverflowNumbers, OverflowPart, TierPool
from kvroute.core.types import PoolName, ReplicaId, RequestId, TenantName
from kvroute.core.walk import (
    MIN_OUTPUT_PAIRS,
    CutShortNote,
    Decided,
    Escalated,
    Fail,
    FailReason,
    NeedTokens,
    OutputLengths,
    Recovered,
    Refuse,
    ReplicaUnreachable,
    RequestWalk,
    Send,
    UpstreamFailed,
    WalkAction,
    Walker,
    WalkRequest,
    WalkRoute,
    WalkSettings,
    WarmNote,
    WindowLearned,
    describe,
)
from kvroute.core.warm import WarmPlanner

SMALL, LARGE, EXT = PoolName("small"), PoolName("large"), PoolName("ext")
SMALL_W, LARGE_W = 2048, 8192
TENANT = TenantName("acme")


def make_walker(*, warm: bool = True, max_retries: int = 2, policy: str = "round_robin",
                external: bool = False) -> tuple[Walker, ManualClock]:
    clock = ManualClock(100.0)
    pools = [
        PoolSpec(SMALL, tuple(ReplicaSpec(ReplicaId(f"small-r{i}")) for i in range(2))),
        PoolSpec(LARGE, tuple(ReplicaSpec(ReplicaId(f"large-r{i}")) for i in range(2))),
    ]
    if external:
        pools.append(PoolSpec(EXT, tuple(ReplicaSpec(ReplicaId(f"ext-e{i}")) for i in range(2))))
    rng = random.Random(0)
    core = RouterCore(pools, lambda: make_policy(policy, rng), clock=clock)
    walker = Walker(core, WarmPlanner(enabled=warm), WalkSettings(max_retries=max_retries),
                    clock)
    return walker, clock


def tier_pools(*, external: bool = False) -> list[TierPool]:
    pools = [TierPool(SMALL, window=SMALL_W, window_fetched_at_s=100.0, served_model="m-small"),
             TierPool(LARGE, window=LARGE_W, window_fetched_at_s=100.0, served_model="m-large")]
    if external:
        pools.append(TierPool(EXT, external=True, catalog=frozenset({"m"}), served_model="m"))
    return pools


def words(n: int) -> str:
    return " ".join(["abc"] * n)


def request(n_words: int = 100, *, session: str | None = "s1", max_tokens: int | None = 32,
            proactive: bool = True, ids: Sequence[int] | None = None,
            text: str = "the prompt", thinking: int = 0) -> WalkRequest:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": words(n_words)}],
                            "max_tokens": max_tokens}
    return WalkRequest(
        request_id=RequestId("q1"), route=WalkRoute("chat", proactive=proactive), tenant=TENANT,
        session_id=session, endpoint="chat" if ids is None else "completions", model="m",
        body=body if ids is None else {"prompt": list(ids)}, max_tokens=max_tokens,
        num_messages=1 if ids is None else None, prompt_token_ids=ids,
        routing_text=lambda: text, thinking_tokens=thinking)


def ids(n: int) -> list[int]:
    return list(range(1000, 1000 + n))


def to_send(walk: RequestWalk, action: WalkAction, token_counts: dict[PoolName, int]) -> Send:
    """Answer every ``NeedTokens`` with ``token_counts[pool]`` ids until the walk sends."""
    for _ in range(8):
        if isinstance(action, Send):
            return action
        assert isinstance(action, NeedTokens), action
        action = walk.tokens(action.pool, ids(token_counts[action.pool]))
    raise AssertionError(f"no Send after 8 token answers: {action}")


def notes_of(walk: RequestWalk, kind: type) -> list[Any]:
    return [n for n in walk.take_notes() if isinstance(n, kind)]


def in_flight(walker: Walker) -> int:
    return sum(walker.core.load.snapshot(ReplicaId(r)).num_in_flight
               for r in ("small-r0", "small-r1", "large-r0", "large-r1"))


# -- placing -----------------------------------------------------------------------------------


def test_a_placement_on_an_estimate_is_rechecked_on_the_exact_count_before_routing() -> None:
    walker, _ = make_walker()
    walk = walker.start(request(100), tier_pools(), None)
    first = walk.begin()
    assert first == NeedTokens(SMALL, for_count=False)
    send = walk.tokens(SMALL, ids(120))
    assert isinstance(send, Send) and send.decision.request.pool == SMALL
    assert send.decision.request.prompt_token_ids == ids(120)
    assert walk.estimate.exact and walk.estimate.low == 120
    assert send.attempt == 1 and send.max_tokens is None and not send.external
    (decided,) = notes_of(walk, Decided)
    assert decided.num_prompt_tokens == 120 and decided.exact


def test_the_exact_count_can_move_a_request_to_the_larger_pool() -> None:
    """The estimate fits the small window; the tokenizer's count does not: the walk
    escalates before anything is sent (and says so)."""
    walker, _ = make_walker()
    walk = walker.start(request(1000), tier_pools(), None)
    assert walk.begin() == NeedTokens(SMALL, for_count=False)
    action = walk.tokens(SMALL, ids(SMALL_W + 10))
    send = to_send(walk, action, {LARGE: SMALL_W + 10})
    assert send.decision.request.pool == LARGE and send.pool_index == 1
    assert [(e.from_pool, e.to_pool, e.how) for e in notes_of(walk, Escalated)] == [
        (SMALL, LARGE, "proactive")]


def test_an_estimate_straddling_the_window_asks_for_an_exact_count() -> None:
    walker, _ = make_walker()
    walk = walker.start(request(1950, max_tokens=16), tier_pools(), None)
    action = walk.begin()
    assert action == NeedTokens(SMALL, for_count=True)


def test_without_a_tokenizer_the_request_is_routed_on_its_text() -> None:
    walker, _ = make_walker()
    walk = walker.start(request(100, text="hello there"), tier_pools(), None)
    assert walk.begin() == NeedTokens(SMALL, for_count=False)
    send = walk.tokens(SMALL, None)
    assert isinstance(send, Send)
    assert send.decision.request.prompt_token_ids is None
    assert send.decision.request.routing_text == "hello there"
    assert send.decision.approximate


def test_token_ids_in_the_body_are_exact_and_need_no_tokenizer() -> None:
    walker, _ = make_walker()
    walk = walker.start(request(ids=ids(300)), tier_pools(), None)
    send = walk.begin()
    assert isinstance(send, Send) and send.decision.request.num_prompt_tokens == 300


def test_a_prompt_no_pool_can_hold_is_refused_with_openais_wording() -> None:
    walker, _ = make_walker()
    walk = walker.start(request(ids=ids(LARGE_W + 1)), tier_pools(), None)
    refuse = walk.begin()
    assert isinstance(refuse, Refuse)
    assert (refuse.status, refuse.outcome, refuse.code) == (400, "no_fit",
                                                           "context_length_exceeded")
    assert "maximum context length is 8192" in refuse.message
    assert walk.ended and walk.end() is None  # nothing of the session changed
    assert in_flight(walker) == 0


def test_a_reactive_only_route_sends_to_the_sessions_tier_with_the_clients_budget() -> None:
    walker, _ = make_walker()
    walk = walker.start(request(100, proactive=False), tier_pools(), SessionRecord(tier=1))
    send = to_send(walk, walk.begin(), {LARGE: 130})
    assert send.decision.request.pool == LARGE
    assert send.max_tokens is None


def test_no_healthy_replica_is_a_503() -> None:
    walker, _ = make_walker()
    for r in ("small-r0", "small-r1"):
        walker.core.set_healthy(ReplicaId(r), False)
    walk = walker.start(request(ids=ids(100)), tier_pools(), None)
    refuse = walk.begin()
    assert isinstance(refuse, Refuse) and (refuse.status, refuse.outcome) == (503, "no_replica")
    assert refuse.pool == SMALL


# -- recovering from overflows -----------------------------------------------------------------


def sent_small(walker: Walker, n: int = 1900, **kw: Any) -> tuple[RequestWalk, Send]:
    walk = walker.start(request(ids=ids(n), **kw), tier_pools(), None)
    send = walk.begin()
    assert isinstance(send, Send) and send.decision.request.pool == SMALL
    walk.take_notes()
    return walk, send


def test_an_overflow_with_room_is_retried_on_the_same_replica_with_a_clamp() -> None:
    """Room for at least the output floor: clamp on the same pool, preferring the replica
    that holds the prefix (a tie the cost policy breaks toward it)."""
    walker, _ = make_walker(policy="kvroute")
    walk, first = sent_small(walker, 1700, max_tokens=400, proactive=False)
    retry = walk.overflowed(OverflowNumbers(OverflowPart.TOTAL, window=SMALL_W,
                                            prompt_tokens=1700, requested_output_tokens=400))
    assert isinstance(retry, Send) and retry.attempt == 2
    assert retry.decision.request.preferred_replica == first.decision.replica
    assert retry.decision.replica == first.decision.replica  # its prefix is there
    assert retry.max_tokens == SMALL_W - 1700
    assert [r.plan for r in notes_of(walk, Recovered)] == ["retry"]
    assert in_flight(walker) == 1  # the first attempt's load was released


def test_an_overflow_without_room_for_the_floor_escalates() -> None:
    walker, _ = make_walker()
    walk, _ = sent_small(walker, 1900, max_tokens=400, proactive=False)
    action = walk.overflowed(OverflowNumbers(OverflowPart.TOTAL, window=SMALL_W,
                                             prompt_tokens=1900, requested_output_tokens=400))
    assert isinstance(action, Send) and action.decision.request.pool == LARGE
    assert action.max_tokens is None  # the client's 400 fits the large window


def test_an_overflow_of_the_prompt_escalates_and_raises_the_sessions_tier() -> None:
    walker, _ = make_walker()
    walk, _ = sent_small(walker, 2100, proactive=False)
    action = walk.overflowed(OverflowNumbers(OverflowPart.PROMPT, window=SMALL_W,
                                             prompt_tokens=2100))
    assert isinstance(action, Send) and action.decision.request.pool == LARGE
    notes = walk.take_notes()
    assert [(n.from_pool, n.to_pool, n.how) for n in notes if isinstance(n, Escalated)] == [
        (SMALL, LARGE, "reactive")]
    walk.answered()
    write = walk.end(["stop"], {"prompt_tokens": 2100, "completion_tokens": 32})
    assert write is not None and write.record.tier == 1 and write.record.pin == action.decision.replica


def test_an_overflow_on_the_largest_pool_gives_up_with_the_engines_numbers() -> None:
    walker, _ = make_walker()
    walk = walker.start(request(ids=ids(9000), proactive=False), tier_pools(),
                        SessionRecord(tier=1))
    send = walk.begin()
    assert isinstance(send, Send)
    refuse = walk.overflowed(OverflowNumbers(OverflowPart.PROMPT, window=LARGE_W,
                                             prompt_tokens=9000))
    assert isinstance(refuse, Refuse)
    assert (refuse.outcome, refuse.decision) == ("overflow_no_larger_pool", send.decision)
    assert in_flight(walker) == 0


def test_a_window_the_engine_contradicts_is_learned_and_noted() -> None:
    walker, clock = make_walker()
    walk, send = sent_small(walker, 1900, proactive=False)
    walk.overflowed(OverflowNumbers(OverflowPart.PROMPT, window=1024, prompt_tokens=1900))
    (learned,) = notes_of(walk, WindowLearned)
    assert (learned.pool, learned.window, learned.previous) == (SMALL, 1024, SMALL_W)
    assert learned.replica == send.decision.replica and learned.now_s == clock.now()
    assert walk.pools[0].window == 1024


# -- failures before the first byte ------------------------------------------------------------


def test_a_retryable_failure_moves_to_the_next_replica_until_the_cap() -> None:
    walker, _ = make_walker(max_retries=1)
    walk, first = sent_small(walker, 100)
    second = walk.failed("connect", retryable=True, unreachable=True, detail="refused")
    assert isinstance(second, Send) and second.decision.replica != first.decision.replica
    notes = walk.take_notes()
    assert ReplicaUnreachable(first.decision.replica, "refused") in notes
    assert UpstreamFailed(first.decision.replica, "connect", retried=True) in notes
    fail = walk.failed("timeout", retryable=True)
    assert isinstance(fail, Fail) and fail.reason is FailReason.RETRIES_SPENT
    assert walk.outcome == "upstream_timeout"
    assert in_flight(walker) == 1  # the last attempt's load stays open until end()
    walk.end()
    assert in_flight(walker) == 0


def test_a_failure_that_may_have_run_is_not_retried() -> None:
    walker, _ = make_walker()
    walk, _ = sent_small(walker, 100)
    fail = walk.failed("timeout", retryable=False)
    assert isinstance(fail, Fail) and fail.reason is FailReason.NOT_RETRYABLE


def test_with_no_replica_left_the_failure_is_final() -> None:
    walker, _ = make_walker()
    walker.core.set_healthy(ReplicaId("small-r1"), False)
    walk, _ = sent_small(walker, 100)
    fail = walk.failed("connect", retryable=True)
    assert isinstance(fail, Fail) and fail.reason is FailReason.NO_REPLICA_LEFT


# -- sessions ----------------------------------------------------------------------------------


def test_the_sessions_pin_is_preferred_only_in_its_own_pool() -> None:
    walker, _ = make_walker()
    pinned = SessionRecord(pin=ReplicaId("small-r1"))
    walk = walker.start(request(ids=ids(100)), tier_pools(), pinned)
    send = walk.begin()
    assert isinstance(send, Send) and send.decision.request.preferred_replica == "small-r1"
    elsewhere = SessionRecord(pin=ReplicaId("large-r0"))
    walk = walker.start(request(ids=ids(100)), tier_pools(), elsewhere)
    send = walk.begin()
    assert isinstance(send, Send) and send.decision.request.preferred_replica is None


def test_the_record_is_written_once_at_the_end_with_pin_tier_and_usage() -> None:
    walker, _ = make_walker()
    walk, send = sent_small(walker, 100)
    walk.answered()
    write = walk.end(["stop"], {"prompt_tokens": 130, "completion_tokens": 20})
    assert write is not None
    assert write.key == session_key(TENANT, "chat", "s1")
    assert write.record == SessionRecord(pin=send.decision.replica, tier=0, usage=None,
                                         prompt_tokens=100)  # a token-id prompt: no messages
    assert walk.end() is None  # idempotent


def test_the_next_turn_is_estimated_from_the_last_usage() -> None:
    walker, _ = make_walker()
    record = SessionRecord(usage=SessionUsage(prompt_tokens=5000, completion_tokens=50,
                                              num_messages=1))
    body_only = walker.start(request(10), tier_pools(), None)
    from_usage = walker.start(request(10), tier_pools(), record)
    body_only.begin()
    from_usage.begin()
    assert from_usage.estimate.low > 5000 > body_only.estimate.high


def test_a_chat_answer_cut_short_by_a_clamp_is_noted_and_its_usage_kept() -> None:
    walker, _ = make_walker()
    walk = walker.start(request(10, max_tokens=400, proactive=False), tier_pools(), None)
    send = to_send(walk, walk.begin(), {SMALL: 1900})
    assert isinstance(send, Send)
    walk.take_notes()
    walk.answered()
    write = walk.end(["length"], {"prompt_tokens": 1900, "completion_tokens": 148})
    (cut,) = notes_of(walk, CutShortNote)
    assert cut.pool == SMALL and cut.why.value == "engine_clamp"
    assert write is not None and write.record.usage == SessionUsage(1900, 148, 1)


def test_without_a_session_nothing_is_written() -> None:
    walker, _ = make_walker()
    walk, _ = sent_small(walker, 100, session=None)
    walk.answered()
    assert walk.end(["stop"], {"prompt_tokens": 100, "completion_tokens": 3}) is None


# -- warm-ahead --------------------------------------------------------------------------------


def test_warm_ahead_rides_on_the_first_send_above_the_threshold() -> None:
    walker, _ = make_walker()
    _walk, send = sent_small(walker, 1500)
    assert send.warm is not None and send.warm.target_pool_name == LARGE
    _walk2, send2 = sent_small(walker, 1500)  # same stage, same session: cooling down
    assert send2.warm is None


def test_warm_ahead_skips_are_noted_with_their_reason() -> None:
    walker, _ = make_walker()
    walk = walker.start(request(ids=ids(100)), tier_pools(), None)
    walk.begin()
    assert notes_of(walk, WarmNote) == [WarmNote("skipped", "below_threshold")]
    walk = walker.start(request(ids=ids(1500), session=None), tier_pools(), None)
    walk.begin()
    assert notes_of(walk, WarmNote) == [WarmNote("skipped", "no_session")]


def test_a_warm_ups_request_is_built_by_the_walk_for_the_target_pool() -> None:
    walker, _ = make_walker()
    walk, _send = sent_small(walker, 1500)
    warm = walk.route_request(LARGE, RequestId("w1"), ids(1500), expected_output_tokens=1)
    assert (warm.pool, warm.expected_output_tokens, warm.scope.tenant) == (LARGE, 1, TENANT)


# -- external providers ------------------------------------------------------------------------


def test_an_external_pool_gets_its_least_loaded_endpoint_and_no_tokens() -> None:
    walker, _ = make_walker(external=True)
    walk = walker.start(request(ids=ids(9000), proactive=False), tier_pools(external=True),
                        SessionRecord(tier=2))
    send = walk.begin()
    assert isinstance(send, Send) and send.external
    req = send.decision.request
    assert req.prompt_token_ids is None and req.routing_text == ""
    assert len(req.exclude) == 1  # every endpoint but one


# -- the protocol ------------------------------------------------------------------------------


def test_calls_out_of_turn_are_refused_loudly() -> None:
    walker, _ = make_walker()
    walk = walker.start(request(ids=ids(100)), tier_pools(), None)
    with pytest.raises(RuntimeError, match="no NeedTokens is open"):
        walk.tokens(SMALL, ids(100))
    with pytest.raises(RuntimeError, match="no attempt is out"):
        walk.answered()
    walk.begin()
    with pytest.raises(RuntimeError, match="expected new"):
        walk.begin()


def test_the_recorder_hears_every_step_as_text() -> None:
    steps: list[tuple[str, str]] = []
    walker, _ = make_walker()
    walker.recorder = lambda rid, step: steps.append((rid, step))
    walk, send = sent_small(walker, 100)
    walk.answered()
    walk.end(["stop"], {"prompt_tokens": 100, "completion_tokens": 2})
    replica = send.decision.replica
    assert steps == [("q1", "begin"), ("q1", describe(send)), ("q1", f"answered {replica}"),
                     ("q1", f"end ok pin={replica} tier=0")]


# -- what the walk predicts a request will output ------------------------------------------------


def test_a_sessions_last_answer_predicts_its_next_one_within_the_budget() -> None:
    lengths = OutputLengths(alpha=0.5)
    assert lengths.predict("chat", None, None) == 256  # nothing known yet
    lengths.observe("chat", 100)
    lengths.observe("chat", 300)
    assert lengths.predict("chat", None, None) == 200  # the route's running mean
    assert lengths.predict("chat", 40, None) == 40  # the session's own last answer
    assert lengths.predict("chat", 900, 128) == 128  # never above the budget
    assert lengths.predict("other", None, 0) == 1


def test_a_last_answer_counts_as_much_as_it_predicted_the_next_ones() -> None:
    """The route's sessions answer 100 and 500 in turn, whatever they said last: a short
    last answer then predicts the route's mean, not itself. Where each answer repeats the
    last one, the last answer is the prediction."""
    lengths = OutputLengths(alpha=0.5, pair_alpha=0.1)
    for i in range(MIN_OUTPUT_PAIRS):
        previous, answer = (100, 500) if i % 2 else (500, 100)
        lengths.observe("agent", answer, previous)
    assert lengths.slope("agent") == 0.0
    mean = round(lengths.predict("agent", None, None))
    assert 100 < mean < 500
    assert lengths.predict("agent", 100, None) == mean
    for i in range(MIN_OUTPUT_PAIRS):
        answer = (100, 500)[i % 2]
        lengths.observe("echo", answer, answer)
    assert lengths.slope("echo") == pytest.approx(1.0)
    assert lengths.predict("echo", 100, None) == 100
    fresh = OutputLengths(alpha=0.5)
    for _ in range(MIN_OUTPUT_PAIRS - 1):  # too few pairs: the last answer as it is
        fresh.observe("agent", 500, 100)
    assert fresh.predict("agent", 100, None) == 100


def test_a_thinking_budget_is_a_floor_of_the_predicted_output() -> None:
    """The thinking allowed counts in the expected decode even before any answer holds it."""
    lengths = OutputLengths(alpha=0.5)
    assert lengths.predict("chat", None, None, thinking=2048) == 256 + 2048  # nothing learned
    assert lengths.predict("chat", None, 1000, thinking=2048) == 1000  # max_tokens caps all
    lengths.observe("chat", 100)  # answers that did not think
    assert lengths.predict("chat", None, None, thinking=2048) == 2048
    assert lengths.predict("chat", None, None) == 100  # thinking off: the learned mean
    assert lengths.predict("chat", 40, None, thinking=512) == 512  # the last turn did not think
    assert lengths.predict("chat", 3000, None, thinking=512) == 3000  # it thought longer


def test_the_walk_prices_a_thinking_requests_decode() -> None:
    walker, _ = make_walker()
    _walk, send = sent_small(walker, 100, max_tokens=4000, thinking=1024)
    assert send.decision.request.predicted_output_tokens == 256 + 1024
    _walk, send = sent_small(walker, 100, max_tokens=600, thinking=1024)
    assert send.decision.request.predicted_output_tokens == 600


def test_the_walk_prices_the_predicted_output_and_learns_from_answers() -> None:
    walker, _ = make_walker()
    walk, send = sent_small(walker, 100, max_tokens=4000)
    assert send.decision.request.predicted_output_tokens == 256
    walk.answered()
    walk.end(["stop"], {"prompt_tokens": 100, "completion_tokens": 60})
    _walk2, send2 = sent_small(walker, 100, max_tokens=4000, session=None)
    assert send2.decision.request.predicted_output_tokens == 60
