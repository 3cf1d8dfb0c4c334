"""Several routers: a peer's fresh placements and load merged into one router's core."""

from __future__ import annotations

import random

import pytest

from kvroute.core.clock import ManualClock
from kvroute.core.index import TenantScope
from kvroute.core.peer_policies import make_policy
from kvroute.core.peers import Announcement, Done, FirstToken, PeerView, Placed
from kvroute.core.router import PoolSpec, ReplicaSpec, RouterCore, RouteRequest
from kvroute.core.types import PoolName, ReplicaId, RequestId, TenantName
from kvroute.wire.peer_announcements import PeerMessageError, decode_batch, encode_batch

POOL = PoolName("p")
ACME = TenantScope(TenantName("acme"))
REPLICAS = tuple(ReplicaSpec(ReplicaId(f"r{i}"), prefill_rate_tps=10_000.0) for i in range(4))
PROMPT = list(range(100, 420))  # 20 blocks of 16


def make_core(clock: ManualClock, seed: int) -> RouterCore:
    rng = random.Random(seed)
    return RouterCore([PoolSpec(POOL, REPLICAS, block_size=16)],
                      lambda: make_policy("kvroute", rng), clock=clock)


def request(rid: str, tokens: list[int], session: str | None = None) -> RouteRequest:
    return RouteRequest(RequestId(rid), POOL, ACME, num_prompt_tokens=len(tokens),
                        prompt_token_ids=tokens, expected_output_tokens=16, session_id=session)


def linked(clock: ManualClock) -> tuple[RouterCore, RouterCore, PeerView, list[Announcement]]:
    """Router a's announcements, carried through the wire codec, into router b."""
    a, b = make_core(clock, 1), make_core(clock, 2)
    sent: list[Announcement] = []
    a.announce = sent.append
    return a, b, PeerView(b, clock=clock, expiry_s=3.0), sent


def carry(view: PeerView, sent: list[Announcement], seq: int = 1) -> None:
    batch = decode_batch(encode_batch("a", seq, sent))
    view.apply(batch.sender, batch.announcements())
    sent.clear()


def test_a_sibling_at_another_router_lands_where_the_first_was_placed() -> None:
    clock = ManualClock()
    a, b, view, sent = linked(clock)
    first = a.route(request("x", PROMPT + [1]))
    carry(view, sent)
    sibling = b.route(request("y", PROMPT + [2]))
    assert sibling.replica == first.replica
    assert sibling.expected_cached_tokens == 320
    # Without the merge, router b would have seen no prefix anywhere.
    lone = make_core(clock, 2).route(request("y", PROMPT + [2]))
    assert lone.expected_cached_tokens == 0


def test_a_peers_requests_count_as_load_until_they_end() -> None:
    clock = ManualClock()
    a, b, view, sent = linked(clock)
    d = a.route(request("x", PROMPT))
    carry(view, sent)
    load = b.load.snapshot(d.replica, clock.now())
    assert load.num_in_flight == 1 and load.outstanding_prefill_tokens == 320
    a.on_first_token(d.replica, RequestId("x"))
    carry(view, sent, 2)
    assert b.load.snapshot(d.replica, clock.now()).num_decoding == 1
    a.on_complete(d.replica, RequestId("x"), output_tokens=16)
    carry(view, sent, 3)
    assert b.load.snapshot(d.replica, clock.now()).num_in_flight == 0
    assert view.in_flight("a") == 0 and view.stats.num_applied == 3


def test_a_silent_peers_load_vanishes_at_expiry_and_not_before() -> None:
    clock = ManualClock()
    a, b, view, sent = linked(clock)
    d = a.route(request("x", PROMPT))
    carry(view, sent)
    clock.advance(2.9)
    assert view.expire() == []
    assert b.load.snapshot(d.replica).num_in_flight == 1
    clock.advance(0.2)
    assert view.expire() == ["a"]
    assert b.load.snapshot(d.replica).num_in_flight == 0
    assert view.stats.num_expired_requests == 1 and view.peers() == []


def test_a_heartbeat_keeps_a_peer_alive() -> None:
    clock = ManualClock()
    a, b, view, sent = linked(clock)
    d = a.route(request("x", PROMPT))
    carry(view, sent)
    for seq in range(2, 6):
        clock.advance(1.0)
        carry(view, [], seq)
        assert view.expire() == []
    assert b.load.snapshot(d.replica).num_in_flight == 1


def test_a_retry_moves_the_peers_load_with_it() -> None:
    clock = ManualClock()
    a, b, view, sent = linked(clock)
    d = a.route(request("x", PROMPT))
    moved = a.reroute(d, d.replica)
    assert moved is not None
    carry(view, sent)
    assert b.load.snapshot(d.replica).num_in_flight == 0
    assert b.load.snapshot(moved.replica).num_in_flight == 1


def test_unknown_requests_and_replicas_are_counted_not_applied() -> None:
    clock = ManualClock()
    _, b, view, _ = linked(clock)
    view.apply("a", [FirstToken("nope", ReplicaId("r0")), Done("nope", ReplicaId("r0")),
                     Placed("z", ReplicaId("elsewhere"), 10, 10, 4)])
    assert view.stats.num_unknown == 2 and view.stats.num_unknown_replica == 1
    assert view.stats.num_applied == 0
    # A repeated placement counts once.
    twice = Placed("y", ReplicaId("r1"), 10, 10, 4)
    view.apply("a", [twice, twice])
    assert b.load.snapshot(ReplicaId("r1")).num_in_flight == 1


def test_requests_held_per_peer_are_bounded() -> None:
    clock = ManualClock()
    b = make_core(clock, 2)
    view = PeerView(b, clock=clock, expiry_s=3.0, max_requests_per_peer=2)
    view.apply("a", [Placed(str(i), ReplicaId("r0"), 10, 10, 4) for i in range(5)])
    assert view.in_flight("a") == 2 and view.stats.num_evicted == 3
    assert b.load.snapshot(ReplicaId("r0")).num_in_flight == 2


def test_garbage_on_the_subject_is_a_clear_error() -> None:
    with pytest.raises(PeerMessageError, match="not a kvroute peer batch"):
        decode_batch(b"\x93\x01\x02")
    with pytest.raises(PeerMessageError):
        decode_batch(encode_batch("", 1, []))


def test_bad_settings_are_refused() -> None:
    clock = ManualClock()
    with pytest.raises(ValueError, match="expiry_s"):
        PeerView(make_core(clock, 0), clock=clock, expiry_s=0)
