"""Real vLLM frames (``tests/data/vllm-vectors-0.32.json``) decode to what vLLM meant, and
our encoder reproduces vLLM's bytes exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvroute.core.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent
from kvroute.core.types import to_wire_hash
from kvroute.wire.vllm_events import (
    ReplayBatch,
    ReplayEnd,
    decode_message,
    decode_payload,
    decode_replay_reply,
    encode_message,
    encode_payload,
    encode_replay_end,
    encode_replay_reply,
    encode_replay_request,
)

VECTORS: dict[str, Any] = json.loads(
    (Path(__file__).parents[1] / "data" / "vllm-vectors-0.32.json").read_text()
)
EXAMPLE = VECTORS["kv_event_batch_example"]
BYTES_EXAMPLE = VECTORS["kv_event_batch_bytes_hash_example"]
LIVE = VECTORS["live_server_capture_v0_32"]["zmq_messages"]


def _expected_event(generic: dict[str, Any]) -> KVEvent:
    """Build the domain event from the vectors' generic decoding (hashes may be hex bytes)."""

    def h(value: Any) -> Any:
        if isinstance(value, dict):
            return to_wire_hash(bytes.fromhex(value["__bytes_hex__"]))
        return None if value is None else to_wire_hash(value)

    fields = {k: v for k, v in generic.items() if k != "type"}
    kind = generic["type"]
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    fields["block_hashes"] = tuple(h(x) for x in fields["block_hashes"])
    if kind == "BlockRemoved":
        return BlockRemoved(**fields)
    fields["parent_block_hash"] = h(fields["parent_block_hash"])
    fields["token_ids"] = tuple(fields["token_ids"])
    if fields.get("extra_keys") is not None:
        fields["extra_keys"] = tuple(fields["extra_keys"])
    return BlockStored(**fields)


def _expected_batch(seq: int, generic: list[Any]) -> EventBatch:
    ts, events, rank = generic
    return EventBatch(seq, ts, tuple(_expected_event(e) for e in events), rank)


def test_publisher_example_frames_decode() -> None:
    frames = EXAMPLE["zmq_frames"]
    message = [
        frames["topic_utf8"].encode(),
        bytes.fromhex(frames["seq_hex"]),
        bytes.fromhex(frames["payload_msgpack_hex"]),
    ]
    batch = decode_message(message)
    assert batch == _expected_batch(frames["seq_int"], EXAMPLE["payload_decoded_generic"])
    # The int hashes are the last 8 bytes of the digests vLLM computed for the request.
    stored = batch.events[0]
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == tuple(
        to_wire_hash(bytes.fromhex(x)) for x in EXAMPLE["request_block_hashes_hex"]
    )
    assert [type(e).__name__ for e in batch.events] == [
        "BlockStored",
        "BlockRemoved",
        "BlockRemoved",
        "AllBlocksCleared",
    ]


def test_publisher_example_reencodes_byte_identical() -> None:
    frames = EXAMPLE["zmq_frames"]
    payload = bytes.fromhex(frames["payload_msgpack_hex"])
    batch = decode_payload(payload, frames["seq_int"])
    assert encode_message(batch, topic=frames["topic_utf8"]) == [
        frames["topic_utf8"].encode(),
        bytes.fromhex(frames["seq_hex"]),
        payload,
    ]


def test_bytes_hash_example_gives_the_same_keys_as_int_hashes() -> None:
    batch = decode_payload(bytes.fromhex(BYTES_EXAMPLE["payload_msgpack_hex"]), 0)
    assert batch == _expected_batch(0, BYTES_EXAMPLE["payload_decoded_generic"])
    int_batch = decode_payload(bytes.fromhex(EXAMPLE["zmq_frames"]["payload_msgpack_hex"]), 0)
    assert batch.events[0] == int_batch.events[0]


def test_replay_exchange_frames() -> None:
    exchange = EXAMPLE["replay_exchange"]
    request = [bytes.fromhex(x) for x in exchange["request_frames_sent_by_DEALER"]]
    assert encode_replay_request(0) == request
    first, end = (
        [bytes.fromhex(x) for x in reply]
        for reply in exchange["response_frames_received_by_DEALER_hex"]
    )
    decoded = decode_replay_reply(first)
    assert isinstance(decoded, ReplayBatch)
    assert decoded.topic == b"kv@test"
    assert decoded.batch == _expected_batch(0, EXAMPLE["payload_decoded_generic"])
    assert encode_replay_reply("kv@test", 0, first[3]) == first
    assert decode_replay_reply(end) == ReplayEnd()
    assert encode_replay_end() == end


@pytest.mark.parametrize("message", LIVE, ids=[f"seq{m['seq']}" for m in LIVE])
def test_live_server_frames(message: dict[str, Any]) -> None:
    payload = bytes.fromhex(message["payload_msgpack_hex"])
    frames = [message["topic_utf8"].encode(), message["seq"].to_bytes(8, "big"), payload]
    batch = decode_message(frames)
    assert batch == _expected_batch(message["seq"], message["payload_decoded"])
    assert encode_payload(batch) == payload


def test_live_extension_chains_to_block_two_of_request_a() -> None:
    """Request E's new block names A's last block as its parent, as §2.4 describes."""
    by_seq = {
        m["seq"]: decode_payload(bytes.fromhex(m["payload_msgpack_hex"]), m["seq"]) for m in LIVE
    }
    first, last = by_seq[min(by_seq)].events[0], by_seq[max(by_seq)].events[0]
    assert isinstance(first, BlockStored) and isinstance(last, BlockStored)
    assert last.parent_block_hash == first.block_hashes[-1]
    assert first.block_size == last.block_size == 32
    assert first.kv_cache_spec_kind == "full_attention"
