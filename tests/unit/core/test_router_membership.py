"""RouterCore's replicas joining and leaving at run time (Kubernetes discovery)."""

from __future__ import annotations

import random

import pytest

from kvroute.core.clock import ManualClock
from kvroute.core.errors import ConfigError, NoEligibleReplica
from kvroute.core.events import BlockStored, EventBatch
from kvroute.core.hashing import BlockHasher
from kvroute.core.index import TenantScope
from kvroute.core.peer_policies import make_policy
from kvroute.core.router import PoolSpec, ReplicaSpec, RouterCore, RouteRequest
from kvroute.core.types import PoolName, ReplicaId, RequestId, TenantName, to_wire_hash

POOL = PoolName("k8s")
SCOPE = TenantScope(TenantName("acme"))
PROMPT = list(range(100, 420))


def _core() -> RouterCore:
    rng = random.Random(0)
    return RouterCore([PoolSpec(POOL, ())], lambda: make_policy("kvroute", rng),
                      clock=ManualClock(), dynamic_pools=frozenset({POOL}))


def _request(rid: str) -> RouteRequest:
    return RouteRequest(RequestId(rid), POOL, SCOPE, num_prompt_tokens=len(PROMPT),
                        prompt_token_ids=PROMPT, expected_output_tokens=16)


def _stored() -> EventBatch:
    hashes = BlockHasher("sha256", 16).hash_blocks(PROMPT)
    return EventBatch(seq=0, ts=0.0, events=(BlockStored(
        block_hashes=tuple(to_wire_hash(h) for h in hashes), parent_block_hash=None,
        token_ids=tuple(PROMPT), block_size=16),))


def test_an_empty_pool_needs_to_be_dynamic() -> None:
    rng = random.Random(0)
    with pytest.raises(ConfigError, match="no replicas"):
        RouterCore([PoolSpec(POOL, ())], lambda: make_policy("kvroute", rng), clock=ManualClock())
    with pytest.raises(NoEligibleReplica):
        _core().route(_request("a"))


def test_a_joined_replica_routes_once_healthy_and_a_removed_one_is_forgotten() -> None:
    rc = _core()
    a, b = ReplicaId("pod-a"), ReplicaId("pod-b")
    rc.add_replica(POOL, ReplicaSpec(a))
    assert rc.has_replica(a) and not rc.is_healthy(a)  # discovery brings it in
    with pytest.raises(NoEligibleReplica):
        rc.route(_request("r0"))
    rc.set_healthy(a, True)
    rc.add_replica(POOL, ReplicaSpec(b))
    rc.set_healthy(b, True)
    assert [rep.name for rep in rc.pool(POOL).replicas] == [a, b]
    rc.apply_events(b, _stored())
    first = rc.route(_request("r1"))
    assert first.replica == b and first.expected_cached_tokens > 0
    rc.remove_replica(b)
    assert not rc.has_replica(b)
    assert [rep.name for rep in rc.pool(POOL).replicas] == [a]
    rc.on_complete(b, RequestId("r1"))  # in flight when it left: counted as unknown
    assert rc.load.num_unknown_completions == 1
    second = rc.route(_request("r2"))
    assert second.replica == a and second.expected_cached_tokens == 0  # b's entries are gone
    rc.remove_replica(b)  # twice: no-op
    with pytest.raises(ConfigError, match="already in pool"):
        rc.add_replica(POOL, ReplicaSpec(a))
