"""RouterCore: the request walk as pure decisions."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from kvroute.core.clock import ManualClock
from kvroute.core.errors import ConfigError, NoEligibleReplica, ScopeError
from kvroute.core.events import BlockStored, EventBatch
from kvroute.core.hashing import BlockHasher
from kvroute.core.index import TenantScope
from kvroute.core.peer_policies import make_policy
from kvroute.core.peers import Announcement, Placed
from kvroute.core.pseudonyms import Pseudonyms
from kvroute.core.router import PoolSpec, ReplicaSpec, RouterCore, RouteRequest, text_chunk_hashes
from kvroute.core.types import PoolName, ReplicaId, RequestId, TenantName, to_wire_hash

POOL = PoolName("p")
ACME = TenantScope(TenantName("acme"))
REPLICAS = tuple(ReplicaSpec(ReplicaId(f"r{i}"), prefill_rate_tps=10_000.0) for i in range(4))


def core(policy: str = "kvroute", *, approximate: bool = False) -> tuple[RouterCore, ManualClock]:
    clock = ManualClock()
    rng = random.Random(0)
    rc = RouterCore([PoolSpec(POOL, REPLICAS, block_size=16, approximate=approximate)],
                    lambda: make_policy(policy, rng), clock=clock)
    return rc, clock


def request(rid: str, tokens: list[int], *, scope: TenantScope = ACME, salt: str | None = None,
            text: str = "") -> RouteRequest:
    return RouteRequest(RequestId(rid), POOL, scope,
                        num_prompt_tokens=len(tokens) if tokens else len(text) // 4,
                        prompt_token_ids=tokens, cache_salt=salt, routing_text=text,
                        expected_output_tokens=16)


def stored(tokens: list[int], salt: str | None = None) -> EventBatch:
    hashes = BlockHasher("sha256", 16).hash_blocks(tokens, cache_salt=salt)
    return EventBatch(seq=0, ts=0.0, events=(BlockStored(
        block_hashes=tuple(to_wire_hash(h) for h in hashes), parent_block_hash=None,
        token_ids=tuple(tokens[: 16 * len(hashes)]), block_size=16),))


PROMPT = list(range(100, 420))  # 320 tokens = 20 blocks


def test_request_lands_where_the_engine_reports_its_prefix() -> None:
    rc, _ = core()
    rc.apply_events(ReplicaId("r2"), stored(PROMPT))
    decision = rc.route(request("a", PROMPT + [7, 8, 9]))
    assert decision.replica == "r2"
    assert decision.expected_cached_tokens == 320
    assert not decision.approximate
    assert len(decision.block_hashes) == 20


def test_only_blocks_not_confirmed_on_the_chosen_replica_are_predicted() -> None:
    """A request behind a cached 20-block prefix predicts its 2 new blocks, not all 22; its
    sibling still co-locates, through the confirmed prefix and the 2 predictions."""
    rc, _ = core()
    rc.apply_events(ReplicaId("r2"), stored(PROMPT))
    tail = list(range(5000, 5032))  # two new blocks
    first = rc.route(request("a", PROMPT + tail + [1]))
    assert first.replica == "r2"
    assert rc.index.stats().num_predicted == 2
    sibling = rc.route(request("b", PROMPT + tail + [2]))
    assert sibling.replica == "r2" and sibling.expected_cached_tokens == 352
    # With nothing confirmed, every block is predicted (the burst case).
    rc2, _ = core()
    rc2.route(request("c", PROMPT))
    assert rc2.index.stats().num_predicted == 20


def test_salted_prefix_is_not_matched_without_the_salt() -> None:
    rc, _ = core()
    rc.apply_events(ReplicaId("r2"), stored(PROMPT, salt="acme-salt"))
    assert rc.route(request("a", PROMPT + [1])).expected_cached_tokens == 0
    rc2, _ = core()
    rc2.apply_events(ReplicaId("r2"), stored(PROMPT, salt="acme-salt"))
    assert rc2.route(request("b", PROMPT + [1], salt="acme-salt")).replica == "r2"


def test_sibling_burst_colocates_through_predicted_entries() -> None:
    """Eight samples of one 2k-token agent prompt, sent before any engine event: together."""
    rc, _ = core()
    agent_prompt = list(range(1000, 3048))
    first = rc.route(request("a", agent_prompt))
    siblings = {rc.route(request(f"s{i}", agent_prompt)).replica for i in range(7)}
    assert siblings == {first.replica}


def test_a_burst_of_short_suffixes_spreads_once_in_flight_requests_add_up() -> None:
    rc, _ = core()
    placed = {rc.route(request(f"s{i}", PROMPT + [i])).replica for i in range(16)}
    assert len(placed) >= 2


def test_predictions_expire_and_do_not_cross_tenants() -> None:
    rc, clock = core()
    first = rc.route(request("a", PROMPT))
    other = rc.route(request("b", PROMPT, scope=TenantScope(TenantName("globex"))))
    assert other.expected_cached_tokens == 0
    rc.on_complete(first.replica, RequestId("a"))
    rc.on_complete(other.replica, RequestId("b"))
    clock.advance(10.0)
    assert rc.route(request("c", PROMPT)).expected_cached_tokens == 0


def test_load_accounting_follows_the_lifecycle() -> None:
    rc, clock = core()
    d = rc.route(request("a", PROMPT))
    assert rc.load.snapshot(d.replica).outstanding_prefill_tokens == 320
    clock.advance(0.05)
    rc.on_first_token(d.replica, RequestId("a"))
    assert rc.load.snapshot(d.replica).num_decoding == 1
    rc.on_complete(d.replica, RequestId("a"))
    assert rc.load.snapshot(d.replica).num_in_flight == 0


def test_unhealthy_replica_is_skipped_and_forgotten() -> None:
    rc, _ = core()
    rc.apply_events(ReplicaId("r2"), stored(PROMPT))
    rc.set_healthy(ReplicaId("r2"), False)
    d = rc.route(request("a", PROMPT + [1]))
    assert d.replica != "r2" and "r2" not in d.ranking
    rc.set_healthy(ReplicaId("r2"), True)
    assert rc.is_healthy(ReplicaId("r2"))
    # its index entries were dropped when it failed
    assert rc.index.match(d.block_hashes, ACME).get(ReplicaId("r2")) is None


def test_reroute_moves_accounting_and_exhausts() -> None:
    rc, _ = core()
    d = rc.route(request("a", PROMPT))
    seen = [d.replica]
    while True:
        nxt = rc.reroute(d, d.replica)
        if nxt is None:
            break
        assert nxt.replica not in seen
        assert rc.load.snapshot(d.replica).num_in_flight == 0
        seen.append(nxt.replica)
        d = nxt
    assert sorted(seen) == ["r0", "r1", "r2", "r3"]


def test_no_eligible_replica() -> None:
    rc, _ = core()
    for rep in REPLICAS:
        rc.set_healthy(rep.name, False)
    with pytest.raises(NoEligibleReplica, match="no healthy replica in pool 'p'"):
        rc.route(request("a", PROMPT))


def test_scope_is_required() -> None:
    rc, _ = core()
    bad = RouteRequest(RequestId("a"), POOL, None, num_prompt_tokens=3,  # type: ignore[arg-type]
                       prompt_token_ids=[1, 2, 3])
    with pytest.raises(ScopeError):
        rc.route(bad)


def test_approximate_mode_matches_text_through_predictions_only() -> None:
    rc, _ = core(approximate=True)
    text = "system prompt text " * 400  # ~2,000 tokens: worth more than a batch seat
    first = rc.route(request("a", [], text=text + "question one"))
    assert first.approximate
    again = rc.route(request("b", [], text=text + "question two"))
    assert again.replica == first.replica
    assert again.expected_cached_tokens > 0


def test_engine_reported_hashing_is_adopted() -> None:
    rc, _ = core()
    rc.set_pool_hashing(POOL, block_size=32, hash_algo="sha256_cbor")
    d = rc.route(request("a", PROMPT))
    assert len(d.block_hashes) == 10
    expected = BlockHasher("sha256_cbor", 32).wire_hashes(PROMPT)
    assert list(d.block_hashes) == expected


def test_configuration_errors() -> None:
    clock = ManualClock()
    factory = lambda: make_policy("random", random.Random(0))
    with pytest.raises(ConfigError, match="at least one pool"):
        RouterCore([], factory, clock=clock)
    with pytest.raises(ConfigError, match="no replicas"):
        RouterCore([PoolSpec(POOL, ())], factory, clock=clock)
    with pytest.raises(ConfigError, match="unique across pools"):
        RouterCore([PoolSpec(POOL, REPLICAS), PoolSpec(PoolName("q"), REPLICAS[:1])], factory,
                   clock=clock)
    rc, _ = core()
    with pytest.raises(ConfigError, match="unknown pool"):
        rc.pool(PoolName("nope"))


def test_text_chunk_hashes_chain() -> None:
    a = text_chunk_hashes("x" * 130)
    b = text_chunk_hashes("x" * 128 + "yy")
    assert len(a) == 2 and a == b
    assert text_chunk_hashes("y" * 64 + "x" * 64)[1] != a[1]


def test_a_replica_without_prefix_caching_is_never_credited_with_hits() -> None:
    rc, _ = core()
    r2 = ReplicaId("r2")
    rc.apply_events(r2, stored(PROMPT))
    rc.set_prefix_caching(r2, False)
    assert rc.prefix_caching_off(r2)
    first = rc.route(request("a", PROMPT + [7]))
    assert first.expected_cached_tokens == 0 and first.cached_by_replica.get(r2, 0) == 0
    # Not even through predicted entries: route it there on purpose, then ask again.
    rc.set_healthy(ReplicaId("r0"), False)
    rc.set_healthy(ReplicaId("r1"), False)
    rc.set_healthy(ReplicaId("r3"), False)
    assert rc.route(request("b", PROMPT + [8])).replica == r2
    again = rc.route(request("c", PROMPT + [9]))
    assert again.expected_cached_tokens == 0
    assert rc.exact_cached_tokens(again.request, r2) == 0
    rc.set_prefix_caching(r2, True)
    rc.apply_events(r2, stored(PROMPT))
    assert rc.route(request("d", PROMPT + [10])).expected_cached_tokens == 320


def test_a_drifting_pool_routes_approximately_and_keeps_its_exact_shadow() -> None:
    rc, _ = core()
    r1 = ReplicaId("r1")
    rc.apply_events(r1, stored(PROMPT))
    rc.set_pool_drifting(POOL, True)
    assert rc.pool_drifting(POOL)
    decision = rc.route(request("a", PROMPT + [7], text="some text " * 40))
    assert decision.approximate
    assert rc.exact_cached_tokens(decision.request, r1) == 320
    rc.set_pool_drifting(POOL, False)
    assert not rc.route(request("b", PROMPT + [8])).approximate


class _CountingNames(Pseudonyms):
    """Pseudonyms that count the session pseudonyms asked of them."""

    __slots__ = ("sessions",)

    def __init__(self, secret: str) -> None:
        super().__init__(secret)
        self.sessions = 0

    def session(self, key: str) -> str:
        self.sessions += 1
        return super().session(key)


def test_a_routed_session_is_named_once_and_the_name_reaches_the_load_and_the_bus() -> None:
    """With shared sessions, ``route`` computes the session's keyed pseudonym once and
    commits the dispatch under it (load tracker and the ``Placed`` announcement)."""
    rc, _ = core()
    secret = "s" * 32
    names = rc.session_names = _CountingNames(secret)
    placed: list[Announcement] = []
    rc.announce = placed.append
    decision = rc.route(replace(request("a", PROMPT), session_id="alice"))
    assert names.sessions == 1
    alias = Pseudonyms(secret).session("acme\x1falice")
    (announced,) = placed
    assert isinstance(announced, Placed) and announced.session == alias
    assert rc.load.snapshot(decision.replica, 0.0).resting_sessions == 0
    rc.on_complete(decision.replica, RequestId("a"))  # it now rests there, under its alias
    assert rc.load_beside(decision.replica, replace(request("b", PROMPT), session_id="bob")
                          ).resting_sessions == 1
    assert rc.load_beside(decision.replica, replace(request("c", PROMPT), session_id="alice")
                          ).resting_sessions == 0
