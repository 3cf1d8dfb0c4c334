"""``kvroute serve`` freezes its start-up heap so full collections stay short while serving."""

from __future__ import annotations

import gc

from kvroute.heap import freeze_startup_heap


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
