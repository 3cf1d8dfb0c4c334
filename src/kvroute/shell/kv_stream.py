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
The connection and the layout live here; the two sides of the stream have a module each:
``shell/kv_stream_reader.py`` reads a replica's history back (``rebuild``) and
``shell/kv_stream_relay.py`` writes it (``KvStreamRelay``).

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
import functools
import logging
from typing import Final

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js.api import (
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
from kvroute.core.types import ReplicaId

__all__ = ["BATCH", "EPOCH_HEADER", "KIND_HEADER", "RESET", "SEQ_HEADER", "KvStream", "Snapshot",
           "subject_token"]

log = logging.getLogger(__name__)

KIND_HEADER: Final = "Kvroute-Kind"
SEQ_HEADER: Final = "Kvroute-Seq"
EPOCH_HEADER: Final = "Kvroute-Epoch"
RESET: Final = "reset"
"""``KIND_HEADER`` of a reset message (the reason as payload)."""
BATCH: Final = "batch"
"""``KIND_HEADER`` of a batch message (vLLM's msgpack as payload)."""
_DUPLICATE_WINDOW_S = 120.0
"""JetStream's ``Nats-Msg-Id`` window: a relay restarted within it repeats nothing."""
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def subject_token(replica: ReplicaId) -> str:
    """``replica`` as one NATS subject token (and object name): ``~XX`` for each character
    outside ``[A-Za-z0-9_-]`` (``.`` would split the subject, ``*``/``>`` are wildcards)."""
    return "".join(ch if ch in _SAFE else "".join(f"~{b:02X}" for b in ch.encode("utf-8"))
                   for ch in replica)


class Snapshot(msgspec.Struct, frozen=True):
    """What the snapshot object holds: the census as one vLLM batch payload, and the last
    batch it covers (engine sequence, epoch, stream sequence)."""

    seq: int
    epoch: int
    stream_seq: int
    payload: bytes


class KvStream:
    """The NATS side of the durable stream: open with ``KvStream.open``, then ``rebuild``
    each replica (``kv_stream_reader.rebuild``) and, on the relaying process, relay
    into it (``kv_stream_relay.KvStreamRelay``)."""

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


    @property
    def js(self) -> JetStreamContext:
        """The JetStream context (the reader's consumers use it)."""
        return self._js

    # ------------------------------------------------------------------ the layout's objects

    async def read_snapshot(self, replica: ReplicaId) -> Snapshot | None:
        """``replica``'s latest snapshot; None when there is none or it is unreadable
        (logged: a reader then reads the stream from its start)."""
        try:
            obj = await self._snapshots.get(subject_token(replica))
        except nats.js.errors.ObjectNotFoundError:
            return None
        if obj.data is None:
            return None
        try:
            return msgspec.msgpack.decode(obj.data, type=Snapshot)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("replica %s: ignored an unreadable KV-event snapshot (%s); reading "
                        "the stream from its start", replica, exc)
            return None

    # ------------------------------------------------------------------ writing

    async def publish(self, replica: ReplicaId, kind: str, seq: int, epoch: int,
                      payload: bytes) -> asyncio.Future[PubAck]:
        """One message on ``replica``'s subject with the layout's headers; its ack future."""
        headers = {KIND_HEADER: kind, SEQ_HEADER: str(seq), EPOCH_HEADER: str(epoch),
                   "Nats-Msg-Id": f"{subject_token(replica)}:{epoch}:{kind}:{seq}"}
        return await self._js.publish_async(self.subject(replica), payload, headers=headers)

    async def put_snapshot(self, replica: ReplicaId, snap: Snapshot) -> None:
        """Replace ``replica``'s snapshot object."""
        await self._snapshots.put(subject_token(replica), msgspec.msgpack.encode(snap))


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
