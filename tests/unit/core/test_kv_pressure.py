"""KV pressure: the resting sessions a placement would evict, and ties spread by load and
free KV.

The policy tests set up two replicas whose other terms favour one of them and whose KV
picture favours the other, so removing the pressure term flips the decision. The tracker
tests check where a session rests, for how long, and what counts as used KV.
"""

from __future__ import annotations

import random
from collections import Counter

from kvroute.core.index import PrefixMatch
from kvroute.core.load import SESSION_RETURN_S, LoadTracker, ReplicaLoad
from kvroute.core.policy import Candidate, KvrouteCostPolicy, PolicyInput
from kvroute.core.types import ReplicaId, RequestId

RATE = 25_000.0
CAPACITY = 396_000


def load(*, used: int = 250_000, resting: int = 0, capacity: int = CAPACITY,
         in_flight: int = 0, last: float = float("-inf")) -> ReplicaLoad:
    return ReplicaLoad(prefill_rate_tps=RATE, num_in_flight=in_flight, last_chosen_s=last,
                       kv_capacity_tokens=capacity, kv_used_tokens=used,
                       resting_session_tokens=resting)


def policy(**weights: float) -> KvrouteCostPolicy:
    return KvrouteCostPolicy(random.Random(0), **weights)


COLD = PolicyInput("r", num_prompt_tokens=60_000, block_size=16, expected_output_tokens=1000)


def test_a_cold_prompt_goes_where_it_evicts_no_resting_session() -> None:
    """The docstring's example: A holds ten blocks of the prompt, B none; both hold 250k of
    396k tokens in flight, but 120k of A's free KV is sessions at rest. Sending the prompt
    to A evicts 35k of their tokens, 1.4 s of prefill they pay on return."""
    a = Candidate(ReplicaId("A"), load(resting=120_000), PrefixMatch(num_gpu_blocks=10))
    b = Candidate(ReplicaId("B"), load())
    assert policy().evicted_resting_tokens(COLD, a, 60_000 - 160) == 60_000 - 160 + 1000 - 26_000
    assert policy().evicted_resting_tokens(COLD, b, 60_000.0) == 0.0
    assert policy().select(COLD, [a, b]).replica == "B"
    assert policy().select(COLD, [b, a]).replica == "B"
    assert policy(pressure_weight=0).select(COLD, [a, b]).replica == "A"


def test_a_sessions_own_cached_prefix_is_taken_not_evicted() -> None:
    """The request's session rests on A with 100k cached tokens, all it has on A: its next
    turn reuses them and evicts nothing, though A's free KV is all resting context."""
    turn = PolicyInput("t", num_prompt_tokens=100_500, block_size=16,
                       expected_output_tokens=500)
    a = Candidate(ReplicaId("A"), load(used=290_000, resting=100_000),
                  PrefixMatch(num_gpu_blocks=100_000 // 16))
    assert policy().evicted_resting_tokens(turn, a, 500.0) == 0.0


def test_spare_kv_is_used_before_any_resting_session_is_evicted() -> None:
    small = PolicyInput("s", num_prompt_tokens=20_000, block_size=16, expected_output_tokens=500)
    a = Candidate(ReplicaId("A"), load(resting=120_000))  # 26k spare
    assert policy().evicted_resting_tokens(small, a, 20_000.0) == 0.0


def test_no_pressure_without_a_known_capacity() -> None:
    a = Candidate(ReplicaId("A"), load(capacity=0, resting=500_000))
    assert policy().evicted_resting_tokens(COLD, a, 60_000.0) == 0.0


def test_select_adds_exactly_the_pressure_term() -> None:
    pol = policy(pressure_weight=0.8)
    a = Candidate(ReplicaId("A"), load(resting=120_000), PrefixMatch(num_gpu_blocks=10))
    b = Candidate(ReplicaId("B"), load(used=380_000, resting=30_000))
    with_term = pol.select(COLD, [a, b]).scores
    without = policy(pressure_weight=0).select(COLD, [a, b]).scores
    for c in (a, b):
        _, prefill = pol.predicted_ttft_s(COLD, c)
        evicted = pol.evicted_resting_tokens(COLD, c, prefill)
        assert evicted > 0
        assert with_term[c.replica] == without[c.replica] + 0.8 * (evicted / RATE)


def test_equal_costs_go_to_the_replica_with_more_free_kv_whatever_the_order() -> None:
    """Same cost (no resting session anywhere, the prompt fits both), but B's engine holds
    less KV: B wins in either list order, and however recently it was chosen."""
    req = PolicyInput("r", num_prompt_tokens=1000, block_size=16, expected_output_tokens=100)
    a = Candidate(ReplicaId("A"), load(used=300_000))
    b = Candidate(ReplicaId("B"), load(used=100_000, last=9.0))
    pol = policy(decode_weight=0, harm_weight=0)
    assert pol.select(req, [a, b]).scores[ReplicaId("A")] == pol.select(req, [a, b]).scores[
        ReplicaId("B")]
    assert pol.select(req, [a, b]).replica == "B"
    assert pol.select(req, [b, a]).replica == "B"


def test_equal_costs_go_to_the_replica_with_fewer_requests_in_flight() -> None:
    """With no per-request charge, a replica with more requests in flight can tie; the tie
    goes to the less loaded one, in either order."""
    req = PolicyInput("r", num_prompt_tokens=1000, block_size=16, expected_output_tokens=100)
    a = Candidate(ReplicaId("A"), load(in_flight=3, used=100_000))
    b = Candidate(ReplicaId("B"), load(in_flight=1, used=300_000))
    pol = policy(decode_weight=0, harm_weight=0, inflight_cost_s=0)
    assert pol.select(req, [a, b]).replica == "B"
    assert pol.select(req, [b, a]).replica == "B"


def test_full_ties_spread_at_random_not_by_list_order() -> None:
    pol = policy()
    req = PolicyInput("r", num_prompt_tokens=1000, block_size=16, expected_output_tokens=100)
    cands = [Candidate(ReplicaId(name), load()) for name in "abcd"]
    firsts = Counter(pol.select(req, cands).replica for _ in range(400))
    assert set(firsts) == {"a", "b", "c", "d"}
    assert min(firsts.values()) > 60


# -- the tracker -----------------------------------------------------------------------------

R0, R1 = ReplicaId("r0"), ReplicaId("r1")


def tracker() -> LoadTracker:
    t = LoadTracker()
    t.add_replica(R0, prefill_rate_tps=RATE, kv_capacity_tokens=CAPACITY)
    t.add_replica(R1, prefill_rate_tps=RATE)
    return t


def turn(t: LoadTracker, replica: ReplicaId, rid: str, *, session: str | None, prompt: int,
         start: float, end: float, output: int) -> None:
    t.on_dispatch(replica, RequestId(rid), prefill_tokens=prompt, prompt_tokens=prompt,
                  expected_output_tokens=output, now_s=start, session=session)
    t.on_first_token(replica, RequestId(rid), now_s=start + 0.5)
    t.on_complete(replica, RequestId(rid), now_s=end, output_tokens=output)


def test_a_session_rests_where_its_request_ended_until_it_returns() -> None:
    t = tracker()
    turn(t, R0, "a1", session="s", prompt=40_000, start=0.0, end=5.0, output=800)
    assert t.snapshot(R0, 6.0).resting_session_tokens == 40_800
    t.on_dispatch(R1, RequestId("a2"), prefill_tokens=41_000, prompt_tokens=41_000,
                  expected_output_tokens=500, now_s=7.0, session="s")
    assert t.snapshot(R0, 7.0).resting_session_tokens == 0  # back, and moved
    t.on_complete(R1, RequestId("a2"), now_s=9.0, output_tokens=500)
    assert t.snapshot(R1, 9.0).resting_session_tokens == 41_500
    assert t.snapshot(R0, 9.0).resting_session_tokens == 0


def test_requests_without_a_session_and_sessions_gone_quiet_do_not_rest() -> None:
    t = tracker()
    turn(t, R0, "x", session=None, prompt=10_000, start=0.0, end=1.0, output=10)
    turn(t, R0, "y", session="q", prompt=10_000, start=0.0, end=2.0, output=10)
    assert t.snapshot(R0, 3.0).resting_session_tokens == 10_010
    assert t.snapshot(R0, 2.0 + SESSION_RETURN_S).resting_session_tokens == 0
    # forgotten for good: its return does not touch another session's count
    turn(t, R0, "z", session="p", prompt=1000, start=400.0, end=401.0, output=10)
    t.on_dispatch(R1, RequestId("y2"), prefill_tokens=1, prompt_tokens=1,
                  expected_output_tokens=1, now_s=402.0, session="q")
    assert t.snapshot(R0, 402.0).resting_session_tokens == 1010


def test_used_kv_is_the_larger_of_the_engines_report_and_the_routers_count() -> None:
    t = tracker()
    t.on_dispatch(R0, RequestId("a"), prefill_tokens=30_000, prompt_tokens=30_000,
                  expected_output_tokens=100, predicted_output_tokens=100, now_s=0.0)
    assert t.snapshot(R0, 0.0).kv_used_tokens == 30_050
    t.on_engine_metrics(R0, running=3, waiting=0, kv_usage=0.5)
    snap = t.snapshot(R0, 0.0)
    assert (snap.kv_capacity_tokens, snap.kv_used_tokens) == (CAPACITY, CAPACITY // 2)
    t.on_engine_metrics(R1, running=0, waiting=0, kv_usage=0.0, kv_capacity_tokens=1000)
    assert t.snapshot(R1, 0.0).kv_capacity_tokens == 1000


def test_a_restarted_or_removed_replica_holds_no_resting_session() -> None:
    t = tracker()
    turn(t, R0, "a", session="s", prompt=5000, start=0.0, end=1.0, output=10)
    t.reset_replica(R0)
    assert t.snapshot(R0, 2.0).resting_session_tokens == 0
    turn(t, R0, "b", session="s", prompt=5000, start=3.0, end=4.0, output=10)
    t.remove_replica(R0)
    t.add_replica(R0, prefill_rate_tps=RATE)
    assert t.snapshot(R0, 5.0).resting_session_tokens == 0


def test_a_session_rests_on_one_replica_only() -> None:
    """Two requests of one session end on two replicas: it rests where it ended last."""
    t = tracker()
    t.on_dispatch(R0, RequestId("a"), prefill_tokens=1000, prompt_tokens=1000,
                  expected_output_tokens=10, now_s=0.0, session="s")
    t.on_dispatch(R1, RequestId("b"), prefill_tokens=2000, prompt_tokens=2000,
                  expected_output_tokens=10, now_s=0.0, session="s")
    t.on_complete(R1, RequestId("b"), now_s=1.0, output_tokens=10)
    t.on_complete(R0, RequestId("a"), now_s=2.0, output_tokens=10)
    assert t.snapshot(R0, 3.0).resting_session_tokens == 1010
    assert t.snapshot(R1, 3.0).resting_session_tokens == 0


def test_the_router_core_tells_the_tracker_where_a_session_rests_and_each_capacity() -> None:
    """Through RouterCore: the configured capacity and a session's ended request reach the
    snapshot the policy scores; the engine's report of its capacity replaces the config's."""
    from kvroute.core.clock import ManualClock
    from kvroute.core.index import TenantScope
    from kvroute.core.peer_policies import make_policy
    from kvroute.core.router import PoolSpec, ReplicaSpec, RouterCore, RouteRequest
    from kvroute.core.types import PoolName, TenantName

    clock = ManualClock()
    pool = PoolName("p")
    rc = RouterCore([PoolSpec(pool, (ReplicaSpec(R0, RATE, kv_capacity_tokens=CAPACITY),),
                              block_size=16)],
                    lambda: make_policy("kvroute", random.Random(0)), clock=clock)
    decision = rc.route(RouteRequest(RequestId("a"), pool, TenantScope(TenantName("t")),
                                     num_prompt_tokens=3000, session_id="s1",
                                     expected_output_tokens=100))
    rc.on_first_token(decision.replica, RequestId("a"))
    rc.on_complete(decision.replica, RequestId("a"), output_tokens=100)
    snap = rc.load.snapshot(R0, clock.now())
    assert (snap.kv_capacity_tokens, snap.resting_session_tokens) == (CAPACITY, 3100)
    rc.on_engine_metrics(R0, running=0, waiting=0, kv_usage=0.0, kv_capacity_tokens=5000)
    assert rc.load.snapshot(R0, clock.now()).kv_capacity_tokens == 5000


def test_two_tenants_sessions_of_one_id_rest_apart() -> None:
    from kvroute.core.clock import ManualClock
    from kvroute.core.index import TenantScope
    from kvroute.core.peer_policies import make_policy
    from kvroute.core.router import PoolSpec, ReplicaSpec, RouterCore, RouteRequest
    from kvroute.core.types import PoolName, TenantName

    clock = ManualClock()
    pool = PoolName("p")
    rc = RouterCore([PoolSpec(pool, (ReplicaSpec(R0, RATE, kv_capacity_tokens=CAPACITY),),
                              block_size=16)],
                    lambda: make_policy("kvroute", random.Random(0)), clock=clock)

    def send(rid: str, tenant: str) -> None:
        rc.route(RouteRequest(RequestId(rid), pool, TenantScope(TenantName(tenant)),
                              num_prompt_tokens=1000, session_id="same",
                              expected_output_tokens=10))

    send("a", "acme")
    rc.on_complete(R0, RequestId("a"), output_tokens=10)
    send("b", "zeta")  # another tenant's session that happens to share the id
    assert rc.load.snapshot(R0, clock.now()).resting_session_tokens == 1010
