"""The piece cache's serving checks, run on a worker thread so that no request waits for one.

``tokenize.segments.SegmentEncoder`` re-encodes one prompt in ``verify_every`` whole and
compares the ids with its cached pieces'. Whole, a long chat prompt costs what the cache
saves, which inline is a stall of the router's event loop that every request in flight waits
out (``docs/benchmarks.md#tokenization-on-the-loop-piece-checks-on-a-thread``).
``PieceCheckThread`` takes the due check off the loop instead: the whole encoding runs on one
worker thread through ``HFTokenizer.encode_plain_unlocked`` (which releases the GIL, so the
loop keeps running), and the comparison, with the cache switch-off it may cause, runs back on
the loop thread (the cache is only ever touched there).

Owns ``PieceCheckThread``. Invariants: at most one check runs at a time (one due while
another runs is dropped and counted: the next comes ``verify_every`` calls later); a failed
encoding is logged as an error and counted, never swallowed, and leaves the cache as it was;
called with no running event loop (a caller outside the router's loop), it checks inline.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvroute.tokenize.segments import SegmentEncoder

__all__ = ["PieceCheckThread"]

log = logging.getLogger(__name__)


class PieceCheckThread:
    """Runs ``pieces``' due checks with ``encode_whole`` on a worker thread.

    Attach with ``pieces.defer_checks(check.submit)``.

    Args:
        pieces: the piece cache whose checks these are.
        encode_whole: the tokenizer's whole encoding without special tokens; called on the
            worker thread, so it should release the GIL (``HFTokenizer.encode_plain_unlocked``).
        name: for the worker thread's name and log lines.

    Attributes:
        dropped: checks that came due while another was still running.
        failed: checks whose whole encoding raised (logged).
    """

    def __init__(self, pieces: SegmentEncoder, encode_whole: Callable[[str], Sequence[int]],
                 *, name: str) -> None:
        self._pieces = pieces
        self._encode_whole = encode_whole
        self._name = name
        self._executor: ThreadPoolExecutor | None = None
        self._running = False
        self.dropped = 0
        self.failed = 0

    def submit(self, text: str, ids: array[int]) -> None:
        """Start checking ``ids`` against ``text``'s whole encoding; returns at once."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._pieces.check(text, array("I", self._encode_whole(text)), ids)
            return
        if self._running:
            self.dropped += 1
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"kvroute-piece-check-{self._name}")
        self._running = True
        future = loop.run_in_executor(self._executor, self._encode_whole, text)
        future.add_done_callback(functools.partial(self._finish, text, ids))

    def _finish(self, text: str, ids: array[int], future: asyncio.Future[Sequence[int]]) -> None:
        self._running = False
        if future.cancelled():
            return  # the loop is shutting down; the next check comes with the next calls
        exc = future.exception()
        if exc is not None:
            self.failed += 1
            log.error("%s: the piece cache's check could not encode a prompt of %d chars "
                      "whole; the cache stays as it was", self._name, len(text), exc_info=exc)
            return
        self._pieces.check(text, array("I", future.result()), ids)

    def close(self) -> None:
        """Stop the worker thread (a check in progress is left to finish on its own)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
