"""Rendezvous (highest-random-weight) ranks: one order of replicas per key, the same in every
process.

Why: several routers place requests without hearing each other's choices for a moment. When
siblings of one new prompt reach different routers at that moment and every replica costs
the same, a tie broken by each router's own history (least recently chosen) or its own
random draw splits them. Broken by a weight that depends only on the prompt's first block
hash and the replica's name, every router picks the same replica for them, while prompts
that begin differently land on different replicas as if drawn at random (the property of
rendezvous hashing: each replica is first for ``1/R`` of the keys, and removing one replica
moves only the keys it was first for).

The weight is keyed BLAKE2b, not Python's ``hash`` (salted per process for strings). The key
is a wire block hash, which already carries the tenant's cache salt when the pool salts
(``core/hashing.py``), so two tenants' identical prompts weigh the replicas differently.
"""

from __future__ import annotations

from hashlib import blake2b

from kvroute.core.types import WIRE_HASH_MASK, ReplicaId, WireHash

__all__ = ["rendezvous_weight"]


def rendezvous_weight(key: WireHash, replica: ReplicaId) -> int:
    """The weight of ``replica`` for ``key``: a 64-bit integer, the same in every process and
    on every machine; the replica with the highest weight is the key's first choice.

    Example: ``max(replicas, key=lambda r: rendezvous_weight(key, r))``.
    """
    digest = blake2b(replica.encode(), digest_size=8,
                     key=(int(key) & WIRE_HASH_MASK).to_bytes(8, "big"))
    return int.from_bytes(digest.digest(), "big")
