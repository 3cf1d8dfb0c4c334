"""Spread-ahead's answer capture: the relayed answer kept for the session's copy.

Spread-ahead (``core/spread.py``; docs/architecture.md, step 8b) may copy a session's
context to an idle replica when its request ends, so that its next turn finds the prefix
there too. The next turn resends the request's messages *and* the answer, so a copy of the
prompt alone would leave the answer's blocks to prefill at the return. Live, the copy is
therefore built from a ``SessionTurn`` (``wire/turn_copy.py``): the parsed request, plus
the answer's text once it has been relayed and finished.

This module holds what ``shell/forward.py`` does for that, apart from driving the walk:

* ``spreads``: whether a route's requests may end in a copy at all (a pool of the route
  has ``spread_ahead`` on, and no model-bound cache scenario applies), so that the answer
  is read only where it can be used;
* ``AnswerCapture``: one request's ``SessionTurn`` (handed to the walk as its shadow
  payload when it starts) and the reading of its answer: the whole body (``answer_of``) or
  the relayed stream piece by piece (``AnswerText``, beside the usage watcher). The answer
  is set only when the first choice finished (a finish reason came), before the walk's end
  plans the copy; otherwise the copy is the prompt alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvroute.config import RouteConfig
from kvroute.core.router import RouterCore
from kvroute.core.spread import SpreadSettings
from kvroute.core.types import PoolName
from kvroute.wire.openai import ParsedRequest
from kvroute.wire.relay import StreamWatcher
from kvroute.wire.turn_copy import AnswerText, SessionTurn, answer_of

__all__ = ["AnswerCapture", "spreads"]


def spreads(core: RouterCore, route: RouteConfig) -> bool:
    """Whether a request of ``route`` may end in a spread-ahead copy (``core/spread.py``;
    the walk plans none on routes with model-bound cache scenarios), so its answer's
    text is worth keeping for the copy (``wire/turn_copy.py``)."""
    if route.scenarios.any:
        return False
    known = set(core.pool_names())
    for name in route.pools:
        pool = PoolName(name)
        if pool in known:
            settings = getattr(core.policy_of(pool), "spread", None)
            if isinstance(settings, SpreadSettings) and settings.enabled:
                return True
    return False


def _finished(reasons: Sequence[str | None]) -> bool:
    """The first choice ended with a finish reason (a cut-off answer is not resent)."""
    return bool(reasons) and reasons[0] is not None


class AnswerCapture:
    """One request's turn for a spread-ahead copy, and the reading of its answer.

    ``keep`` False (no session, several choices, or a route that never spreads): ``turn``
    is still the walk's shadow payload, but its answer stays None and nothing is read.
    """

    __slots__ = ("_keep", "_text", "turn")

    def __init__(self, parsed: ParsedRequest, *, keep: bool) -> None:
        self.turn = SessionTurn(parsed)
        self._keep = keep
        self._text: AnswerText | None = None

    def whole(self, body: bytes, reasons: Sequence[str | None]) -> None:
        """A whole (non-streamed) answer was relayed with these finish reasons."""
        if self._keep and _finished(reasons):
            self.turn.answer = answer_of(body, self.turn.request.endpoint)

    def on_chunk(self, watcher: StreamWatcher) -> Callable[[bytes], None]:
        """What each relayed piece of a stream is fed to: the usage ``watcher``, and the
        answer's text reader when the answer is kept."""
        if not self._keep:
            return watcher.feed
        text = self._text = AnswerText(self.turn.request.endpoint)

        def feed(piece: bytes) -> None:
            watcher.feed(piece)
            text.feed(piece)
        return feed

    def streamed(self, reasons: Sequence[str | None]) -> None:
        """The stream fed through ``on_chunk`` ended with these finish reasons."""
        if self._text is not None and _finished(reasons):
            self.turn.answer = self._text.text
