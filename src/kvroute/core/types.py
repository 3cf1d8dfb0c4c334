"""The shared vocabulary of kvroute: identifiers, hash forms and media.

Owns only names and tiny value types; no behaviour lives here, so every other module can
import it without cycles.

Hash forms, as vLLM names them (``vllm/v1/core/kv_cache_utils.py``):

* ``BlockHash``: the raw digest of one block (32 bytes for sha256*, 16 for xxhash*).
* ``WireHash``: the 64-bit form vLLM puts in KV events by default: the *last* 8 bytes of the
  digest read big-endian, unsigned (``int.from_bytes(digest, "big") & (2**64 - 1)``).
  The prefix index is keyed by this form because it is what every engine reports, it is a
  small int (cheap to store), and a digest converts to it losslessly for comparison.
"""

from __future__ import annotations

import enum
from typing import NewType

ReplicaId = NewType("ReplicaId", str)
"""The operator-given name of one engine replica (``s0``, ``large-1``); unique in a router."""

PoolName = NewType("PoolName", str)
"""The name of a pool: a set of replicas serving the same model with the same window."""

TenantName = NewType("TenantName", str)
"""The name of a tenant, resolved from its API key."""

RequestId = NewType("RequestId", str)

BlockHash = NewType("BlockHash", bytes)
"""Raw digest of one full block, exactly as vLLM computes it."""

WireHash = NewType("WireHash", int)
"""64-bit unsigned wire form of a block hash: the last 8 bytes of the digest, big-endian."""

WIRE_HASH_MASK = (1 << 64) - 1


def to_wire_hash(value: bytes | int) -> WireHash:
    """Return the 64-bit wire form of a hash given as raw digest bytes or as an int.

    vLLM sends ints by default and raw bytes when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``;
    both become the same key here, so an index never depends on the engine's setting.
    """
    if isinstance(value, int):
        return WireHash(value & WIRE_HASH_MASK)
    return WireHash(int.from_bytes(value[-8:], "big"))


class Medium(enum.IntEnum):
    """Where a cached block lives. Ordered from most to least useful for a prefill.

    vLLM reports ``"GPU"`` for the device pool (even on the CPU backend), ``"CPU"`` for host
    offload and ``"STORAGE"`` for disk tiers; third-party connectors use other spellings.
    """

    GPU = 0
    CPU = 1
    STORAGE = 2

    @classmethod
    def from_wire(cls, value: str | None) -> Medium:
        """Map an event's ``medium`` string to a medium.

        ``None`` (older vLLM events) means the device pool. Known spellings are matched
        case-insensitively (the Mooncake store sends ``"cpu"``). Anything unrecognised is
        treated as ``STORAGE``, the tier with the least routing credit: an unknown tier must
        never attract traffic as if it were on the GPU.
        """
        if value is None:
            return cls.GPU
        key = value.strip().upper()
        if key in ("GPU", "DEVICE", "HBM"):
            return cls.GPU
        if key in ("CPU", "HOST", "DRAM"):
            return cls.CPU
        return cls.STORAGE


MEDIA: tuple[Medium, ...] = (Medium.GPU, Medium.CPU, Medium.STORAGE)
