"""A session's turn as its next turn will resend it: the prompt plus the answer (pure codecs).

Spread-ahead (``core/spread.py``) copies a resting session's context to an idle replica so
that its next turn finds the prefix there. The next turn of a chat session sends the last
request's messages, then the answer as an ``assistant`` message, then the new user message;
a copy of the prompt alone leaves the answer's blocks to be prefilled on the target at the
return. So the forwarding driver reads the answer's text as it relays it (``AnswerText`` for
a stream, ``answer_of`` for a whole answer), keeps it beside the parsed request in a
``SessionTurn``, and the shadow warm-up sender builds the copy with ``turn_copy_body``:

* chat: the messages plus ``{"role": "assistant", "content": <answer>}``, rendered with
  ``add_generation_prompt: false``, so the rendered text ends where the assistant message
  ends, which is a prefix of the next turn's rendered prompt under the same chat template
  (the next turn adds a user message and its generation prompt after it);
* completions with a text prompt: the prompt followed by the completion text.

The answer is kept only while it is plain text of one choice within ``MAX_ANSWER_CHARS``
(memory is bounded per request); a longer answer, tool calls, several choices, a token-id
prompt or an answer that did not finish: the copy is the prompt alone, as before. The body
keeps every other field of the session's request (tools, ``chat_template_kwargs``, the
tenant's ``cache_salt``), so the engine hashes the same blocks the next turn will look up.

No I/O: ``shell/answer_capture.py`` feeds these for ``shell/forward.py``, and
``shell/shadow_warm.py`` sends the body.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Final

import msgspec

from kvroute.wire.openai import (
    Endpoint,
    ParsedRequest,
    validate_cache_salt,
    warm_request_body,
)
from kvroute.wire.sse import data_payloads

__all__ = ["MAX_ANSWER_CHARS", "AnswerText", "SessionTurn", "answer_of", "turn_copy_body"]

MAX_ANSWER_CHARS: Final = 65_536
"""The longest answer kept for a copy (about 16k tokens of text): beyond it the copy is the
prompt alone, so a very long answer costs no memory while it streams."""


@dataclass(slots=True)
class SessionTurn:
    """What a shadow warm-up of a session resends: its last request and, once the answer
    ended, the answer's text (``None``: not known, not plain text, or over the cap).

    Mutable on purpose: the driver hands it to the walk when the request starts and sets
    ``answer`` when the answer has been relayed, before the walk's end plans a copy."""

    request: ParsedRequest
    answer: str | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    tool_calls: list[Any] | None = None
    function_call: Any = None


class _Message(msgspec.Struct):
    content: str | None = None
    tool_calls: list[Any] | None = None
    function_call: Any = None


class _Choice(msgspec.Struct):
    index: int | None = None
    delta: _Delta | None = None
    message: _Message | None = None
    text: str | None = None


class _Doc(msgspec.Struct):
    choices: list[_Choice] = msgspec.field(default_factory=list)


_DOC_DECODER: Final = msgspec.json.Decoder(_Doc)


def _text_of(choice: _Choice, endpoint: Endpoint) -> str | None:
    """One choice's text piece; ``None`` when it carries what a plain assistant message
    cannot replay (tool or function calls) or is of the other endpoint's shape."""
    if endpoint == "completions":
        return choice.text if choice.text is not None else ""
    part = choice.delta if choice.delta is not None else choice.message
    if part is None:
        return ""
    if part.tool_calls or part.function_call is not None:
        return None
    return part.content or ""


class AnswerText:
    """Choice 0's text read out of a relayed stream, up to ``cap`` characters.

    Invariants: only complete ``data:`` lines are decoded (a line cut between two pieces
    waits in ``_tail``); once the answer is over the cap, has a second choice, tool calls or
    an event of an unexpected shape, collecting stops for good and ``text`` is ``None``, and
    nothing more is decoded or kept.
    """

    __slots__ = ("_cap", "_chars", "_endpoint", "_failed", "_parts", "_tail")

    def __init__(self, endpoint: Endpoint, cap: int = MAX_ANSWER_CHARS) -> None:
        self._endpoint = endpoint
        self._cap = cap
        self._parts: list[str] = []
        self._chars = 0
        self._tail = b""
        self._failed = False

    @property
    def text(self) -> str | None:
        """The answer so far, or ``None`` when it cannot be replayed (class docstring)."""
        if not self._failed and self._tail:
            tail, self._tail = self._tail, b""
            self._read(tail)
        return None if self._failed else "".join(self._parts)

    def feed(self, piece: bytes) -> None:
        if self._failed:
            return
        if self._tail:
            piece = self._tail + piece
        end = piece.rfind(b"\n") + 1
        self._tail = piece[end:]
        if end:
            self._read(piece[:end])

    def _fail(self) -> None:
        self._failed = True
        self._parts.clear()
        self._tail = b""

    def _read(self, text: bytes) -> None:
        for data in data_payloads(text):
            try:
                doc = _DOC_DECODER.decode(data)
            except msgspec.DecodeError:
                self._fail()
                return
            for choice in doc.choices:
                piece = _text_of(choice, self._endpoint)
                if piece is None or choice.index not in (None, 0):
                    self._fail()
                    return
                self._chars += len(piece)
                if self._chars > self._cap:
                    self._fail()
                    return
                if piece:
                    self._parts.append(piece)


def answer_of(body: bytes, endpoint: Endpoint, cap: int = MAX_ANSWER_CHARS) -> str | None:
    """Choice 0's text of a whole (non-streamed) answer, or ``None`` when it cannot be
    replayed: several choices, tool calls, over ``cap`` characters, not an answer."""
    try:
        doc = _DOC_DECODER.decode(body)
    except msgspec.DecodeError:
        return None
    if len(doc.choices) != 1:
        return None
    text = _text_of(doc.choices[0], endpoint)
    return None if text is None or len(text) > cap else text


def turn_copy_body(request: ParsedRequest, answer: str | None, *, model: str | None,
                   cache_salt: str | None) -> bytes:
    """The body of a ``max_tokens: 1`` copy of a session's context (module docstring):
    its prompt plus ``answer`` when one is known and can be appended, its prompt alone
    otherwise; ``cache_salt`` (the session's own) set when not ``None``.

    Raises:
        RequestError: ``cache_salt`` is invalid.
    """
    body: dict[str, Any] = dict(request.body)
    if cache_salt is not None:
        body["cache_salt"] = cache_salt = validate_cache_salt(cache_salt)
    messages, prompt = request.messages, request.prompt
    if answer is not None and request.n == 1:
        if messages is not None and not body.get("continue_final_message"):
            messages = [*messages, {"role": "assistant", "content": answer}]
            body["messages"] = messages
            body["add_generation_prompt"] = False
            body.pop("continue_final_message", None)
        elif request.endpoint == "completions" and isinstance(prompt, str) \
                and not body.get("echo") and body.get("suffix") is None:
            prompt = prompt + answer
            body["prompt"] = prompt
    copy = replace(request, body=body, messages=messages, prompt=prompt,
                   cache_salt=cache_salt if cache_salt is not None else request.cache_salt)
    return warm_request_body(copy, model=model)
