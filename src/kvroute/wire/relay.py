"""What the router reads from and writes into the requests and answers it relays: pure codecs.

* ``routing_text``: the prompt as plain text (approximate routing, text-matching policies);
* ``prompt_ids_from_body``: a completions prompt that already is token ids;
* ``forward_body``: the body to send upstream (the client's own bytes when nothing changes);
* ``StreamWatcher`` / ``completion_of``: ``finish_reason`` and ``usage`` read out of a
  relayed stream or a whole answer, cheaply (the walk's step 6 needs nothing else).

No I/O: the shell's forwarding driver (``shell/forward.py``) calls these.
"""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Final

import msgspec

from kvroute.wire.openai import ParsedRequest, encode_request
from kvroute.wire.sse import data_payloads

__all__ = [
    "StreamWatcher",
    "completion_of",
    "completion_of_any",
    "forward_body",
    "prompt_ids_from_body",
    "routing_text",
]

_JSON_DECODER: Final = msgspec.json.Decoder()


def routing_text(parsed: ParsedRequest) -> str:
    """The prompt as plain text, for approximate routing and text-matching peer policies.

    Chat: each message's role and its text content (text parts joined), in order; tools
    first, as chat templates put them. Completions: the prompt string(s).
    """
    if parsed.messages is not None:
        parts: list[str] = []
        if parsed.tools:
            parts.append(json.dumps(parsed.tools, separators=(",", ":"), sort_keys=True))
        for message in parsed.messages:
            parts.append(str(message.get("role", "")))
            content = message.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                for part in content:
                    text = part.get("text") if isinstance(part, dict) else None
                    parts.append(text if isinstance(text, str) else f"<{part.get('type')}>")
        return "\n".join(parts)
    prompt = parsed.prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return "\n".join(p for p in prompt if isinstance(p, str))
    return ""


def prompt_ids_from_body(parsed: ParsedRequest) -> Sequence[int] | None:
    """A completions prompt sent as one list of token ids is already exact.

    ``parse_request`` has checked every item is a non-negative int, so the ids are taken in
    one C-level conversion to ``array('I')`` (what the local tokenizer gives too: the
    block-hash memo and the session chains read its raw bytes), or as a copy of the list
    when an id does not fit in 32 bits (the engine will refuse it; routing stays exact)."""
    prompt = parsed.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        try:
            return array("I", prompt)
        except (OverflowError, TypeError):
            return [int(t) for t in prompt if isinstance(t, int)]
    return None


_FINISH_OR_USAGE: Final = re.compile(rb'"finish_reason":\s*"|"usage":\s*\{')
"""A relayed SSE piece worth decoding: a choice's end, or the usage chunk. Every other
chunk (one per engine step) is passed through without being parsed."""


class StreamWatcher:
    """Reads ``finish_reason`` and ``usage`` out of a relayed stream, cheaply.

    Invariants: only complete lines are looked at (a line cut between two chunks waits for
    its end in ``_tail``, and an unterminated last line is read when the answer is asked
    for), so any split of the same bytes gives the same answer; only text matching
    ``_FINISH_OR_USAGE`` is decoded, so a long answer costs one ``rfind`` and one regex scan
    per chunk; undecodable events are ignored (they are relayed regardless).
    """

    __slots__ = ("_reasons", "_tail", "_usage")

    def __init__(self) -> None:
        self._reasons: dict[int, str] = {}
        self._usage: Mapping[str, Any] | None = None
        self._tail = b""

    @property
    def finish_reasons(self) -> list[str | None]:
        """Each choice's ``finish_reason`` seen so far (None where none was)."""
        self._read_tail()
        return [self._reasons.get(i) for i in range(max(self._reasons, default=-1) + 1)]

    @property
    def usage(self) -> Mapping[str, Any] | None:
        """The stream's last ``usage`` object, if any."""
        self._read_tail()
        return self._usage

    def feed(self, piece: bytes) -> None:
        if self._tail:
            piece = self._tail + piece
        end = piece.rfind(b"\n") + 1
        if end < len(piece):
            self._tail = piece[end:]
            piece = piece[:end]
        else:
            self._tail = b""
        if piece and _FINISH_OR_USAGE.search(piece) is not None:
            self._read(piece)

    def _read_tail(self) -> None:
        tail, self._tail = self._tail, b""
        if tail and _FINISH_OR_USAGE.search(tail) is not None:
            self._read(tail)

    def _read(self, text: bytes) -> None:
        for data in data_payloads(text):
            try:
                doc = _JSON_DECODER.decode(data)
            except msgspec.DecodeError:
                continue
            if isinstance(doc, dict):
                _read_completion(doc, self._reasons)
                usage = doc.get("usage")
                if isinstance(usage, dict):
                    self._usage = usage


def _read_completion(doc: Mapping[str, Any], reasons: dict[int, str]) -> None:
    choices = doc.get("choices")
    if not isinstance(choices, list):
        return
    for pos, choice in enumerate(choices):
        if not isinstance(choice, dict):
            continue
        reason = choice.get("finish_reason")
        index = choice.get("index")
        if index is None:  # absent or null: the choice's position (as the typed read does)
            index = pos
        if isinstance(reason, str) and isinstance(index, int):
            reasons[index] = reason


class _Choice(msgspec.Struct):
    index: int | None = None
    finish_reason: str | None = None


class _Completion(msgspec.Struct):
    """The two things read from a whole answer; msgspec skips every other field (the
    generated text above all) without building objects for it."""

    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: dict[str, Any] | None = None


_COMPLETION_DECODER: Final = msgspec.json.Decoder(_Completion)


def completion_of(body: bytes) -> tuple[list[str | None], Mapping[str, Any] | None]:
    """``finish_reason`` of each choice and the ``usage`` of a whole (non-streamed) answer.

    The typed decode is the fast path; an answer of another shape (a field of an unexpected
    type) falls back to the lenient walk over the generic decode, so the two always agree.
    """
    try:
        typed = _COMPLETION_DECODER.decode(body)
    except msgspec.DecodeError:
        pass  # ValidationError is a DecodeError: try the lenient walk
    else:
        found: dict[int, str] = {}
        for pos, choice in enumerate(typed.choices):
            if choice.finish_reason is not None:
                found[choice.index if choice.index is not None else pos] = choice.finish_reason
        return [found.get(i) for i in range(max(found, default=-1) + 1)], typed.usage
    return completion_of_any(body)


def completion_of_any(body: bytes) -> tuple[list[str | None], Mapping[str, Any] | None]:
    """``completion_of`` by a lenient walk over the generic decode: any JSON shape."""
    try:
        doc = _JSON_DECODER.decode(body)
    except msgspec.DecodeError:
        return [], None
    if not isinstance(doc, dict):
        return [], None
    reasons: dict[int, str] = {}
    _read_completion(doc, reasons)
    usage = doc.get("usage")
    return ([reasons.get(i) for i in range(max(reasons, default=-1) + 1)],
            usage if isinstance(usage, dict) else None)


def forward_body(raw: bytes, parsed: ParsedRequest, *, max_tokens: int | None, model: str,
                 cache_salt: str | None, vllm_xargs: Mapping[str, Any] | None = None,
                 set_fields: Mapping[str, Any] | None = None) -> bytes:
    """The body to send upstream: the client's own bytes when nothing in it changes.

    ``encode_request`` copies and re-encodes the whole body (about 10 µs for a 2 kB prompt,
    proportional to its size); most requests need no change at all (the route's name is the
    served model, no clamp, no router salt), and then the engine gets exactly what the client
    sent. The conditions mirror ``encode_request`` field by field, so the two always agree on
    the decoded JSON:

    * ``model`` already equals the pool's served name;
    * ``cache_salt`` is None or already the body's own (``parse_request`` validated it);
    * ``max_tokens`` is None, or every output-limit field the client sent is a number no
      larger than it (``encode_request`` adds ``max_tokens`` when none is present, and lowers
      a larger or null one).

    Args:
        raw: the client's body, as read.
        parsed: its parse.
        max_tokens / model / cache_salt: as ``encode_request`` takes them.
        vllm_xargs: entries to add to the body's ``vllm_xargs`` (vLLM's sampling
            ``extra_args``, e.g. ``kv_cache_report_mode``); a key the client already set
            keeps the client's value.
        set_fields: further fields to set (a route's reasoning settings).
    """
    body = parsed.body
    xargs_field: dict[str, Any] | None = None
    if vllm_xargs:
        own = parsed.vllm_xargs or {}
        if any(key not in own for key in vllm_xargs):
            xargs_field = {**vllm_xargs, **own}
    unchanged = xargs_field is None and not set_fields and body.get("model") == model and (
        cache_salt is None or body.get("cache_salt") == cache_salt)
    if unchanged and max_tokens is not None:
        present = parsed.output_param_names
        unchanged = bool(present) and all(
            body[key] is not None and body[key] <= max_tokens for key in present)
    if unchanged:
        return raw
    fields = dict(set_fields or {})
    if xargs_field is not None:
        fields["vllm_xargs"] = xargs_field
    return encode_request(parsed, max_tokens=max_tokens, model=model, cache_salt=cache_salt,
                          set_fields=fields or None)
