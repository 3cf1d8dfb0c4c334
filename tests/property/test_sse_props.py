"""SSE decoder properties: any split of a stream decodes to the same events."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.wire.sse import SSEDecoder, SSEEvent, encode_event


def decode_in_pieces(data: bytes, cuts: list[int], *, partial: bool) -> list[SSEEvent]:
    dec = SSEDecoder()
    events: list[SSEEvent] = []
    previous = 0
    for cut in sorted(set(cuts)):
        events += dec.feed(data[previous:cut])
        previous = cut
    events += dec.feed(data[previous:])
    return events + dec.flush(dispatch_partial=partial)


def decode_whole(data: bytes, *, partial: bool) -> list[SSEEvent]:
    dec = SSEDecoder()
    return dec.feed(data) + dec.flush(dispatch_partial=partial)


# Text that exercises multi-byte UTF-8 and every line-ending form inside payloads.
payload_text = st.lists(st.sampled_from([*'ab {}":,é😀\n\r', "\r\n"]), max_size=30).map("".join)
event_names = st.one_of(st.none(), st.sampled_from(["message", "update", "é"]))
ids = st.one_of(st.none(), st.sampled_from(["1", "abc", "ü"]))

encoded_event = st.builds(
    lambda data, event, id_, retry: (data, event, id_, retry),
    payload_text,
    event_names,
    ids,
    st.one_of(st.none(), st.integers(0, 10_000)),
)


def expected_events(items: list[tuple[str, str | None, str | None, int | None]]) -> list[SSEEvent]:
    out = []
    last_id = None
    for data, event, id_, retry in items:
        if id_ is not None:
            last_id = id_
        text = data.replace("\r\n", "\n").replace("\r", "\n")
        out.append(SSEEvent(text, event=event or "message", id=last_id, retry=retry))
    return out


@settings(max_examples=300, deadline=None)
@given(items=st.lists(encoded_event, max_size=6), cuts=st.lists(st.integers(0, 2000), max_size=12))
def test_any_split_of_an_encoded_stream_decodes_to_the_same_events(
    items: list[tuple[str, str | None, str | None, int | None]], cuts: list[int]
) -> None:
    stream = b"".join(encode_event(d, event=e, id=i, retry=r) for d, e, i, r in items)
    cuts = [c % (len(stream) + 1) for c in cuts]
    expected = expected_events(items)
    assert decode_whole(stream, partial=False) == expected
    assert decode_in_pieces(stream, cuts, partial=False) == expected


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300), cuts=st.lists(st.integers(0, 300), max_size=10),
       partial=st.booleans())  # fmt: skip
def test_arbitrary_bytes_split_anywhere_give_the_same_result(
    data: bytes, cuts: list[int], partial: bool
) -> None:
    # The decoder never raises on arbitrary bytes, and the split never changes the result.
    cuts = [c % (len(data) + 1) for c in cuts]
    assert decode_in_pieces(data, cuts, partial=partial) == decode_whole(data, partial=partial)


@settings(max_examples=200, deadline=None)
@given(
    lines=st.lists(
        st.sampled_from([b"data: x", b"data:", b": c", b"event: e", b"id: 1", b"retry: 5", b"",
                         b"data: \xc3\xa9", b"junk"]),
        max_size=20,
    ),
    eol=st.sampled_from([b"\n", b"\r\n", b"\r"]),
)  # fmt: skip
def test_line_ending_style_does_not_matter(lines: list[bytes], eol: bytes) -> None:
    assert decode_whole(eol.join(lines) + eol, partial=True) == decode_whole(
        b"\n".join(lines) + b"\n", partial=True
    )
