"""One record per session: what the router remembers between a session's requests.

A session (an agent's or a chat's conversation, named by the client's session id) carries
these facts from one request to the next, all in one :class:`SessionRecord`:

* ``pin`` — the replica that served it last: the walk passes it to the policy as
  ``preferred_replica`` (ties go to it; the ``session`` policy follows it);
* ``tier`` — the largest pool index of its route it reached: a session never flaps back to
  a smaller pool that lacks its prefix;
* ``usage`` — the engine's ``usage`` of its last answer: the next turn's prompt is estimated
  from it (``core/tokens.from_session``) rather than from characters;
* ``version``, ``arm``, ``prompt_tokens`` — the model version and A/B arm that served it,
  and its last prompt's length: a session stays on one version and one arm, and a move is
  billed (docs/model-bound-caches.md).

The record is keyed by :func:`session_key` (tenant, route and session id: sessions never
cross tenants or routes), read once when a request's walk starts and written once when it
ends (``core/walk.py``). Where it is kept is the store's business: :class:`SessionTable`
here (bounded, expiring, pure: the simulator's store and the live router's in-memory one),
or Redis in ``shell/state.py`` so that several router processes share it.

Warm-ahead cooldowns are not in the record: they are claims (at most one warm-up per
session and growth stage per cooldown, ``core/warm.py``), taken atomically in the shared
store, not read-modify-written with the rest.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

from kvroute.core.errors import ConfigError
from kvroute.core.types import ReplicaId

__all__ = ["DEFAULT_MAX_SESSIONS", "SessionRecord", "SessionTable", "SessionUsage", "session_key"]

DEFAULT_MAX_SESSIONS: Final = 100_000

_SEP: Final = "\x1f"


def session_key(tenant: str, route: str, session_id: str) -> str:
    """The key of a session's record: tenant, route and id joined by the unit separator
    (a byte no tenant or route name holds, so two triples never share a key)."""
    return f"{tenant}{_SEP}{route}{_SEP}{session_id}"


@dataclass(frozen=True, slots=True)
class SessionUsage:
    """A session's last answer as the engine counted it (its ``usage``), with the number of
    messages its request held (the next turn's new messages are estimated on top)."""

    prompt_tokens: int
    completion_tokens: int
    num_messages: int


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """What the router remembers of one session (module docstring).

    Attributes:
        pin: the replica that served the session's last request, if any.
        tier: the largest pool index of the route the session reached (0: the smallest).
        usage: the engine's count of the last answer, when it sent one.
        version: the model version (``core/versions.py``) that served it last: its next
            requests stay in that version group (docs/model-bound-caches.md).
        arm: the A/B arm (a pool) it was given, when its route splits traffic.
        prompt_tokens: the prompt length its last request was routed with (what it had
            cached where it was: a move's recompute bill, ``core/scenarios.py``).
    """

    pin: ReplicaId | None = None
    tier: int = 0
    usage: SessionUsage | None = None
    version: str | None = None
    arm: str | None = None
    prompt_tokens: int = 0


EMPTY_RECORD: Final = SessionRecord()


class SessionTable:
    """Session records in memory: a bounded LRU whose entries expire ``ttl_s`` after their
    last write.

    Invariants: at most ``max_sessions`` records; the least recently used is evicted first;
    an expired record is never returned (it is dropped when met). Nothing sweeps: the bound,
    not a timer, limits memory. Losing a record costs one session its pin, tier and usage
    estimate (one cache miss or one proactive re-escalation), never a failed request.

    Args:
        max_sessions: bound on records.
        ttl_s: how long a record lives after its last write.
    """

    __slots__ = ("_records", "max_sessions", "ttl_s")

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS, ttl_s: float = 3600.0) -> None:
        if max_sessions < 1:
            raise ConfigError(
                f"state.max_pins must be >= 1, got {max_sessions}; it bounds the sessions "
                "the router remembers (100000 by default)")
        if not ttl_s > 0:
            raise ConfigError(
                f"state.session_ttl_s must be a positive number of seconds, got {ttl_s!r}")
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._records: OrderedDict[str, tuple[SessionRecord, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def get(self, key: str, now_s: float) -> SessionRecord | None:
        """The live record of ``key``, or None (never written, expired or evicted)."""
        entry = self._records.get(key)
        if entry is None:
            return None
        record, expires_at = entry
        if now_s >= expires_at:
            del self._records[key]
            return None
        self._records.move_to_end(key)
        return record

    def put(self, key: str, record: SessionRecord, now_s: float,
            ttl_s: float | None = None) -> None:
        """Write ``key``'s record; it lives ``ttl_s`` (default: the table's) from now."""
        self._records[key] = (record, now_s + (self.ttl_s if ttl_s is None else ttl_s))
        self._records.move_to_end(key)
        while len(self._records) > self.max_sessions:
            self._records.popitem(last=False)

    def clear(self) -> None:
        self._records.clear()
