"""``kvroute serve`` freezes its start-up heap so full collections stay short while serving,
and its runtime reports every collection's pause (``heap.watch_gc_pauses``) and how late its
event loop wakes (``heap.watch_loop_lag``)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time

from kvroute.shell.heap import freeze_startup_heap, watch_gc_pauses, watch_loop_lag


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


def test_a_blocked_loop_is_reported_as_one_late_wake_up() -> None:
    lags: list[float] = []

    async def main() -> None:
        watch = asyncio.create_task(watch_loop_lag(lags.append, period_s=0.01))
        await asyncio.sleep(0.05)
        time.sleep(0.15)  # noqa: ASYNC251 - the loop blocked on purpose: its timer fires late
        await asyncio.sleep(0.05)
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch

    asyncio.run(main())
    assert len(lags) >= 2 and all(lag >= 0 for lag in lags)
    assert max(lags) >= 0.14
