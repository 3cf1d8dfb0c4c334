"""Sequencing of one replica's KV-event stream: which batches to apply, when to ask the
engine for a replay, and when the replica's index can no longer be trusted.

Owns the sequence bookkeeping of one engine's stream and the batches of a replay in
progress, nothing else. It is sans-IO, in the manner of h11: facts go in (a live batch, a
replayed batch, the end of a replay, a replay that timed out or could not be read) and
decisions come out (apply, reset then apply, request a replay of ``[start, stop)``, drop a
replayed duplicate, the outcome of a replay). It reads no socket and no clock: the shell's
``EventSubscriber`` (``shell/zmq_events.py``) moves the frames, bounds a replay's waiting,
makes catch-ups take turns and calls the owner's callbacks. Must not import ``shell``,
``sim`` or ``wire``.

Theory of operation
-------------------

vLLM numbers the batches of one publisher process 0, 1, 2, ... and keeps the last few
thousand for replay. ``expected`` is the next sequence number the owner has not yet seen::

       NEW ---- first live s: s == 0, catch-up off or no replay socket: Apply ----> FOLLOWING
        |                                                                          ^   |
        | first live s > 0: RequestReplay(0, s, CATCH_UP)                          |   |
        v                                                                          |   |
   CATCHING_UP ---- replay over: ReplayOutcome, never a reset ---------------------+   |
                                                                                   |   |
   RECOVERING ----- replay over: ReplayOutcome, a reset if incomplete -------------+   |
        ^                                                                              |
        +---- live s > expected, replay socket: RequestReplay(expected, s, GAP) -------+

   FOLLOWING, live s == expected: Apply
              live s <  expected: ResetThenApply(RESTART)
              live s >  expected, no replay socket: ResetThenApply(GAP_WITHOUT_REPLAY)

For each live batch with sequence ``s``:

* first batch ever: if ``s > 0``, catch-up is on and the engine has a replay socket, ask for
  ``[0, s)`` and apply whatever contiguous run ending at ``s - 1`` the engine still buffers
  (never a reset: the owner's view of this replica starts empty), then ``s``. Otherwise
  apply ``s``.
* ``s == expected``: apply (the steady state, and the cheapest path).
* ``s > expected`` (a gap: the SUB socket dropped messages, or they were malformed): ask for
  ``[expected, s)``. If all of it arrives, apply it in order, then ``s``. Otherwise (no
  replay socket, the buffer no longer reaches back that far, a timeout, a malformed reply)
  reset, apply the contiguous tail ending at ``s - 1`` that did arrive, then ``s``: events
  after a reset are fresh truth, and removals of blocks the owner never saw are no-ops for
  a reference-counting index.
* ``s < expected``: the publisher restarted (vLLM counts from 0 per process): reset, then
  apply ``s``. This is never a duplicate: ZMQ does not repeat a message, and a replay is
  only asked for ``[expected, s)``, below the live stream, so a lower number can only come
  from a new publisher.

While a replay is under way the live stream waits (the driver holds the live batch that
asked for it and reads no further), so the machine takes no live batch then. Replayed
batches outside ``[start, stop)`` or already held are dropped as duplicates: below
``start`` the owner has them, from ``stop`` on the live stream carries them (vLLM replays
everything it buffers from ``start``).

Resuming. A router that rebuilt a replica's index from somewhere else first (the durable
stream, ``shell/kv_stream.py``, up to and including batch ``n``) starts its machine with
``resume_after=n``: it is then ``FOLLOWING`` with ``expected == n + 1``, so the first live
batch goes through the ordinary rules above. ``n + 1`` applies; a higher number is a gap
recovered from the engine's replay buffer (or a reset if the buffer no longer holds it); a
number at or below ``n`` can only come from a new publisher process (the stream's batches
were published before the subscription began), so it resets.

NOTE: a restart is invisible if the new process publishes past ``expected`` before the
subscriber reads its first message (vLLM has no publisher epoch): the gap logic then
replays from the new process and the index keeps stale entries until they are evicted. The
discovery loop's health checks (engine restart) are the backstop for that case.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from kvroute.core.events import EventBatch

__all__ = [
    "APPLY",
    "Apply",
    "EventSequence",
    "LiveAction",
    "ReplayOutcome",
    "ReplayPurpose",
    "Replayed",
    "RequestReplay",
    "ResetCause",
    "ResetThenApply",
    "SequenceState",
]


class SequenceState(enum.Enum):
    """Where the stream stands."""

    NEW = "new"
    """No live batch received yet."""
    FOLLOWING = "following"
    """In step with the live stream: ``expected`` is the next sequence number."""
    CATCHING_UP = "catching_up"
    """The first live batch was not 0: replaying the engine's buffer before it."""
    RECOVERING = "recovering"
    """A gap in the live stream: replaying the missed batches."""


class ReplayPurpose(enum.Enum):
    """Why a replay is asked for; it decides what an incomplete replay costs."""

    CATCH_UP = "catch_up"
    """Before the first live batch; incomplete is fine (the owner's view starts empty)."""
    GAP = "gap"
    """Batches missed from the live stream; incomplete means the index cannot be trusted."""


class ResetCause(enum.Enum):
    """Why a live batch makes the owner forget everything it knows about the replica (a
    replay's own reset is always a gap it could not recover, ``ReplayOutcome.reset``)."""

    RESTART = "restart"
    """The sequence went backwards: a new publisher process."""
    GAP_WITHOUT_REPLAY = "gap_without_replay"
    """Batches were missed and the engine has no replay socket to ask."""


class Replayed(enum.Enum):
    """What became of one replayed batch."""

    KEPT = "kept"
    """Held, to be applied when the replay is over; more are needed."""
    DUPLICATE = "duplicate"
    """Outside the requested range, or already held: dropped."""
    COMPLETE = "complete"
    """Held, and it was the last one missing: stop reading and end the replay."""


@dataclass(frozen=True, slots=True)
class Apply:
    """Apply the live batch now: it is the next in sequence (or the first, not caught up)."""


APPLY: Final = Apply()
"""The only ``Apply``: the steady state allocates nothing."""


@dataclass(frozen=True, slots=True)
class ResetThenApply:
    """Tell the owner to forget the replica (``reason`` is for people), then apply the live
    batch: what follows a reset is fresh truth."""

    cause: ResetCause
    reason: str


@dataclass(frozen=True, slots=True)
class RequestReplay:
    """Ask the engine's replay socket for ``[start, stop)``; the live batch ``stop`` waits.

    Feed what arrives to ``receive_replayed`` and end with ``replay_ended``,
    ``replay_timed_out`` or ``replay_malformed``.
    """

    start: int
    stop: int
    purpose: ReplayPurpose


LiveAction = Apply | ResetThenApply | RequestReplay
"""What ``EventSequence.receive_live`` decides."""


@dataclass(frozen=True, slots=True)
class ReplayOutcome:
    """A replay is over. In order: if ``reset`` is set, tell the owner to forget the replica
    with that reason; apply ``replayed``; apply ``live``.

    Attributes:
        live: the live batch that asked for the replay.
        replayed: contiguous replayed batches ending at ``live.seq - 1`` (all of the asked
            range when ``problem`` is None, else the tail that arrived; maybe empty).
        reset: the reason for a reset (an incomplete gap recovery), or None.
        problem: why the replay was incomplete, or None. A catch-up can be incomplete
            without a reset (an engine that ran long no longer buffers batch 0).
    """

    live: EventBatch
    replayed: tuple[EventBatch, ...]
    reset: str | None
    problem: str | None


class EventSequence:
    """The sequence state machine of one replica's event stream (module doc).

    Args:
        can_replay: the engine has a replay socket the driver can ask.
        catch_up: replay the engine's buffer when the first live batch is not 0.
        resume_after: the owner already applied every batch up to and including this one
            (module doc, Resuming); None: start ``NEW``.

    Invariants: ``expected`` is set exactly in ``FOLLOWING``; a replay's held batches all
    lie in ``[start, stop)``; every ``ReplayOutcome`` leaves the machine ``FOLLOWING`` with
    ``expected == live.seq + 1``.
    """

    __slots__ = ("_can_replay", "_catch_up", "_expected", "_got", "_live", "_purpose",
                 "_start", "_state")

    def __init__(self, *, can_replay: bool, catch_up: bool = True,
                 resume_after: int | None = None) -> None:
        if resume_after is not None and resume_after < 0:
            raise ValueError(f"resume_after must be a sequence number >= 0, got {resume_after}")
        self._can_replay = can_replay
        self._catch_up = catch_up
        self._state = SequenceState.NEW
        self._expected = 0  # meaningful in FOLLOWING only (the ``expected`` property)
        if resume_after is not None:
            self._state = SequenceState.FOLLOWING
            self._expected = resume_after + 1
        # The replay in progress: its purpose, range start, the waiting live batch (whose
        # seq is the range's stop) and what arrived of the range so far.
        self._purpose = ReplayPurpose.CATCH_UP
        self._start = 0
        self._live: EventBatch | None = None
        self._got: dict[int, EventBatch] = {}

    @property
    def state(self) -> SequenceState:
        return self._state

    @property
    def expected(self) -> int | None:
        """The next sequence number the owner has not seen; None unless ``FOLLOWING``."""
        return self._expected if self._state is SequenceState.FOLLOWING else None

    # ------------------------------------------------------------------ the live stream

    def receive_live(self, batch: EventBatch) -> LiveAction:
        """Decide what to do with a live batch (module doc, Theory of operation).

        Raises:
            RuntimeError: a replay is under way (the driver must end it first).
        """
        seq = batch.seq
        state = self._state
        if state is SequenceState.FOLLOWING:
            expected = self._expected
            if seq == expected:
                self._expected = seq + 1
                return APPLY
            if seq < expected:
                self._expected = seq + 1
                return ResetThenApply(
                    ResetCause.RESTART,
                    f"sequence went back from {expected - 1} to {seq}: the engine's publisher "
                    "restarted, so everything known about this replica is stale",
                )
            if not self._can_replay:
                self._expected = seq + 1
                return ResetThenApply(
                    ResetCause.GAP_WITHOUT_REPLAY,
                    f"missed batches {expected}..{seq - 1} and no replay endpoint is "
                    "configured (set the engine's kv-events replay_endpoint to recover gaps)",
                )
            return self._begin_replay(ReplayPurpose.GAP, SequenceState.RECOVERING,
                                      expected, batch)
        if state is SequenceState.NEW:
            if seq > 0 and self._catch_up and self._can_replay:
                return self._begin_replay(ReplayPurpose.CATCH_UP, SequenceState.CATCHING_UP,
                                          0, batch)
            self._state = SequenceState.FOLLOWING
            self._expected = seq + 1
            return APPLY
        raise RuntimeError(
            f"live batch {seq} received while {state.value}: end the replay for batch "
            f"{self._live_seq()} first"
        )

    def _begin_replay(self, purpose: ReplayPurpose, state: SequenceState, start: int,
                      live: EventBatch) -> RequestReplay:
        self._state = state
        self._purpose = purpose
        self._start = start
        self._live = live
        self._got = {}
        return RequestReplay(start, live.seq, purpose)

    # ------------------------------------------------------------------ a replay

    def receive_replayed(self, batch: EventBatch) -> Replayed:
        """Take one batch the replay socket sent.

        Raises:
            RuntimeError: no replay is under way.
        """
        stop = self._live_seq()
        seq = batch.seq
        got = self._got
        if not self._start <= seq < stop or seq in got:
            return Replayed.DUPLICATE
        got[seq] = batch
        return Replayed.COMPLETE if len(got) == stop - self._start else Replayed.KEPT

    def replay_ended(self) -> ReplayOutcome:
        """The replay socket sent its end marker, or ``receive_replayed`` said COMPLETE.

        Raises:
            RuntimeError: no replay is under way.
        """
        stop = self._live_seq()
        got = self._got
        if len(got) == stop - self._start:
            return self._finish(None)
        missing = next(s for s in range(self._start, stop) if s not in got)
        oldest = f"the oldest it returned was {min(got)}" if got else "it returned none of them"
        return self._finish(
            f"the engine's replay buffer no longer holds batch {missing} ({oldest})")

    def replay_timed_out(self, timeout_s: float) -> ReplayOutcome:
        """The driver waited ``timeout_s`` for the engine's answers in all (the time the
        router spent on its own work in between is not counted).

        Raises:
            RuntimeError: no replay is under way.
        """
        return self._finish_unless_complete(
            f"replay did not finish within {timeout_s}s of waiting for the engine's answers")

    def replay_malformed(self, detail: str) -> ReplayOutcome:
        """A reply could not be decoded (``detail`` says why); the rest is not read.

        Raises:
            RuntimeError: no replay is under way.
        """
        return self._finish_unless_complete(f"malformed replay reply ({detail})")

    def _finish_unless_complete(self, problem: str) -> ReplayOutcome:
        complete = len(self._got) == self._live_seq() - self._start
        return self._finish(None if complete else problem)

    def _finish(self, problem: str | None) -> ReplayOutcome:
        live = self._live
        assert live is not None, "a replay outcome without a live batch waiting"
        stop = live.seq
        got = self._got
        first = stop
        while first - 1 in got:  # the contiguous run that ends at stop - 1
            first -= 1
        replayed = tuple(got[s] for s in range(first, stop))
        reset = None
        if problem is not None and self._purpose is ReplayPurpose.GAP:
            reset = f"could not recover batches {self._start}..{stop - 1}: {problem}"
        self._state = SequenceState.FOLLOWING
        self._expected = stop + 1
        self._live = None
        self._got = {}
        return ReplayOutcome(live, replayed, reset, problem)

    def _live_seq(self) -> int:
        """The waiting live batch's seq (the replay's stop); raises when none is waiting."""
        live = self._live
        if live is None:
            raise RuntimeError(f"no replay is under way (the stream is {self._state.value})")
        return live.seq
