"""wire/sse.py, tested the h11 way: whole, byte by byte, with trailing data."""

from __future__ import annotations

import json

import pytest

from kvroute.sim import openai_answers as answers
from kvroute.wire import openai as oa
from kvroute.wire.sse import (
    DONE,
    SSEDecoder,
    SSEEvent,
    data_payloads,
    encode_comment,
    encode_data,
    encode_event,
    error_event,
)


def decode_whole(data: bytes, *, partial: bool = False) -> list[SSEEvent]:
    dec = SSEDecoder()
    return dec.feed(data) + dec.flush(dispatch_partial=partial)


def decode_bytewise(data: bytes, *, partial: bool = False) -> list[SSEEvent]:
    dec = SSEDecoder()
    events: list[SSEEvent] = []
    for i in range(len(data)):
        events += dec.feed(data[i : i + 1])
    return events + dec.flush(dispatch_partial=partial)


def both(data: bytes, *, partial: bool = False) -> list[SSEEvent]:
    whole = decode_whole(data, partial=partial)
    assert decode_bytewise(data, partial=partial) == whole
    return whole


VLLM_STREAM = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
    b'"finish_reason":null}]}\n\n'
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"h\xc3\xa9llo \xf0\x9f\x98\x80"},"logprobs":null,'
    b'"finish_reason":null}]}\n\n'
    b"data: [DONE]\n\n"
)


def test_vllm_stream() -> None:
    events = both(VLLM_STREAM)
    assert len(events) == 3
    assert events[0].json()["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[1].json()["choices"][0]["delta"]["content"] == "héllo 😀"
    assert [e.is_done for e in events] == [False, False, True]
    assert all(e.event == "message" and e.id is None for e in events)


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_line_endings(eol: bytes) -> None:
    data = b"data: a" + eol + b"data: b" + eol + eol + b"data: c" + eol + eol
    assert both(data) == [SSEEvent("a\nb"), SSEEvent("c")]


def test_mixed_line_endings_and_cr_split_from_lf() -> None:
    data = b"data: a\r\n\r\ndata: b\r\rdata: c\n\n"
    assert both(data) == [SSEEvent("a"), SSEEvent("b"), SSEEvent("c")]
    # CR at the end of one chunk and LF at the start of the next is one line end, not two.
    dec = SSEDecoder()
    assert dec.feed(b"data: x\r") == []
    assert dec.feed(b"\n") == []
    assert dec.feed(b"\r\n") == [SSEEvent("x")]


def test_comments_and_unknown_fields() -> None:
    dec = SSEDecoder()
    events = dec.feed(b": ping\n\n:\nfoo: bar\ndata: x\n\n") + dec.flush()
    assert events == [SSEEvent("x")]
    assert dec.num_comments == 2


def test_field_parsing_rules() -> None:
    data = (
        b"event: update\nid: 7\nretry: 1500\ndata:nospace\ndata:  two spaces\ndata\n\n"
        b"data: next\n\n"
        b"retry: x1\nid: a\x00b\ndata: third\n\n"
    )
    events = both(data)
    assert events[0] == SSEEvent("nospace\n two spaces\n", event="update", id="7", retry=1500)
    # The last event id persists; type and retry reset per event.
    assert events[1] == SSEEvent("next", id="7")
    assert events[2] == SSEEvent("third", id="7")


def test_event_without_data_is_not_dispatched() -> None:
    assert both(b"event: x\n\nid: 3\n\n\n\n") == []


def test_bom_is_dropped_once() -> None:
    assert both(b"\xef\xbb\xbfdata: a\n\n") == [SSEEvent("a")]
    # Only a leading BOM is dropped: later, it makes the field name "\ufeffdata", which is
    # an unknown field and ignored, as the standard says.
    assert both(b"data: a\n\n\xef\xbb\xbfdata: b\n\n") == [SSEEvent("a")]


def test_invalid_utf8_is_replaced() -> None:
    assert both(b"data: a\xffb\n\n") == [SSEEvent("a\ufffdb")]


def test_incomplete_event_at_end() -> None:
    data = b'data: {"error": {"message": "boom"}}\n'
    assert both(data) == []
    assert both(data, partial=True) == [SSEEvent('{"error": {"message": "boom"}}')]
    # An unterminated last line counts too in partial mode.
    assert both(b"data: a", partial=True) == [SSEEvent("a")]
    assert both(b"data: a\r", partial=True) == [SSEEvent("a")]


def test_trailing_data_waits_for_more() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: a\n\ndata: b") == [SSEEvent("a")]
    assert dec.feed(b"c\n") == []
    assert dec.feed(b"\n") == [SSEEvent("bc")]
    assert dec.flush() == []


def test_utf8_split_inside_a_character() -> None:
    dec = SSEDecoder()
    emoji = "😀".encode()
    assert dec.feed(b"data: " + emoji[:1]) == []
    assert dec.feed(emoji[1:3]) == []
    assert dec.feed(emoji[3:] + b"\n\n") == [SSEEvent("😀")]


def test_flush_of_incomplete_utf8_replaces() -> None:
    dec = SSEDecoder()
    dec.feed(b"data: \xf0\x9f")
    assert dec.flush(dispatch_partial=True) == [SSEEvent("\ufffd")]


# ---------------------------------------------------------------------------- encoders


def test_encode_data_forms() -> None:
    assert encode_data(b"[DONE]") == DONE
    assert encode_data("x") == b"data: x\n\n"
    assert encode_data({"a": 1, "b": "é"}) == b'data: {"a":1,"b":"\xc3\xa9"}\n\n'


def test_encode_data_multiline_round_trips() -> None:
    for text in ["a\nb", "a\r\nb\rc", "\n", "line\n"]:
        assert decode_whole(encode_data(text)) == [
            SSEEvent(text.replace("\r\n", "\n").replace("\r", "\n"))
        ]


def test_encode_event_fields() -> None:
    raw = encode_event("x", event="e", id="1", retry=10)
    assert raw == b"event: e\nid: 1\nretry: 10\ndata: x\n\n"
    assert decode_whole(raw) == [SSEEvent("x", event="e", id="1", retry=10)]
    with pytest.raises(ValueError, match="line break"):
        encode_event("x", event="a\nb")
    with pytest.raises(ValueError, match="non-negative"):
        encode_event("x", retry=-1)


def test_encode_comment() -> None:
    dec = SSEDecoder()
    assert dec.feed(encode_comment("ping") + encode_comment()) == []
    assert dec.num_comments == 2
    with pytest.raises(ValueError):
        encode_comment("a\nb")


def test_error_event_shape() -> None:
    raw = error_event("upstream died", "InternalServerError", 500)
    (event,) = decode_whole(raw + DONE)[:1]
    assert event.json() == {
        "error": {
            "message": "upstream died",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    assert list(event.json()["error"]) == ["message", "type", "param", "code"]
    # Same body as a non-streamed error.
    assert event.data.encode() == oa.error_body("upstream died", status=500)


def test_round_trip_of_a_simulated_stream() -> None:
    chunks = [
        answers.chat_chunk(id="c", created=1, model="m", role="assistant", content=""),
        answers.chat_chunk(id="c", created=1, model="m", content="a\nb"),
        answers.chat_chunk(id="c", created=1, model="m", content="", finish_reason="stop",
                           final=True),
    ]
    raw = b"".join(encode_data(c) for c in chunks) + DONE
    events = both(raw)
    assert [e.json() for e in events[:-1]] == [json.loads(json.dumps(c)) for c in chunks]
    assert events[-1].is_done


def test_data_payloads_keep_whole_data_lines_and_leave_out_done_and_the_rest() -> None:
    text = (b'data: {"a":1}\n\n: keep-alive\nevent: x\ndata:{"b":2}\r\n\ndata: \n'
            b"data: [DONE]\n\n")
    assert list(data_payloads(text)) == [b'{"a":1}', b'{"b":2}']
