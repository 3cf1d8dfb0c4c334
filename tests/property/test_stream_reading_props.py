"""The load generator's stream reader sees what a full SSE decoder sees, however the bytes
are cut: the same text events at the same arrival times, usage, errors and ``[DONE]``.

Reference: ``wire.sse.SSEDecoder`` fed the same chunks, every event decoded as JSON (what the
client did before it read streams on the bytes).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.bench.live_client import StreamReading, has_text
from kvroute.wire.sse import SSEDecoder


def _reference(chunks: list[bytes]) -> dict[str, Any]:
    decoder = SSEDecoder()
    out: dict[str, Any] = {"times": [], "done": False, "usage": None, "error": False}
    for now, chunk in enumerate(chunks):
        for event in decoder.feed(chunk):
            if event.is_done:
                out["done"] = True
                continue
            try:
                doc = event.json()
            except ValueError:
                continue
            if isinstance(doc, dict):
                out["error"] = out["error"] or "error" in doc
                usage = doc.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                    out["usage"] = usage["completion_tokens"]
            if has_text(doc):
                out["times"].append(float(now))
    return out


def _reading(chunks: list[bytes]) -> dict[str, Any]:
    reading = StreamReading(started=0.0)
    for now, chunk in enumerate(chunks):
        reading.feed(chunk, float(now))
    reading.close()
    times = [] if reading.ttft_s is None else [reading.ttft_s]
    for gap in reading.itl_s:
        times.append(times[-1] + gap)
    return {"times": times, "done": reading.done, "usage": reading.usage_completion_tokens,
            "error": reading.error_event}


def _chat(content: str | None, *, role: bool = False) -> dict[str, Any]:
    delta: dict[str, Any] = {} if content is None else {"content": content}
    if role:
        delta["role"] = "assistant"
    return {"id": "c", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


_PAYLOADS = st.one_of(
    st.builds(lambda t: _chat(t), st.text(max_size=6)),  # "" is an empty delta: no text
    st.just(_chat("", role=True)),
    st.just(_chat(None)),
    st.builds(lambda t: {"choices": [{"index": 0, "text": t}]}, st.text(max_size=6)),
    st.builds(lambda n: {"choices": [], "usage": {"completion_tokens": n}},
              st.integers(0, 99)),
    st.just({"error": {"message": "engine failed", "code": 502}}),
    st.just({"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}),
)


@st.composite
def _streams(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    newline = draw(st.sampled_from([b"\n", b"\r\n"]))
    spaced = draw(st.booleans())
    parts = []
    for payload in draw(st.lists(_PAYLOADS, max_size=8)):
        separators = (", ", ": ") if spaced else (",", ":")
        line = b"data: " + json.dumps(payload, separators=separators).encode()
        if draw(st.integers(0, 9)) == 0:
            parts.append(b": ping" + newline + newline)  # a comment between events
        parts.append(line + newline + newline)
    if draw(st.booleans()):
        parts.append(b"data: [DONE]" + newline + newline)
    if draw(st.booleans()):
        parts.append(b'data: {"choices": [{"index": 0, "text": "cut off')  # no blank line
    body = b"".join(parts)
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=6)))
    return body, cuts


@settings(max_examples=400, deadline=None)
@given(_streams())
def test_byte_reader_matches_a_full_decoder_for_any_cuts(stream: tuple[bytes, list[int]]) -> None:
    body, cuts = stream
    bounds = [0, *cuts, len(body)]
    chunks = [body[a:b] for a, b in itertools.pairwise(bounds)]
    assert _reading(chunks) == _reference(chunks)


def test_a_multi_line_event_hands_the_rest_to_the_full_decoder() -> None:
    chunks = [b'data: {"choices": [{"index": 0,\ndata: "text": "a"}]}\n\n',
              b'data: {"choices": [{"index": 0, "text": "b"}]}\n\ndata: [DONE]\n\n']
    assert _reading(chunks) == _reference(chunks)
    assert _reading(chunks)["times"] == [0.0, 1.0]
