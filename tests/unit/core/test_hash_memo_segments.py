"""The block-hash memo's store (``core.hash_memo._Segments``): bounded, FIFO by segment, hits
refreshed, and never a table rebuild (every eviction is a ``popitem``)."""

from __future__ import annotations

import pytest

from kvroute.core.hash_memo import _SEGMENTS, _Segments

HOT, COLD = 10**6, 10**6 + 1


def entry(i: int) -> bytes:
    return i.to_bytes(32, "big")


def key(i: int) -> bytes:
    return i.to_bytes(64, "big") + b"n"


@pytest.mark.parametrize("bound", [1, 3, _SEGMENTS, 100, 1000])
def test_the_bound_holds_at_every_write_and_counts_every_copy(bound: int) -> None:
    store = _Segments(bound)
    for i in range(5 * bound + 7):
        store.put(key(i), entry(i))
        assert len(store) == min(i + 1, bound)
        assert sum(len(s) for s in store.segments) == len(store)
    assert store.get(key(5 * bound + 6)) == entry(5 * bound + 6)  # the newest is kept
    assert store.get(key(0)) is None  # the oldest went
    store.put(key(5 * bound + 6), entry(HOT))  # a rewrite in the newest segment: no new entry
    assert len(store) == bound and store.get(key(5 * bound + 6)) == entry(HOT)


def test_entries_leave_oldest_segment_first() -> None:
    store = _Segments(80)  # segments of 10
    for i in range(200):
        store.put(key(i), entry(i))
    # Read the segments directly: ``get`` would refresh what it finds.
    present = [i for i in range(200) if any(s.get(key(i)) is not None for s in store.segments)]
    assert len(present) == 80
    # Everything from the oldest kept segment on is there; nothing older survives.
    assert present == list(range(200 - 80, 200))


def test_a_key_looked_up_while_others_churn_stays_and_a_cold_one_goes() -> None:
    store = _Segments(64)
    store.put(key(HOT), entry(HOT))
    store.put(key(COLD), entry(COLD))
    for i in range(2000):
        store.put(key(i), entry(i))
        if i % 16 == 0:
            assert store.get(key(HOT)) == entry(HOT), f"the hot key was evicted at write {i}"
    assert store.get(key(COLD)) is None
    assert len(store) == 64


def test_eviction_shrinks_the_oldest_segment_in_place() -> None:
    """Only ``popitem`` and ``popleft`` remove entries: the oldest segment loses one entry per
    entry written beyond the bound and is dropped once empty; no segment is ever copied."""
    store = _Segments(16)  # segments of 2
    for i in range(16):
        store.put(key(i), entry(i))
    oldest = store.segments[0]
    assert len(oldest) == 2
    store.put(key(16), entry(16))
    assert store.segments[0] is oldest and len(oldest) == 1
    store.put(key(17), entry(17))
    assert store.segments[0] is not oldest and not oldest  # emptied in place, then dropped
