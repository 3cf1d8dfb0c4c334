"""The durable KV-event stream read back: a replica's history, from its snapshot and stream.

The stream's layout is ``shell/kv_stream.py``'s; ``rebuild`` is its consumer (a router
rebuilding its index, a relay process continuing the history), the relay its writer
(``shell/kv_stream_relay.py``).

The latest snapshot, if any, is applied (after a reset of the replica), then the replica's
subject from the message after the one the snapshot covers to the last one there now, with
an ordered consumer. Batches are sequenced as the ZMQ subscriber sequences the live stream:
the next one applies, a repeat is dropped, a jump (messages dropped by the stream's limits,
a publish that failed) or a new epoch without its reset message resets the replica, then
applies. The result, ``StreamPosition.last_seq``, is where the ZMQ subscriber resumes
(``EventSubscriber(resume_after=...)``): a gap between the stream's end and the first live
batch is then recovered from the engine's replay buffer, the usual way.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable

import nats.errors
import nats.js.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from kvroute.core.block_census import BlockCensus
from kvroute.core.errors import MalformedEventError
from kvroute.core.events import EventBatch
from kvroute.core.types import ReplicaId
from kvroute.shell.kv_stream import EPOCH_HEADER, KIND_HEADER, RESET, SEQ_HEADER, KvStream
from kvroute.wire.vllm_events import decode_payload

__all__ = ["OnBatch", "OnReset", "StreamPosition", "rebuild"]

log = logging.getLogger(__name__)

OnBatch = Callable[[ReplicaId, EventBatch], None]
OnReset = Callable[[ReplicaId, str], None]

_READ_WAIT_S = 5.0
"""Longest wait for the next message of a rebuild before it is declared cut short."""
_FETCH = 64
"""Messages asked of JetStream at a time while rebuilding."""
_READ_PER_TURN = 16
"""Most batches a rebuild applies between two yields to the loop (as a ZMQ replay does)."""


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


async def rebuild(stream: KvStream, replica: ReplicaId, on_batch: OnBatch | None,
                  on_reset: OnReset | None, *, census: bool = False) -> StreamPosition:
    """Replay ``replica``'s history from its snapshot and the stream (module doc).

    ``on_batch``/``on_reset`` receive what an index needs (None: only the position is
    wanted, as by a relay process); with ``census`` the position also counts the blocks
    (what a relay continues from). NATS errors while reading end the rebuild early with
    a warning: what was applied stands, and the position says where it ended.
    """
    pos = StreamPosition(census=BlockCensus() if census else None)
    subject = stream.subject(replica)
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
        snap = await stream.read_snapshot(replica)
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
            last = await stream.js.get_last_msg(stream.config.name, subject)
        except nats.js.errors.NotFoundError:
            return pos
        if last.seq is None or last.seq < start:
            return pos
        await _read(stream, subject, start, last.seq, pos, apply, reset)
    except (TimeoutError, nats.errors.Error, MalformedEventError) as exc:
        log.warning("replica %s: rebuilding from the KV-event stream stopped early (%s); "
                    "the index holds what was read, up to batch %s", replica,
                    str(exc) or type(exc).__name__, pos.last_seq)
    finally:
        log.info("replica %s: rebuilt from the KV-event stream: snapshot at %s, then %d "
                 "batches, up to batch %s, in %.2f s", replica, pos.snapshot_seq,
                 pos.batches, pos.last_seq, time.perf_counter() - began)
    return pos


async def _read(stream: KvStream, subject: str, start: int, last: int, pos: StreamPosition,
                apply: Callable[[EventBatch], None], reset: Callable[[str], None]) -> None:
    """Read ``subject`` from stream sequence ``start`` through ``last``, in order."""
    sub = await stream.js.pull_subscribe(
        subject, durable=None, stream=stream.config.name,
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
                    epoch = int(headers.get(EPOCH_HEADER, "0"))
                    seq = int(headers[SEQ_HEADER])
                except (KeyError, ValueError) as exc:
                    raise MalformedEventError(
                        f"stream message {meta.sequence.stream} on {subject} has no valid "
                        f"{SEQ_HEADER}/{EPOCH_HEADER} headers ({exc!r}): only kvroute's relay may "
                        "publish there") from exc
                if headers.get(KIND_HEADER) == RESET:
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
