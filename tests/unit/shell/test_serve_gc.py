"""``kvroute serve`` freezes its start-up heap so full collections stay short while serving,
and its runtime reports every collection's pause (``heap.watch_gc_pauses``)."""

from __future__ import annotations

import gc

from kvroute.shell.heap import freeze_startup_heap, watch_gc_pauses


def test_the_startup_heap_is_moved_out_of_the_collectors_reach() -> None:
    assert gc.get_freeze_count() == 0
    try:
        freeze_startup_heap()
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # this process's modules and test machinery, at the least
        tracked_after = len(gc.get_objects())
        assert tracked_after < frozen  # what a full collection still walks
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_gc_pauses_are_reported_by_generation_until_the_watch_stops() -> None:
    seen: list[tuple[int, float]] = []
    before = len(gc.callbacks)
    stop = watch_gc_pauses(lambda generation, seconds: seen.append((generation, seconds)))
    try:
        assert len(gc.callbacks) == before + 1
        gc.collect()
        gc.collect(0)
        assert [g for g, _ in seen] == [2, 0]
        assert all(s >= 0 for _, s in seen)
    finally:
        stop()
    stop()  # idempotent
    assert len(gc.callbacks) == before
    gc.collect()
    assert len(seen) == 2
