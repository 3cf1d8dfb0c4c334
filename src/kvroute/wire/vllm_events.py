"""vLLM KV-cache event frames ⇄ ``core.events`` values.

Owns the byte format of vLLM's KV-event stream (``vllm/distributed/kv_events.py``) and
nothing else: no sockets, no clocks, no logging. ``shell/zmq_events.py`` moves the frames,
``sim/kv_publisher.py`` publishes them; both call this module.

Theory of operation
-------------------

A live message is three ZMQ frames ``[topic, seq, payload]``: ``topic`` is the UTF-8 topic
(``b""`` when unset), ``seq`` is 8 bytes big-endian counting batches from 0 per publisher,
``payload`` is msgpack ``[ts, events, data_parallel_rank]`` (``data_parallel_rank`` omitted
when None, so 2 elements are accepted too, and extra trailing elements are ignored).

Two event encodings exist, and both are decoded:

* **map form** (current vLLM, 0.32/0.33): each event is a map whose first key is ``"type"``
  (``"BlockStored"``, ``"BlockRemoved"``, ``"AllBlocksCleared"``), then the fields in
  declaration order, fields equal to their default omitted;
* **array form** (releases before vLLM PR #42892): ``["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium, ...]``, ``["BlockRemoved",
  block_hashes, medium, ...]``, ``["AllBlocksCleared"]``; trailing default fields omitted.

Block hashes are 64-bit unsigned ints (vLLM's default) or raw digest bytes
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``); both become ``WireHash`` ints. Negative ints
(very old releases hashed with Python's ``hash()``) are folded into the unsigned range the
same way, with ``to_wire_hash``.

Decoding is tiered for speed. The hot path decodes the whole payload in one msgspec call
into private tagged Structs whose hash fields only accept unsigned ints, then copies each
event into its domain type (the domain Structs carry no tag, so msgspec cannot target them
directly; a subclass would, but instances of a subclass compare unequal to the domain
type's, which would surprise every consumer). When msgspec rejects that, the next tiers are
tried in order: map form with any hash type (bytes, negative ints; folded in Python), array
form with unsigned ints, array form with any hash type, and finally a per-event path that
handles unknown event types and mixed forms and pins an error to the event that caused it.
Only the last tier builds error messages, so valid traffic never pays for them; a rejected
tier costs a partial parse, which fails at the first event that does not fit.

Unknown event types are **skipped and reported** through ``on_unknown`` rather than
rejected. NOTE: a newer engine that adds an event type (say, a partial-block promotion)
would otherwise make every batch containing it undecodable; the subscriber would then see
gaps, replay the same undecodable batches, and reset the replica's index over and over,
losing the stores and removals it does understand. Skipping keeps the index as good as the
router's knowledge allows, and the count (a subscriber metric) makes the situation visible.
Unknown *fields* are ignored silently: that is how vLLM itself evolves the schema.

Replay exchange (a DEALER talking to the engine's ROUTER): request ``[b"", seq8]``; replies
``[b"", topic, seq8, payload]`` per buffered batch with ``seq >= start``, then the end
marker ``[b"", b"", ff*8, b""]``. Older releases replied without the topic frame; both
shapes are accepted (see ``decode_replay_reply``).

Every failure on bad input is a ``MalformedEventError`` whose message says what was wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, TypeAlias

import msgspec
from msgspec import Meta

from kvroute.core.errors import MalformedEventError
from kvroute.core.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent
from kvroute.core.types import WireHash, to_wire_hash

__all__ = [
    "END_SEQ",
    "EVENT_TYPES",
    "MAX_SEQ",
    "ReplayBatch",
    "ReplayEnd",
    "decode_message",
    "decode_payload",
    "decode_replay_reply",
    "decode_replay_request",
    "decode_seq",
    "encode_message",
    "encode_payload",
    "encode_replay_end",
    "encode_replay_reply",
    "encode_replay_request",
    "encode_seq",
]

END_SEQ = b"\xff" * 8
"""The replay end marker's sequence frame: ``(-1).to_bytes(8, "big", signed=True)``."""

MAX_SEQ = (1 << 63) - 1
"""Largest sequence number accepted; everything above is the end-marker range, never a batch."""

EVENT_TYPES = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})
"""Event type tags this codec understands; any other tag is skipped (see module docstring)."""

OnUnknown: TypeAlias = Callable[[str], None]
"""Called once per skipped event with its type tag."""

_U64 = Annotated[WireHash, Meta(ge=0)]
_Size = Annotated[int, Meta(ge=0)]
# Slow-path hash: any msgpack int (folded to 64 bits) or a raw digest.
_AnyHash = int | bytes
_MIN_DIGEST_BYTES = 8

# ---------------------------------------------------------------------------------------
# Decode-side wire Structs. Field order is vLLM's (the array form depends on it); defaults
# are the domain's, so an event missing an optional field decodes instead of failing.
# ---------------------------------------------------------------------------------------


class _MapStored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    block_hashes: tuple[_U64, ...]
    parent_block_hash: _U64 | None
    token_ids: tuple[int, ...]
    block_size: _Size
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None


class _MapRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    block_hashes: tuple[_U64, ...]
    medium: str | None = "GPU"
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _MapCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


class _ArrStored(_MapStored, array_like=True, gc=False):
    pass


class _ArrRemoved(_MapRemoved, array_like=True, gc=False):
    pass


class _ArrCleared(_MapCleared, array_like=True, gc=False):
    pass


class _SlowMapStored(_MapStored, gc=False):
    block_hashes: tuple[_AnyHash, ...]  # type: ignore[assignment]
    parent_block_hash: _AnyHash | None  # type: ignore[assignment]


class _SlowMapRemoved(_MapRemoved, gc=False):
    block_hashes: tuple[_AnyHash, ...]  # type: ignore[assignment]


class _SlowArrStored(_SlowMapStored, array_like=True, gc=False):
    pass


class _SlowArrRemoved(_SlowMapRemoved, array_like=True, gc=False):
    pass


class _MapStoredLean(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    """``_MapStored`` with ``token_ids`` skipped, not decoded: the router's index needs only
    the hashes, and token ids are about half of a batch's decode time."""

    block_hashes: tuple[_U64, ...]
    parent_block_hash: _U64 | None
    token_ids: msgspec.Raw
    block_size: _Size
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None


_MapEvent = _MapStored | _MapRemoved | _MapCleared
_ArrEvent = _ArrStored | _ArrRemoved | _ArrCleared


class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MapEvent]
    data_parallel_rank: int | None = None


class _MapLeanBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MapStoredLean | _MapRemoved | _MapCleared]
    data_parallel_rank: int | None = None


class _ArrBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrEvent]
    data_parallel_rank: int | None = None


class _MapAnyBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_SlowMapStored | _SlowMapRemoved | _MapCleared]
    data_parallel_rank: int | None = None


class _ArrAnyBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_SlowArrStored | _SlowArrRemoved | _ArrCleared]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_MAP_BATCH = msgspec.msgpack.Decoder(_MapBatch)
_MAP_LEAN_BATCH = msgspec.msgpack.Decoder(_MapLeanBatch)
_ARR_BATCH = msgspec.msgpack.Decoder(_ArrBatch)
_MAP_ANY_BATCH = msgspec.msgpack.Decoder(_MapAnyBatch)
_ARR_ANY_BATCH = msgspec.msgpack.Decoder(_ArrAnyBatch)
_RAW_BATCH = msgspec.msgpack.Decoder(_RawBatch)
_GENERIC = msgspec.msgpack.Decoder()
_SLOW: dict[tuple[bool, str], msgspec.msgpack.Decoder[Any]] = {
    (True, "BlockStored"): msgspec.msgpack.Decoder(_SlowMapStored),
    (True, "BlockRemoved"): msgspec.msgpack.Decoder(_SlowMapRemoved),
    (True, "AllBlocksCleared"): msgspec.msgpack.Decoder(_MapCleared),
    (False, "BlockStored"): msgspec.msgpack.Decoder(_SlowArrStored),
    (False, "BlockRemoved"): msgspec.msgpack.Decoder(_SlowArrRemoved),
    (False, "AllBlocksCleared"): msgspec.msgpack.Decoder(_ArrCleared),
}

_CLEARED = AllBlocksCleared()
_DecodeErrors = (msgspec.MsgspecError, RecursionError)


def _to_domain(event: Any) -> KVEvent:
    """Copy one decoded wire event into its domain type (hashes already unsigned ints)."""
    if isinstance(event, _MapRemoved):
        return BlockRemoved(
            event.block_hashes, event.medium, event.group_idx, event.locality, event.ownership
        )
    if isinstance(event, (_MapStored, _MapStoredLean)):
        return BlockStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids if isinstance(event, _MapStored) else (),
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
            event.extra_keys,
            event.group_idx,
            event.kv_cache_spec_kind,
            event.kv_cache_spec_sliding_window,
            event.locality,
            event.ownership,
            event.session_id,
            event.lookahead_token_ids,
        )
    return _CLEARED


def _hash(value: int | bytes, where: str) -> WireHash:
    if isinstance(value, bytes) and len(value) < _MIN_DIGEST_BYTES:
        raise MalformedEventError(
            f"{where}: a bytes block hash must be a digest of at least {_MIN_DIGEST_BYTES} bytes "
            f"(vLLM sends 16 or 32), got {len(value)} bytes"
        )
    return to_wire_hash(value)


def _fold_to_domain(event: Any, where: str) -> KVEvent:
    """Copy one slow-path wire event into its domain type, folding every hash to 64 bits."""
    if isinstance(event, _SlowMapRemoved):
        return BlockRemoved(
            tuple([_hash(h, where) for h in event.block_hashes]),
            event.medium,
            event.group_idx,
            event.locality,
            event.ownership,
        )
    if isinstance(event, _SlowMapStored):
        parent = event.parent_block_hash
        return BlockStored(
            tuple([_hash(h, where) for h in event.block_hashes]),
            None if parent is None else _hash(parent, where),
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
            event.extra_keys,
            event.group_idx,
            event.kv_cache_spec_kind,
            event.kv_cache_spec_sliding_window,
            event.locality,
            event.ownership,
            event.session_id,
            event.lookahead_token_ids,
        )
    return _CLEARED


def _slow_event(raw: msgspec.Raw, index: int, on_unknown: OnUnknown | None) -> KVEvent | None:
    """Decode one event of any legal shape; None when its type is unknown (skipped)."""
    where = f"event {index}"
    try:
        generic = _GENERIC.decode(raw)
    except _DecodeErrors as exc:  # pragma: no cover - the batch decode already checked syntax
        raise MalformedEventError(f"{where}: invalid msgpack ({exc})") from exc
    if isinstance(generic, dict):
        is_map, tag = True, generic.get("type")
    elif isinstance(generic, list):
        is_map, tag = False, (generic[0] if generic else None)
    else:
        raise MalformedEventError(
            f"{where}: expected a map (current vLLM) or an array (older vLLM), "
            f"got {type(generic).__name__}"
        )
    if not isinstance(tag, str):
        place = "its 'type' key" if is_map else "its first element"
        raise MalformedEventError(
            f"{where}: the event type tag ({place}) must be a string, got {tag!r}"
        )
    if tag not in EVENT_TYPES:
        if on_unknown is not None:
            on_unknown(tag)
        return None
    where = f"event {index} ({tag})"
    try:
        event = _SLOW[(is_map, tag)].decode(raw)
    except _DecodeErrors as exc:
        raise MalformedEventError(f"{where}: {exc}") from exc
    return _fold_to_domain(event, where)


def decode_payload(
    payload: bytes | bytearray | memoryview,
    seq: int,
    *,
    on_unknown: OnUnknown | None = None,
    token_ids: bool = True,
) -> EventBatch:
    """Decode one msgpack batch payload into an ``EventBatch`` carrying ``seq``.

    Args:
        payload: the third frame of a live message (or the last of a replay reply).
        seq: the batch's sequence number, from its own frame.
        on_unknown: called with the type tag of every skipped event of an unknown type.
        token_ids: with False, ``BlockStored.token_ids`` of the current (map) form is left
            empty instead of decoded — the router's index needs only hashes. The bytes are
            still checked to be one well-formed msgpack value.

    Returns:
        The batch, its events in publication order, hashes as ``WireHash`` ints.

    Raises:
        MalformedEventError: the payload is not a valid vLLM KV-event batch.
    """
    try:
        fast = (_MAP_BATCH if token_ids else _MAP_LEAN_BATCH).decode(payload)
    except msgspec.ValidationError:
        pass
    except _DecodeErrors as exc:
        raise MalformedEventError(f"batch payload is not valid msgpack: {exc}") from exc
    else:
        return EventBatch(
            seq, fast.ts, tuple([_to_domain(e) for e in fast.events]), fast.data_parallel_rank
        )
    for decoder in (_MAP_ANY_BATCH, _ARR_BATCH, _ARR_ANY_BATCH):
        try:
            tier = decoder.decode(payload)
        except _DecodeErrors:
            continue
        if decoder is _ARR_BATCH:
            events_ = [_to_domain(e) for e in tier.events]
        else:
            events_ = [_fold_to_domain(e, f"event {i}") for i, e in enumerate(tier.events)]
        return EventBatch(seq, tier.ts, tuple(events_), tier.data_parallel_rank)
    try:
        raw = _RAW_BATCH.decode(payload)
    except _DecodeErrors as exc:
        raise MalformedEventError(
            f"batch payload must be a msgpack array [ts, events, data_parallel_rank]: {exc}"
        ) from exc
    events: list[KVEvent] = []
    for index, item in enumerate(raw.events):
        event = _slow_event(item, index, on_unknown)
        if event is not None:
            events.append(event)
    return EventBatch(seq, raw.ts, tuple(events), raw.data_parallel_rank)


def encode_seq(seq: int) -> bytes:
    """Return the 8-byte big-endian frame for a batch sequence number (0 ≤ seq ≤ MAX_SEQ)."""
    if not 0 <= seq <= MAX_SEQ:
        raise ValueError(f"sequence number must be in 0..{MAX_SEQ}, got {seq}")
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes | bytearray | memoryview) -> int:
    """Read a batch sequence frame.

    Raises:
        MalformedEventError: the frame is not 8 bytes, or holds the end-marker range.
    """
    if len(frame) != 8:
        raise MalformedEventError(
            f"sequence frame must be 8 bytes (big-endian batch number), got {len(frame)} bytes"
        )
    seq = int.from_bytes(frame, "big")
    if seq > MAX_SEQ:
        raise MalformedEventError(
            f"sequence number {seq:#x} is out of range (ff*8 is the replay end marker, not a batch)"
        )
    return seq


def decode_message(
    frames: Sequence[bytes | bytearray | memoryview],
    *,
    on_unknown: OnUnknown | None = None,
    token_ids: bool = True,
) -> EventBatch:
    """Decode one live PUB message ``[topic, seq8, payload]``.

    The topic is not checked here: the SUB socket already filtered on it. ``token_ids`` as
    for ``decode_payload``.

    Raises:
        MalformedEventError: wrong frame count, bad sequence frame or bad payload.
    """
    if len(frames) != 3:
        raise MalformedEventError(
            f"a KV-event message has 3 frames [topic, seq, payload], got {len(frames)}"
        )
    seq = decode_seq(frames[1])
    return decode_payload(frames[2], seq, on_unknown=on_unknown, token_ids=token_ids)


# ---------------------------------------------------------------------------------------
# Encode-side Structs: vLLM's own declarations (field order, which fields have defaults),
# so that ``omit_defaults`` reproduces vLLM's bytes exactly.
# ---------------------------------------------------------------------------------------


class _EncStored(msgspec.Struct, tag="BlockStored", tag_field="type", omit_defaults=True, gc=False):
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class _EncStoredLookahead(_EncStored, gc=False):
    """vLLM 0.33's declaration: one more field.

    NOTE: msgspec writes a map header sized for the declared field count (fixmap up to 15
    entries, map16 above), so 0.32's 14 fields + tag encode as ``0x8?`` and 0.33's 15 + tag as
    ``0xde 00 ??`` even when ``lookahead_token_ids`` is omitted. Events without lookahead are
    encoded with 0.32's declaration, which makes our bytes identical to the 0.32 vectors.
    """

    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None


class _EncRemoved(
    msgspec.Struct, tag="BlockRemoved", tag_field="type", omit_defaults=True, gc=False
):
    block_hashes: tuple[int, ...]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _EncCleared(
    msgspec.Struct, tag="AllBlocksCleared", tag_field="type", omit_defaults=True, gc=False
):
    pass


class _EncArrStored(_EncStored, array_like=True, gc=False):
    pass


class _EncArrStoredLookahead(_EncStoredLookahead, array_like=True, gc=False):
    pass


class _EncArrRemoved(_EncRemoved, array_like=True, gc=False):
    pass


class _EncArrCleared(_EncCleared, array_like=True, gc=False):
    pass


class _EncBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_ENC_TYPES: dict[bool, tuple[type[_EncStored], type[_EncRemoved], type[_EncCleared]]] = {
    True: (_EncStored, _EncRemoved, _EncCleared),
    False: (_EncArrStored, _EncArrRemoved, _EncArrCleared),
}
_ENC_LOOKAHEAD: dict[bool, type[_EncStoredLookahead]] = {
    True: _EncStoredLookahead,
    False: _EncArrStoredLookahead,
}


def _encodable(event: KVEvent, as_map: bool) -> msgspec.Struct:
    stored_t, removed_t, cleared_t = _ENC_TYPES[as_map]
    if isinstance(event, BlockStored):
        if event.lookahead_token_ids is not None:
            return _ENC_LOOKAHEAD[as_map](
                event.block_hashes,
                event.parent_block_hash,
                event.token_ids,
                event.block_size,
                event.lora_id,
                event.medium,
                event.lora_name,
                event.extra_keys,
                event.group_idx,
                event.kv_cache_spec_kind,
                event.kv_cache_spec_sliding_window,
                event.locality,
                event.ownership,
                event.session_id,
                event.lookahead_token_ids,
            )
        return stored_t(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
            event.lora_name,
            event.extra_keys,
            event.group_idx,
            event.kv_cache_spec_kind,
            event.kv_cache_spec_sliding_window,
            event.locality,
            event.ownership,
            event.session_id,
        )
    if isinstance(event, BlockRemoved):
        return removed_t(
            event.block_hashes, event.medium, event.group_idx, event.locality, event.ownership
        )
    if isinstance(event, AllBlocksCleared):
        return cleared_t()
    raise TypeError(f"not a KV event: {type(event).__name__}")


def encode_payload(batch: EventBatch, *, form: Literal["map", "array"] = "map") -> bytes:
    """Encode a batch's payload exactly as vLLM's ``ZmqEventPublisher`` does.

    Hashes go out as ints (vLLM's default). ``form="map"`` is current vLLM and byte-identical
    to it; ``form="array"`` is the positional encoding of releases before PR #42892. ``seq``
    is not part of the payload (it travels in its own frame).
    """
    if form not in ("map", "array"):
        raise ValueError(f"form must be 'map' or 'array', got {form!r}")
    as_map = form == "map"
    events = [_encodable(e, as_map) for e in batch.events]
    return _ENCODER.encode(_EncBatch(batch.ts, events, batch.data_parallel_rank))


def encode_message(
    batch: EventBatch, topic: str = "kv", *, form: Literal["map", "array"] = "map"
) -> list[bytes]:
    """Return the three frames ``[topic, seq8, payload]`` a vLLM PUB socket sends for ``batch``."""
    return [topic.encode("utf-8"), encode_seq(batch.seq), encode_payload(batch, form=form)]


# ---------------------------------------------------------------------------------------
# Replay exchange
# ---------------------------------------------------------------------------------------


class ReplayBatch(msgspec.Struct, frozen=True, gc=False):
    """One replayed batch. ``topic`` is None for older releases that sent no topic frame."""

    topic: bytes | None
    batch: EventBatch


class ReplayEnd(msgspec.Struct, frozen=True, gc=False):
    """The end marker: the replay socket has sent everything it buffered."""


def encode_replay_request(start_seq: int) -> list[bytes]:
    """Frames a DEALER sends to ask for every buffered batch with ``seq >= start_seq``."""
    return [b"", encode_seq(start_seq)]


def decode_replay_request(frames: Sequence[bytes | bytearray | memoryview]) -> int:
    """Read a replay request as a ROUTER receives it: ``[identity, b"", seq8]``.

    Returns:
        The requested start sequence number.

    Raises:
        MalformedEventError: not exactly 3 frames, non-empty delimiter, or a bad seq frame
            (vLLM logs "Invalid replay request" and answers nothing in these cases).
    """
    if len(frames) != 3:
        raise MalformedEventError(
            f"a replay request has 3 frames [identity, b'', seq] at the ROUTER, got {len(frames)}"
        )
    if len(frames[1]) != 0:
        raise MalformedEventError("a replay request's second frame must be the empty delimiter")
    return decode_seq(frames[2])


def encode_replay_reply(topic: str, seq: int, payload: bytes) -> list[bytes]:
    """Frames a ROUTER sends per replayed batch, without the leading identity frame."""
    return [b"", topic.encode("utf-8"), encode_seq(seq), payload]


def encode_replay_end() -> list[bytes]:
    """The end-marker frames a ROUTER sends last, without the leading identity frame."""
    return [b"", b"", END_SEQ, b""]


def decode_replay_reply(
    frames: Sequence[bytes | bytearray | memoryview], *, on_unknown: OnUnknown | None = None,
    token_ids: bool = True,
) -> ReplayBatch | ReplayEnd:
    """Decode one reply as a DEALER receives it (``token_ids`` as for ``decode_payload``).

    Accepted shapes, newest first:

    * ``[b"", topic, seq8, payload]`` (vLLM 0.32/0.33); end ``[b"", b"", ff*8, b""]``;
    * ``[b"" or topic, seq8, payload]`` (older releases without topic, or a REQ-style
      receive that dropped the delimiter; the two cannot be told apart and need not be);
    * ``[seq8, payload]`` (older releases as seen without a delimiter).

    Raises:
        MalformedEventError: any other shape, a bad sequence frame, or a bad payload.
    """
    count = len(frames)
    if count == 4:
        if len(frames[0]) != 0:
            raise MalformedEventError("a 4-frame replay reply must start with the empty delimiter")
        topic: bytes | None = bytes(frames[1])
        seq_frame, payload = frames[2], frames[3]
    elif count == 3:
        topic = bytes(frames[0]) or None
        seq_frame, payload = frames[1], frames[2]
    elif count == 2:
        topic = None
        seq_frame, payload = frames[0], frames[1]
    else:
        raise MalformedEventError(
            f"a replay reply has 4 frames [b'', topic, seq, payload] (or 2-3 from older vLLM), "
            f"got {count}"
        )
    if bytes(seq_frame) == END_SEQ:
        if len(payload) != 0:
            raise MalformedEventError("the replay end marker must carry an empty payload")
        return ReplayEnd()
    seq = decode_seq(seq_frame)
    return ReplayBatch(topic, decode_payload(payload, seq, on_unknown=on_unknown,
                                             token_ids=token_ids))
