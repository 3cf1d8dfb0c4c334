"""Several routers: a peer's fresh placements and load merged into one router's core."""

from __future__ import annotations

import math
import random

import msgspec
import pytest

from kvroute.core.clock import ManualClock
from kvroute.core.index import TenantScope
from kvroute.core.load import RateSample
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


def _rates(core: RouterCore) -> dict[ReplicaId, float]:
    """The learned prefill rates (without the decay toward the configured rate since)."""
    return {spec.name: core.load.snapshot(spec.name).prefill_rate_tps for spec in REPLICAS}


def test_a_peers_first_token_teaches_the_rate_exactly_as_the_local_one() -> None:
    clock = ManualClock()
    a, b, view, sent = linked(clock)
    d = a.route(request("x", PROMPT))
    carry(view, sent)
    clock.advance(0.1)  # 320 tokens in 0.1 s: a sample of 3,200 tokens/s, against 10,000
    a.on_first_token(d.replica, RequestId("x"))
    first = sent[0]
    assert isinstance(first, FirstToken) and first.rate_sample == RateSample(320, 0.1)
    clock.advance(0.3)  # arrival time is not the origin's: the sample is
    carry(view, sent, 2)
    learned = _rates(a)
    assert learned[d.replica] == pytest.approx(10_000 + 0.2 * (3_200 - 10_000))
    assert _rates(b) == learned
    assert view.stats.num_rate_samples == 1 and view.stats.num_bad_samples == 0


def test_a_first_token_without_a_sample_teaches_nothing() -> None:
    # a peer of the version before samples sends ["f", id, replica]; a split's decode half
    # and a short prefill send no sample either
    clock = ManualClock()
    a, b, view, sent = linked(clock)
    d = a.route(request("x", PROMPT))
    carry(view, sent)
    clock.advance(0.1)
    old = msgspec.msgpack.encode({"from": "a", "seq": 2, "items": [["f", "x", d.replica]]})
    batch = decode_batch(old)
    view.apply(batch.sender, batch.announcements())
    assert batch.announcements() == [FirstToken("x", d.replica)]
    assert b.load.snapshot(d.replica, clock.now()).num_decoding == 1  # the news still counts
    assert set(_rates(b).values()) == {10_000.0}
    assert view.stats.num_rate_samples == view.stats.num_bad_samples == 0
    e = a.route(request("y", PROMPT + [5]))
    clock.advance(0.1)
    a.on_first_token(e.replica, RequestId("y"), learn=False)
    assert sent[-1] == FirstToken("y", e.replica)


class OldFirstToken(msgspec.Struct, array_like=True, tag="f"):
    """A first token as the version before rate samples reads it."""

    request_id: str
    replica: str


class OldBatch(msgspec.Struct, rename={"sender": "from"}):
    sender: str
    seq: int
    items: list[OldFirstToken] = []
    bye: bool = False


def test_an_older_reader_skips_the_sample() -> None:
    data = encode_batch("a", 1, [FirstToken("x", ReplicaId("r1"), RateSample(320, 0.1))])
    assert msgspec.msgpack.decode(data, type=OldBatch).items == [OldFirstToken("x", "r1")]


@pytest.mark.parametrize("sample", [RateSample(-320, 0.1), RateSample(320, math.nan),
                                    RateSample(320, math.inf), RateSample(320, 0.0),
                                    RateSample(320, -0.1)])
def test_a_garbage_sample_is_refused_and_counted_not_raised(sample: RateSample) -> None:
    clock = ManualClock()
    a, b, view, sent = linked(clock)
    d = a.route(request("x", PROMPT))
    carry(view, sent)
    clock.advance(0.1)
    batch = decode_batch(encode_batch("a", 2, [FirstToken("x", d.replica, sample)]))
    view.apply(batch.sender, batch.announcements())
    assert view.stats.num_bad_samples == 1 and view.stats.num_rate_samples == 0
    assert set(_rates(b).values()) == {10_000.0}
    assert b.load.snapshot(d.replica, clock.now()).num_decoding == 1
    with pytest.raises(ValueError, match="rate sample"):
        b.load.learn_rate(d.replica, sample, now_s=clock.now())


def test_a_sample_of_the_wrong_type_on_the_wire_is_a_clear_error() -> None:
    bad = msgspec.msgpack.encode({"from": "a", "seq": 1,
                                  "items": [["f", "x", "r1", 320, "fast"]]})
    with pytest.raises(PeerMessageError):
        decode_batch(bad)


def _itl_scales(core: RouterCore) -> dict[ReplicaId, float]:
    return {spec.name: core.load.snapshot(spec.name).itl_scale for spec in REPLICAS}


def test_a_peers_end_teaches_the_inter_token_factor_exactly_as_the_local_one() -> None:
    clock = ManualClock()
    a, b, view, sent = linked(clock)
    d = a.route(request("x", PROMPT))
    clock.advance(0.1)
    a.on_first_token(d.replica, RequestId("x"))
    carry(view, sent)
    clock.advance(2.0)  # 64 tokens in 2 s: far slower than the step model
    a.on_complete(d.replica, RequestId("x"), output_tokens=64)
    end = sent[0]
    assert isinstance(end, Done) and end.itl_sample is not None and end.itl_sample > 1.0
    clock.advance(0.5)  # when the news arrives does not enter it
    carry(view, sent, 2)
    learned = _itl_scales(a)
    assert learned[d.replica] > 1.0
    assert _itl_scales(b) == learned
    assert view.stats.num_itl_samples == 1 and view.stats.num_bad_samples == 0


def test_an_end_without_a_sample_teaches_no_inter_token_factor() -> None:
    clock = ManualClock()
    a, b, view, sent = linked(clock)
    d = a.route(request("x", PROMPT))
    clock.advance(0.1)
    a.on_first_token(d.replica, RequestId("x"))
    carry(view, sent)
    clock.advance(2.0)
    old = msgspec.msgpack.encode({"from": "a", "seq": 2,
                                  "items": [["d", "x", d.replica, 64]]})  # the version before
    batch = decode_batch(old)
    assert batch.announcements() == [Done("x", d.replica, 64)]
    view.apply(batch.sender, batch.announcements())
    assert set(_itl_scales(b).values()) == {1.0}
    assert b.load.snapshot(d.replica).num_in_flight == 0
    assert view.stats.num_itl_samples == view.stats.num_bad_samples == 0


@pytest.mark.parametrize("sample", [-1.0, math.nan, math.inf])
def test_a_garbage_inter_token_sample_is_refused_and_counted_not_raised(sample: float) -> None:
    clock = ManualClock()
    a, b, view, sent = linked(clock)
    d = a.route(request("x", PROMPT))
    clock.advance(0.1)
    a.on_first_token(d.replica, RequestId("x"))
    carry(view, sent)
    batch = decode_batch(encode_batch("a", 2, [Done("x", d.replica, 64, sample)]))
    view.apply(batch.sender, batch.announcements())
    assert view.stats.num_bad_samples == 1 and view.stats.num_itl_samples == 0
    assert set(_itl_scales(b).values()) == {1.0}
    assert b.load.snapshot(d.replica).num_in_flight == 0
    with pytest.raises(ValueError, match="inter-token sample"):
        b.load.learn_itl_scale(d.replica, sample)
