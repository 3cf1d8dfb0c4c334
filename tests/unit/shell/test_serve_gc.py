"""``kvroute serve`` freezes its start-up heap so full collections stay short while serving,
and its runtime reports every collection's pause (``heap.watch_gc_pauses``)."""

from __future__ import annotations

import asyncio
import gc
from collections import deque

from kvroute.shell.heap import (
    SERVING_GC_THRESHOLDS,
    collect_young_every,
    freeze_startup_heap,
    watch_gc_pauses,
)


def test_the_startup_heap_is_moved_out_of_the_collectors_reach() -> None:
    assert gc.get_freeze_count() == 0
    defaults = gc.get_threshold()
    try:
        freeze_startup_heap()
        assert gc.get_threshold() == SERVING_GC_THRESHOLDS
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # this process's modules and test machinery, at the least
        tracked_after = len(gc.get_objects())
        assert tracked_after < frozen  # what a full collection still walks
    finally:
        gc.unfreeze()
        gc.set_threshold(*defaults)
    assert gc.get_freeze_count() == 0


def _collections_while_serving(requests: int) -> list[int]:
    """Collections of each generation while ``requests`` request-shaped lives run: each
    makes a burst of 1,000 tracked objects (a parsed body, its tokens, say) that stays alive
    while the next four are made (requests in flight), then goes. The counts follow from the
    allocations alone, not from time."""
    in_flight: deque[list[dict[str, int]]] = deque()
    before = [s["collections"] for s in gc.get_stats()]
    for _ in range(requests):
        in_flight.append([{"token": j} for j in range(1000)])
        if len(in_flight) > 4:
            in_flight.popleft()
    return [s["collections"] - b for s, b in zip(gc.get_stats(), before, strict=True)]


def test_serving_thresholds_leave_short_lived_request_objects_to_refcounting() -> None:
    """With Python's thresholds, the requests in flight outgrow the young generation, so
    collections run while they are alive, promote them, and full collections follow, each
    walking the whole heap; at the serving thresholds the same churn runs no collection (the
    soak's p99 spikes were such full collections)."""
    defaults = gc.get_threshold()
    gc.freeze()  # as the router's start-up heap: out of the count a full collection needs
    try:
        gc.collect()
        gc.set_threshold(700, 10, 10)
        young, middle, full = _collections_while_serving(5000)
        assert young > 1000 and middle > 100 and full >= 10
        gc.collect()
        gc.set_threshold(*SERVING_GC_THRESHOLDS)
        assert _collections_while_serving(5000) == [0, 0, 0]
    finally:
        gc.set_threshold(*defaults)
        gc.unfreeze()


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


def test_the_young_generation_is_collected_every_tick_whatever_its_count() -> None:
    """A cache that evicts one entry per entry added keeps the young count near zero while
    its new (tracked) entries pile up; the tick collects them anyway, so each collection
    walks one tick's worth."""
    defaults = gc.get_threshold()
    gc.set_threshold(*SERVING_GC_THRESHOLDS)
    loop = asyncio.new_event_loop()
    try:
        cache: dict[int, tuple[bytes, list[int]]] = {}
        for i in range(5000):  # churn: each new entry evicts an old one
            cache[i] = (b"k", [i])
            cache.pop(i - 100, None)
        assert gc.get_count()[0] < SERVING_GC_THRESHOLDS[0]  # no collection is due
        young_before = len(gc.get_objects(0))
        assert young_before >= 100  # the live entries' lists, at the least
        collections = gc.get_stats()[0]["collections"]
        stop = collect_young_every(loop, every_s=0.0)
        loop.run_until_complete(asyncio.sleep(0.05))  # bounded; counts, not durations, checked
        stop()
        assert gc.get_stats()[0]["collections"] > collections
        assert len(gc.get_objects(0)) < young_before
        ticks = gc.get_stats()[0]["collections"]
        loop.run_until_complete(asyncio.sleep(0.05))
        assert gc.get_stats()[0]["collections"] - ticks <= 1  # stopped (one may have been due)
    finally:
        loop.close()
        gc.set_threshold(*defaults)
