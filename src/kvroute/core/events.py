"""KV-cache events as values: what an engine reports about its prefix cache.

These mirror vLLM's ``vllm/distributed/kv_events.py`` (same class and field names, so the two
codebases can be read side by side) but in the router's normal form:

* every block hash is the 64-bit ``WireHash`` (bytes hashes are converted once, at decode);
* ``medium`` keeps the engine's own string (``None``, ``"GPU"``, ``"cpu"``...); consumers map
  it with ``Medium.from_wire``;
* ``EventBatch.seq`` is the publisher's sequence number from the ZMQ frame, not the payload.

They are ``msgspec.Struct`` classes rather than dataclasses because an index applies about a
million of them per second: Structs are several times cheaper to build and need no GC
tracking (``gc=False``; they hold only scalars, tuples and lists of scalars). ``msgspec`` is a
pure library; nothing here does I/O.
"""

from __future__ import annotations

from typing import TypeAlias

import msgspec

from kvroute.core.types import WireHash


class BlockStored(msgspec.Struct, frozen=True, gc=False):
    """Blocks newly cached by one engine step, for one KV-cache group.

    ``block_hashes[i]`` covers ``token_ids[i*block_size:(i+1)*block_size]`` (with a sliding
    window some blocks are skipped and ``token_ids`` can be longer). ``parent_block_hash`` is
    the hash of the block just before the first new one, ``None`` when the run starts at block 0
    (or when vLLM re-announces reused blocks in ``kv_cache_report_mode="full"``).
    """

    block_hashes: tuple[WireHash, ...]
    parent_block_hash: WireHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: tuple[object, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None


class BlockRemoved(msgspec.Struct, frozen=True, gc=False):
    """Cached copies evicted (lazily, when their physical blocks were reallocated).

    vLLM sends one hash per event; each names one physical copy, so consumers decrement a
    reference count rather than deleting the hash outright.
    """

    block_hashes: tuple[WireHash, ...]
    medium: str | None = "GPU"
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, gc=False):
    """The engine reset its prefix cache (``BlockPool.reset_prefix_cache``): forget it all."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, frozen=True, gc=False):
    """One published batch: the events of one engine step, in order.

    ``seq`` starts at 0 per publisher process and increases by one per batch; a reset to a
    lower value means the engine restarted and everything known about it is stale.
    """

    seq: int
    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None
