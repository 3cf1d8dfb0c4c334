"""Per replica, the order in which its engine last used its GPU blocks, as its events say.

vLLM evicts the least recently used free block. A router that only hears ``BlockStored``
(new blocks) and ``BlockRemoved`` knows when each block was *computed*, not when it was last
*reused*: a system prompt every request hits looks as old as the day it was stored. With
``kv_cache_report_mode: "full"`` each hit re-announces the reused blocks, and this order
follows the engine's LRU (``docs/visible-hits.md``).

``BlockRecency`` keeps one ordered map per replica (least recent first): a stored or
re-announced GPU hash moves to the recent end, a removed one leaves. It also scores itself:
when the engine removes a block (evicts it, in steady state), where was that block in the
order? ``eviction_position`` is the block's place between the oldest (0.0) and the newest
(1.0) hash the replica holds, by touch stamps, so a perfect LRU view scores near 0 on every
eviction. Costs O(1) per hash and event.

Pure: no I/O; one owner (``RouterCore``) calls it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvroute.core.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvroute.core.types import ReplicaId, WireHash

__all__ = ["BlockRecency", "RecencyStats"]

_GPU = (None, "GPU", "gpu")


@dataclass(frozen=True, slots=True)
class RecencyStats:
    """How well the order predicted the engine's removals.

    Attributes:
        num_scored: removed GPU blocks that were in the order (scored).
        mean_position: their mean place between the oldest (0) and newest (1) hash held at
            the time; lower is a truer LRU view. None before any removal.
        num_touches: stored hashes that were already held (re-announced hits or copies).
    """

    num_scored: int
    mean_position: float | None
    num_touches: int


class BlockRecency:
    """The per-replica LRU order of GPU blocks (module docstring)."""

    __slots__ = ("_num_scored", "_num_touches", "_order", "_stamp", "_sum_position")

    def __init__(self) -> None:
        self._order: dict[ReplicaId, OrderedDict[WireHash, int]] = {}
        self._stamp = 0
        self._sum_position = 0.0
        self._num_scored = 0
        self._num_touches = 0

    def apply(self, replica: ReplicaId, batch: EventBatch) -> None:
        """Follow one batch of ``replica``'s events, in order."""
        order = self._order.get(replica)
        if order is None:
            order = self._order[replica] = OrderedDict()
        for event in batch.events:
            if isinstance(event, BlockStored):
                if event.medium not in _GPU:
                    continue
                for h in event.block_hashes:
                    self._stamp += 1
                    if h in order:
                        self._num_touches += 1
                        order.move_to_end(h)
                    order[h] = self._stamp
            elif isinstance(event, BlockRemoved):
                if event.medium not in _GPU:
                    continue
                for h in event.block_hashes:
                    stamp = order.pop(h, None)
                    if stamp is not None:
                        self._score(order, stamp)
            elif isinstance(event, AllBlocksCleared):
                order.clear()

    def _score(self, order: OrderedDict[WireHash, int], stamp: int) -> None:
        if order:
            oldest = min(next(iter(order.values())), stamp)
            newest = max(next(reversed(order.values())), stamp)
            span = newest - oldest
            self._sum_position += (stamp - oldest) / span if span else 0.0
        self._num_scored += 1

    def clear(self, replica: ReplicaId) -> None:
        """Forget ``replica``'s order (its index was reset)."""
        self._order.pop(replica, None)

    def least_recent(self, replica: ReplicaId, n: int) -> list[WireHash]:
        """``replica``'s ``n`` least recently used GPU hashes, oldest first."""
        order = self._order.get(replica)
        if not order:
            return []
        out: list[WireHash] = []
        for h in order:
            if len(out) >= n:
                break
            out.append(h)
        return out

    def stats(self) -> RecencyStats:
        mean = self._sum_position / self._num_scored if self._num_scored else None
        return RecencyStats(self._num_scored, mean, self._num_touches)
