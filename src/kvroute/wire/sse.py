"""Server-sent events: an incremental decoder and the few encoders an OpenAI stream needs.

Owns the SSE framing only (WHATWG HTML, "Server-sent events", event stream interpretation);
what the ``data`` of an event means is the caller's business. Pure: no sockets, no asyncio,
no clock, so it is shared by the proxy (reading an engine's stream) and the simulated engine
(writing one).

Theory of operation (the decoder)
---------------------------------
Bytes arrive in chunks cut anywhere: inside a line, between ``\\r`` and ``\\n``, or inside a
multi-byte UTF-8 sequence. The decoder keeps three pieces of state:

1. an incremental UTF-8 decoder (``errors="replace"``, as the standard asks), which holds the
   first bytes of a character split across chunks;
2. the text of the current, unterminated line. A line ends at ``\\r\\n``, ``\\n`` or a lone
   ``\\r``. A ``\\r`` at the very end of the buffered text is *not* treated as a line end yet,
   because the next chunk may start with ``\\n``; it is settled on the next ``feed`` or by
   ``flush``;
3. the event being built: its ``data`` lines, ``event`` type, ``id`` and ``retry``.

An empty line dispatches the event being built if it has any ``data`` (an event with no data
is dropped, as the standard says). Lines starting with ``:`` are comments (keep-alives). A
leading UTF-8 BOM is dropped. Because every step depends only on the characters seen, any
split of the same bytes yields the same events; ``tests/property/test_sse_props.py`` checks
exactly that.

NOTE: the standard discards an event the stream ends in the middle of. ``flush`` does the
same by default, but ``flush(dispatch_partial=True)`` returns it: a router reading a stream
that an engine cut short wants to see an error payload that lacked its blank line.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import msgspec

__all__ = [
    "DONE",
    "DONE_DATA",
    "SSEDecoder",
    "SSEEvent",
    "data_payloads",
    "encode_comment",
    "encode_data",
    "encode_event",
    "error_event",
]

DONE_DATA: Final = "[DONE]"
"""The ``data`` of the sentinel event that ends an OpenAI stream."""

DONE: Final = b"data: [DONE]\n\n"
"""The sentinel event, encoded exactly as vLLM and OpenAI send it."""

_LINE_END = re.compile(r"\r\n|\r|\n")


def data_payloads(text: bytes) -> Iterator[bytes]:
    """The non-empty ``data`` payloads of the whole lines in ``text``, the ``[DONE]``
    sentinel left out: the quick read of an OpenAI stream's events when each sits on one
    ``data:`` line (as vLLM writes them), for watchers that look at a relayed stream without
    decoding its framing (``wire/relay.py``, ``wire/turn_copy.py``)."""
    for line in text.splitlines():
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data and data != b"[DONE]":
            yield data
_JSON_ENCODER = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One dispatched event.

    Attributes:
        data: the ``data`` lines joined with ``\\n`` (the last newline removed).
        event: the event type; ``"message"`` when the stream gave none.
        id: the last event id seen on the stream so far (it persists across events), or None.
        retry: the reconnection time in ms if this event carried a valid ``retry`` field.
    """

    data: str
    event: str = "message"
    id: str | None = None
    retry: int | None = None

    @property
    def is_done(self) -> bool:
        """True for OpenAI's ``data: [DONE]`` sentinel."""
        return self.data == DONE_DATA

    def json(self) -> Any:
        """Decode ``data`` as JSON.

        Raises:
            msgspec.DecodeError: if ``data`` is not valid JSON (``[DONE]`` is not).
        """
        return msgspec.json.decode(self.data)


class SSEDecoder:
    """Incremental SSE decoder: ``feed`` bytes as they arrive, ``flush`` at end of stream.

    Invariant: the events returned by any sequence of ``feed`` calls followed by ``flush``
    depend only on the concatenation of the fed bytes, never on where they were split.
    """

    __slots__ = (
        "_bom_checked",
        "_data",
        "_event",
        "_has_data",
        "_last_id",
        "_line",
        "_retry",
        "_utf8",
        "num_comments",
    )

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._line = ""
        self._bom_checked = False
        self._data: list[str] = []
        self._has_data = False
        self._event = ""
        self._last_id: str | None = None
        self._retry: int | None = None
        self.num_comments = 0
        """Comment lines seen (keep-alives such as ``: ping``)."""

    def feed(self, data: bytes) -> list[SSEEvent]:
        """Decode one chunk and return the events it completed, in order."""
        text = self._utf8.decode(data)
        return self._consume(text, final=False)

    def flush(self, *, dispatch_partial: bool = False) -> list[SSEEvent]:
        """End of stream: settle a trailing ``\\r`` and any incomplete UTF-8 sequence.

        Args:
            dispatch_partial: also return the event the stream ended in the middle of (no
                terminating blank line). The standard discards it; see the module note.

        Returns:
            The events completed by the end of the stream.
        """
        text = self._utf8.decode(b"", final=True)
        events = self._consume(text, final=True)
        if self._line:
            self._process_line(self._line, events)
            self._line = ""
        if dispatch_partial:
            self._dispatch(events)
        else:
            self._reset_event()
        return events

    def _consume(self, text: str, *, final: bool) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        if not text and not final:
            return events
        buf = self._line + text if self._line else text
        if not self._bom_checked and buf:
            self._bom_checked = True
            if buf[0] == "\ufeff":
                buf = buf[1:]
        if not final and buf.endswith("\r"):
            # A lone CR at the end may be the first half of CRLF: hold it back.
            hold = "\r"
            buf = buf[:-1]
        else:
            hold = ""
        pos = 0
        for match in _LINE_END.finditer(buf):
            self._process_line(buf[pos : match.start()], events)
            pos = match.end()
        self._line = buf[pos:] + hold
        return events

    def _process_line(self, line: str, events: list[SSEEvent]) -> None:
        if not line:
            self._dispatch(events)
            return
        if line[0] == ":":
            self.num_comments += 1
            return
        field, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
            self._has_data = True
        elif field == "event":
            self._event = value
        elif field == "id":
            if "\x00" not in value:
                self._last_id = value
        elif field == "retry" and value.isascii() and value.isdigit():
            self._retry = int(value)
        # Any other field name is ignored, as the standard says.

    def _dispatch(self, events: list[SSEEvent]) -> None:
        if self._has_data:
            events.append(
                SSEEvent(
                    data="\n".join(self._data),
                    event=self._event or "message",
                    id=self._last_id,
                    retry=self._retry,
                )
            )
        self._reset_event()

    def _reset_event(self) -> None:
        self._data = []
        self._has_data = False
        self._event = ""
        self._retry = None


def _payload_bytes(data: Any) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, str):
        return data.encode("utf-8")
    return _JSON_ENCODER.encode(data)


def encode_data(data: Any) -> bytes:
    """Encode one ``data`` event: ``data: <payload>\\n\\n``.

    Args:
        data: bytes or str sent as is, or any msgspec-encodable object (dict, list, Struct),
            sent as compact JSON. A payload containing line breaks is split over several
            ``data:`` lines, so the decoder gives back exactly the original text.
    """
    payload = _payload_bytes(data)
    if b"\n" not in payload and b"\r" not in payload:
        return b"data: " + payload + b"\n\n"
    return encode_event(payload)


def encode_event(
    data: Any, *, event: str | None = None, id: str | None = None, retry: int | None = None
) -> bytes:
    """Encode a full event with optional ``event``, ``id`` and ``retry`` fields.

    Raises:
        ValueError: if ``event`` or ``id`` contains a line break (it would end the field),
            or ``retry`` is negative.
    """
    parts: list[bytes] = []
    for name, value in (("event", event), ("id", id)):
        if value is None:
            continue
        if "\n" in value or "\r" in value:
            raise ValueError(f"SSE field {name!r} must not contain a line break, got {value!r}")
        parts.append(f"{name}: {value}\n".encode())
    if retry is not None:
        if retry < 0:
            raise ValueError(f"SSE retry must be a non-negative integer of ms, got {retry}")
        parts.append(f"retry: {retry}\n".encode())
    text = _payload_bytes(data).decode("utf-8", errors="replace")
    for line in _LINE_END.split(text):
        parts.append(b"data: " + line.encode("utf-8") + b"\n")
    parts.append(b"\n")
    return b"".join(parts)


def encode_comment(text: str = "") -> bytes:
    """A comment line (``: text``), used as a keep-alive; clients ignore it."""
    if "\n" in text or "\r" in text:
        raise ValueError(f"an SSE comment must be a single line, got {text!r}")
    return b": " + text.encode("utf-8") + b"\n\n" if text else b":\n\n"


def error_event(
    message: str,
    type: str = "InternalServerError",
    code: int = 500,
    param: str | None = None,
) -> bytes:
    """An event that reports an error inside a stream that has already started.

    vLLM's chat and completion stream generators do this when generation fails after the
    first byte: they send ``data: {"error": {"message", "type", "param", "code"}}`` (the same
    ``ErrorResponse`` body as a non-streamed error) and then ``data: [DONE]``. The caller
    sends ``DONE`` after this event, as vLLM does.
    """
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return b"data: " + _JSON_ENCODER.encode(body) + b"\n\n"
