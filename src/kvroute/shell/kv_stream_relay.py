"""The durable KV-event stream written: engines' batches relayed into it, with snapshots.

``KvStreamRelay`` is fed by subscribers' callbacks (``shell/zmq_events.EventSubscriber``) and
writes the layout of ``shell/kv_stream.py``: each batch on its replica's subject, a reset
message when the subscriber resets, and the replica's ``BlockCensus`` as a snapshot every
``snapshot_every`` batches. It continues a replica's history from the position
``shell/kv_stream_reader.rebuild`` found (``adopt``), or from what its owner counted while NATS
was away (``resume``: a reset and a snapshot).

A publish that fails (refused, or not acknowledged within ``_ACK_TIMEOUT_S``) is counted and
logged (the first of a run of failures); readers see the hole it leaves as a jump and reset,
and the relay writes a snapshot past it soon. A snapshot that cannot be written is logged and
retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

import nats.errors
from nats.js.api import PubAck

from kvroute.core.block_census import BlockCensus
from kvroute.core.events import EventBatch
from kvroute.core.types import ReplicaId
from kvroute.shell.kv_stream import BATCH, RESET, KvStream, Snapshot
from kvroute.shell.kv_stream_reader import StreamPosition
from kvroute.wire.vllm_events import encode_payload

__all__ = ["KvStreamRelay", "RelayStats"]

log = logging.getLogger(__name__)

_ACK_TIMEOUT_S = 10.0
"""A publish JetStream has not acknowledged by then counts as failed (nats-py's futures
never time out: one lost with its connection would otherwise wait for ever)."""
_SNAPSHOT_RETRY_S = 2.0
"""Least time between two attempts at a snapshot that is due after a failure."""
_RELAY_QUEUE = 100_000
"""Batches waiting for the relay's publisher; beyond it they are dropped (and counted)."""


@dataclasses.dataclass(slots=True)
class RelayStats:
    """Counters of one relay; ``KvStreamRelay.stats`` returns a copy."""

    published: int = 0
    """Batches handed to JetStream (acknowledged or not yet)."""
    resets: int = 0
    """Reset messages handed to JetStream."""
    failed: int = 0
    """Publishes JetStream refused or never acknowledged."""
    dropped: int = 0
    """Batches dropped because the relay's queue was full."""
    snapshots: int = 0
    """Snapshots written."""
    snapshot_failures: int = 0
    """Snapshots that could not be written."""
    last_seq: dict[ReplicaId, int] = dataclasses.field(default_factory=dict)
    """The last batch handed to JetStream, per replica."""


@dataclasses.dataclass(slots=True)
class _Tail:
    """The relay's view of one replica's subject."""

    epoch: int
    last_seq: int | None
    census: BlockCensus
    since_snapshot: int = 0
    last_ack: asyncio.Future[PubAck] | None = None
    snapshot_due: bool = False
    """A publish failed: the stream may have a hole, so snapshot past it soon."""
    next_try: float = 0.0
    """Loop time before which a due snapshot is not tried again (NATS still away)."""


@dataclasses.dataclass(slots=True, frozen=True)
class _Resume:
    """A relay's queue item: the replica's census counted while NATS was away."""

    census: BlockCensus
    last_seq: int | None
    reason: str


class KvStreamRelay:
    """Mirrors KV-event batches into the stream, in the order they are delivered.

    ``on_batch``/``on_reset`` are subscriber callbacks (``EventSubscriber``): they only queue,
    so the subscriber never waits for NATS. One task publishes (``publish_async``: the acks
    are awaited only before a snapshot) and writes each replica's snapshot every
    ``snapshot_every`` batches. ``adopt`` first, with the position ``kv_stream_reader.rebuild``
    found, so the relay continues the replica's history (its epoch and census).
    """

    def __init__(self, stream: KvStream, *, queue_size: int = _RELAY_QUEUE) -> None:
        self._stream = stream
        self._every = stream.config.snapshot_every
        self._queue: asyncio.Queue[tuple[ReplicaId, EventBatch | str | _Resume]] = (
            asyncio.Queue(queue_size))
        self._tails: dict[ReplicaId, _Tail] = {}
        self._stats = RelayStats()
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    @property
    def stats(self) -> RelayStats:
        return dataclasses.replace(self._stats, last_seq=dict(self._stats.last_seq))

    def adopt(self, replica: ReplicaId, position: StreamPosition) -> None:
        """Continue ``replica``'s history from ``position`` (from ``kv_stream_reader.rebuild``)."""
        if position.census is None:
            raise ValueError("adopt needs the census: rebuild(..., census=True)")
        self._tails[replica] = _Tail(position.epoch, position.last_seq, position.census)

    def start(self) -> asyncio.Task[None]:
        if self._task is not None:
            raise RuntimeError("the relay is already started")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-stream-relay")
        return self._task

    async def stop(self, drain_s: float = 5.0) -> None:
        """Publish what is queued (for up to ``drain_s``), then end the task."""
        task = self._task
        if task is None:
            return
        if not task.done():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(drain_s):
                    await self._queue.join()
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def idle(self) -> None:
        """Return once everything queued so far has been handed to JetStream."""
        await self._queue.join()

    # -- the subscriber's callbacks (on the loop's thread) --------------------------------------

    def on_batch(self, replica: ReplicaId, batch: EventBatch) -> None:
        self._put(replica, batch)

    def on_reset(self, replica: ReplicaId, reason: str) -> None:
        self._put(replica, reason)

    def resume(self, replica: ReplicaId, census: BlockCensus, last_seq: int | None,
               reason: str) -> None:
        """Continue ``replica`` from what its owner counted while the stream was away
        (``census``, up to batch ``last_seq``): the relay writes a reset, then a snapshot
        of ``census`` covering ``last_seq`` (past the reset), so a reader rebuilds the
        engine's blocks without the batches that were never relayed. Call it before the
        first ``on_batch`` after ``last_seq``; the census is the relay's from then on."""
        self._put(replica, _Resume(census, last_seq, reason))

    def _put(self, replica: ReplicaId, item: EventBatch | str | _Resume) -> None:
        try:
            self._queue.put_nowait((replica, item))
        except asyncio.QueueFull:
            self._stats.dropped += 1
            if self._stats.dropped == 1 or self._stats.dropped % 10_000 == 0:
                log.warning("KV-event relay: queue full (NATS too slow or away), %d batches "
                            "dropped so far; readers of the stream will see the hole and "
                            "reset that replica", self._stats.dropped)

    # -- the task --------------------------------------------------------------------------------

    async def _run(self) -> None:
        queue = self._queue
        while True:
            replica, item = await queue.get()
            try:
                tail = self._tails.get(replica)
                if tail is None:
                    # Not adopted (its history could not be read): an epoch no earlier
                    # writer can have used, so readers reset and no Nats-Msg-Id repeats.
                    tail = self._tails[replica] = _Tail(int(time.time() * 1000), None,
                                                        BlockCensus())
                if isinstance(item, str):
                    await self._write_reset(replica, tail, item)
                elif isinstance(item, _Resume):
                    await self._write_resume(replica, tail, item)
                else:
                    await self._write_batch(replica, tail, item)
            finally:
                queue.task_done()

    async def _write_reset(self, replica: ReplicaId, tail: _Tail,
                           reason: str) -> asyncio.Future[PubAck] | None:
        tail.epoch += 1
        tail.last_seq = None
        tail.census.clear()
        tail.since_snapshot = 0
        ack = await self._publish(replica, tail, RESET, 0, reason.encode("utf-8"))
        if ack is not None:
            self._stats.resets += 1
        return ack

    async def _write_resume(self, replica: ReplicaId, tail: _Tail, resume: _Resume) -> None:
        """A new epoch whose snapshot is what the owner counted while NATS was away."""
        ack = await self._write_reset(replica, tail, resume.reason)
        tail.census = resume.census
        tail.last_seq = resume.last_seq
        if ack is None or resume.last_seq is None:
            tail.snapshot_due = ack is None and resume.last_seq is not None
            return
        tail.last_ack = ack
        await self._write_snapshot(replica, tail, resume.last_seq)

    async def _write_batch(self, replica: ReplicaId, tail: _Tail, batch: EventBatch) -> None:
        if tail.last_seq is not None and batch.seq != tail.last_seq + 1:
            # No reset came first, so the batches in between were lost here (a full queue):
            # readers see the same jump and reset; the census does the same.
            tail.census.clear()
        tail.census.apply(batch)
        tail.last_seq = batch.seq
        ack = await self._publish(replica, tail, BATCH, batch.seq, encode_payload(batch))
        if ack is not None:
            tail.last_ack = ack
            self._stats.published += 1
            self._stats.last_seq[replica] = batch.seq
        tail.since_snapshot += 1
        if tail.since_snapshot >= self._every or (
                tail.snapshot_due and asyncio.get_running_loop().time() >= tail.next_try):
            await self._write_snapshot(replica, tail, batch.seq)

    async def _publish(self, replica: ReplicaId, tail: _Tail, kind: str, seq: int,
                       payload: bytes) -> asyncio.Future[PubAck] | None:
        try:
            ack = await self._stream.publish(replica, kind, seq, tail.epoch, payload)
        except (nats.errors.Error, OSError) as exc:
            self._failed(replica, tail, exc)
            return None
        timer = asyncio.get_running_loop().call_later(_ACK_TIMEOUT_S, ack.cancel)

        def acked(fut: asyncio.Future[PubAck]) -> None:
            timer.cancel()
            if fut.cancelled():
                self._failed(replica, tail, TimeoutError(
                    f"no acknowledgement within {_ACK_TIMEOUT_S:g} s"))
            elif fut.exception() is not None:
                self._failed(replica, tail, fut.exception())
            else:
                self._failing = False

        ack.add_done_callback(acked)
        return ack

    def _failed(self, replica: ReplicaId, tail: _Tail, exc: BaseException | None) -> None:
        self._stats.failed += 1
        tail.snapshot_due = True
        if not self._failing:
            self._failing = True
            log.warning("KV-event relay: a publish for replica %s failed (%s); readers that "
                        "meet the hole in the stream reset that replica until the next "
                        "snapshot, written as soon as NATS acknowledges again. Logged once "
                        "until a publish succeeds again", replica, exc or "unknown")

    async def _write_snapshot(self, replica: ReplicaId, tail: _Tail, seq: int) -> None:
        """Write ``tail``'s census as the replica's snapshot: it covers batch ``seq``; its
        stream position is that of the last batch JetStream acknowledged (a batch after it
        that never reached the stream is in the census; one that did is a repeat readers
        drop)."""
        tail.since_snapshot = 0
        ack = tail.last_ack
        if ack is None:
            return
        await asyncio.wait([ack])  # done within _ACK_TIMEOUT_S: cancelled then
        problem: BaseException | None
        if ack.cancelled():
            problem = TimeoutError(f"batch not acknowledged within {_ACK_TIMEOUT_S:g} s")
        else:
            problem = ack.exception()
        if problem is None:
            snap = Snapshot(seq=seq, epoch=tail.epoch, stream_seq=ack.result().seq,
                             payload=encode_payload(EventBatch(seq, time.time(),
                                                               tail.census.snapshot())))
            try:
                await self._stream.put_snapshot(replica, snap)
            except (nats.errors.Error, OSError, TimeoutError) as exc:
                problem = exc
        if problem is not None:
            self._stats.snapshot_failures += 1
            tail.snapshot_due = True
            tail.next_try = asyncio.get_running_loop().time() + _SNAPSHOT_RETRY_S
            log.warning("replica %s: could not write the KV-event snapshot at batch %d (%s); "
                        "trying again in %g s", replica, seq, problem, _SNAPSHOT_RETRY_S)
            return
        tail.snapshot_due = False
        self._stats.snapshots += 1
