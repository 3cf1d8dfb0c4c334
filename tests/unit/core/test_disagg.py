"""The prefill/decode split decision (``core/disagg.py``) and its accounting in the core.

Each policy test sets up a fleet where one term alone decides: removing the transfer term
(or the decode term) from the split's price flips the decision the test asserts.
"""

from __future__ import annotations

import random

import pytest

from kvroute.core.clock import ManualClock
from kvroute.core.disagg import DisaggSpec, Role, choose_split, split_parts
from kvroute.core.errors import ConfigError, NoEligibleReplica
from kvroute.core.index import PrefixMatch, TenantScope
from kvroute.core.load import DecodeTiming, ReplicaLoad
from kvroute.core.peer_policies import make_policy
from kvroute.core.policy import Candidate, KvrouteCostPolicy, PolicyInput
from kvroute.core.router import PoolSpec, ReplicaSpec, RouterCore, RouteRequest
from kvroute.core.types import PoolName, ReplicaId, RequestId, TenantName

RATE = 25_000.0
TIMING = DecodeTiming(0.006, 20e-6, 50e-9)  # the 8B/H100 step law of the docstrings
FAST_LINK = DisaggSpec("auto", 131_072 / 12.5e9)  # 10.5 us a token
SLOW_LINK = DisaggSpec("auto", 1e-3)  # 1 ms a token: slower than recomputing anywhere


def policy(**weights: float) -> KvrouteCostPolicy:
    return KvrouteCostPolicy(random.Random(0), **weights)


def idle() -> ReplicaLoad:
    return ReplicaLoad(prefill_rate_tps=RATE)


def decoding(streams: int, context: int, left: float = 200.0) -> ReplicaLoad:
    """A replica with ``streams`` requests decoding over ``context`` tokens of KV."""
    return ReplicaLoad(prefill_rate_tps=RATE, num_in_flight=streams, num_decoding=streams,
                       decoding_context_tokens=context, decode_tokens_left=streams * left)


def ask(n: int, m: int = 256) -> PolicyInput:
    return PolicyInput("r", num_prompt_tokens=n, block_size=16, expected_output_tokens=m,
                       decode_timing=TIMING)


ROLES: dict[ReplicaId, Role] = {ReplicaId("P"): "prefill", ReplicaId("D"): "decode",
                                ReplicaId("D2"): "decode"}


def test_a_long_cold_prompt_splits_away_from_decoding_streams() -> None:
    """The docstring's example: 20,000 cold tokens, the only decode replica runs 30
    streams. Colocated, its prefill stalls them 0.8 s each; split, an idle prefill replica
    computes it and the KV moves in 0.21 s."""
    cands = [Candidate(ReplicaId("P"), idle()), Candidate(ReplicaId("D"), decoding(30, 300_000))]
    choice = choose_split(policy(), ask(20_000), cands, ROLES, FAST_LINK)
    assert choice.prefill == "P" and choice.selection.replica == "D"
    assert choice.split_cost_s < choice.colocated_cost_s


def test_a_slow_link_keeps_the_request_colocated() -> None:
    """The same request over a 1 ms-a-token link: the transfer (20 s) costs more than the
    stall it saves, so the decode replica prefills it itself. Without the transfer term in
    the price it would split."""
    cands = [Candidate(ReplicaId("P"), idle()), Candidate(ReplicaId("D"), decoding(30, 300_000))]
    choice = choose_split(policy(), ask(20_000), cands, ROLES, SLOW_LINK)
    assert choice.prefill is None and choice.selection.replica == "D"
    parts = split_parts(policy(), ask(20_000), cands[1], "decode", 1e-3, 1.0)
    assert parts.decode_s is not None and parts.decode_s > 19.99  # the transfer is in it


def test_a_short_suffix_of_a_cached_prompt_goes_straight_to_decode() -> None:
    """A 500-token suffix of a 20,000-token conversation D holds: its prefill there is
    small, while a prefill replica without the prefix would recompute it all."""
    cands = [Candidate(ReplicaId("P"), idle()),
             Candidate(ReplicaId("D"), decoding(30, 300_000),
                       PrefixMatch(num_gpu_blocks=19_500 // 16))]
    choice = choose_split(policy(), ask(20_000), cands, ROLES, FAST_LINK)
    assert choice.prefill is None and choice.selection.replica == "D"


def test_the_decode_half_goes_where_its_own_decode_is_fastest() -> None:
    """Two decode replicas: D holds a quarter of the prompt (less to pull) but its batch
    reads 3M tokens of KV a step, whose streams are about to end (no harm to them); D2 is
    idle. The split decodes on D2, by the request's own decode term alone: without it D
    wins on the transfer."""
    cands = [Candidate(ReplicaId("P"), idle()),
             Candidate(ReplicaId("D"), decoding(20, 3_000_000, left=0.0),
                       PrefixMatch(num_gpu_blocks=5_000 // 16)),
             Candidate(ReplicaId("D2"), idle())]
    always = DisaggSpec("always", FAST_LINK.link_s_per_token)
    weights = {"inflight_cost_s": 0.0}
    choice = choose_split(policy(**weights), ask(20_000), cands, ROLES, always)
    assert choice.prefill == "P" and choice.selection.replica == "D2"
    blind = choose_split(policy(decode_weight=0.0, **weights), ask(20_000), cands, ROLES, always)
    assert blind.selection.replica == "D"


def test_modes_and_roles() -> None:
    """``never`` colocates (prefill-only replicas stay out), ``always`` splits whenever a
    pair exists, and a prefill-only replica never answers a request itself."""
    cands = [Candidate(ReplicaId("P"), idle()), Candidate(ReplicaId("D"), idle())]
    never = choose_split(policy(), ask(100), cands, ROLES, DisaggSpec("never"))
    assert never.prefill is None and never.selection.ranking == ("D",)
    always = choose_split(policy(), ask(100), cands, ROLES, DisaggSpec("always"))
    assert always.prefill == "P" and always.selection.replica == "D"
    auto = choose_split(policy(), ask(100), cands, ROLES, FAST_LINK)
    assert auto.prefill is None and "P" not in auto.selection.ranking
    peer = choose_split(make_policy("least_loaded", random.Random(0)), ask(100), cands, ROLES,
                        FAST_LINK)
    assert peer.prefill == "P" and peer.selection.replica == "D"  # peers always split
    with pytest.raises(ValueError, match="prefill-only"):
        choose_split(policy(), ask(100), cands[:1], ROLES, FAST_LINK)
    with pytest.raises(ValueError, match="mode"):
        DisaggSpec("sometimes")  # type: ignore[arg-type]


# -- the core's accounting -----------------------------------------------------------------------

POOL = PoolName("pd")
SCOPE = TenantScope(TenantName("t"))


def pd_core(mode: str = "always") -> RouterCore:
    replicas = (ReplicaSpec(ReplicaId("p0"), RATE, role="prefill"),
                ReplicaSpec(ReplicaId("d0"), RATE, role="decode"),
                ReplicaSpec(ReplicaId("d1"), RATE, role="decode"))
    spec = PoolSpec(POOL, replicas, decode_timing=TIMING,
                    disagg=DisaggSpec(mode, FAST_LINK.link_s_per_token))  # type: ignore[arg-type]
    rng = random.Random(0)
    return RouterCore([spec], lambda: make_policy("kvroute", rng), clock=ManualClock())


def route_request(rid: str, n: int = 4_000) -> RouteRequest:
    return RouteRequest(RequestId(rid), POOL, SCOPE, num_prompt_tokens=n,
                        prompt_token_ids=list(range(n)), expected_output_tokens=64)


def test_a_split_counts_the_prefill_on_p_and_the_decode_on_d() -> None:
    core = pd_core()
    decision = core.route(route_request("a"))
    assert decision.prefill_replica == "p0" and decision.replica in ("d0", "d1")
    assert core.load.snapshot(ReplicaId("p0"), 0.0).outstanding_prefill_tokens == 4_000
    assert core.load.snapshot(decision.replica, 0.0).outstanding_prefill_tokens == 1
    moved = core.colocate(decision)  # the prefill failed: D prefills it itself
    assert moved.prefill_replica is None and moved.replica == decision.replica
    assert core.load.snapshot(ReplicaId("p0"), 0.0).num_in_flight == 0
    assert core.load.snapshot(decision.replica, 0.0).outstanding_prefill_tokens == 4_000


def test_roles_need_a_disaggregated_pool_and_a_decode_replica() -> None:
    with pytest.raises(ConfigError, match="not disaggregated"):
        RouterCore([PoolSpec(POOL, (ReplicaSpec(ReplicaId("p0"), role="prefill"),))],
                   lambda: make_policy("kvroute", random.Random(0)), clock=ManualClock())
    core = pd_core()
    core.set_healthy(ReplicaId("d0"), False)
    core.set_healthy(ReplicaId("d1"), False)
    with pytest.raises(NoEligibleReplica, match="prefill-only"):
        core.route(route_request("b"))


def test_a_warm_up_is_never_split() -> None:
    """A ``max_tokens: 1`` copy (warm-ahead, shadow warm-up) is a prefill: it goes to one
    replica that can decode, and nothing is counted on a prefill replica."""
    core = pd_core()
    warm = RouteRequest(RequestId("w"), POOL, SCOPE, num_prompt_tokens=4_000,
                        prompt_token_ids=list(range(4_000)), expected_output_tokens=1)
    decision = core.route(warm)
    assert decision.prefill_replica is None and decision.replica in ("d0", "d1")
    assert core.load.snapshot(ReplicaId("p0"), 0.0).num_in_flight == 0


def test_idle_twin_prefill_replicas_take_turns() -> None:
    """Two idle prefill replicas tie: the one chosen less recently gets the prefill, never
    the first in the list."""
    roles: dict[ReplicaId, Role] = {ReplicaId("P1"): "prefill", ReplicaId("P2"): "prefill",
                                    ReplicaId("D"): "decode"}
    recent = ReplicaLoad(prefill_rate_tps=RATE, last_chosen_s=5.0)
    cands = [Candidate(ReplicaId("P1"), recent), Candidate(ReplicaId("P2"), idle()),
             Candidate(ReplicaId("D"), idle())]
    choice = choose_split(policy(), ask(2_000), cands, roles, DisaggSpec("always"))
    assert choice.prefill == "P2"


def test_a_split_decode_half_teaches_no_prefill_rate() -> None:
    """The decode half of a split waits for the prefill replica and the transfer, so its
    time to first token is no sample of the decode replica's prefill rate: it leaves D's
    learned rate alone (the prefill half's first token teaches P's). Learned from, the
    4,000 tokens queued ahead on D over the 10 s wait would drag D's rate to the clamp."""
    from kvroute.core.tiers import TierPool
    from kvroute.core.walk import Send, Walker, WalkRequest, WalkRoute, WalkSettings
    from kvroute.core.warm import WarmPlanner

    clock = ManualClock(100.0)
    replicas = (ReplicaSpec(ReplicaId("p0"), RATE, role="prefill"),
                ReplicaSpec(ReplicaId("d0"), RATE, role="decode"))
    spec = PoolSpec(POOL, replicas, decode_timing=TIMING,
                    disagg=DisaggSpec("always", FAST_LINK.link_s_per_token))
    rng = random.Random(0)
    core = RouterCore([spec], lambda: make_policy("kvroute", rng), clock=clock)
    walker = Walker(core, WarmPlanner(enabled=False), WalkSettings(), clock)
    d0 = ReplicaId("d0")
    core.load.on_dispatch(d0, RequestId("ahead"), prefill_tokens=4_000, prompt_tokens=4_000,
                          expected_output_tokens=64, now_s=100.0)
    before = core.load.snapshot(d0, 100.0).prefill_rate_tps
    tokens = list(range(1000, 5000))
    walk = walker.start(WalkRequest(
        request_id=RequestId("q"), route=WalkRoute("chat", proactive=False),
        tenant=TenantName("t"), session_id=None, endpoint="completions", model="m",
        body={"prompt": tokens}, max_tokens=64, prompt_token_ids=tokens,
        routing_text=lambda: ""), [TierPool(POOL, window=32_768, window_fetched_at_s=100.0,
                                            served_model="m")], None)
    send = walk.begin()
    assert isinstance(send, Send) and send.decision.prefill_replica == "p0"
    assert send.decision.replica == d0
    clock.advance(10.0)
    walk.prefill_answered()
    walk.answered()
    after = core.load.snapshot(d0, 110.0)
    assert after.num_decoding == 1  # the decode half did start decoding there
    assert after.prefill_rate_tps == before


def test_a_decode_avoids_a_replica_that_keeps_prefilling_for_others() -> None:
    """D1 holds 2,000 of the prompt's 2,100 tokens, D2 none; both are idle now, but D1
    spent 60% of its recent decodes prefilling other replicas' splits (its learned
    ``prefill_duty``): 256 tokens there take 2.5 times the step model's time. Priced, the
    request decodes on D2; without the duty term D1's prefix would win."""
    roles: dict[ReplicaId, Role] = {ReplicaId("P"): "prefill", ReplicaId("D1"): "decode",
                                    ReplicaId("D2"): "decode"}
    busy = ReplicaLoad(prefill_rate_tps=RATE, prefill_duty=0.6)
    cands = [Candidate(ReplicaId("P"), idle()),
             Candidate(ReplicaId("D1"), busy, PrefixMatch(num_gpu_blocks=2_000 // 16)),
             Candidate(ReplicaId("D2"), idle())]
    choice = choose_split(policy(), ask(2_100), cands, roles, FAST_LINK)
    assert choice.prefill is None and choice.selection.replica == "D2"
    plain = choose_split(policy(), ask(2_100), cands, roles, DisaggSpec("never"))
    assert plain.selection.replica == "D1"  # never: an ordinary fleet, no duty priced
