"""Lifetime load: sessions resting on a replica that are likely to come back while a request
decodes there join its batch (its tokens slow down) and read its context (theirs do).

The policy tests set up two replicas whose first-token cost favours the one where sessions
rest and whose lifetime batch favours the other, so removing the term flips the decision.
The tracker tests check what the snapshot says of resting sessions and how soon they return.
"""

from __future__ import annotations

import math
import random

import pytest

from kvroute.core.load import (
    DEFAULT_DECODE_TIMING,
    SESSION_REST_PRIOR_S,
    LoadTracker,
    ReplicaLoad,
)
from kvroute.core.policy import Candidate, KvrouteCostPolicy, PolicyInput
from kvroute.core.types import ReplicaId, RequestId

RATE = 25_000.0
T = DEFAULT_DECODE_TIMING
R0, R1 = ReplicaId("r0"), ReplicaId("r1")


def load(*, queue: int = 0, sessions: int = 0, tokens: int = 0,
         rest_s: float = 5.0) -> ReplicaLoad:
    return ReplicaLoad(outstanding_prefill_tokens=queue, prefill_rate_tps=RATE,
                       resting_sessions=sessions, resting_other_tokens=tokens,
                       resting_session_tokens=tokens, session_rest_s=rest_s)


def policy(**weights: float) -> KvrouteCostPolicy:
    return KvrouteCostPolicy(random.Random(0), **weights)


NEW = PolicyInput("n", num_prompt_tokens=40_000, block_size=16, expected_output_tokens=400,
                  session_id="new")


def test_a_new_session_goes_where_no_session_rests_that_would_soon_share_its_batch() -> None:
    """Both replicas are idle now. Four sessions of 50k tokens each rest on A and come back
    every 5 s on average; B has 10k tokens of queue (0.4 s). Over the request's 3.2 s of
    decode about one of them is back beside it, which costs it and them more than the queue."""
    a = Candidate(ReplicaId("A"), load(sessions=4, tokens=200_000))
    b = Candidate(ReplicaId("B"), load(queue=10_000))
    assert policy().select(NEW, [a, b]).replica == "B"
    assert policy().select(NEW, [b, a]).replica == "B"
    assert policy(return_weight=0).select(NEW, [a, b]).replica == "A"


def test_the_terms_are_the_expected_share_of_the_returning_sessions() -> None:
    """The documented formula: each resting session is back beside the request for
    ``(1 − e^(−window/rest)) / 2`` of its decode window on average."""
    a = Candidate(ReplicaId("A"), load(sessions=4, tokens=200_000))
    m, n = 400, 40_000
    step_with = T.step_s(1, n + m // 2)
    share = 0.5 * (1 - math.exp(-m * step_with / 5.0))
    decode, harm = policy().returning_terms_s(NEW, a)
    assert decode == pytest.approx(
        m * (T.seq_s * 4 * share + T.context_token_s * share * (200_000 + 4 * (m // 2))))
    assert harm == pytest.approx(4 * share * m * (T.seq_s + T.context_token_s * (n + m // 2)))


def test_sessions_that_rest_long_weigh_little_and_none_weigh_nothing() -> None:
    a_soon = Candidate(ReplicaId("A"), load(sessions=4, tokens=200_000, rest_s=5.0))
    a_late = Candidate(ReplicaId("A"), load(sessions=4, tokens=200_000, rest_s=500.0))
    soon, late = policy().returning_terms_s(NEW, a_soon), policy().returning_terms_s(NEW, a_late)
    assert 0 < late[0] < soon[0] / 50 and 0 < late[1] < soon[1] / 50
    assert policy().returning_terms_s(NEW, Candidate(ReplicaId("B"), load())) == (0.0, 0.0)


def test_select_adds_exactly_the_returning_terms() -> None:
    pol = policy(decode_weight=0.7, harm_weight=0.4, return_weight=1.5)
    cands = [Candidate(ReplicaId("A"), load(sessions=3, tokens=90_000)),
             Candidate(ReplicaId("B"), load(queue=2000))]
    sel = pol.select(NEW, cands)
    for c in cands:
        ttft, prefill = pol.predicted_ttft_s(NEW, c)
        decode, harm = pol.turn_terms_s(NEW, c, prefill)
        ret_decode, ret_harm = pol.returning_terms_s(NEW, c)
        expected = ttft + pol.work_weight * prefill / RATE
        expected += 0.7 * decode
        expected += 0.4 * harm
        if c.load.resting_sessions:
            expected += 1.5 * (0.7 * ret_decode + 0.4 * ret_harm)
        assert sel.scores[c.replica] == expected


def tracker() -> LoadTracker:
    t = LoadTracker()
    t.add_replica(R0, prefill_rate_tps=RATE)
    t.add_replica(R1, prefill_rate_tps=RATE)
    return t


def turn(t: LoadTracker, replica: ReplicaId, rid: str, session: str, *, start: float,
         end: float, prompt: int = 10_000, output: int = 100) -> None:
    t.on_dispatch(replica, RequestId(rid), prefill_tokens=prompt, prompt_tokens=prompt,
                  expected_output_tokens=output, now_s=start, session=session)
    t.on_first_token(replica, RequestId(rid), now_s=start + 0.5)
    t.on_complete(replica, RequestId(rid), now_s=end, output_tokens=output)


def test_the_snapshot_counts_the_other_sessions_at_rest_not_the_routed_ones() -> None:
    t = tracker()
    turn(t, R0, "a", "s1", start=0.0, end=1.0, prompt=10_000, output=100)
    turn(t, R0, "b", "s2", start=0.0, end=2.0, prompt=20_000, output=200)
    snap = t.snapshot(R0, 3.0)
    assert (snap.resting_sessions, snap.resting_other_tokens) == (2, 30_300)
    own = t.snapshot(R0, 3.0, session="s2")
    assert (own.resting_sessions, own.resting_other_tokens) == (1, 10_100)
    assert own.resting_session_tokens == 30_300  # the pressure term still sees its own
    assert t.snapshot(R1, 3.0, session="s2").resting_sessions == 0


def test_the_mean_rest_is_learned_from_sessions_that_come_back() -> None:
    t = tracker()
    assert t.snapshot(R0, 0.0).session_rest_s == SESSION_REST_PRIOR_S
    end = 0.0
    for i in range(60):  # the session comes back 8 s after each answer, on the other replica
        turn(t, (R0, R1)[i % 2], f"q{i}", "s", start=end + 8.0 if i else 0.0,
             end=(end + 8.0 if i else 0.0) + 1.0)
        end = (end + 8.0 if i else 0.0) + 1.0
    assert t.session_rest_s == pytest.approx(8.0, rel=1e-3)
    assert t.snapshot(R1, end).session_rest_s == t.session_rest_s


def test_a_session_copied_ahead_rests_on_the_copys_replica_not_its_home() -> None:
    """Spread-ahead copied s1's context to R1: its next turn is expected there, so R1 counts
    it among the sessions coming back (and its tokens among the KV to keep) and R0 no longer
    does; its return still teaches the mean rest."""
    t = tracker()
    turn(t, R0, "a", "s1", start=0.0, end=1.0, prompt=10_000, output=100)
    turn(t, R0, "b", "s2", start=0.0, end=2.0, prompt=20_000, output=200)
    assert t.move_resting("s1", R1)
    home, copy = t.snapshot(R0, 3.0), t.snapshot(R1, 3.0)
    assert (home.resting_sessions, home.resting_session_tokens) == (1, 20_200)
    assert (copy.resting_sessions, copy.resting_session_tokens) == (1, 10_100)
    assert t.snapshot(R1, 3.0, session="s1").resting_sessions == 0  # its own return
    t.on_dispatch(R1, RequestId("c"), prefill_tokens=100, prompt_tokens=10_200,
                  expected_output_tokens=100, now_s=9.0, session="s1")
    assert t.snapshot(R1, 9.0).resting_sessions == 0
    assert t.session_rest_s < SESSION_REST_PRIOR_S  # a rest of 8 s was learned


def test_moving_a_session_that_rests_nowhere_or_to_its_home_changes_nothing() -> None:
    t = tracker()
    assert not t.move_resting("s1", R1)  # never seen
    turn(t, R0, "a", "s1", start=0.0, end=1.0)
    assert not t.move_resting("s1", R0)  # already there
    assert not t.move_resting("s1", ReplicaId("gone"))
    assert t.snapshot(R0, 2.0).resting_sessions == 1
    assert t.snapshot(R1, 2.0).resting_sessions == 0
