"""The process heap after start-up: what the long-running servers do with it once ready.

Owns ``freeze_startup_heap``, called by ``kvroute serve`` (the router) and ``kvroute sim
serve`` (the simulated engine) once they listen, ``watch_gc_pauses``, which the router's
runtime uses to export how long the collector stops it (``kvroute_gc_pause_seconds``), and
``watch_loop_lag``, how late its event loop wakes (``kvroute_event_loop_lag_seconds``).

It lives in ``shell``, the lowest ring that uses it (the simulated engine's server and the
CLI sit above and import it from here); no pure ring may touch the collector.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from typing import Any, Final

__all__ = ["LOOP_LAG_PERIOD_S", "freeze_startup_heap", "watch_gc_pauses", "watch_loop_lag"]

LOOP_LAG_PERIOD_S: Final = 0.02
"""``watch_loop_lag`` asks to be woken this often: 50 wake-ups a second, a few µs each."""


def freeze_startup_heap() -> None:
    """Collect once, then move everything alive (modules, tokenizers, templates, config) out
    of the collector's reach (``gc.freeze``).

    Why: a full collection walks every tracked object and stops the event loop meanwhile;
    after start-up most tracked objects are the ones loading created and will never be
    garbage, yet every full collection while serving walks them again, and every request in
    flight waits meanwhile (the pauses with and without the freeze:
    ``docs/benchmarks.md#garbage-collection-pauses``).
    Frozen objects are still freed normally by reference counting; only cycles among them
    would stay, and start-up makes none worth collecting.
    """
    gc.collect()
    gc.freeze()


def watch_gc_pauses(on_pause: Callable[[int, float], None]) -> Callable[[], None]:
    """Call ``on_pause(generation, seconds)`` after every garbage collection of this process;
    returns the function that stops it.

    Why: a collection stops the event loop, and every request in flight waits as long. Its
    cost grows with what the process keeps (caches, the index), so it is the pause a long run
    shows and a short one does not; the loop's own timings never see it as such. The
    callback runs in the collecting thread, between ``start`` and ``stop`` of a collection
    that may have been triggered by any allocation: ``on_pause`` must be cheap and must not
    allocate much (a histogram observation is fine).
    """
    started = [0.0]

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif started[0]:
            on_pause(int(info["generation"]), time.perf_counter() - started[0])

    gc.callbacks.append(callback)

    def stop() -> None:
        if callback in gc.callbacks:
            gc.callbacks.remove(callback)

    return stop


async def watch_loop_lag(on_lag: Callable[[float], None],
                         period_s: float = LOOP_LAG_PERIOD_S) -> None:
    """Sleep ``period_s`` over and over on the running loop and call ``on_lag(seconds)`` with
    how late each wake-up came; runs until cancelled.

    Why: a request's own time (``router_time_seconds``) starts when the loop reads it and
    when it reads the engine's answer, so a stall of the whole loop (a collection, the
    process waiting for a CPU or stolen by the hypervisor, a blocking call, one long
    callback) while requests wait in sockets or on the engines adds to every one of them and
    shows in none of their own times. This is that stall, as the loop itself sees it.
    """
    clock = time.perf_counter
    while True:
        due = clock() + period_s
        await asyncio.sleep(period_s)
        on_lag(max(0.0, clock() - due))
