"""The process heap after start-up: what the long-running servers do with it once ready.

Owns ``freeze_startup_heap``, called by ``kvroute serve`` (the router) and ``kvroute sim
serve`` (the simulated engine) once they listen (it also sets the collector's serving
thresholds, ``SERVING_GC_THRESHOLDS``), and ``watch_gc_pauses``, which the router's
runtime uses to export how long the collector stops it (``kvroute_gc_pause_seconds``).

It lives in ``shell``, the lowest ring that uses it (the simulated engine's server and the
CLI sit above and import it from here); no pure ring may touch the collector.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from typing import Any, Final

__all__ = ["SERVING_GC_THRESHOLDS", "YOUNG_COLLECTION_EVERY_S", "collect_young_every",
           "freeze_startup_heap", "watch_gc_pauses"]

SERVING_GC_THRESHOLDS: Final = (10_000, 10, 10)
"""``gc.set_threshold`` once serving: a young collection once 10,000 more tracked objects
are alive than at the last one (Python's default: 700), then as Python does, a middle one
every 10 young ones and a full one at most every 10 middle ones (and only once the objects
promoted to the oldest generation since the last full collection exceed a quarter of it).

Why: the young count is allocations minus deallocations, so a young collection runs while a
request's objects are alive whenever one request's worth (a parsed body, its tokens, its
routing walk: well over 700 objects) is made faster than freed. With Python's 700, each
collection promoted what the requests in flight held at that instant, and a router at 200
requests a second ran a full collection every ~900 requests, walking every long-lived
tracked object (the caches' containers, sessions, connections) with the event loop stopped:
its cost grew with the caches from 3 to 53 CPU-ms over 20,000 requests in process, to 150
CPU-ms live, which is what the soak's p99 spikes were. At 10,000 a request's objects are
mostly freed before a collection sees them, so little is promoted and, in process, 20,000
requests ran no full collection at all; a young collection then walks up to 10,000 recent
objects, and a middle one that and what survived (figures:
``docs/benchmarks.md#long-run-memory-and-p99``; ``benchmarks/micro/bench_soak_gc.py``).
Larger values make young collections longer (50,000: 7-16 CPU-ms each on the shared svc
machine) and let the middle generation fill with what requests held under overload.
Garbage cycles are still collected: those that die young by the young collections, the rest
by the rarer full ones.
"""


def freeze_startup_heap() -> None:
    """Collect once, move everything alive (modules, tokenizers, templates, config) out of
    the collector's reach (``gc.freeze``), and set the serving thresholds
    (``SERVING_GC_THRESHOLDS``).

    Why the freeze: a full collection walks every tracked object and stops the event loop
    meanwhile; after start-up most tracked objects are the ones loading created and will never
    be garbage, yet every full collection while serving walks them again, and every request
    in flight waits meanwhile (the pauses with and without the freeze:
    ``docs/benchmarks.md#garbage-collection-pauses``).
    Frozen objects are still freed normally by reference counting; only cycles among them
    would stay, and start-up makes none worth collecting. Why the thresholds: their constant's
    docstring.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_GC_THRESHOLDS)


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


YOUNG_COLLECTION_EVERY_S: Final = 1.0
"""How often ``collect_young_every`` collects the young generation while serving."""


def collect_young_every(loop: asyncio.AbstractEventLoop,
                        every_s: float = YOUNG_COLLECTION_EVERY_S) -> Callable[[], None]:
    """Collect the young generation every ``every_s`` on ``loop``, whatever its count says;
    returns the function that stops it.

    Why: the young count is allocations minus deallocations, and a cache that evicts one
    entry for each it adds (the block-hash memo, the piece cache) keeps it near zero while
    its new entries pile up in the young generation, tracked until a collection untracks
    them. At the serving thresholds a young collection then came about once a minute and
    walked a minute of that churn: ~300 CPU-ms with the event loop stopped, nothing
    collected (``docs/benchmarks.md#long-run-memory-and-p99``). Collected every second, the
    young generation holds a second's worth, a few ms of work each time.
    """
    handle: list[asyncio.TimerHandle | None] = [None]

    def tick() -> None:
        gc.collect(0)
        handle[0] = loop.call_later(every_s, tick)

    handle[0] = loop.call_later(every_s, tick)

    def stop() -> None:
        if handle[0] is not None:
            handle[0].cancel()
            handle[0] = None

    return stop
