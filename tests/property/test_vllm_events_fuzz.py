"""Fuzz invariants of the vLLM KV-event codec.

* Arbitrary bytes, and valid payloads with bytes flipped, inserted or deleted, either decode
  or raise ``MalformedEventError``; nothing else ever escapes.
* Any batch of domain events survives encode → decode unchanged, in both encodings.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.core.errors import MalformedEventError
from kvroute.core.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent
from kvroute.core.types import WireHash
from kvroute.wire.vllm_events import (
    decode_message,
    decode_payload,
    decode_replay_reply,
    encode_payload,
)

hashes = st.integers(min_value=0, max_value=2**64 - 1).map(WireHash)
small_int = st.integers(min_value=-(2**63), max_value=2**64 - 1)
text = st.text(max_size=8)
opt = st.none


@st.composite
def stored_events(draw: st.DrawFn) -> BlockStored:
    block_hashes = tuple(draw(st.lists(hashes, min_size=0, max_size=4)))
    block_size = draw(st.integers(min_value=0, max_value=64))
    return BlockStored(
        block_hashes,
        draw(opt() | hashes),
        tuple(draw(st.lists(small_int, max_size=40))),
        block_size,
        draw(opt() | st.integers(min_value=0, max_value=2**31)),
        draw(opt() | st.sampled_from(["GPU", "CPU", "STORAGE", "cpu"])),
        draw(opt() | text),
        draw(opt() | st.lists(opt() | st.lists(text, max_size=2), max_size=4).map(tuple)),
        draw(opt() | st.integers(min_value=0, max_value=8)),
        draw(opt() | st.sampled_from(["full_attention", "sliding_window", "mamba"])),
        draw(opt() | st.integers(min_value=0, max_value=4096)),
        draw(opt() | st.sampled_from(["LOCAL", "REMOTE"])),
        draw(opt() | text),
        draw(opt() | text),
        draw(opt() | st.lists(st.lists(small_int, max_size=3).map(tuple), max_size=3).map(tuple)),
    )


removed_events = st.builds(
    BlockRemoved,
    st.lists(hashes, max_size=3).map(tuple),
    opt() | st.sampled_from(["GPU", "CPU"]),
    opt() | st.integers(min_value=0, max_value=8),
    opt() | st.sampled_from(["LOCAL", "REMOTE"]),
    opt() | text,
)
events: st.SearchStrategy[KVEvent] = st.one_of(
    stored_events(), removed_events, st.just(AllBlocksCleared())
)
batches = st.builds(
    EventBatch,
    st.integers(min_value=0, max_value=2**63 - 1),
    st.floats(allow_nan=False),
    st.lists(events, max_size=6).map(tuple),
    opt() | st.integers(min_value=0, max_value=64),
)


def _decode_or_malformed(payload: bytes) -> EventBatch | None:
    try:
        return decode_payload(payload, 0)
    except MalformedEventError:
        return None


@settings(max_examples=300, deadline=None)
@given(batches, st.sampled_from(["map", "array"]))
def test_round_trip(batch: EventBatch, form: Any) -> None:
    assert decode_payload(encode_payload(batch, form=form), batch.seq) == batch


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_decode_or_raise_malformed(data: bytes) -> None:
    _decode_or_malformed(data)
    for frames in ([data], [b"kv", data[:8], data[8:]], [b"", b"kv", data[:8], data[8:]]):
        try:
            decode_message(frames)
        except MalformedEventError:
            pass
        try:
            decode_replay_reply(frames)
        except MalformedEventError:
            pass


@st.composite
def mutated_payloads(draw: st.DrawFn) -> bytes:
    payload = bytearray(encode_payload(draw(batches), form=draw(st.sampled_from(["map", "array"]))))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        action = draw(st.sampled_from(["flip", "insert", "delete"]))
        at = draw(st.integers(min_value=0, max_value=max(len(payload) - 1, 0)))
        if action == "flip" and payload:
            payload[at] = draw(st.integers(min_value=0, max_value=255))
        elif action == "insert":
            payload[at:at] = draw(st.binary(min_size=1, max_size=3))
        elif payload:
            del payload[at]
    return bytes(payload)


@settings(max_examples=1000, deadline=None)
@given(mutated_payloads())
def test_mutated_valid_payloads_decode_or_raise_malformed(payload: bytes) -> None:
    batch = _decode_or_malformed(payload)
    if batch is not None:
        # Whatever decodes is in the router's normal form.
        for event in batch.events:
            if isinstance(event, (BlockStored, BlockRemoved)):
                assert all(0 <= h < 2**64 for h in event.block_hashes)
            if isinstance(event, BlockStored):
                assert event.block_size >= 0
