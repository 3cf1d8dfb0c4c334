"""Ties broken alike by every router: the rendezvous replica of the prompt's first block no
candidate holds, so siblings of a new prefix that reach several routers at once land
together (whether the prompt is cached nowhere or behind a system prompt every replica
holds), while unrelated prompts still spread."""

from __future__ import annotations

import random
from collections import Counter

from kvroute.core.clock import ManualClock
from kvroute.core.index import PrefixMatch, TenantScope
from kvroute.core.load import ReplicaLoad
from kvroute.core.peer_policies import make_policy
from kvroute.core.policy import Candidate, KvrouteCostPolicy, PolicyInput
from kvroute.core.rendezvous import rendezvous_weight
from kvroute.core.router import PoolSpec, ReplicaSpec, RouterCore, RouteRequest
from kvroute.core.types import PoolName, ReplicaId, RequestId, TenantName, WireHash

POOL = PoolName("p")
ACME = TenantScope(TenantName("acme"))
NAMES = tuple(ReplicaId(f"r{i}") for i in range(4))


def idle(name: ReplicaId, *, last: float = float("-inf"), rate: float = 10_000.0,
         gpu: int = 0, predicted: int = 0) -> Candidate:
    return Candidate(name, ReplicaLoad(prefill_rate_tps=rate, last_chosen_s=last),
                     PrefixMatch(num_gpu_blocks=gpu, num_predicted_blocks=predicted))


def cold(first: int, n: int = 2_000) -> PolicyInput:
    return PolicyInput("r", num_prompt_tokens=n, block_size=16,
                       block_hashes=(WireHash(first), WireHash(first + 1)))


def test_two_routers_with_their_own_seeds_and_histories_pick_the_same_replica() -> None:
    """Router a chose r3 last, router b chose r0 last (their least-recently-chosen orders
    disagree), and their random draws differ: every cold sibling still lands on one replica
    at both. With the rule off the same two routers split every one of them (the control)."""
    a_history = [idle(r, last=float(i)) for i, r in enumerate(NAMES)]
    b_history = [idle(r, last=float(-i)) for i, r in enumerate(NAMES)]
    for on in (True, False):
        a = KvrouteCostPolicy(random.Random(1), tie_hash=on)
        b = KvrouteCostPolicy(random.Random(2), tie_hash=on)
        same = [a.select(cold(k), a_history).replica == b.select(cold(k), b_history).replica
                for k in range(0, 4_000, 200)]
        if on:
            assert all(same)
        else:
            assert not any(same)


def test_unrelated_cold_prompts_spread_over_the_replicas() -> None:
    policy = KvrouteCostPolicy(random.Random(0))
    firsts = Counter(policy.select(cold(k * 7_919), [idle(r) for r in NAMES]).replica
                     for k in range(400))
    assert set(firsts) == set(NAMES)
    assert min(firsts.values()) > 60  # 100 each on average


SYSTEM = tuple(WireHash(9_000 + i) for i in range(4))
"""Four blocks of a system prompt every replica holds (``held``)."""


def behind_system(first_new: int) -> PolicyInput:
    return PolicyInput("r", num_prompt_tokens=2_000, block_size=16,
                       block_hashes=(*SYSTEM, WireHash(first_new), WireHash(first_new + 1)))


def held(name: ReplicaId, *, last: float = float("-inf")) -> Candidate:
    return idle(name, last=last, gpu=len(SYSTEM))


def test_siblings_behind_a_system_prompt_every_replica_holds_tie_alike() -> None:
    """The prompt is cached everywhere up to its new part: the key is the first new block,
    so two routers with their own histories agree; keyed only for prompts cached nowhere
    (``tie_hash_cold_only``, the control) they split."""
    a_view = [held(r, last=float(i)) for i, r in enumerate(NAMES)]
    b_view = [held(r, last=float(-i)) for i, r in enumerate(NAMES)]
    for cold_only in (False, True):
        a = KvrouteCostPolicy(random.Random(1), tie_hash_cold_only=cold_only)
        b = KvrouteCostPolicy(random.Random(2), tie_hash_cold_only=cold_only)
        same = [a.select(behind_system(k), a_view).replica
                == b.select(behind_system(k), b_view).replica for k in range(0, 4_000, 200)]
        assert all(same) if not cold_only else not any(same)


def test_unrelated_prompts_behind_one_system_prompt_spread() -> None:
    """Keyed on the system prompt's first block, every such prompt would go to one replica
    whenever the replicas tie; keyed on the first new block they spread."""
    policy = KvrouteCostPolicy(random.Random(0))
    firsts = Counter(policy.select(behind_system(k * 7_919), [held(r) for r in NAMES]).replica
                     for k in range(400))
    assert set(firsts) == set(NAMES)
    assert min(firsts.values()) > 60


def test_costs_and_cached_prefixes_still_decide_before_the_hash() -> None:
    """The hash only breaks ties: a faster replica wins, so does one that holds (or is
    predicted to hold) more of the prompt; a prompt held entirely somewhere has no new
    block, and its ties go to the least recently chosen as before."""
    policy = KvrouteCostPolicy(random.Random(0))
    for k in range(20):
        ranked = [idle(r) for r in NAMES]
        favourite = policy.select(cold(k), ranked).replica
        other = next(r for r in NAMES if r != favourite)
        faster = [idle(r, rate=20_000.0 if r == other else 10_000.0) for r in NAMES]
        assert policy.select(cold(k), faster).replica == other
        ahead = [idle(r, predicted=1 if r == other else 0) for r in NAMES]
        assert policy.select(cold(k), ahead).replica == other
        whole = [idle(r, gpu=10, last=0.0 if r == other else 5.0) for r in NAMES]
        assert policy.select(cold(k), whole).replica == other


def test_a_band_lets_routers_that_learned_slightly_different_rates_agree() -> None:
    """Router a learned r0 1% faster than the others, router b learned r1 1% faster: exact
    ties only, each sends the cold prompt to its own favourite; with a 2% band they agree
    on the prompt's rendezvous replica."""
    def view(fast: ReplicaId) -> list[Candidate]:
        return [idle(r, rate=10_100.0 if r == fast else 10_000.0) for r in NAMES]

    for band, agree in ((0.0, False), (0.02, True)):
        a = KvrouteCostPolicy(random.Random(1), tie_band=band)
        b = KvrouteCostPolicy(random.Random(2), tie_band=band)
        same = {a.select(cold(k), view(NAMES[0])).replica
                == b.select(cold(k), view(NAMES[1])).replica for k in range(0, 2_000, 100)}
        assert same == {agree}


def test_the_weight_is_the_same_in_every_process() -> None:
    """Keyed BLAKE2b, not Python's per-process string hash: a literal from another run."""
    assert rendezvous_weight(WireHash(1), ReplicaId("r0")) == 0x38A24F5F7C9CE772
    weights = {rendezvous_weight(WireHash(1), r) for r in NAMES}
    assert len(weights) == len(NAMES)
    assert (rendezvous_weight(WireHash(1), NAMES[0])
            != rendezvous_weight(WireHash(2), NAMES[0]))  # a salted first block weighs anew


def two_routers(seed_a: int, seed_b: int, on: bool) -> tuple[RouterCore, RouterCore]:
    replicas = tuple(ReplicaSpec(r, prefill_rate_tps=10_000.0) for r in NAMES)
    made = []
    for seed in (seed_a, seed_b):
        rng = random.Random(seed)
        made.append(RouterCore([PoolSpec(POOL, replicas, block_size=16)],
                               lambda rng=rng: make_policy("kvroute", rng, tie_hash=on),
                               clock=ManualClock()))
    return made[0], made[1]


def request(rid: str, tokens: list[int]) -> RouteRequest:
    return RouteRequest(RequestId(rid), POOL, ACME, num_prompt_tokens=len(tokens),
                        prompt_token_ids=tokens, expected_output_tokens=16)


def test_two_router_cores_place_siblings_that_reach_both_at_once_together() -> None:
    """Two routers with their own seeds and their own past traffic (unrelated prompts,
    served and ended) each receive one sibling of a new 1,000-token prompt before either
    has heard of the other's: they choose the same replica. Without the rule (the control)
    some of the pairs split."""
    for on in (True, False):
        a, b = two_routers(3, 4, on)
        for i in range(5):
            d = a.route(request(f"ha{i}", [7_000 + 100 * i + t for t in range(64)]))
            a.on_complete(d.replica, RequestId(f"ha{i}"))
        for i in range(2):
            d = b.route(request(f"hb{i}", [9_000 + 100 * i + t for t in range(64)]))
            b.on_complete(d.replica, RequestId(f"hb{i}"))
        together = []
        for k in range(16):
            prefix = [100_000 * (k + 1) + t for t in range(1_000)]
            da = a.route(request(f"a{k}", prefix + [1]))
            db = b.route(request(f"b{k}", prefix + [2]))
            together.append(da.replica == db.replica)
            a.on_complete(da.replica, RequestId(f"a{k}"))
            b.on_complete(db.replica, RequestId(f"b{k}"))
        assert all(together) if on else not all(together)
