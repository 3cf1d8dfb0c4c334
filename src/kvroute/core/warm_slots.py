"""The in-flight guards of warm-ahead, as bookkeeping without I/O (:class:`WarmSlots`).

Owns which warm-up job each session has in flight or waiting, and how many warm-ups each
target replica is sending. Pure: no tasks, no clock, no I/O; ``shell/warm.py`` (``WarmSender``)
runs the tasks and asks this module what it may do. Why the guards exist (vLLM's FCFS queue,
a warm-up being a full prefill) is told in ``shell/warm.py``'s module docstring.

Generic over the job: the guards read only a job's ``session_id`` and hand the job back
unchanged, so the shell's job type (which carries an async route-request factory) never has
to be known here.

Theory of operation (one session):

    no job --offer--> current (uncommitted)           Offer.START
    current (uncommitted) --offer--> the new job is current, the old one is returned
                                                     Offer.REPLACED (dropped: superseded)
    current --commit--> current (committed: being sent)
    committed --offer--> the new job waits behind it; an older waiting job is returned
                                                     Offer.QUEUED (dropped: superseded)
    committed --advance--> the waiting job becomes current (uncommitted), or no job
    any --drop--> no job (the session's task ended without ``advance``: cancelled)

Per replica: ``acquire`` takes one of ``per_replica`` slots or refuses, ``release`` gives it
back; the count never goes above the bound nor below zero.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from kvroute.core.errors import ConfigError
from kvroute.core.types import ReplicaId

__all__ = ["Offer", "SessionJob", "WarmSlots"]


class SessionJob(Protocol):
    """What the guards need of a warm-up job: the session it warms."""

    @property
    def session_id(self) -> str: ...


JobT = TypeVar("JobT", bound=SessionJob)


class Offer(enum.Enum):
    """What ``WarmSlots.offer`` did with a job."""

    START = "start"
    """The session had no warm-up: start a task for it."""
    REPLACED = "replaced"
    """The session's warm-up was not committed yet (waiting for a replica slot): it now
    carries this job instead."""
    QUEUED = "queued"
    """The session's warm-up is being sent: this job runs after it."""


@dataclass(slots=True)
class _SessionWarms(Generic[JobT]):
    job: JobT
    committed: bool = False
    next: JobT | None = None


class WarmSlots(Generic[JobT]):
    """Warm-ups in flight per session and per replica: bookkeeping only, no I/O, no tasks.

    Invariants: a session has at most one current job (committed once its sending begins)
    and at most one job waiting behind it; ``in_flight(r) <= per_replica`` for every
    replica (``acquire`` refuses beyond it, ``release`` gives a slot back).

    Args:
        per_replica: ``warm_ahead.max_in_flight_per_replica``.

    Raises:
        ConfigError: ``per_replica`` below 1.
    """

    __slots__ = ("_in_flight", "_per_replica", "_sessions")

    def __init__(self, per_replica: int) -> None:
        if per_replica < 1:
            raise ConfigError(
                f"warm_ahead.max_in_flight_per_replica must be >= 1, got {per_replica}; to "
                "stop warm-ups set warm_ahead.enabled: false")
        self._per_replica = per_replica
        self._sessions: dict[str, _SessionWarms[JobT]] = {}
        self._in_flight: Counter[ReplicaId] = Counter()

    def __len__(self) -> int:
        """Sessions with a current job."""
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    # -- per session ---------------------------------------------------------------------

    def offer(self, job: JobT) -> tuple[Offer, JobT | None]:
        """Record ``job`` for its session; returns what happened and the job it superseded.

        The superseded job (an older stage, never sent) is dropped by the caller with a
        ``superseded`` count.
        """
        session = job.session_id
        entry = self._sessions.get(session)
        if entry is None:
            self._sessions[session] = _SessionWarms(job)
            return Offer.START, None
        if not entry.committed:
            old, entry.job = entry.job, job
            return Offer.REPLACED, old
        old_next, entry.next = entry.next, job
        return Offer.QUEUED, old_next

    def current(self, session_id: str) -> JobT:
        """The session's current job (``KeyError`` when it has none)."""
        return self._sessions[session_id].job

    def commit(self, session_id: str) -> JobT:
        """Fix the session's current job (it is about to be sent); later offers queue."""
        entry = self._sessions[session_id]
        entry.committed = True
        return entry.job

    def advance(self, session_id: str) -> JobT | None:
        """The current job is done: make the waiting one current (uncommitted) and return
        it, or forget the session and return None."""
        entry = self._sessions[session_id]
        if entry.next is None:
            del self._sessions[session_id]
            return None
        entry.job, entry.next, entry.committed = entry.next, None, False
        return entry.job

    def drop(self, session_id: str) -> None:
        """Forget the session's jobs (its task ended without ``advance``: cancelled)."""
        self._sessions.pop(session_id, None)

    # -- per replica ---------------------------------------------------------------------

    def in_flight(self, replica: ReplicaId) -> int:
        return self._in_flight[replica]

    def has_room(self, replicas: Iterable[ReplicaId]) -> bool:
        """True when some replica of ``replicas`` is below the bound (False when empty)."""
        return any(self._in_flight[r] < self._per_replica for r in replicas)

    def acquire(self, replica: ReplicaId) -> bool:
        """Take a slot on ``replica``; False (nothing taken) when it is at the bound."""
        if self._in_flight[replica] >= self._per_replica:
            return False
        self._in_flight[replica] += 1
        return True

    def release(self, replica: ReplicaId) -> None:
        """Give back a slot ``acquire`` took."""
        left = self._in_flight[replica] - 1
        if left < 0:
            raise AssertionError(f"warm-up slot of {replica} released more often than taken")
        if left:
            self._in_flight[replica] = left
        else:
            del self._in_flight[replica]
