"""Per-stage thread CPU of a live ``kvroute serve``, for docs/long-contexts.md ("Where a live
turn's CPU goes"). Not imported by kvroute: put this directory first on ``PYTHONPATH`` of
the router (``profile_live.py`` does) and set ``KVROUTE_STAGE_CPU=<out file>``.

On SIGUSR1 it wraps the request path's synchronous stages (parse, render, encode, the walk's
hashing, match and commit, the sockets' data_received) and every event-loop callback with
``time.thread_time_ns`` (a few calls a request: the wrappers cost ~1 µs each, not the
whole-program slowdown of cProfile or a sampler); on SIGUSR2 it writes the totals, per stage
and per callback (a task's callbacks under its coroutine's name), to the out file.
"""

from __future__ import annotations

import asyncio.events
import collections
import os
import signal
import sys
import time
from typing import Any

_OUT = os.environ.get("KVROUTE_STAGE_CPU")
_stages: collections.Counter[str] = collections.Counter()
_stage_calls: collections.Counter[str] = collections.Counter()
_callbacks: collections.Counter[str] = collections.Counter()
_callback_calls: collections.Counter[str] = collections.Counter()
_live = [False]


def _wrap(owner: Any, name: str, label: str) -> None:
    orig = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time_ns()
        try:
            return orig(*args, **kwargs)
        finally:
            _stages[label] += time.thread_time_ns() - t0
            _stage_calls[label] += 1

    setattr(owner, name, timed)


def _label(handle: asyncio.events.Handle) -> str:
    callback = handle._callback  # type: ignore[attr-defined]
    owner = getattr(callback, "__self__", None)
    if isinstance(owner, asyncio.Task):
        coro = owner.get_coro()
        return "task " + getattr(coro, "__qualname__", repr(coro))
    return "callback " + getattr(callback, "__qualname__", type(callback).__name__)


_orig_run = asyncio.events.Handle._run


def _run(self: asyncio.events.Handle) -> None:
    if not _live[0]:
        return _orig_run(self)  # type: ignore[no-any-return]
    t0 = time.thread_time_ns()
    try:
        return _orig_run(self)  # type: ignore[no-any-return]
    finally:
        label = _label(self)
        _callbacks[label] += time.thread_time_ns() - t0
        _callback_calls[label] += 1


def _start(*_: object) -> None:
    m = sys.modules
    _wrap(m["kvroute.shell.app"], "parse_within_limits", "parse + check the body")
    _wrap(m["kvroute.tokenize.hf"].HFTokenizer, "render_chat", "render the chat template")
    _wrap(m["kvroute.tokenize.hf"].HFTokenizer, "encode", "encode (pieces, checkpoints, new text)")
    _wrap(m["kvroute.core.walk"].RequestWalk, "tokens", "walk.tokens (hashes, match, policy)")
    _wrap(m["kvroute.core.router"].RouterCore, "block_hashes", "  block hashes")
    _wrap(m["kvroute.core.index"].PrefixIndex, "match", "  index match")
    _wrap(m["kvroute.core.router"].RouterCore, "_commit", "  commit (predictions, load)")
    _wrap(m["kvroute.core.walk"].RequestWalk, "end", "walk.end")
    _wrap(m["kvroute.shell.forward"], "forward_body", "forward_body")
    _wrap(m["kvroute.http.server"]._Connection, "data_received", "client socket data")
    _wrap(m["kvroute.http.client"]._Connection, "data_received", "engine socket data")
    _stages.clear()
    _callbacks.clear()
    _live[0] = True


def _dump(*_: object) -> None:
    assert _OUT is not None
    with open(_OUT, "w") as out:
        out.write("stage\tcalls\tthread CPU ms\n")
        out.writelines(f"{key}\t{_stage_calls[key]}\t{ns / 1e6:.1f}\n" for key, ns in _stages.most_common())
        out.write("event-loop callback\tcalls\tthread CPU ms\n")
        out.writelines(f"{key}\t{_callback_calls[key]}\t{ns / 1e6:.1f}\n" for key, ns in _callbacks.most_common(25))


if _OUT:
    asyncio.events.Handle._run = _run  # type: ignore[method-assign]
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _dump)
