"""KV-event subscriber: one per replica, SUB + on-demand replay, batches delivered in order.

Owns the sockets that read one engine's event stream, and drives the sequence machine that
decides what to do with each batch (``core/event_sequence.py``). It does not own the index: it hands each batch to ``on_batch(replica, batch)`` and tells the
owner to forget the replica with ``on_reset(replica, reason)`` when the stream can no longer
be trusted. Both callbacks run on the event loop's thread, one at a time (from the socket's
reader callback, or from the subscriber's task around a replay), so the owner can feed a
single-owner actor (``RouterCore``) without locks. An exception from a callback ends
the subscriber (it propagates out of ``run``): an owner bug must be loud, not retried.

Sequencing
----------

What to do with each batch is decided by a pure state machine, ``core/event_sequence.py``
(its module doc has the theory of operation): apply it, reset the owner's view then apply
it, or replay ``[start, stop)`` first and then apply what the replay brought. The
subscriber is its driver: it feeds it live and replayed batches, the replay's end, timeout
or malformed reply, and carries out what it decides.

Malformed live messages are counted and logged; the loop keeps going, and the lost sequence
number is recovered (or reset) by the gap logic when the next good message arrives. Events
of unknown types are skipped by the codec and counted in ``unknown_events``.

Receiving
---------

The SUB socket is a plain (synchronous) libzmq socket whose file descriptor the event loop
watches (``add_reader``); the subscriber reads it from that callback with ``NOBLOCK``. Why
not ``zmq.asyncio``: an awaited ``recv_multipart`` costs a future, pyzmq's own reader
callback, flag arithmetic on Python enums and a wake-up of the subscriber's task for every
message. A router gets about one message per request, one at a time, so that machinery was
a visible share of its CPU (docs/benchmarks.md, "KV events read without zmq.asyncio").

Every message goes through the reader callback, which decodes it and carries out what the
sequence machine decides right there when no replay is needed (the steady state, and a
reset): one callback a message, no task wake-up. A message that needs a replay first (the
first one ever, a gap) is handed to the subscriber's task, which runs the replay and
delivers. Until the task is done with it, the callback reads nothing more: order holds,
and a replay finishes before the next queued message is taken. The task then drains what
queued meanwhile.

The descriptor is edge-triggered: it signals a change of ``ZMQ_EVENTS``, not readiness, and
stays readable until ``ZMQ_EVENTS`` is read. So each read checks ``ZMQ_EVENTS`` first and
stops only when it shows no message, nothing stops reading without either that or a reader
already scheduled (a continuation, or the task with a message in hand), and a callback that
stands down for such a reader still reads ``ZMQ_EVENTS`` (or the loop's poll would report
the descriptor on every turn). At most ``_TAKE_PER_TURN``
messages are handled per callback; if more are queued, the rest are taken by a continuation
on the next loop turn (``call_soon``), so a busy engine cannot starve the router's other
tasks. A continuation already scheduled makes the descriptor's own callback stand down, so a
turn never takes more than ``_TAKE_PER_TURN``. All of it runs on the loop's thread, as ZMQ
requires.

An exception from ``on_batch`` or ``on_reset`` in the callback is kept and raised by the
subscriber's task, so it still ends the subscriber (``run``, ``stop``).

Replays
-------

A replay can be large: a router that starts (or restarts) beside busy engines catches up on
each engine's whole buffer (vLLM keeps 10,000 batches). It runs beside the requests the router
is serving, so it must neither stall the loop nor starve them:

* the DEALER is a plain socket read with ``NOBLOCK``, like the SUB (pyzmq's asyncio ``poll``
  and ``recv_multipart`` were most of a replay's CPU: docs/benchmarks.md, "Starting beside
  busy engines: the KV-event catch-up");
* receiving and then delivering both yield to the loop after every ``_REPLAY_PER_TURN``
  batches, so a request waits for one such slice at most;
* subscribers given the same ``catch_up_turns`` lock (the router gives all of its own one)
  catch up one at a time. Eight at once put eight slices back to back between two steps of
  every request (the p99 it cost is in the same section). Gap recoveries,
  small and urgent (the live stream waits for them), do not take turns.

The live stream queues meanwhile (the task has a message in hand), and ``stats.replaying``
says a replay is under way (the router exports it as ``kvroute_kv_event_replaying``).

``replay_timeout`` bounds the time spent *waiting* for the engine during one replay, not the
time the router spends decoding, delivering and serving in between: a dead or silent replay
socket still fails the replay within it, while a long catch-up on a busy router is not cut
short for the router's own slowness. The engine's buffer bounds what it can send.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import cast

import zmq
import zmq.asyncio

from kvroute.core.errors import MalformedEventError
from kvroute.core.event_sequence import (
    Apply,
    EventSequence,
    Replayed,
    ReplayOutcome,
    ReplayPurpose,
    RequestReplay,
    ResetCause,
)
from kvroute.core.events import EventBatch
from kvroute.core.types import ReplicaId
from kvroute.wire.vllm_events import (
    ReplayEnd,
    decode_message,
    decode_replay_reply,
    encode_replay_request,
)

__all__ = ["EventSubscriber", "OnBatch", "OnReset", "SubscriberStats"]

log = logging.getLogger(__name__)

OnBatch = Callable[[ReplicaId, EventBatch], None]
OnReset = Callable[[ReplicaId, str], None]

_TAKE_PER_TURN = 64
"""Most live messages handled between two yields to the event loop."""
_REPLAY_PER_TURN = 16
"""Most replayed messages received, or replayed batches delivered, between two yields: a
catch-up is not urgent, and a request should wait for a few hundred µs of it at most."""
_BIND_WAIT_S = 2.0
"""How long a binding subscriber waits for its address to be released (``_bind_sub``)."""
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)  # plain ints: ``zmq.PollEvent`` arithmetic runs in Python


@dataclasses.dataclass(slots=True)
class SubscriberStats:
    """Counters of one subscriber; ``EventSubscriber.stats`` returns a copy."""

    batches: int = 0
    """Batches delivered to ``on_batch`` (live and replayed)."""
    events: int = 0
    """Events delivered to ``on_batch``."""
    gaps: int = 0
    """Times a live sequence number jumped ahead of the expected one."""
    replays: int = 0
    """Replay requests sent (gap recovery and the first-message catch-up)."""
    replayed_batches: int = 0
    """Batches delivered that came from a replay."""
    resets: int = 0
    """Calls to ``on_reset``."""
    malformed: int = 0
    """Live messages or replay replies that could not be decoded."""
    unknown_events: int = 0
    """Events of an unknown type, skipped by the codec."""
    last_seq: int | None = None
    """Sequence number of the last delivered batch."""
    replaying: bool = False
    """A replay (catch-up or gap recovery) is being received or delivered now."""


class EventSubscriber:
    """Subscribes to one replica's KV events and delivers them in sequence order.

    Args:
        replica: the replica these events describe (passed back to the callbacks).
        endpoint: the engine's PUB endpoint (``tcp://host:5557``), connected to.
        on_batch: receives each batch, in sequence order, exactly once.
        on_reset: told to forget everything about the replica, with a human-readable reason.
        replay_endpoint: the engine's replay ROUTER endpoint; None disables recovery.
        topic: SUB prefix filter (vLLM's default topic is ``""``, which matches everything).
        replay_timeout: seconds one replay may spend waiting for the engine's answers (the
            router's own work in between is not counted; module doc, Replays).
        catch_up: replay the engine's buffer when the first message is not seq 0.
        hwm: receive high-water mark of the SUB socket (vLLM's PUB default is 100 000).
        context: a ``zmq.asyncio.Context``; the process-wide instance when None.
        catch_up_turns: a lock shared by subscribers that should catch up one at a time
            (module doc, Replays); None: this one never waits for others.
        token_ids: decode ``BlockStored.token_ids`` of live messages; the router turns it off
            (its index needs only hashes, and skipping them roughly halves decode time).
        resume_after: the owner already holds every batch up to and including this sequence
            number (rebuilt from the durable stream, ``shell/kv_stream.py``): the first live
            batch is sequenced as if that one had just been delivered, so a gap after it is
            replayed from the engine and a lower number is a restart
            (``core/event_sequence.py``, Resuming). None: catch up as usual.
        bind: bind the SUB socket at ``endpoint`` instead of connecting. vLLM's publisher
            binds only wildcard (``tcp://*:5557``), ipc and inproc endpoints; given a concrete
            ``tcp://127.0.0.1:5601`` it connects, and the router must bind that address.
    """

    def __init__(
        self,
        replica: ReplicaId,
        endpoint: str,
        *,
        on_batch: OnBatch,
        on_reset: OnReset,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout: float = 2.0,
        catch_up: bool = True,
        hwm: int = 100_000,
        context: zmq.asyncio.Context | None = None,
        bind: bool = False,
        token_ids: bool = True,
        catch_up_turns: asyncio.Lock | None = None,
        resume_after: int | None = None,
    ) -> None:
        if replay_timeout <= 0:
            raise ValueError(f"replay_timeout must be > 0 seconds, got {replay_timeout}")
        self.replica = replica
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._on_batch = on_batch
        self._on_reset = on_reset
        self._replay_timeout = replay_timeout
        self._hwm = hwm
        self._bind = bind
        self._token_ids = token_ids
        self._catch_up_turns = catch_up_turns
        self._ctx = context if context is not None else zmq.asyncio.Context.instance()
        self._stats = SubscriberStats(last_seq=resume_after)
        self._sequence = EventSequence(can_replay=replay_endpoint is not None,
                                       catch_up=catch_up, resume_after=resume_after)
        self._task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        # Receiving (module doc): the socket while running, the task's wake-up, the replay
        # it must run, an error from a callback, and whether a continuation is scheduled.
        self._sub: zmq.Socket[bytes] | None = None
        self._wake = asyncio.Event()
        self._pending: RequestReplay | None = None
        self._failure: Exception | None = None
        self._continuing = False

    @property
    def stats(self) -> SubscriberStats:
        """A snapshot of the counters."""
        return dataclasses.replace(self._stats)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> asyncio.Task[None]:
        """Run the subscriber on a new task of the running loop and return the task."""
        if self._task is not None:
            raise RuntimeError(f"subscriber for {self.replica} already started")
        self._task = asyncio.get_running_loop().create_task(
            self.run(), name=f"kv-events-{self.replica}"
        )
        return self._task

    async def wait_connected(self) -> None:
        """Return once the SUB socket is connected (the subscription may still be in flight)."""
        await self._connected.wait()

    async def stop(self) -> None:
        """End the subscriber promptly and close its sockets. Idempotent.

        Raises:
            Exception: whatever ended the task before it was stopped (a callback's error).
        """
        task = self._task
        if task is None:
            return
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def run(self) -> None:
        """Receive until cancelled. Use ``start``/``stop``, or own the task yourself."""
        loop = asyncio.get_running_loop()
        sub: zmq.Socket[bytes] = zmq.Socket(self._ctx, zmq.SUB)
        fd: int | None = None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, self._hwm)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode("utf-8"))
            if self._bind:
                # The engine was given this exact tcp://host:port, so vLLM *connects* its
                # PUB socket to it and the subscriber must be the one that binds.
                await self._bind_sub(sub)
            else:
                sub.connect(self.endpoint)
            self._sub = sub
            fd = cast(int, sub.getsockopt(zmq.FD))
            loop.add_reader(fd, self._on_readable)
            self._connected.set()
            self._take()  # anything queued before the reader was in place raised no edge
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._failure is not None:
                    raise self._failure
                request = self._pending
                if request is not None:
                    await self._recover(request)
                    self._pending = None
                    self._take()  # the edges of what queued meanwhile were not acted on
        finally:
            self._sub = None
            if fd is not None:
                loop.remove_reader(fd)
            sub.close(linger=0)

    async def _bind_sub(self, sub: zmq.Socket[bytes]) -> None:
        """Bind ``sub`` at the endpoint, waiting up to ``_BIND_WAIT_S`` while the address is
        in use.

        Why wait: libzmq releases a closed socket's listener later, in its I/O thread, so a
        subscriber started right after another one of this process closed on the same
        endpoint (a router runtime restarted in place) can find it still held for a moment.
        Any other error, or the address still in use after the wait, is raised.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _BIND_WAIT_S
        while True:
            try:
                sub.bind(self.endpoint)
                return
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or loop.time() >= deadline:
                    raise
            await asyncio.sleep(0.05)

    def _on_readable(self) -> None:
        """The descriptor's callback (module doc, Receiving)."""
        sub = self._sub
        if sub is not None and (self._continuing or self._pending is not None):
            # A continuation or the task will read; reading ZMQ_EVENTS here clears the
            # descriptor, which the loop's level-triggered poll would otherwise report on
            # every turn until then.
            sub.get(_EVENTS)
            return
        self._take()

    def _continue(self) -> None:
        self._continuing = False
        self._take()

    def _take(self) -> None:
        """Read and deliver queued messages until none is left, one needs a replay (the
        task's), or ``_TAKE_PER_TURN`` were handled (then continue on the next loop turn)."""
        sub = self._sub
        if sub is None or self._pending is not None or self._failure is not None:
            return  # stopped, or the task has a message in hand and drains after it
        try:
            for _ in range(_TAKE_PER_TURN):
                if not cast(int, sub.get(_EVENTS)) & _POLLIN:
                    return
                batch = self._decode(sub.recv_multipart(zmq.NOBLOCK))
                if batch is None:
                    continue
                action = self._sequence.receive_live(batch)
                if isinstance(action, Apply):
                    self._deliver(batch)
                elif isinstance(action, RequestReplay):
                    if action.purpose is ReplayPurpose.GAP:
                        self._stats.gaps += 1
                    self._pending = action
                    self._wake.set()
                    return
                else:
                    if action.cause is ResetCause.GAP_WITHOUT_REPLAY:
                        self._stats.gaps += 1
                    self._reset(action.reason)
                    self._deliver(batch)
            self._continuing = True
            asyncio.get_running_loop().call_soon(self._continue)  # callbacks run on the loop
        except Exception as exc:  # noqa: BLE001 - kept and raised by the task (module doc)
            self._failure = exc
            self._wake.set()

    # ------------------------------------------------------------------ sequencing

    def _decode(self, frames: list[bytes]) -> EventBatch | None:
        """The live message's batch, or None (counted and logged) when it is malformed."""
        try:
            return decode_message(frames, on_unknown=self._count_unknown,
                                  token_ids=self._token_ids)
        except MalformedEventError as exc:
            self._stats.malformed += 1
            log.warning("replica %s: dropped a malformed KV-event message: %s", self.replica, exc)
            return None

    def _count_unknown(self, tag: str) -> None:
        self._stats.unknown_events += 1
        log.debug("replica %s: skipped an event of unknown type %r", self.replica, tag)

    def _deliver(self, batch: EventBatch) -> None:
        self._stats.batches += 1
        self._stats.events += len(batch.events)
        self._stats.last_seq = batch.seq
        self._on_batch(self.replica, batch)

    def _reset(self, reason: str) -> None:
        self._stats.resets += 1
        log.warning("replica %s: KV index reset: %s", self.replica, reason)
        self._on_reset(self.replica, reason)

    @contextlib.contextmanager
    def _replaying(self) -> Iterator[None]:
        """``stats.replaying`` while a replay is received and delivered."""
        self._stats.replaying = True
        try:
            yield
        finally:
            self._stats.replaying = False

    async def _deliver_replayed(self, batches: tuple[EventBatch, ...]) -> None:
        """Deliver replayed batches in order, yielding to the loop after every
        ``_REPLAY_PER_TURN`` (module doc, Replays)."""
        for n, batch in enumerate(batches, start=1):
            self._stats.replayed_batches += 1
            self._deliver(batch)
            if n % _REPLAY_PER_TURN == 0:
                await asyncio.sleep(0)

    async def _recover(self, request: RequestReplay) -> None:
        """Run the replay the sequence machine asked for and carry out its outcome: a
        catch-up in turns with the other subscribers (module doc, Replays), a gap recovery
        at once."""
        catch_up = request.purpose is ReplayPurpose.CATCH_UP
        turns = self._catch_up_turns if catch_up else None
        async with turns or contextlib.nullcontext():
            with self._replaying():
                outcome = await self._replay(request)
                if outcome.reset is not None:
                    self._reset(outcome.reset)
                elif outcome.problem is not None:  # a catch-up: no reset (module doc)
                    log.info("replica %s: caught up on the last %d batches before %d only: %s",
                             self.replica, len(outcome.replayed), outcome.live.seq,
                             outcome.problem)
                await self._deliver_replayed(outcome.replayed)
        self._deliver(outcome.live)

    async def _replay(self, request: RequestReplay) -> ReplayOutcome:
        """Ask the replay ROUTER for ``[request.start, request.stop)`` and feed the answers
        to the sequence machine until it has them all, the engine says it has no more, the
        waiting exceeds ``replay_timeout`` or a reply is malformed; never raises for a bad
        peer.

        Reads a plain DEALER with ``NOBLOCK`` and yields every ``_REPLAY_PER_TURN`` messages;
        waits on the descriptor only when ``ZMQ_EVENTS`` shows nothing (module doc,
        Receiving and Replays)."""
        assert self.replay_endpoint is not None, "the sequence machine replays only with one"
        self._stats.replays += 1
        sequence = self._sequence
        loop = asyncio.get_running_loop()
        waited = 0.0
        dealer: zmq.Socket[bytes] = zmq.Socket(self._ctx, zmq.DEALER)
        readable = asyncio.Event()
        fd: int | None = None
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.replay_endpoint)
            # A connecting DEALER queues the request (its pipe exists from connect on).
            dealer.send_multipart(encode_replay_request(request.start), zmq.NOBLOCK)
            fd = cast(int, dealer.getsockopt(zmq.FD))
            loop.add_reader(fd, readable.set)
            taken = 0
            while True:
                if not cast(int, dealer.get(_EVENTS)) & _POLLIN:
                    # Reading ZMQ_EVENTS re-armed the edge: the next message sets the event.
                    readable.clear()
                    remaining = self._replay_timeout - waited
                    if remaining <= 0:
                        return sequence.replay_timed_out(self._replay_timeout)
                    began = loop.time()
                    try:
                        async with asyncio.timeout(remaining):
                            await readable.wait()
                    except TimeoutError:
                        return sequence.replay_timed_out(self._replay_timeout)
                    finally:
                        waited += loop.time() - began
                    continue
                frames = dealer.recv_multipart(zmq.NOBLOCK)
                try:
                    reply = decode_replay_reply(frames, on_unknown=self._count_unknown,
                                                token_ids=self._token_ids)
                except MalformedEventError as exc:
                    self._stats.malformed += 1
                    return sequence.replay_malformed(str(exc))
                if isinstance(reply, ReplayEnd):
                    return sequence.replay_ended()
                if sequence.receive_replayed(reply.batch) is Replayed.COMPLETE:
                    return sequence.replay_ended()
                taken += 1
                if taken % _REPLAY_PER_TURN == 0:
                    await asyncio.sleep(0)
        finally:
            if fd is not None:
                loop.remove_reader(fd)
            dealer.close(linger=0)
