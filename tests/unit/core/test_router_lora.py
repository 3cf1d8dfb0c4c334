"""RouterCore with LoRA adapters: vLLM's extra key, listing and adapter slots."""

from __future__ import annotations

import random

import pytest

from kvroute.core.clock import ManualClock
from kvroute.core.errors import NoEligibleReplica
from kvroute.core.events import BlockStored, EventBatch
from kvroute.core.hashing import BlockHasher, LoraKey
from kvroute.core.index import TenantScope
from kvroute.core.peer_policies import make_policy
from kvroute.core.router import AdapterSlots, PoolSpec, ReplicaSpec, RouterCore, RouteRequest
from kvroute.core.types import PoolName, ReplicaId, RequestId, TenantName, to_wire_hash

POOL = PoolName("p")
ACME = TenantScope(TenantName("acme"))
R0, R1, R2 = (ReplicaId(f"r{i}") for i in range(3))
PROMPT = list(range(100, 420))  # 20 blocks of 16
AD = LoraKey("ad1", "/adapters/ad1")


def core() -> RouterCore:
    rng = random.Random(0)
    return RouterCore([PoolSpec(POOL, tuple(ReplicaSpec(r) for r in (R0, R1, R2)),
                                block_size=16)],
                      lambda: make_policy("kvroute", rng), clock=ManualClock())


def request(rid: str, lora: LoraKey | None) -> RouteRequest:
    return RouteRequest(RequestId(rid), POOL, ACME, num_prompt_tokens=len(PROMPT),
                        prompt_token_ids=PROMPT, lora=lora, expected_output_tokens=16)


def stored(lora: LoraKey | None) -> EventBatch:
    hashes = BlockHasher("sha256", 16).hash_blocks(PROMPT, lora=lora)
    return EventBatch(seq=0, ts=0.0, events=(BlockStored(
        block_hashes=tuple(to_wire_hash(h) for h in hashes), parent_block_hash=None,
        token_ids=tuple(PROMPT), block_size=16,
        lora_name=None if lora is None else lora.name),))


def test_the_adapter_enters_the_hash_as_vllm_extra_key() -> None:
    rc = core()
    for r in (R0, R1, R2):
        rc.set_replica_adapters(r, {"ad1": "/adapters/ad1"})
    rc.apply_events(R1, stored(None))  # the base model's blocks of the same tokens
    rc.apply_events(R2, stored(AD))
    decision = rc.route(request("a", AD))
    assert decision.replica == R2
    assert decision.expected_cached_tokens == 304  # a hit never covers the last token
    expected = BlockHasher("sha256", 16).wire_hashes(PROMPT, lora=AD)
    assert list(decision.block_hashes) == expected
    assert rc.route(request("b", None)).replica == R1


def test_only_replicas_listing_the_adapter_at_that_path_are_candidates() -> None:
    rc = core()
    rc.set_replica_adapters(R0, {"ad1": "/adapters/ad1"})
    rc.set_replica_adapters(R1, {"ad1": "/other/ad1"})
    rc.set_replica_adapters(R2, {"ad2": "/adapters/ad2"})
    assert rc.lora_key(POOL, "ad1") == LoraKey("ad1", "/adapters/ad1")  # tie: smaller path
    assert rc.lora_key(POOL, "ad3") is None
    assert rc.adapter_pools("ad2") == [POOL] and rc.adapter_pools("ad3") == []
    for i in range(5):
        assert rc.route(request(f"x{i}", AD)).replica == R0
    with pytest.raises(NoEligibleReplica, match="ad1"):
        rc.route(RouteRequest(RequestId("y"), POOL, ACME, num_prompt_tokens=len(PROMPT),
                              prompt_token_ids=PROMPT, lora=AD, exclude=frozenset({R0})))


def test_a_replica_whose_adapter_slots_are_taken_is_used_only_when_all_are() -> None:
    rc = core()
    for r in (R0, R1):
        rc.set_replica_adapters(r, {"ad1": "/adapters/ad1", "ad2": "/adapters/ad2"})
    rc.apply_events(R0, stored(AD))  # R0 holds the prefix...
    rc.set_adapter_slots(R0, AdapterSlots(running=frozenset({"ad2"}), max_lora=1))  # ...no slot
    rc.set_adapter_slots(R1, AdapterSlots(max_lora=1))
    assert rc.route(request("a", AD)).replica == R1
    # The router's own request "a" now holds R1's only slot, so ad2 fits only where it runs.
    ad2 = LoraKey("ad2", "/adapters/ad2")
    assert rc.route(request("b", ad2)).replica == R0
    # Every slot taken by other adapters: the rule steps aside and the cost decides.
    ad3 = LoraKey("ad3", "/adapters/ad3")
    for r in (R0, R1):
        rc.set_replica_adapters(r, {"ad1": "/adapters/ad1", "ad2": "/adapters/ad2",
                                    "ad3": "/adapters/ad3"})
    assert rc.route(request("c", ad3)).replica in {R0, R1}


def test_with_a_free_slot_the_cached_prefix_wins() -> None:
    rc = core()
    for r in (R0, R1):
        rc.set_replica_adapters(r, {"ad1": "/adapters/ad1"})
    rc.apply_events(R0, stored(AD))
    rc.set_adapter_slots(R0, AdapterSlots(running=frozenset({"ad2"}), max_lora=2))
    rc.set_adapter_slots(R1, AdapterSlots(running=frozenset({"ad1"}), max_lora=2))
    assert rc.route(request("a", AD)).replica == R0


def test_in_flight_adapters_are_released_on_completion() -> None:
    rc = core()
    for r in (R0, R1):
        rc.set_replica_adapters(r, {"ad1": "/adapters/ad1", "ad2": "/adapters/ad2"})
        rc.set_adapter_slots(r, AdapterSlots(max_lora=1))
    first = rc.route(request("a", AD))
    ad2 = LoraKey("ad2", "/adapters/ad2")
    assert rc.route(request("b", ad2)).replica != first.replica  # ad1 holds that slot
    rc.on_complete(first.replica, RequestId("a"))
    rc.on_complete(ReplicaId("r1" if first.replica == R0 else "r0"), RequestId("b"))
    # Both slots free again: every replica is a candidate for ad2.
    seen = {rc.route(request(f"c{i}", ad2)).replica for i in range(1)}
    assert seen <= {R0, R1}


def test_declared_adapters_are_configured_per_pool() -> None:
    from kvroute.config import ConfigError, parse_config

    def cfg(adapters: object) -> object:
        return parse_config({
            "pools": {"p": {"model": "m", "lora_adapters": adapters,
                            "replicas": [{"name": "r", "url": "http://127.0.0.1:1"}]}},
            "routes": {"a": {"pools": ["p"]}}}, env={})

    assert dict(cfg({"sql": "/a/sql"}).pools["p"].lora_adapters) == {  # type: ignore[attr-defined]
        "sql": "/a/sql"}
    with pytest.raises(ConfigError, match="names the pool's own model"):
        cfg({"m": "/a/m"})
    with pytest.raises(ConfigError, match="lora_adapters.sql"):
        cfg({"sql": 3})
