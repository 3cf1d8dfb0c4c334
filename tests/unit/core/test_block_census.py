"""The block census a KV-event relay snapshots: counted like the index, written back whole."""

from __future__ import annotations

import pytest

from kvroute.core.block_census import BlockCensus
from kvroute.core.clock import ManualClock
from kvroute.core.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent
from kvroute.core.index import AdminCapability, PrefixIndex
from kvroute.core.types import ReplicaId


def batch(seq: int, *events: KVEvent) -> EventBatch:
    return EventBatch(seq, 0.0, events)


def stored(*hashes: int, medium: str | None = "GPU") -> BlockStored:
    return BlockStored(hashes, None, (), 16, medium=medium)


HISTORY = (
    batch(0, stored(1, 2, 3), stored(7, medium="CPU")),
    batch(1, stored(2)),                          # a second copy of 2
    batch(2, BlockRemoved((2, 3, 99))),           # one copy of 2 goes, 3 goes, 99 unknown
    batch(3, stored(4, 5), BlockRemoved((7,), medium="CPU"), stored(8, medium="CPU")),
)


def test_the_census_counts_copies_per_medium_as_the_events_say() -> None:
    census = BlockCensus()
    for b in HISTORY:
        census.apply(b)
    assert census.hashes("GPU") == {1, 2, 4, 5}
    assert census.hashes("CPU") == {8}
    assert len(census) == 5


def test_a_snapshot_gives_an_empty_index_what_the_whole_history_gave_another() -> None:
    census = BlockCensus()
    replayed = PrefixIndex(clock=ManualClock())
    for b in (*HISTORY, batch(4, stored(1))):  # block 1 ends with two copies
        census.apply(b)
        replayed.apply_batch(ReplicaId("r"), b)
    restored = PrefixIndex(clock=ManualClock())
    restored.apply_batch(ReplicaId("r"), batch(4, *census.snapshot()))
    assert restored.stats().num_entries == replayed.stats().num_entries == 5
    assert restored.stats().num_extra_copies == replayed.stats().num_extra_copies == 1
    scope = AdminCapability().fleet_scope()
    for h in range(1, 10):
        assert restored.match([h], scope) == replayed.match([h], scope)


def test_all_blocks_cleared_empties_the_census() -> None:
    census = BlockCensus()
    census.apply(HISTORY[0])
    census.apply(batch(1, AllBlocksCleared()))
    assert len(census) == 0 and census.snapshot() == ()


def test_an_event_of_another_type_is_refused() -> None:
    with pytest.raises(TypeError, match="cannot count"):
        BlockCensus().apply(batch(0, "BlockStored"))  # type: ignore[arg-type]


def test_a_snapshot_comes_in_chunks_that_add_up_to_every_copy() -> None:
    census = BlockCensus()
    census.apply(batch(0, stored(*range(1, 11)), stored(1, 2), stored(50, medium="CPU")))
    events = census.snapshot(chunk=4)
    assert all(isinstance(e, BlockStored) and len(e.block_hashes) <= 4 for e in events)
    gpu = sorted(h for e in events if isinstance(e, BlockStored) and e.medium == "GPU"
                 for h in e.block_hashes)
    assert gpu == sorted([*range(1, 11), 1, 2])
    with pytest.raises(ValueError, match="chunk"):
        census.snapshot(chunk=0)
