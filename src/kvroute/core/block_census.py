"""What one engine holds, counted from its KV events, and written back as one batch.

Owns a count of copies per (block hash, medium) for one replica, nothing else. The KV-event
relay (``shell/kv_stream_relay.py``) keeps one per engine from the batches it mirrors into the
durable stream, and publishes ``snapshot`` every so many batches, so that a restarting
router rebuilds the replica's index from the snapshot plus the stream's tail instead of the
whole history (bounded catch-up).

The counting follows ``PrefixIndex._apply`` (``core/index.py``): a store adds one copy per
hash, a removal takes one away (never below zero; removing what is not held is a no-op, as
vLLM's lazy removals require), ``AllBlocksCleared`` empties it. Hit reports (parent-less
re-announcements of held blocks) are not told apart here: a relay for a replica whose
requests ask for them would over-count copies, which can only keep an entry longer than the
engine does (the index's own bound and the engine's next removals correct it).

Pure: no IO, no clock.
"""

from __future__ import annotations

from kvroute.core.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent
from kvroute.core.types import WireHash

__all__ = ["BlockCensus"]

_DEFAULT_BLOCK_SIZE = 16
"""``block_size`` written into a snapshot of a census that never saw a store."""


class BlockCensus:
    """Copies held per (hash, medium) by one engine, applied batch by batch.

    Invariants: every count in ``_copies`` is >= 1; ``len(self)`` is the number of
    (hash, medium) pairs held, the entry count ``PrefixIndex`` keeps for the replica.
    """

    __slots__ = ("_block_size", "_copies")

    def __init__(self) -> None:
        self._copies: dict[str | None, dict[WireHash, int]] = {}
        self._block_size = _DEFAULT_BLOCK_SIZE

    def __len__(self) -> int:
        return sum(len(held) for held in self._copies.values())

    def hashes(self, medium: str | None = "GPU") -> frozenset[WireHash]:
        """The hashes held at least once on ``medium``."""
        return frozenset(self._copies.get(medium, ()))

    def apply(self, batch: EventBatch) -> None:
        """Count one batch's events, in order.

        Raises:
            TypeError: an event is none of ``BlockStored``, ``BlockRemoved``,
                ``AllBlocksCleared``.
        """
        for event in batch.events:
            if isinstance(event, BlockStored):
                held = self._copies.setdefault(event.medium, {})
                for h in event.block_hashes:
                    held[h] = held.get(h, 0) + 1
                self._block_size = event.block_size
            elif isinstance(event, BlockRemoved):
                kept = self._copies.get(event.medium)
                if kept is None:
                    continue
                for h in event.block_hashes:
                    n = kept.get(h)
                    if n is None:
                        continue
                    if n > 1:
                        kept[h] = n - 1
                    else:
                        del kept[h]
            elif isinstance(event, AllBlocksCleared):
                self._copies.clear()
            else:
                raise TypeError(f"cannot count {event!r}: expected BlockStored, BlockRemoved "
                                "or AllBlocksCleared")

    def clear(self) -> None:
        """Forget everything (the engine's stream was reset)."""
        self._copies.clear()

    def snapshot(self, chunk: int = 4096) -> tuple[KVEvent, ...]:
        """Events that, applied to an empty index, give it exactly these copies:
        ``BlockStored`` events of at most ``chunk`` hashes, each hash repeated once per copy,
        parent None (chunks let a reader apply a large snapshot in slices).

        Raises:
            ValueError: ``chunk`` < 1.
        """
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1 hash, got {chunk}")
        events: list[KVEvent] = []
        for medium, held in self._copies.items():
            hashes: list[WireHash] = []
            for h, n in held.items():
                hashes.extend([h] * n)
            for i in range(0, len(hashes), chunk):
                events.append(BlockStored(block_hashes=tuple(hashes[i:i + chunk]),
                                          parent_block_hash=None, token_ids=(),
                                          block_size=self._block_size, medium=medium))
        return tuple(events)
