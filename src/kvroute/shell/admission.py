"""Admission control: a bound on requests in flight, a bounded FIFO wait queue, a wait timeout.

Owns the count of admitted requests and the queue of waiters. A request either gets a slot
at once, waits in line (at most ``max_queue`` others ahead, at most ``queue_timeout_s``), or
is refused with ``AdmissionRejected``, which the HTTP layer turns into a 429 with
``Retry-After``.

Why a queue and not only a semaphore: a burst slightly above the bound should wait a few
milliseconds, not fail; a sustained overload should fail fast (a full queue) so that the
gateway in front can shed or fall back. Why FIFO and hand-off: when a slot frees up it is
given directly to the oldest waiter (``release`` resolves its future), so a newcomer can never
overtake a waiter, and the in-flight count never exceeds ``max_in_flight`` even transiently.

Invariants: ``0 <= in_flight <= max_in_flight``; ``len(queue) <= max_queue``; every waiter
leaves the queue exactly once (granted, timed out or cancelled).

Single event loop; no locks needed (every method runs on the loop's thread).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from typing import Literal

__all__ = ["Admission", "AdmissionRejected"]


class AdmissionRejected(Exception):
    """The router is over its in-flight bound and the request cannot wait.

    Attributes:
        reason: ``queue_full`` or ``queue_timeout``.
        retry_after_s: what to put in ``Retry-After``.
    """

    def __init__(self, reason: Literal["queue_full", "queue_timeout"], retry_after_s: int,
                 message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.message = message


class Admission:
    """In-flight bound + FIFO wait queue + wait timeout (see the module docstring).

    Args:
        max_in_flight: requests served at once (>= 1).
        max_queue: requests allowed to wait for a slot (0 = refuse at once when full).
        queue_timeout_s: longest wait for a slot.
        retry_after_s: the ``Retry-After`` advice given with a refusal.
    """

    def __init__(self, max_in_flight: int, max_queue: int, queue_timeout_s: float,
                 retry_after_s: int = 1) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self._queue: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def acquire(self) -> None:
        """Take a slot, waiting in line if needed.

        Raises:
            AdmissionRejected: the queue is full, or the wait exceeded ``queue_timeout_s``.
        """
        if self.in_flight < self.max_in_flight and not self._queue:
            self.in_flight += 1
            return
        if len(self._queue) >= self.max_queue:
            raise AdmissionRejected(
                "queue_full", self.retry_after_s,
                f"kvroute is at its limit of {self.max_in_flight} requests in flight and "
                f"{self.max_queue} waiting; retry after {self.retry_after_s}s, or raise "
                "admission.max_in_flight / admission.max_queue if the engines have room.",
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.queue_timeout_s)
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return  # granted in the same tick the timeout fired: keep the slot
            waiter.cancel()
            self._remove(waiter)
            raise AdmissionRejected(
                "queue_timeout", self.retry_after_s,
                f"kvroute waited {self.queue_timeout_s:g}s for one of its "
                f"{self.max_in_flight} in-flight slots; retry after {self.retry_after_s}s, or "
                "raise admission.queue_timeout_s.",
            ) from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # granted, but the client went away: pass the slot on
            else:
                waiter.cancel()
                self._remove(waiter)
            raise

    def release(self) -> None:
        """Give a slot back: to the oldest live waiter, or to the pool."""
        while self._queue:
            waiter = self._queue.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot moves to the waiter; in_flight unchanged
                return
        if self.in_flight <= 0:
            raise AssertionError("Admission.release called more often than acquire")
        self.in_flight -= 1

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """``async with admission.slot():`` — acquire, and release on every exit path."""
        await self.acquire()
        try:
            yield
        finally:
            self.release()

    def _remove(self, waiter: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):  # already popped by release()
            self._queue.remove(waiter)
