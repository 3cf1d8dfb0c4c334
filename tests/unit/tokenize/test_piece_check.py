"""``PieceCheckThread``: the piece cache's due checks encode on a worker thread while the event
loop runs on, report back on the loop, one at a time, and never swallow a failure."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from array import array
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import pytest

from kvroute.shell.metrics import RouterMetrics
from kvroute.tokenize.hf import HFTokenizer, bundled_tokenizer_dir
from kvroute.tokenize.piece_check import PieceCheckThread
from kvroute.tokenize.prompt import LocalTokenizer
from kvroute.tokenize.segments import SegmentEncoder


def _in_loop(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run the async test on a fresh event loop, bounded to 20 s."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(fn(*args, **kwargs), 20))
    return run


_TOK = HFTokenizer.from_dir(bundled_tokenizer_dir())
_TEXT = "<s><|user|>\nwhat does the router cache?<|end|>\n"


class _SlowWhole:
    """The whole encoding, after ``delay_s`` of sleep (which releases the GIL, as
    ``encode_batch`` does), recording the thread it ran on; ``wrong`` changes the last id."""

    def __init__(self, delay_s: float = 0.0, *, wrong: bool = False,
                 error: Exception | None = None) -> None:
        self.delay_s = delay_s
        self.wrong = wrong
        self.error = error
        self.threads: list[int] = []
        self.started = threading.Event()

    def __call__(self, text: str) -> Sequence[int]:
        self.threads.append(threading.get_ident())
        self.started.set()
        time.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        ids = _TOK.encode_plain_unlocked(text)
        if self.wrong:
            ids[-1] = 999
        return ids


def _encoder(verify_every: int = 1) -> SegmentEncoder:
    return SegmentEncoder(_TOK.encode_plain_unlocked, _TOK.split_tokens(),
                          verify_every=verify_every, name="test")


def _attached(whole: Callable[[str], Sequence[int]], *,
              name: str = "t") -> tuple[SegmentEncoder, PieceCheckThread]:
    """A piece cache checking every call, its checks deferred to a ``PieceCheckThread``."""
    pieces = _encoder()
    check = PieceCheckThread(pieces, whole, name=name)
    pieces.defer_checks(check.submit)
    return pieces, check


async def _settled(check: PieceCheckThread, pieces: SegmentEncoder, checks: int) -> None:
    for _ in range(500):
        if pieces.checks >= checks and not check._running:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no check came back within 5 s ({pieces.checks} of {checks})")


@_in_loop
async def test_the_whole_encoding_runs_on_another_thread_while_the_loop_runs() -> None:
    whole = _SlowWhole(delay_s=0.3)
    pieces, check = _attached(whole)
    loop_ticks = 0
    ids = pieces.encode(_TEXT)  # due at once (verify_every=1): handed to the thread
    assert pieces.checks == 0
    while not whole.started.is_set() or check._running:
        await asyncio.sleep(0.005)
        loop_ticks += 1
    await _settled(check, pieces, 1)
    assert whole.threads and whole.threads[0] != threading.get_ident()
    assert loop_ticks >= 10  # the loop kept turning through the 0.3 s encoding
    assert pieces.checks == 1 and pieces.enabled and pieces.mismatches == 0
    assert list(ids) == _TOK.encode_plain_unlocked(_TEXT)
    check.close()


@_in_loop
async def test_a_disagreement_found_by_the_thread_turns_the_cache_off(
        caplog: pytest.LogCaptureFixture) -> None:
    pieces, check = _attached(_SlowWhole(wrong=True))
    with caplog.at_level(logging.ERROR):
        pieces.encode(_TEXT)
        await _settled(check, pieces, 1)
    assert not pieces.enabled and pieces.mismatches == 1
    assert "token cache is now off" in caplog.text
    check.close()


@_in_loop
async def test_one_check_at_a_time_and_the_extra_ones_are_counted() -> None:
    whole = _SlowWhole(delay_s=0.2)
    pieces, check = _attached(whole)
    pieces.encode(_TEXT)
    pieces.encode(_TEXT + " again")  # due while the first still runs
    pieces.encode(_TEXT + " and again")
    assert check.dropped == 2
    await _settled(check, pieces, 1)
    assert pieces.checks == 1 and len(whole.threads) == 1
    pieces.encode(_TEXT)  # the thread is free again
    await _settled(check, pieces, 2)
    assert pieces.checks == 2 and check.dropped == 2
    check.close()


@_in_loop
async def test_a_failed_encoding_is_logged_and_counted_and_the_cache_stays(
        caplog: pytest.LogCaptureFixture) -> None:
    pieces, check = _attached(_SlowWhole(error=RuntimeError("tokenizer exploded")),
                              name="pool p")
    with caplog.at_level(logging.ERROR):
        pieces.encode(_TEXT)
        for _ in range(500):
            if check.failed:
                break
            await asyncio.sleep(0.01)
    assert check.failed == 1 and pieces.checks == 0 and pieces.enabled
    assert "pool p: the piece cache's check could not encode" in caplog.text
    assert "tokenizer exploded" in caplog.text
    check.close()


def test_without_a_running_loop_the_check_runs_inline() -> None:
    whole = _SlowWhole()
    pieces, _ = _attached(whole)
    pieces.encode(_TEXT)
    assert pieces.checks == 1 and whole.threads == [threading.get_ident()]


@_in_loop
async def test_a_local_tokenizer_checks_off_the_loop_and_close_brings_checks_back_inline(
) -> None:
    local = LocalTokenizer("p", HFTokenizer.from_dir(bundled_tokenizer_dir()), RouterMetrics())
    pieces = local.pieces
    body = {"messages": [{"role": "system", "content": "You route. " * 50},
                         {"role": "user", "content": "which replica?"}]}
    for _ in range(pieces._verify_every):
        local.encode_body(body)
    assert pieces.checks == 0  # the due check went to the thread
    await _settled(local.piece_check, pieces, 1)
    assert pieces.checks == 1 and pieces.enabled
    local.close()
    for _ in range(pieces._verify_every):
        local.encode_body(body)
    assert pieces.checks == 2  # inline now
    assert isinstance(local.encode_body(body), array)
