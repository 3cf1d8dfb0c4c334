"""A KV tier below an engine's device blocks: vLLM's native CPU offloading, or a shared store.

Owns the blocks one tier holds, their LRU order, and the KV events their changes produce. It
behaves as vLLM 0.32's ``OffloadingConnector`` with the CPU spec does, in what a router can
observe (``vllm/v1/kv_offload/cpu``, ``.../kv_connector/v1/offloading``; read, not copied):

* **Write-through.** Every block the engine computes and caches is stored in the tier too
  (the connector stores full blocks as requests compute them, not on eviction), so the tier
  holds the most recent ``capacity`` blocks whatever the device cache dropped.
* **Its own LRU.** A store of a block the tier already holds, and a load, make it most recent;
  a store into a full tier evicts the least recent block.
* **Events with the tier's medium.** A newly stored run of blocks is one ``BlockStored`` with
  ``medium="CPU"`` (or ``"STORAGE"``) and its own parent hash; an evicted block is one
  ``BlockRemoved`` with the same medium.
* **Loads at a bandwidth.** A waiting request whose prefix continues in the tier after its
  device hit loads those blocks (``lookup`` then ``load``); they count as computed tokens and
  cost ``load_s_per_block`` each. The engine model adds the load to its step (the transfer on
  the critical path; vLLM overlaps it with other requests' compute, so the model is a little
  pessimistic for the tier).

A store shared by several engines (LMCache-like) is one ``OffloadTier`` given to each of
them: any engine's store is every engine's hit. Its events describe the store, not one engine;
``sim/fleet.py`` delivers them under every replica that reads it.

Pure: no I/O, no clock. Must not import ``shell``, ``sim`` or ``wire``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvroute.core.errors import ConfigError
from kvroute.core.events import BlockRemoved, BlockStored, KVEvent
from kvroute.core.types import BlockHash, WireHash

__all__ = ["MEDIUM_CPU", "MEDIUM_STORAGE", "OffloadTier"]

MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


class OffloadTier:
    """Blocks below the device, in LRU order, with their events.

    Invariants (``check_invariants``): at most ``capacity`` blocks; every held hash has its
    wire hash; the LRU order lists each held hash once.
    """

    __slots__ = ("_events", "_lru", "block_size", "capacity", "load_s_per_block", "loads",
                 "medium", "stores")

    def __init__(self, capacity: int, block_size: int, *, medium: str = MEDIUM_CPU,
                 load_s_per_block: float = 0.0) -> None:
        """A tier of ``capacity`` blocks of ``block_size`` tokens.

        Raises:
            ConfigError: capacity or block size below 1, or a negative load time.
        """
        if capacity < 1 or block_size < 1:
            raise ConfigError(
                f"an offload tier needs capacity >= 1 block and block_size >= 1, got "
                f"{capacity} and {block_size}")
        if not load_s_per_block >= 0.0 or load_s_per_block == float("inf"):
            raise ConfigError(f"load_s_per_block={load_s_per_block!r} must be finite and >= 0")
        self.capacity = capacity
        self.block_size = block_size
        self.medium = medium
        self.load_s_per_block = load_s_per_block
        self._lru: OrderedDict[BlockHash, WireHash] = OrderedDict()
        self._events: list[KVEvent] = []
        self.stores = 0
        self.loads = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._lru

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        """How many of ``hashes``, from the first, the tier holds in a row (no change)."""
        lru = self._lru
        n = 0
        for h in hashes:
            if h not in lru:
                break
            n += 1
        return n

    def load(self, hashes: Sequence[BlockHash]) -> float:
        """Load ``hashes`` (all held: the caller looked them up) back to the device; they
        become most recent. Returns the seconds the transfer takes."""
        lru = self._lru
        for h in hashes:
            lru.move_to_end(h)
        self.loads += len(hashes)
        return len(hashes) * self.load_s_per_block

    def store(self, hashes: Sequence[BlockHash], wire: Sequence[WireHash],
              parent: WireHash | None, token_ids: Sequence[int]) -> None:
        """Store a request's consecutive computed blocks (``token_ids`` are their tokens,
        ``parent`` the wire hash of the block before the first): held ones become most
        recent, new ones are added (evicting the least recent) and announced, one
        ``BlockStored`` per run of new blocks."""
        lru = self._lru
        run_start = -1
        for i, h in enumerate(hashes):
            if h in lru:
                lru.move_to_end(h)
                if run_start >= 0:
                    self._announce(wire, run_start, i, parent, token_ids)
                    run_start = -1
                continue
            if len(lru) >= self.capacity:
                if run_start >= 0:  # announce before any of the run can be evicted
                    self._announce(wire, run_start, i, parent, token_ids)
                    run_start = -1
                _, old_wire = lru.popitem(last=False)
                self._events.append(BlockRemoved((old_wire,), self.medium, 0))
            lru[h] = wire[i]
            self.stores += 1
            if run_start < 0:
                run_start = i
        if run_start >= 0:
            self._announce(wire, run_start, len(hashes), parent, token_ids)

    def _announce(self, wire: Sequence[WireHash], start: int, end: int,
                  parent: WireHash | None, token_ids: Sequence[int]) -> None:
        bs = self.block_size
        self._events.append(BlockStored(
            block_hashes=tuple(wire[start:end]),
            parent_block_hash=wire[start - 1] if start else parent,
            token_ids=tuple(token_ids[start * bs:end * bs]),
            block_size=bs, medium=self.medium, group_idx=0,
            kv_cache_spec_kind="full_attention",
        ))

    def take_events(self) -> list[KVEvent]:
        """Return and clear the events since the last call, oldest first."""
        events = self._events
        self._events = []
        return events

    def held(self) -> list[BlockHash]:
        """Held hashes, least recent first (tests)."""
        return list(self._lru)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` on a broken invariant (tests)."""
        if len(self._lru) > self.capacity:
            raise AssertionError(f"{len(self._lru)} blocks in a tier of {self.capacity}")
