"""The vLLM KV-event codec, tested the h11 way: whole, truncated at every offset, with
trailing data, round trips in both encodings, and every documented malformation."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from kvroute.core.errors import MalformedEventError
from kvroute.core.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvroute.core.types import WireHash
from kvroute.wire.vllm_events import (
    END_SEQ,
    MAX_SEQ,
    ReplayBatch,
    ReplayEnd,
    decode_message,
    decode_payload,
    decode_replay_reply,
    decode_replay_request,
    decode_seq,
    encode_message,
    encode_payload,
    encode_replay_end,
    encode_replay_reply,
    encode_replay_request,
    encode_seq,
)

H1 = WireHash(0x371B9883C7C23ABF)
H2 = WireHash(0xFFFFFFFFFFFFFFFF)  # needs msgpack uint64


def make_stored(
    hashes: tuple[int, ...] = (H1, H2), parent: int | None = None, block_size: int = 16, **kw: Any
) -> BlockStored:
    tokens = tuple(range(1, len(hashes) * block_size + 1))
    return BlockStored(
        tuple(WireHash(h) for h in hashes),
        None if parent is None else WireHash(parent),
        tokens,
        block_size,
        **kw,
    )


def make_batch(seq: int = 7, **kw: Any) -> EventBatch:
    events = (
        make_stored(),
        make_stored((WireHash(5),), parent=H2, lora_id=3, lora_name="l", group_idx=1),
        BlockRemoved((H1,), group_idx=0),
        BlockRemoved((H2,), medium="CPU"),
        AllBlocksCleared(),
    )
    return EventBatch(seq, 1700000000.25, events, kw.get("dp", 0))


def pack(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("form", ["map", "array"])
def test_round_trip_both_forms(form: Any) -> None:
    batch = make_batch()
    assert decode_payload(encode_payload(batch, form=form), batch.seq) == batch


@pytest.mark.parametrize("form", ["map", "array"])
def test_round_trip_every_optional_field(form: Any) -> None:
    event = make_stored(
        lora_id=2,
        medium="STORAGE",
        lora_name="adapter",
        extra_keys=(["adapter", "salt"], None),
        group_idx=3,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=128,
        locality="REMOTE",
        ownership="kvcr",
        session_id="sess-1",
        lookahead_token_ids=((33,), (34,)),
    )
    removed = BlockRemoved((H1,), medium=None, group_idx=2, locality="LOCAL", ownership="kvcr")
    batch = EventBatch(0, 1.5, (event, removed), None)
    assert decode_payload(encode_payload(batch, form=form), 0) == batch


def test_message_round_trip_and_frames() -> None:
    batch = make_batch(seq=42)
    frames = encode_message(batch, topic="kv@x")
    assert frames[0] == b"kv@x"
    assert frames[1] == (42).to_bytes(8, "big")
    assert decode_message(frames) == batch


def test_two_element_batch_without_rank() -> None:
    """Older batches were ``[ts, events]``; msgspec (like vLLM) writes a null rank instead."""
    batch = EventBatch(3, 2.0, (BlockRemoved((H1,)),), None)
    assert msgspec.msgpack.decode(encode_payload(batch))[2] is None
    payload = pack([2.0, [{"type": "BlockRemoved", "block_hashes": [H1], "medium": "GPU"}]])
    assert decode_payload(payload, 3) == batch


def test_extra_batch_elements_are_ignored() -> None:
    payload = pack([1.0, [{"type": "AllBlocksCleared"}], 0, "future"])
    assert decode_payload(payload, 0) == EventBatch(0, 1.0, (AllBlocksCleared(),), 0)


# ---------------------------------------------------------------- accepted variants


def test_array_form_as_older_vllm_sent_it() -> None:
    """The pre-#42892 positional form, with the short BlockStored of the upstream example."""
    payload = pack(
        [
            9.0,
            [
                ["BlockStored", [1, 2], None, list(range(32)), 16, None, "GPU"],
                ["BlockStored", [3], 2, list(range(16)), 16],  # even older: no medium
                ["BlockRemoved", [1], "GPU"],
                ["AllBlocksCleared"],
            ],
        ]
    )
    batch = decode_payload(payload, 4)
    assert batch == EventBatch(
        4,
        9.0,
        (
            BlockStored((WireHash(1), WireHash(2)), None, tuple(range(32)), 16, None, "GPU"),
            BlockStored((WireHash(3),), WireHash(2), tuple(range(16)), 16),
            BlockRemoved((WireHash(1),), "GPU"),
            AllBlocksCleared(),
        ),
        None,
    )


def test_bytes_hashes_become_last_eight_bytes() -> None:
    digest = bytes(range(24)) + H1.to_bytes(8, "big")
    parent = b"\x00" * 8 + H2.to_bytes(8, "big")  # a 16-byte xxhash digest
    payload = pack(
        [
            1.0,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [digest],
                    "parent_block_hash": parent,
                    "token_ids": [1] * 16,
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                },
                {"type": "BlockRemoved", "block_hashes": [digest], "medium": "GPU"},
            ],
            0,
        ]
    )
    stored, removed = decode_payload(payload, 0).events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert stored.block_hashes == (H1,)
    assert stored.parent_block_hash == H2
    assert removed.block_hashes == (H1,)


def test_bytes_hashes_in_array_form() -> None:
    payload = pack([1.0, [["BlockRemoved", [b"\x01" * 16], None]]])
    (event,) = decode_payload(payload, 0).events
    assert event == BlockRemoved((WireHash(0x0101010101010101),), None)


def test_negative_int_hash_is_folded_to_unsigned() -> None:
    """Very old vLLM hashed with Python's hash(): signed 64-bit values."""
    payload = pack([1.0, [["BlockRemoved", [-1], "GPU"]]])
    (event,) = decode_payload(payload, 0).events
    assert event == BlockRemoved((WireHash(2**64 - 1),), "GPU")


def test_unknown_fields_are_ignored() -> None:
    payload = pack(
        [
            1.0,
            [
                {
                    "type": "BlockRemoved",
                    "block_hashes": [1],
                    "medium": "GPU",
                    "remaining_copy_counts": [2],
                    "something_from_2027": {"a": [1, 2]},
                }
            ],
            0,
        ]
    )
    assert decode_payload(payload, 0).events == (BlockRemoved((WireHash(1),), "GPU"),)


def test_missing_optional_fields_take_domain_defaults() -> None:
    payload = pack([1.0, [{"type": "BlockRemoved", "block_hashes": [1]}]])
    assert decode_payload(payload, 0).events == (BlockRemoved((WireHash(1),), "GPU"),)


@pytest.mark.parametrize("form", ["map", "array"])
def test_unknown_event_types_are_skipped_and_reported(form: str) -> None:
    if form == "map":
        unknown: Any = {"type": "BlockPromoted", "block_hashes": [9]}
        known: Any = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
    else:
        unknown = ["BlockPromoted", [9]]
        known = ["BlockRemoved", [1], "GPU"]
    seen: list[str] = []
    batch = decode_payload(pack([1.0, [unknown, known, unknown], 0]), 5, on_unknown=seen.append)
    assert batch.events == (BlockRemoved((WireHash(1),), "GPU"),)
    assert seen == ["BlockPromoted", "BlockPromoted"]
    # Without a callback the events are still skipped, never an error.
    assert decode_payload(pack([1.0, [unknown], 0]), 5).events == ()


def test_mixed_forms_in_one_batch_decode() -> None:
    payload = pack([1.0, [["AllBlocksCleared"], {"type": "AllBlocksCleared"}], 0])
    assert decode_payload(payload, 0).events == (AllBlocksCleared(), AllBlocksCleared())


# ---------------------------------------------------------------- malformed input


def _stored_map(**override: Any) -> dict[str, Any]:
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [1] * 16,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    event.update(override)
    return {k: v for k, v in event.items() if v is not _DROP}


_DROP = object()


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        (b"", "not valid msgpack"),
        (b"\xc1", "not valid msgpack"),
        (pack({"ts": 1.0}), "msgpack array"),
        (pack([1.0]), "msgpack array"),
        (pack(["now", []]), "msgpack array"),
        (pack([1.0, {}]), "msgpack array"),
        (pack([1.0, [5]]), "event 0: expected a map"),
        (pack([1.0, [{"block_hashes": [1]}]]), "event 0: the event type tag"),
        (pack([1.0, [[]]]), "event 0: the event type tag"),
        (pack([1.0, [[7, [1]]]]), "event 0: the event type tag"),
        (pack([1.0, [_stored_map(block_size=-16)]]), "block_size"),
        (pack([1.0, [_stored_map(block_hashes=[1.5])]]), "block_hashes"),
        (pack([1.0, [_stored_map(block_hashes=["ab"])]]), "block_hashes"),
        (pack([1.0, [_stored_map(block_hashes=[b"\x01\x02"])]]), "at least 8 bytes"),
        (pack([1.0, [_stored_map(parent_block_hash="x")]]), "parent_block_hash"),
        (pack([1.0, [_stored_map(token_ids=_DROP)]]), "token_ids"),
        (pack([1.0, [_stored_map(token_ids=[1.0])]]), "token_ids"),
        (pack([1.0, [_stored_map(medium=3)]]), "medium"),
        (pack([1.0, [{}, _stored_map()]]), "event 0"),
        (pack([1.0, [_stored_map(), ["BlockRemoved", "x"]]]), "event 1 (BlockRemoved)"),
        (pack([1.0, [], "rank"]), "msgpack array"),
    ],
)
def test_malformed_payloads_name_the_problem(payload: bytes, fragment: str) -> None:
    with pytest.raises(MalformedEventError, match=None) as info:
        decode_payload(payload, 0)
    assert fragment in str(info.value), str(info.value)


def test_every_truncation_raises_malformed_event_error() -> None:
    for form in ("map", "array"):
        payload = encode_payload(make_batch(), form=form)
        assert decode_payload(payload, 7) == make_batch()
        for cut in range(len(payload)):
            with pytest.raises(MalformedEventError):
                decode_payload(payload[:cut], 7)


def test_byte_by_byte_prefixes_and_memoryview_frames() -> None:
    """Frames may arrive as any buffer; each growing prefix fails until the whole is there."""
    payload = encode_payload(make_batch())
    buffer = bytearray()
    outcomes = []
    for byte in payload:
        buffer.append(byte)
        try:
            decode_payload(memoryview(buffer), 7)
            outcomes.append(True)
        except MalformedEventError:
            outcomes.append(False)
    assert outcomes == [False] * (len(payload) - 1) + [True]


@pytest.mark.parametrize("tail", [b"\x00", b"\xc0", b"\x93"])
def test_trailing_data_is_rejected(tail: bytes) -> None:
    with pytest.raises(MalformedEventError, match="trailing"):
        decode_payload(encode_payload(make_batch()) + tail, 7)


def test_deep_nesting_is_malformed_not_a_crash() -> None:
    nested = b"\x91" * 100_000 + b"\xc0"
    payload = pack([1.0, [_stored_map(extra_keys=None)]])
    bad = payload.replace(b"\xc0", nested, 1)  # parent_block_hash null -> deep array
    with pytest.raises(MalformedEventError):
        decode_payload(bad, 0)
    with pytest.raises(MalformedEventError):
        decode_payload(b"\x92\xcb" + b"\x00" * 8 + nested, 0)


# ---------------------------------------------------------------- frames and seq


def test_message_frame_count_and_seq_are_checked() -> None:
    payload = encode_payload(make_batch())
    with pytest.raises(MalformedEventError, match="3 frames"):
        decode_message([b"kv", encode_seq(1)])
    with pytest.raises(MalformedEventError, match="3 frames"):
        decode_message([b"kv", encode_seq(1), payload, b""])
    for bad_seq in (b"", b"\x00" * 7, b"\x00" * 9):
        with pytest.raises(MalformedEventError, match="8 bytes"):
            decode_message([b"kv", bad_seq, payload])
    with pytest.raises(MalformedEventError, match="end marker"):
        decode_message([b"kv", END_SEQ, payload])


def test_seq_codec_bounds() -> None:
    assert decode_seq(encode_seq(0)) == 0
    assert decode_seq(encode_seq(MAX_SEQ)) == MAX_SEQ
    with pytest.raises(ValueError, match="sequence number"):
        encode_seq(-1)
    with pytest.raises(ValueError, match="sequence number"):
        encode_seq(MAX_SEQ + 1)


# ---------------------------------------------------------------- replay


def test_replay_request_frames() -> None:
    assert encode_replay_request(11) == [b"", (11).to_bytes(8, "big")]
    assert decode_replay_request([b"id", *encode_replay_request(11)]) == 11
    with pytest.raises(MalformedEventError, match="3 frames"):
        decode_replay_request([b"", encode_seq(1)])
    with pytest.raises(MalformedEventError, match="delimiter"):
        decode_replay_request([b"id", b"x", encode_seq(1)])
    with pytest.raises(MalformedEventError, match="8 bytes"):
        decode_replay_request([b"id", b"", b"\x01"])


def test_replay_reply_current_shape() -> None:
    batch = make_batch(seq=12)
    payload = encode_payload(batch)
    frames = encode_replay_reply("kv", 12, payload)
    assert frames == [b"", b"kv", (12).to_bytes(8, "big"), payload]
    assert decode_replay_reply(frames) == ReplayBatch(b"kv", batch)
    assert encode_replay_end() == [b"", b"", b"\xff" * 8, b""]
    assert decode_replay_reply(encode_replay_end()) == ReplayEnd()


def test_replay_reply_older_shapes() -> None:
    batch = make_batch(seq=3)
    payload = encode_payload(batch, form="array")
    assert decode_replay_reply([b"", encode_seq(3), payload]) == ReplayBatch(None, batch)
    assert decode_replay_reply([b"kv", encode_seq(3), payload]) == ReplayBatch(b"kv", batch)
    assert decode_replay_reply([encode_seq(3), payload]) == ReplayBatch(None, batch)
    assert decode_replay_reply([b"", END_SEQ, b""]) == ReplayEnd()
    assert decode_replay_reply([END_SEQ, b""]) == ReplayEnd()


@pytest.mark.parametrize(
    ("frames", "fragment"),
    [
        ([b""], "got 1"),
        ([b"", b"kv", encode_seq(1), b"", b""], "got 5"),
        ([b"x", b"kv", encode_seq(1), b"\x90"], "empty delimiter"),
        ([b"", b"", END_SEQ, b"\x90"], "empty payload"),
        ([b"", b"kv", b"\x01", b"\x90"], "8 bytes"),
        ([b"", b"kv", encode_seq(1), b"\x90"], "msgpack array"),
    ],
)
def test_replay_reply_malformed(frames: list[bytes], fragment: str) -> None:
    with pytest.raises(MalformedEventError) as info:
        decode_replay_reply(frames)
    assert fragment in str(info.value), str(info.value)


def test_encode_rejects_bad_form() -> None:
    with pytest.raises(ValueError, match="form"):
        encode_payload(make_batch(), form="json")  # type: ignore[arg-type]


def test_decoding_without_token_ids_keeps_everything_else() -> None:
    """The router's lean decode: same events, token ids left empty."""
    from kvroute.wire.vllm_events import decode_message, encode_message

    stored = BlockStored((WireHash(1), WireHash(2)), WireHash(9), tuple(range(32)), 16, None,
                         "GPU", "lora-a", (("lora-a", "salt"), ("lora-a",)), 0, "full_attention")
    batch = EventBatch(seq=3, ts=1.5, events=(stored, BlockRemoved((WireHash(7),), "GPU", 0),
                                              AllBlocksCleared()), data_parallel_rank=0)
    frames = encode_message(batch, "kv")
    full = decode_message(frames)
    lean = decode_message(frames, token_ids=False)
    assert full.events[0].token_ids == stored.token_ids  # type: ignore[union-attr]
    assert lean.events[1:] == full.events[1:]
    first = lean.events[0]
    assert isinstance(first, BlockStored) and first.token_ids == ()
    assert msgspec.structs.replace(first, token_ids=stored.token_ids) == full.events[0]
