"""The durable KV-event stream: engines' batches mirrored into NATS JetStream, and read back.

Owns one NATS connection, the JetStream stream of KV-event batches, the object-store bucket
of per-replica block snapshots, the relay that writes both and the rebuild that reads them.
It does not own an index: ``rebuild`` hands batches to the caller's callbacks, as the ZMQ
subscriber does (``shell/zmq_events.py``), and the relay is fed by subscribers' callbacks.

Why: a vLLM engine keeps its last 10,000 batches for replay. A router that starts after an
engine has published more than that can rebuild only the tail of its cache from the replay,
and the index misses every block cached before. The stream keeps the batches as long as its
limits allow (``kv_stream.max_age_s``, ``max_bytes``), and the snapshots bound how much of it
a restarting router must read.

Layout
------

* Events: stream ``<name>``, subjects ``<prefix>.events.<replica>`` (replica names with any
  character outside ``[A-Za-z0-9_-]`` written ``~XX``), limits retention, the oldest
  dropped first. Each message is one batch, its payload vLLM's own msgpack
  (``wire.vllm_events.encode_payload``, token ids left out: the index needs hashes), with
  headers ``Kvroute-Seq`` (the engine's sequence number, kept), ``Kvroute-Epoch`` and
  ``Nats-Msg-Id`` ``<replica>:<epoch>:<seq>`` (JetStream drops a repeated one). A *reset*
  message (``Kvroute-Kind: reset``, the reason as payload) says the relay's subscriber
  reset: the engine restarted, or lost batches could not be replayed. Every reset starts a
  new epoch.
* Snapshots: object ``<replica>`` in bucket ``<name>_SNAPSHOTS``, replaced every
  ``snapshot_every`` batches of that replica: the relay's ``BlockCensus`` (copies per hash
  and medium) as one batch, with the sequence number, epoch and stream sequence of the last
  batch it covers. The object store chunks it, so a large cache is not bounded by NATS's
  message size.

Reading back (``rebuild``)
--------------------------

The latest snapshot, if any, is applied (after a reset of the replica), then the replica's
subject from the message after the one the snapshot covers to the last one there now, with
an ordered consumer. Batches are sequenced as the ZMQ subscriber sequences the live stream:
the next one applies, a repeat is dropped, a jump (messages dropped by the stream's limits,
a publish that failed) or a new epoch without its reset message resets the replica, then
applies. The result, ``StreamPosition.last_seq``, is where the ZMQ subscriber resumes
(``EventSubscriber(resume_after=...)``): a gap between the stream's end and the first live
batch is then recovered from the engine's replay buffer, the usual way.

Failure
-------

NATS unreachable at start: ``KvStream.open`` logs a warning saying the router runs on the
engines' ZMQ feeds only, and returns None; the router (``shell/runtime.py``) tries again
with bounded backoff (``STREAM_RETRY_S``, doubling to ``STREAM_RETRY_MAX_S``, quietly) and,
once NATS answers, uses the stream for its next restart; a relaying router then hands the
relay what it counted meanwhile (``KvStreamRelay.resume``: a reset and a snapshot). A publish that fails later is counted and logged
(the first of a run of failures); readers see the hole it leaves as a jump and reset. A
snapshot that cannot be written is logged and retried at the next interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    ObjectStoreConfig,
    PubAck,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.client import JetStreamContext
from nats.js.object_store import ObjectStore

from kvroute.config import KvStreamConfig
from kvroute.core.block_census import BlockCensus
from kvroute.core.errors import MalformedEventError
from kvroute.core.events import EventBatch
from kvroute.core.types import ReplicaId
from kvroute.wire.vllm_events import decode_payload, encode_payload

__all__ = ["KvStream", "KvStreamRelay", "RelayStats", "StreamPosition", "subject_token"]

log = logging.getLogger(__name__)

OnBatch = Callable[[ReplicaId, EventBatch], None]
OnReset = Callable[[ReplicaId, str], None]

_KIND = "Kvroute-Kind"
_SEQ = "Kvroute-Seq"
_EPOCH = "Kvroute-Epoch"
_RESET = "reset"
_BATCH = "batch"
_DUPLICATE_WINDOW_S = 120.0
"""JetStream's ``Nats-Msg-Id`` window: a relay restarted within it repeats nothing."""
_READ_WAIT_S = 5.0
"""Longest wait for the next message of a rebuild before it is declared cut short."""
_FETCH = 64
"""Messages asked of JetStream at a time while rebuilding."""
_READ_PER_TURN = 16
"""Most batches a rebuild applies between two yields to the loop (as a ZMQ replay does)."""
_ACK_TIMEOUT_S = 10.0
"""A publish JetStream has not acknowledged by then counts as failed (nats-py's futures
never time out: one lost with its connection would otherwise wait for ever)."""
_SNAPSHOT_RETRY_S = 2.0
"""Least time between two attempts at a snapshot that is due after a failure."""
_RELAY_QUEUE = 100_000
"""Batches waiting for the relay's publisher; beyond it they are dropped (and counted)."""
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def subject_token(replica: ReplicaId) -> str:
    """``replica`` as one NATS subject token (and object name): ``~XX`` for each character
    outside ``[A-Za-z0-9_-]`` (``.`` would split the subject, ``*``/``>`` are wildcards)."""
    return "".join(ch if ch in _SAFE else "".join(f"~{b:02X}" for b in ch.encode("utf-8"))
                   for ch in replica)


class _Snapshot(msgspec.Struct, frozen=True):
    """What the snapshot object holds: the census as one vLLM batch payload, and the last
    batch it covers (engine sequence, epoch, stream sequence)."""

    seq: int
    epoch: int
    stream_seq: int
    payload: bytes


@dataclasses.dataclass(slots=True)
class StreamPosition:
    """Where a replica's history in the stream ends, once ``rebuild`` has read it."""

    last_seq: int | None = None
    """The engine sequence number of the last batch applied; None: nothing to resume from
    (no history, or it ended with a reset)."""
    epoch: int = 0
    """The epoch of the last message read."""
    census: BlockCensus | None = None
    """The blocks the read history leaves the replica with (the relay's starting point);
    None unless ``rebuild`` was asked to count them."""
    batches: int = 0
    """Batches read from the stream (the snapshot not counted)."""
    snapshot_seq: int | None = None
    """The sequence number the snapshot covered, or None when there was none."""
    resets: int = 0
    """Resets the history called for (reset messages, jumps, epochs changed)."""


class KvStream:
    """The NATS side of the durable stream: open with ``KvStream.open``, then ``rebuild``
    each replica and, on the relaying process, ``relay()``."""

    def __init__(self, config: KvStreamConfig, nc: NatsClient, js: JetStreamContext,
                 snapshots: ObjectStore) -> None:
        self.config = config
        self._nc = nc
        self._js = js
        self._snapshots = snapshots

    @classmethod
    async def open(cls, config: KvStreamConfig, *, quiet: bool = False) -> KvStream | None:
        """Connect and make sure the stream and the bucket exist (limits as configured).

        Returns None, after a warning (at debug level with ``quiet``: a retry of an outage
        already logged), when NATS cannot be reached within ``connect_timeout_s`` or
        refuses the stream: the caller runs on ZMQ alone, and may try again later.
        """
        nc: NatsClient | None = None
        errors: list[Exception] = []
        try:
            async with asyncio.timeout(config.connect_timeout_s):
                nc = await nats.connect(config.url, connect_timeout=config.connect_timeout_s,
                                        allow_reconnect=True, max_reconnect_attempts=-1,
                                        reconnect_time_wait=1.0,
                                        error_cb=functools.partial(_nats_error, errors),
                                        disconnected_cb=functools.partial(_log_disconnected,
                                                                          config.url),
                                        reconnected_cb=_log_reconnected)
                js = nc.jetstream()
                stream = StreamConfig(
                    name=config.name, subjects=[f"{config.subject_prefix}.events.>"],
                    retention=RetentionPolicy.LIMITS, discard=DiscardPolicy.OLD,
                    max_age=config.max_age_s, max_bytes=config.max_bytes,
                    storage=StorageType.FILE, duplicate_window=_DUPLICATE_WINDOW_S,
                    description="kvroute: engines' KV-event batches (shell/kv_stream.py)",
                )
                try:
                    await js.add_stream(stream)
                except nats.js.errors.BadRequestError:
                    await js.update_stream(stream)  # exists with other limits: take ours
                bucket = f"{config.name}_SNAPSHOTS"
                snapshots = await js.create_object_store(bucket, config=ObjectStoreConfig(
                    bucket=bucket, max_bytes=config.max_bytes, storage=StorageType.FILE,
                    description="kvroute: per-replica block snapshots of the KV-event stream"))
        except asyncio.CancelledError:
            if nc is not None:  # cancelled at shutdown while connected: leave nothing open
                with contextlib.suppress(Exception):
                    await nc.close()
            raise
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            why = str(errors[-1] if errors and isinstance(exc, TimeoutError) else exc)
            log.log(logging.DEBUG if quiet else logging.WARNING,
                    "KV-event stream unavailable (NATS at %s: %s): running on the engines' "
                    "ZMQ feeds only until NATS answers (retried with backoff); meanwhile a "
                    "restarted router catches up on their replay buffers (the last 10,000 "
                    "batches on vLLM) and nothing is relayed",
                    config.url, why or type(exc).__name__)
            if nc is not None:
                with contextlib.suppress(Exception):  # already failing; the warning says why
                    await nc.close()
            return None
        log.info("KV-event stream %s on %s (max age %.0f s, max %d bytes)", config.name,
                 config.url, config.max_age_s, config.max_bytes)
        return cls(config, nc, js, snapshots)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Send what is pending (for up to ``timeout_s``: NATS may be away) and close."""
        if self._nc.is_closed:
            return
        try:
            async with asyncio.timeout(timeout_s):
                await self._nc.drain()
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("KV-event stream: closed without sending everything pending (%s)",
                        str(exc) or type(exc).__name__)
            await self._nc.close()

    @property
    def connected(self) -> bool:
        """Whether the NATS connection is up now (nats-py reconnects on its own)."""
        return self._nc.is_connected

    def pending(self) -> int:
        """Publishes JetStream has not acknowledged (nor failed) yet."""
        return self._js.publish_async_pending()

    def subject(self, replica: ReplicaId) -> str:
        return f"{self.config.subject_prefix}.events.{subject_token(replica)}"

    # ------------------------------------------------------------------ reading back

    async def rebuild(self, replica: ReplicaId, on_batch: OnBatch | None,
                      on_reset: OnReset | None, *, census: bool = False) -> StreamPosition:
        """Replay ``replica``'s history from its snapshot and the stream (module doc).

        ``on_batch``/``on_reset`` receive what an index needs (None: only the position is
        wanted, as by a relay process); with ``census`` the position also counts the blocks
        (what a relay continues from). NATS errors while reading end the rebuild early with
        a warning: what was applied stands, and the position says where it ended.
        """
        pos = StreamPosition(census=BlockCensus() if census else None)
        subject = self.subject(replica)
        began = time.perf_counter()

        def reset(reason: str) -> None:
            if pos.census is not None:
                pos.census.clear()
            pos.last_seq = None
            pos.resets += 1
            if on_reset is not None:
                on_reset(replica, reason)

        def apply(batch: EventBatch) -> None:
            if pos.census is not None:
                pos.census.apply(batch)
            if on_batch is not None:
                on_batch(replica, batch)

        start = 1
        try:
            snap = await self._read_snapshot(replica)
            if snap is not None:
                batch = decode_payload(snap.payload, snap.seq, token_ids=False)
                reset("rebuilding from the KV-event stream's snapshot")
                pos.resets -= 1  # the index starts from the snapshot: not a reset of history
                for n, event in enumerate(batch.events, start=1):  # chunks of 4,096 hashes
                    apply(EventBatch(batch.seq, batch.ts, (event,), batch.data_parallel_rank))
                    if n % 4 == 0:
                        await asyncio.sleep(0)  # a large snapshot shares the loop too
                pos.last_seq, pos.epoch, pos.snapshot_seq = snap.seq, snap.epoch, snap.seq
                start = snap.stream_seq + 1
            try:
                last = await self._js.get_last_msg(self.config.name, subject)
            except nats.js.errors.NotFoundError:
                return pos
            if last.seq is None or last.seq < start:
                return pos
            await self._read(subject, start, last.seq, pos, apply, reset)
        except (TimeoutError, nats.errors.Error, MalformedEventError) as exc:
            log.warning("replica %s: rebuilding from the KV-event stream stopped early (%s); "
                        "the index holds what was read, up to batch %s", replica,
                        str(exc) or type(exc).__name__, pos.last_seq)
        finally:
            log.info("replica %s: rebuilt from the KV-event stream: snapshot at %s, then %d "
                     "batches, up to batch %s, in %.2f s", replica, pos.snapshot_seq,
                     pos.batches, pos.last_seq, time.perf_counter() - began)
        return pos

    async def _read_snapshot(self, replica: ReplicaId) -> _Snapshot | None:
        try:
            obj = await self._snapshots.get(subject_token(replica))
        except nats.js.errors.ObjectNotFoundError:
            return None
        if obj.data is None:
            return None
        try:
            return msgspec.msgpack.decode(obj.data, type=_Snapshot)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("replica %s: ignored an unreadable KV-event snapshot (%s); reading "
                        "the stream from its start", replica, exc)
            return None

    async def _read(self, subject: str, start: int, last: int, pos: StreamPosition,
                    apply: Callable[[EventBatch], None], reset: Callable[[str], None]) -> None:
        """Read ``subject`` from stream sequence ``start`` through ``last``, in order."""
        sub = await self._js.pull_subscribe(
            subject, durable=None, stream=self.config.name,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                  opt_start_seq=start, ack_policy=AckPolicy.NONE,
                                  inactive_threshold=_READ_WAIT_S * 6),
        )
        try:
            while True:
                # Small fetches: the client parses what one fetch brings in one go, so
                # this bounds how long a read holds the loop (as _READ_PER_TURN does).
                for msg in await sub.fetch(_FETCH, timeout=_READ_WAIT_S):
                    meta = msg.metadata
                    headers = msg.headers or {}
                    try:
                        epoch = int(headers.get(_EPOCH, "0"))
                        seq = int(headers[_SEQ])
                    except (KeyError, ValueError) as exc:
                        raise MalformedEventError(
                            f"stream message {meta.sequence.stream} on {subject} has no valid "
                            f"{_SEQ}/{_EPOCH} headers ({exc!r}): only kvroute's relay may "
                            "publish there") from exc
                    if headers.get(_KIND) == _RESET:
                        reset(f"the KV-event stream says: {msg.data.decode('utf-8', 'replace')}")
                        pos.epoch = epoch
                    else:
                        expected = None if pos.last_seq is None else pos.last_seq + 1
                        if expected is not None and epoch == pos.epoch and seq < expected:
                            pass  # a repeat (two relays, or a relay restarted past its window)
                        else:
                            if expected is not None and (epoch != pos.epoch or seq != expected):
                                reset(f"the KV-event stream jumps from batch {expected - 1} "
                                      f"(epoch {pos.epoch}) to {seq} (epoch {epoch})")
                            pos.epoch = epoch
                            apply(decode_payload(msg.data, seq, token_ids=False))
                            pos.last_seq = seq
                            pos.batches += 1
                            if pos.batches % _READ_PER_TURN == 0:
                                await asyncio.sleep(0)  # a long read shares the loop
                    if meta.sequence.stream >= last:
                        return
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    # ------------------------------------------------------------------ writing

    def relay(self, *, queue_size: int = _RELAY_QUEUE) -> KvStreamRelay:
        """A relay writing into this stream (start it with ``KvStreamRelay.start``)."""
        return KvStreamRelay(self, queue_size=queue_size)

    async def publish(self, replica: ReplicaId, kind: str, seq: int, epoch: int,
                      payload: bytes) -> asyncio.Future[PubAck]:
        headers = {_KIND: kind, _SEQ: str(seq), _EPOCH: str(epoch),
                   "Nats-Msg-Id": f"{subject_token(replica)}:{epoch}:{kind}:{seq}"}
        return await self._js.publish_async(self.subject(replica), payload, headers=headers)

    async def put_snapshot(self, replica: ReplicaId, snap: _Snapshot) -> None:
        await self._snapshots.put(subject_token(replica), msgspec.msgpack.encode(snap))


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
    ``snapshot_every`` batches. ``adopt`` first, with the position ``KvStream.rebuild``
    found, so the relay continues the replica's history (its epoch and census).
    """

    def __init__(self, stream: KvStream, *, queue_size: int) -> None:
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
        """Continue ``replica``'s history from ``position`` (from ``KvStream.rebuild``)."""
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
        ack = await self._publish(replica, tail, _RESET, 0, reason.encode("utf-8"))
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
        ack = await self._publish(replica, tail, _BATCH, batch.seq, encode_payload(batch))
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
            snap = _Snapshot(seq=seq, epoch=tail.epoch, stream_seq=ack.result().seq,
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


async def _nats_error(seen: list[Exception], exc: Exception) -> None:
    if len(seen) < 16:
        seen.append(exc)  # the reason ``open`` gives when it times out
    # Each failed (re)connection attempt reports here: the outage itself is logged once,
    # by ``open`` or ``_log_disconnected``.
    log.debug("KV-event stream: NATS error: %s", exc)


async def _log_disconnected(url: str) -> None:
    # Also called when the connection is closed on purpose (drained at shutdown).
    log.info("KV-event stream: disconnected from NATS at %s (reconnecting unless closing)", url)


async def _log_reconnected() -> None:
    log.info("KV-event stream: reconnected to NATS")
