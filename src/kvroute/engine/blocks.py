"""The paged KV-block pool of one simulated vLLM engine, with its prefix cache and KV events.

Owns the physical blocks of one engine: their reference counts, the free-block queue that
doubles as the LRU eviction order, the map from block hash to cached physical blocks, and the
queue of KV events those changes produce. It mirrors vLLM v1's ``BlockPool``
(``vllm/v1/core/block_pool.py``) and the full-attention part of ``KVCacheManager`` /
``SingleTypeKVCacheManager`` closely enough that everything a router can observe (events,
hit lengths, eviction order, usage) is the same; it does not copy their code.

Pure: no I/O, no clock. Must not import ``shell``, ``sim`` or ``wire``.

Theory of operation (the vLLM v1 rules this reproduces):

* Block 0 is vLLM's *null block*: reserved at start-up, never allocated, never free. So an
  engine with ``num_gpu_blocks = N`` can hold ``N - 1`` blocks of KV, and usage is
  ``1 - free / (N - 1)``.
* A block is either in use (``ref_cnt > 0``, held by one or more requests) or in the free
  queue (``ref_cnt == 0``). Free blocks keep their hash: they are still a cache hit until
  the block is reallocated. Eviction is therefore *lazy*: ``BlockRemoved`` is emitted only when
  a free cached block is popped for reuse.
* The free queue is the LRU order. Allocation pops from the head; freed blocks are appended
  to the tail, a request's blocks in *reverse* order, so the tail of a prompt (the least
  shareable part) is evicted before its head. A prefix hit on a free block takes it out of
  the queue (``touch``); it goes back to the tail when its last user frees it.
* The cache is not de-duplicated: two requests that compute the same block (concurrently, or
  because a fully cached prompt recomputes its last block) cache two physical copies under one
  hash, and each copy gets its own ``BlockStored`` and, later, its own ``BlockRemoved``.
  Lookups return the oldest surviving copy.
* ``BlockStored`` is emitted when blocks become full *as scheduled*: at allocation time, for the
  full blocks the step will have computed, exactly as vLLM's ``allocate_slots`` caches them.

NOTE: the free queue is an ``OrderedDict`` keyed by block id rather than vLLM's hand-made
doubly linked list: it gives the same O(1) pop-head / append-tail / remove-middle in C. A
plain ``dict`` was rejected because popping its first key repeatedly degrades to O(n) until
the table is rebuilt.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final

from kvroute.core.errors import ConfigError
from kvroute.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvroute.core.types import BlockHash, WireHash

NULL_BLOCK_ID: Final = 0
MEDIUM_GPU: Final = "GPU"
KV_CACHE_SPEC_KIND: Final = "full_attention"

_ExtraKeys = tuple[object, ...] | None


class BlockPool:
    """Physical KV blocks, the free/LRU queue, the hash → blocks map and the event queue.

    Invariants (checked by ``check_invariants`` in tests):
        * every block id ``1..num_gpu_blocks-1`` is in the free queue iff its ``ref_cnt`` is 0;
          ``ref_cnt`` never goes below 0; the null block is never free and never cached;
        * a block has a hash iff it is registered under that hash in the cached map;
        * ``num_free_blocks + num_used_blocks == capacity`` (``num_gpu_blocks - 1``).

    Block ids are plain ints and the per-block state lives in parallel lists: a simulation
    allocates and frees hundreds of millions of blocks, and an object per block would cost
    several times more in attribute access and memory.
    """

    __slots__ = (
        "_cached",
        "_events",
        "_free",
        "_hash",
        "_ref_cnt",
        "_wire",
        "block_size",
        "num_gpu_blocks",
    )

    def __init__(self, num_gpu_blocks: int, block_size: int) -> None:
        """Create a pool of ``num_gpu_blocks`` blocks (one of them the reserved null block).

        Raises:
            ConfigError: ``num_gpu_blocks`` < 2 or ``block_size`` < 1.
        """
        if num_gpu_blocks < 2:
            raise ConfigError(
                f"num_gpu_blocks={num_gpu_blocks} is too small: vLLM reserves one null block, "
                "so at least 2 are needed; give the engine more KV blocks"
            )
        if block_size < 1:
            raise ConfigError(f"block_size={block_size} must be a positive number of tokens")
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self._ref_cnt: list[int] = [0] * num_gpu_blocks
        self._hash: list[BlockHash | None] = [None] * num_gpu_blocks
        self._wire: list[WireHash] = [WireHash(0)] * num_gpu_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_gpu_blocks))
        # hash -> one block id, or an insertion-ordered dict of block ids when copies exist.
        self._cached: dict[BlockHash, int | dict[int, None]] = {}
        self._events: list[KVEvent] = []

    # ------------------------------------------------------------------ queries

    @property
    def capacity(self) -> int:
        """Blocks that can hold KV: all but the null block."""
        return self.num_gpu_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no user (cached or not); what an allocation may take."""
        return len(self._free)

    def usage(self) -> float:
        """``vllm:kv_cache_usage_perc``: the fraction of blocks held by requests, 0..1."""
        return 1.0 - len(self._free) / (self.num_gpu_blocks - 1)

    def ref_cnt(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._hash[block_id]

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """The oldest cached copy of ``block_hash``, or ``None`` on a miss."""
        entry = self._cached.get(block_hash)
        if entry is None or isinstance(entry, int):
            return entry
        return next(iter(entry))

    def num_cached_copies(self, block_hash: BlockHash) -> int:
        entry = self._cached.get(block_hash)
        if entry is None:
            return 0
        return 1 if isinstance(entry, int) else len(entry)

    def cached_copies(self) -> dict[BlockHash, int]:
        """Every cached hash with its number of physical copies (for tests and metrics)."""
        return {h: (1 if isinstance(e, int) else len(e)) for h, e in self._cached.items()}

    def free_queue_order(self) -> list[int]:
        """Block ids in eviction order (head first)."""
        return list(self._free)

    # ------------------------------------------------------------------ changes

    def touch(self, block_ids: list[int]) -> None:
        """Take prefix-hit blocks for one more user; free ones leave the eviction queue."""
        ref = self._ref_cnt
        free = self._free
        for b in block_ids:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Pop ``num_blocks`` blocks from the head of the free queue, evicting cached ones.

        The caller has checked ``num_free_blocks``. Each evicted cached block produces one
        ``BlockRemoved`` (lazy eviction, as vLLM's ``_maybe_evict_cached_block``).
        """
        if num_blocks > len(self._free):
            raise AssertionError(
                f"allocation of {num_blocks} blocks with only {len(self._free)} free: "
                "the caller must check num_free_blocks first"
            )
        popitem = self._free.popitem
        ref = self._ref_cnt
        hashes = self._hash
        cached = self._cached
        wire = self._wire
        emit = self._events.append
        out: list[int] = []
        append = out.append
        # NOTE: eviction is inlined (one call per block in a simulation that evicts millions)
        # and BlockRemoved is built positionally (hashes, medium, group_idx).
        for _ in range(num_blocks):
            b = popitem(last=False)[0]
            h = hashes[b]
            if h is not None:
                entry = cached[h]
                if entry.__class__ is int:
                    if entry != b:
                        raise AssertionError(f"block {b} has a hash the cache maps to {entry}")
                    del cached[h]
                else:
                    del entry[b]  # type: ignore[union-attr]
                    if not entry:
                        del cached[h]
                hashes[b] = None
                emit(BlockRemoved((wire[b],), MEDIUM_GPU, 0))
            ref[b] = 1
            append(b)
        return out

    def cache_full_blocks(
        self,
        block_ids: list[int],
        block_hashes: list[BlockHash],
        wire_hashes: list[WireHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        token_ids: list[int],
        *,
        lora_name: str | None,
        cache_salt: str | None,
        lora_id: int | None = None,
    ) -> None:
        """Register blocks ``[num_cached_blocks, num_full_blocks)`` of a request as cached.

        Emits one ``BlockStored`` covering them, whose ``parent_block_hash`` is the hash of
        block ``num_cached_blocks - 1`` (``None`` from block 0) and whose ``extra_keys`` are
        vLLM's untagged per-block keys: ``(lora_name, salt)`` on block 0, ``(lora_name,)``
        after it, the salt alone without LoRA, ``None`` for a block with no keys.

        Args:
            block_ids: the request's blocks, in token order.
            block_hashes / wire_hashes: the request's full-block hashes (raw and 64-bit).
            token_ids: the request's whole token sequence (prompt + output).
        """
        if num_cached_blocks >= num_full_blocks:
            return
        cached = self._cached
        hashes = self._hash
        wire = self._wire
        for i in range(num_cached_blocks, num_full_blocks):
            b = block_ids[i]
            h = block_hashes[i]
            if hashes[b] is not None:
                raise AssertionError(f"block {b} is cached twice")
            hashes[b] = h
            wire[b] = wire_hashes[i]
            entry = cached.get(h)
            if entry is None:
                cached[h] = b
            elif isinstance(entry, int):
                cached[h] = {entry: None, b: None}
            else:
                entry[b] = None
        extra = _event_keys(num_cached_blocks, num_full_blocks, lora_name, cache_salt)
        bs = self.block_size
        self._events.append(
            BlockStored(
                block_hashes=tuple(wire_hashes[num_cached_blocks:num_full_blocks]),
                parent_block_hash=(
                    None if num_cached_blocks == 0 else wire_hashes[num_cached_blocks - 1]
                ),
                token_ids=tuple(token_ids[num_cached_blocks * bs : num_full_blocks * bs]),
                block_size=bs,
                lora_id=lora_id,
                medium=MEDIUM_GPU,
                lora_name=lora_name,
                extra_keys=extra,
                group_idx=0,
                kv_cache_spec_kind=KV_CACHE_SPEC_KIND,
            )
        )

    def emit_cached(
        self,
        wire_hashes: list[WireHash],
        token_ids: list[int],
        *,
        lora_name: str | None,
        lora_id: int | None,
        cache_salt: str | None,
    ) -> None:
        """vLLM's ``emit_cached_block_events`` (``kv_cache_report_mode: "full"``): one
        ``BlockStored`` for a request's prefix hit, blocks ``0..len(wire_hashes)-1``, parent
        ``None``, tokens from position 0. Changes no block's state."""
        n = len(wire_hashes)
        if n == 0:
            return
        bs = self.block_size
        self._events.append(
            BlockStored(
                block_hashes=tuple(wire_hashes),
                parent_block_hash=None,
                token_ids=tuple(token_ids[: n * bs]),
                block_size=bs,
                lora_id=lora_id,
                medium=MEDIUM_GPU,
                lora_name=lora_name,
                extra_keys=_event_keys(0, n, lora_name, cache_salt),
                group_idx=0,
                kv_cache_spec_kind=KV_CACHE_SPEC_KIND,
            )
        )

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drop one user of each block of a request; blocks left unused join the LRU tail.

        ``block_ids`` is in token order; they are released in *reverse* order so that a
        prompt's last blocks are evicted first (vLLM's ``SingleTypeKVCacheManager.free``).
        """
        ref = self._ref_cnt
        free = self._free
        for b in reversed(block_ids):
            r = ref[b] - 1
            if r < 0:
                raise AssertionError(f"block {b} freed more often than it was taken")
            ref[b] = r
            if r == 0:
                free[b] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, as vLLM's ``BlockPool.reset_prefix_cache``.

        Succeeds, and queues ``AllBlocksCleared``, only when no block is in use (vLLM
        refuses while requests hold blocks, because their blocks would lose their hashes).

        Returns:
            True when the cache was reset.
        """
        if len(self._free) != self.num_gpu_blocks - 1:
            return False
        self._cached.clear()
        self._hash = [None] * self.num_gpu_blocks
        self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """Return and clear the events queued since the last call, oldest first."""
        events = self._events
        self._events = []
        return events

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first inconsistency found (tests only: O(n))."""
        if NULL_BLOCK_ID in self._free or self._hash[NULL_BLOCK_ID] is not None:
            raise AssertionError("the null block is free or cached")
        for b in range(1, self.num_gpu_blocks):
            r = self._ref_cnt[b]
            if r < 0:
                raise AssertionError(f"block {b} has ref_cnt {r}")
            if (r == 0) != (b in self._free):
                raise AssertionError(f"block {b} has ref_cnt {r} but free-queue membership "
                                     f"{b in self._free}")
            h = self._hash[b]
            if h is not None:
                entry = self._cached.get(h)
                members = {entry} if isinstance(entry, int) else set(entry or ())
                if b not in members:
                    raise AssertionError(f"block {b} has a hash the cached map does not list")
        for h, entry in self._cached.items():
            ids = [entry] if isinstance(entry, int) else list(entry)
            if not ids:
                raise AssertionError("an empty copy set is left in the cached map")
            for b in ids:
                if self._hash[b] != h:
                    raise AssertionError(f"cached map lists block {b} under a hash it lacks")
        used = sum(1 for b in range(1, self.num_gpu_blocks) if self._ref_cnt[b] > 0)
        if used + len(self._free) != self.capacity:
            raise AssertionError(
                f"{used} used + {len(self._free)} free != capacity {self.capacity}"
            )


def _event_keys(first: int, end: int, lora_name: str | None,
                cache_salt: str | None) -> tuple[_ExtraKeys, ...]:
    """vLLM's untagged per-block event keys of blocks ``[first, end)``: ``(lora_name, salt)``
    on block 0, ``(lora_name,)`` after it, the salt alone without LoRA, ``None`` for a block
    with no keys."""
    if lora_name is None and not cache_salt:
        return (None,) * (end - first)
    later: _ExtraKeys = (lora_name,) if lora_name is not None else None
    keys = [later] * (end - first)
    if first == 0 and cache_salt:
        keys[0] = (lora_name, cache_salt) if lora_name is not None else (cache_salt,)
    return tuple(keys)
