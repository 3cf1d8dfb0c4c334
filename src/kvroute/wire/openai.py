"""OpenAI-compatible request and response shapes, as vLLM 0.32 reads and writes them.

Owns:

* ``parse_request``: bytes of a ``/v1/chat/completions`` or ``/v1/completions`` body → a
  ``ParsedRequest`` (the fields the router needs, typed and validated) that keeps the decoded
  body untouched for forwarding;
* ``encode_request`` / ``warm_request_body``: re-encode that body with specific changes
  (clamped ``max_tokens``, injected ``cache_salt``, a ``max_tokens: 1`` warm-up) and every
  other field as the client sent it;
* ``RequestError`` and ``error_body``: one error type for bad input, and OpenAI's error body
  ``{"error": {"message", "type", "param", "code"}}`` with vLLM's types and integer codes;
* ``session_from_request``: the session id, from headers in LiteLLM's order, then the body;
* ``model_card`` / ``models_response``: the ``/v1/models`` body with vLLM's field names and
  order (``tests/data/vllm-vectors-0.32.json``, ``http_examples_v0_32``), for the router's own
  list and the simulated engine's. The other bodies an engine answers with are built in
  ``sim/openai_answers.py``: the router relays them and never builds one.

Pure: no I/O, no clock, no randomness. Ids and ``created`` are passed in by the caller.

Why a dict and not a Struct: the router forwards the body, and OpenAI-compatible clients send
many fields it does not know (vLLM alone accepts ~60). Decoding to a dict with msgspec keeps
every field and its order; the few fields the router reads are then checked by hand, which
also lets every message say exactly which field is wrong and how to fix it. Re-encoding a
shallow copy with the changed keys keeps the rest as the client sent it (JSON whitespace and
number spelling such as ``1e2`` are normalised; values are not).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec

from kvroute.core.errors import RouterError

__all__ = [
    "CACHE_SALT_MAX_CHARS",
    "DEFAULT_MAX_BODY_BYTES",
    "Endpoint",
    "ParsedRequest",
    "RequestError",
    "SessionRef",
    "encode_request",
    "error_body",
    "error_type_for_status",
    "model_card",
    "models_response",
    "parse_request",
    "session_from_request",
    "validate_cache_salt",
    "warm_chunk_body",
    "warm_request_body",
]

Endpoint = Literal["chat", "completions"]
"""``chat`` is ``/v1/chat/completions`` (``messages``); ``completions`` is ``/v1/completions``."""

DEFAULT_MAX_BODY_BYTES: Final = 16 * 1024 * 1024
"""Default body limit: room for long agent transcripts and a few base64 images."""

CACHE_SALT_MAX_CHARS: Final = 128
"""vLLM 0.32 ``validate_cache_salt``: at most 128 characters."""

_CACHE_SALT_FORBIDDEN: Final = ("@", "/", "\\", "\x00")
# vLLM's exact text (vllm/entrypoints/generate/base/protocol.py), with the
# " (parameter=cache_salt)" suffix VLLMValidationError adds; see the 0.32 vectors.
_CACHE_SALT_MESSAGE: Final = (
    "Parameter 'cache_salt' must be at most 128 characters and must not contain "
    "'@', '/', '\\\\', or NUL. (parameter=cache_salt)"
)

_STATUS_TYPES: Final = {
    400: "BadRequestError",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFoundError",
    408: "Request Timeout",
    413: "Request Entity Too Large",
    415: "Unsupported Media Type",
    422: "Unprocessable Entity",
    429: "Too Many Requests",
    500: "InternalServerError",
    501: "NotImplementedError",
    502: "Bad Gateway",
    503: "ServiceUnavailableError",
    504: "Gateway Timeout",
}

_JSON_ENCODER: Final = msgspec.json.Encoder()
_JSON_DECODER: Final = msgspec.json.Decoder()


def error_type_for_status(status: int) -> str:
    """The ``type`` vLLM puts in an error body for an HTTP status.

    vLLM uses ``BadRequestError`` (400), ``NotFoundError`` (404), ``NotImplementedError``
    (501) and ``InternalServerError`` (500) by name, and the HTTP reason phrase for statuses
    raised as ``HTTPException`` (e.g. 413 ``Request Entity Too Large``).
    """
    return _STATUS_TYPES.get(
        status, "BadRequestError" if 400 <= status < 500 else "InternalServerError"
    )


def error_body(
    message: str,
    *,
    status: int = 400,
    type: str | None = None,
    param: str | None = None,
    code: int | str | None = None,
) -> bytes:
    """OpenAI's error body as vLLM (>= 0.10.1) sends it.

    ``{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}``; ``type`` defaults
    to vLLM's type for ``status`` and ``code`` to ``status`` (vLLM sends the status as an
    int; OpenAI sends strings such as ``"context_length_exceeded"``, which may be passed).
    """
    info = {
        "message": message,
        "type": type if type is not None else error_type_for_status(status),
        "param": param,
        "code": code if code is not None else status,
    }
    return _JSON_ENCODER.encode({"error": info})


class RequestError(RouterError):
    """A client request kvroute refuses, with the HTTP status and OpenAI error fields.

    The message says what was wrong and how to fix it; ``body()`` is the response to send.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        type: str | None = None,
        code: int | str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type if type is not None else error_type_for_status(status)
        self.code: int | str = code if code is not None else status

    def body(self) -> bytes:
        """The OpenAI/vLLM error body for this error."""
        return error_body(
            self.message, status=self.status, type=self.type, param=self.param, code=self.code
        )


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------

Prompt = str | list[str] | list[int] | list[list[int]]


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated OpenAI request: the fields the router reads, and the body to forward.

    Invariant: ``body`` is the decoded client body and is never mutated; every change goes
    through ``encode_request``, which copies it.

    Attributes:
        endpoint: ``chat`` or ``completions``.
        body: the decoded JSON object, every field as the client sent it.
        model: the requested model name.
        messages: the chat messages (chat only), each a dict with at least ``role``.
        prompt: the completions prompt (completions only); str, list[str], list[int] or
            list[list[int]].
        stream: ``stream`` (False when absent).
        include_usage: ``stream_options.include_usage`` (False when absent).
        max_tokens: the output limit the engine will apply: ``max_completion_tokens`` if set
            (chat), else ``max_tokens``; None when the client set neither.
        max_tokens_param: which field ``max_tokens`` came from (vLLM names it in errors).
        n: ``n`` (1 when absent).
        tools: ``tools`` or None.
        cache_salt: ``cache_salt`` or None (validated as vLLM does).
        user: ``user`` or None.
        session_id: ``session_id`` or ``metadata.session_id`` from the body, or None.
        vllm_xargs: ``vllm_xargs`` or None.
    """

    endpoint: Endpoint
    body: Mapping[str, Any]
    model: str
    messages: list[dict[str, Any]] | None
    prompt: Prompt | None
    stream: bool
    include_usage: bool
    max_tokens: int | None
    max_tokens_param: Literal["max_tokens", "max_completion_tokens"] | None
    n: int
    tools: list[Any] | None
    cache_salt: str | None
    user: str | None
    session_id: str | None
    vllm_xargs: dict[str, Any] | None

    @property
    def output_param_names(self) -> tuple[str, ...]:
        """The output-limit fields present in the body (both may be)."""
        return tuple(k for k in ("max_tokens", "max_completion_tokens") if k in self.body)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _short(value: Any) -> str:
    text = _JSON_ENCODER.encode(value).decode("utf-8", errors="replace")
    return text if len(text) <= 40 else text[:37] + "..."


def _bad_type(param: str, expected: str, value: Any, example: str) -> RequestError:
    return RequestError(
        f"'{param}' must be {expected}, got {_json_type(value)} {_short(value)}. "
        f"Send it as e.g. {example}.",
        param=param,
    )


def validate_cache_salt(value: Any) -> str:
    """Check ``cache_salt`` exactly as vLLM 0.32 does and return it.

    Raises:
        RequestError: 400 with vLLM's own message and ``param: "cache_salt"`` if the salt is
            not a non-empty string of at most 128 characters free of ``@ / \\ NUL``.
    """
    if (
        not isinstance(value, str)
        or not value
        or len(value) > CACHE_SALT_MAX_CHARS
        or any(ch in value for ch in _CACHE_SALT_FORBIDDEN)
    ):
        raise RequestError(_CACHE_SALT_MESSAGE, param="cache_salt")
    return value


def _optional_int(body: Mapping[str, Any], key: str, *, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad_type(key, "an integer", value, f'"{key}": {max(minimum, 16)}')
    if value < minimum:
        # vLLM's wording for max_tokens < 1, with its (parameter=, value=) suffix.
        raise RequestError(
            f"{key} must be at least {minimum}, got {value}. (parameter={key}, value={value})",
            param=key,
        )
    return value


def _optional_str(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None or isinstance(value, str):
        return value
    raise _bad_type(key, "a string", value, f'"{key}": "abc"')


def _optional_bool(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    raise _bad_type(key, "true or false", value, f'"{key}": true')


def _check_messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise RequestError(
            "Missing 'messages': /v1/chat/completions needs a non-empty list of messages, e.g. "
            '"messages": [{"role": "user", "content": "Hello"}]. '
            "Use /v1/completions to send a plain 'prompt'.",
            param="messages",
        )
    if not isinstance(value, list):
        raise _bad_type(
            "messages", "a list of message objects", value, '[{"role": "user", "content": "Hi"}]'
        )
    if not value:
        raise RequestError(
            "'messages' is empty: send at least one message, e.g. "
            '[{"role": "user", "content": "Hello"}].',
            param="messages",
        )
    for i, message in enumerate(value):
        # The common message (a dict, a string role, text or no content) in a few C calls:
        # a long conversation has hundreds, checked on every turn (docs/long-contexts.md).
        if type(message) is dict:
            role, content = message.get("role"), message.get("content")
            if type(role) is str and (content is None or type(content) is str):
                continue
        _check_message(i, message)
    return value


def _check_message(i: int, message: Any) -> None:
    """``messages[i]`` as ``_check_messages`` requires it, or a ``RequestError`` saying what is
    wrong (the slow path: content parts, and every message that fails)."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise _bad_type(where, "an object", message, '{"role": "user", "content": "Hi"}')
    role = message.get("role")
    if role is None:
        raise RequestError(
            f'{where} has no \'role\': every message needs one of "system", "user", '
            '"assistant", "tool" (or "developer"), e.g. {"role": "user", "content": "Hi"}.',
            param=f"{where}.role",
        )
    if not isinstance(role, str):
        raise _bad_type(f"{where}.role", "a string", role, '"role": "user"')
    content = message.get("content")
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _bad_type(
            f"{where}.content",
            "a string, a list of content parts or null",
            content,
            '"content": "Hi" or "content": [{"type": "text", "text": "Hi"}]',
        )
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise _bad_type(
                f"{where}.content[{j}]",
                "a content part object with a string 'type'",
                part,
                '{"type": "text", "text": "Hi"}',
            )


def _all_token_ids(value: list[Any]) -> bool:
    """Whether every item is a non-negative int (not a bool), without a Python-level loop:
    a 128K-id prompt costs a few ms checked item by item, and its whole turn should cost
    what its new tokens do (docs/long-contexts.md)."""
    return set(map(type, value)) == {int} and min(value) >= 0


def _check_prompt(value: Any, body: Mapping[str, Any]) -> Prompt | None:
    if value is None:
        if body.get("prompt_embeds") is not None:
            return None
        raise RequestError(
            "Missing 'prompt': /v1/completions needs a prompt as a string, a list of strings, "
            'a list of token ids or a list of token-id lists, e.g. "prompt": "Hello". '
            "Use /v1/chat/completions to send 'messages'.",
            param="prompt",
        )
    if isinstance(value, str):
        return value
    example = '"prompt": "Hello" or "prompt": [1, 2, 3]'
    expected = "a string, a list of strings, a list of token ids or a list of token-id lists"
    if not isinstance(value, list):
        raise _bad_type("prompt", expected, value, example)
    if not value:
        raise RequestError(
            "'prompt' is an empty list: send at least one string or token id.", param="prompt"
        )
    first = value[0]
    if isinstance(first, str):
        kind: type = str
    elif isinstance(first, int) and not isinstance(first, bool):
        kind = int
    elif isinstance(first, list):
        kind = list
    else:
        raise _bad_type("prompt", expected, value, example)
    if kind is int and _all_token_ids(value):
        return value  # checked in C; the loop below only finds the first bad item
    for i, item in enumerate(value):
        if kind is int:
            ok = isinstance(item, int) and not isinstance(item, bool) and item >= 0
        elif kind is list:
            ok = (
                isinstance(item, list)
                and bool(item)
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in item)
            )
        else:
            ok = isinstance(item, str)
        if not ok:
            raise RequestError(
                f"prompt[{i}] is {_json_type(item)} {_short(item)}, but prompt[0] makes 'prompt' "
                f"a list of {'strings' if kind is str else 'token ids' if kind is int else 'token-id lists'}"
                ": do not mix kinds, and token ids must be non-negative integers.",
                param="prompt",
            )
    prompt_value: Prompt = value
    return prompt_value


def parse_request(
    raw: bytes,
    endpoint: Endpoint,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> ParsedRequest:
    """Decode and validate an OpenAI chat or completions request body.

    Args:
        raw: the request body.
        endpoint: ``chat`` for ``/v1/chat/completions``, ``completions`` for
            ``/v1/completions``.
        max_body_bytes: larger bodies are refused with 413 before decoding.

    Returns:
        The parsed request; ``body`` holds every field as sent.

    Raises:
        RequestError: 413 for a body over the limit; 400 for malformed JSON (with the byte
            position), a body that is not an object, a missing or mistyped ``model``,
            ``messages`` or ``prompt``, a mistyped ``stream``/``stream_options``/``n``/
            ``tools``/``user``/``session_id``/``vllm_xargs``, a non-integer or non-positive
            ``max_tokens``/``max_completion_tokens``, or a ``cache_salt`` vLLM would reject.
    """
    if len(raw) > max_body_bytes:
        raise RequestError(
            f"Request body is {len(raw)} bytes, over this router's limit of {max_body_bytes} "
            "bytes. Send a shorter prompt, or raise the router's max_body_bytes setting.",
            status=413,
        )
    try:
        body = _JSON_DECODER.decode(raw)
    except msgspec.DecodeError as exc:
        detail = str(exc)
        if "truncated" in detail:
            detail += f" (the body ends at byte {len(raw)} before the JSON value is complete)"
        raise RequestError(
            f"Request body is not valid JSON: {detail}. Send one JSON object encoded as UTF-8 "
            "with Content-Type: application/json."
        ) from exc
    if not isinstance(body, dict):
        raise RequestError(
            f"Request body must be a JSON object, got {_json_type(body)}. "
            'Send e.g. {"model": "my-model", ...}.'
        )

    model = body.get("model")
    if model is None:
        raise RequestError(
            'Missing \'model\': name the model to use, e.g. "model": "my-model" '
            "(GET /v1/models lists the names this router serves).",
            param="model",
        )
    if not isinstance(model, str) or not model:
        raise _bad_type("model", "a non-empty string", model, '"model": "my-model"')

    messages: list[dict[str, Any]] | None = None
    prompt: Prompt | None = None
    if endpoint == "chat":
        messages = _check_messages(body.get("messages"))
    else:
        prompt = _check_prompt(body.get("prompt"), body)

    stream = _optional_bool(body, "stream")
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise _bad_type(
                "stream_options",
                "an object",
                stream_options,
                '"stream_options": {"include_usage": true}',
            )
        usage_flag = stream_options.get("include_usage")
        if usage_flag is not None and not isinstance(usage_flag, bool):
            raise _bad_type(
                "stream_options.include_usage", "true or false", usage_flag, '"include_usage": true'
            )
        include_usage = bool(usage_flag)

    max_tokens = _optional_int(body, "max_tokens", minimum=1)
    max_completion_tokens = _optional_int(body, "max_completion_tokens", minimum=1)
    effective: int | None
    param: Literal["max_tokens", "max_completion_tokens"] | None
    if max_completion_tokens is not None:
        effective, param = max_completion_tokens, "max_completion_tokens"
    elif max_tokens is not None:
        effective, param = max_tokens, "max_tokens"
    else:
        effective, param = None, None

    n = _optional_int(body, "n", minimum=1)

    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _bad_type(
            "tools",
            "a list of tool objects",
            tools,
            '"tools": [{"type": "function", "function": {...}}]',
        )

    salt = body.get("cache_salt")
    cache_salt = validate_cache_salt(salt) if salt is not None else None

    user = _optional_str(body, "user")
    session_id = _optional_str(body, "session_id")
    metadata = body.get("metadata")
    if session_id is None and isinstance(metadata, dict):
        meta_session = metadata.get("session_id")
        if isinstance(meta_session, str) and meta_session:
            session_id = meta_session

    xargs = body.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        raise _bad_type("vllm_xargs", "an object", xargs, '"vllm_xargs": {"key": "value"}')

    return ParsedRequest(
        endpoint=endpoint,
        body=body,
        model=model,
        messages=messages,
        prompt=prompt,
        stream=stream,
        include_usage=include_usage,
        max_tokens=effective,
        max_tokens_param=param,
        n=n if n is not None else 1,
        tools=tools,
        cache_salt=cache_salt,
        user=user,
        session_id=session_id,
        vllm_xargs=xargs,
    )


def encode_request(
    req: ParsedRequest,
    *,
    max_tokens: int | None = None,
    cache_salt: str | None = None,
    model: str | None = None,
    stream: bool | None = None,
    set_fields: Mapping[str, Any] | None = None,
    remove_fields: Iterable[str] = (),
) -> bytes:
    """Re-encode the client body with the given changes; every other field is kept.

    Keys keep their position when replaced; new keys are appended.

    Args:
        req: the parsed request.
        max_tokens: clamp the output limit to at most this value. Each output-limit field
            the client sent (``max_tokens``, ``max_completion_tokens``) is lowered to it if
            larger; if the client sent none, ``max_tokens`` is added (chat and completions
            both accept it).
        cache_salt: set ``cache_salt`` (validated as vLLM does).
        model: replace ``model`` (the served name behind a route alias).
        stream: set ``stream``; ``False`` also drops ``stream_options``, which vLLM rejects
            on a non-streamed request.
        set_fields: further fields to set, applied last.
        remove_fields: fields to drop.

    Raises:
        RequestError: if ``cache_salt`` is invalid.
        ValueError: if ``max_tokens`` < 1 (vLLM rejects 0; a caller bug, not client input).
    """
    body = dict(req.body)
    if max_tokens is not None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1 (vLLM rejects 0), got {max_tokens}")
        present = req.output_param_names
        if present:
            for key in present:
                current = body[key]
                if current is None or current > max_tokens:
                    body[key] = max_tokens
        else:
            body["max_tokens"] = max_tokens
    if cache_salt is not None:
        body["cache_salt"] = validate_cache_salt(cache_salt)
    if model is not None:
        body["model"] = model
    if stream is not None:
        body["stream"] = stream
        if not stream:
            body.pop("stream_options", None)
    if set_fields:
        body.update(set_fields)
    for key in remove_fields:
        body.pop(key, None)
    return _JSON_ENCODER.encode(body)


def warm_request_body(req: ParsedRequest, *, model: str | None = None) -> bytes:
    """The body of a warm-ahead request: same prompt, ``max_tokens: 1``, not streamed.

    Every field that shapes the prompt (``messages``/``prompt``, ``tools``, ``cache_salt``,
    ``chat_template_kwargs``...) is kept so the engine computes the same prefix blocks;
    ``n`` is set to 1 when present (one prefill is what warming needs).
    """
    set_fields: dict[str, Any] = {"n": 1} if "n" in req.body else {}
    body = dict(req.body)
    for key in req.output_param_names:
        body[key] = 1
    if not req.output_param_names:
        body["max_tokens"] = 1
    warm = ParsedRequest(
        endpoint=req.endpoint, body=body, model=req.model, messages=req.messages,
        prompt=req.prompt, stream=False, include_usage=False, max_tokens=1,
        max_tokens_param=req.max_tokens_param, n=1, tools=req.tools,
        cache_salt=req.cache_salt, user=req.user, session_id=req.session_id,
        vllm_xargs=req.vllm_xargs,
    )  # fmt: skip
    return encode_request(warm, model=model, stream=False, set_fields=set_fields)


def warm_chunk_body(token_ids: Sequence[int], *, model: str, cache_salt: str | None) -> bytes:
    """The ``/v1/completions`` body of one chunk of a chunked warm-up: a prefix of the warm
    prompt's exact token ids, ``max_tokens: 1``, not streamed.

    A token-id prompt is hashed by the engine exactly as the chat prompt those ids came
    from (vLLM adds no special tokens to ids, and ``cache_salt`` enters block 0 the same
    way), so each chunk caches the blocks the full warm-up and the escalated request look
    up. ``model`` is the target pool's served model (a LoRA adapter's name keeps the
    adapter in the blocks' extra keys).

    Raises:
        ValueError: ``token_ids`` is empty (vLLM rejects an empty prompt; a caller bug).
        RequestError: ``cache_salt`` is invalid.
    """
    if not token_ids:
        raise ValueError("a warm-up chunk needs at least one token id")
    body: dict[str, Any] = {"model": model, "prompt": list(token_ids), "max_tokens": 1,
                            "stream": False}
    if cache_salt is not None:
        body["cache_salt"] = validate_cache_salt(cache_salt)
    return _JSON_ENCODER.encode(body)


# --------------------------------------------------------------------------------------------
# Sessions
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SessionRef:
    """A session id and where it came from (for the decision log)."""

    session_id: str
    source: str


_VENDOR_SESSION_HEADER = re.compile(r"x-([a-z0-9][a-z0-9_-]*)-session-id")
_VENDOR_SESSION_VALUE = re.compile(r"[A-Za-z0-9_-]{8,}")
_CODEX_HEADERS: Final = ("session-id", "session_id", "thread-id", "conversation_id")


def _lower_headers(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> dict[str, str]:
    items = headers.items() if isinstance(headers, Mapping) else headers
    out: dict[str, str] = {}
    for key, value in items:
        out.setdefault(key.lower(), value)  # first occurrence wins for repeated headers
    return out


def _baggage_session(value: str) -> str | None:
    for member in value.split(","):
        key, sep, val = member.strip().partition("=")
        if sep and key.strip() == "session.id":
            val = val.split(";", 1)[0].strip()
            return val or None
    return None


def session_from_request(
    headers: Mapping[str, str] | Iterable[tuple[str, str]],
    body: Mapping[str, Any] | None = None,
    *,
    use_user: bool = True,
    lowered: bool = False,
) -> SessionRef | None:
    """Find the session id of a request, in LiteLLM's order, then the body.

    Order (LiteLLM ``get_chain_id_from_headers``, v1.108, then kvroute's body fallbacks):

    1. ``x-litellm-trace-id``
    2. ``x-litellm-session-id``
    3. any other ``x-<vendor>-session-id`` whose value matches ``^[A-Za-z0-9_-]{8,}$``
       (e.g. ``x-claude-code-session-id``); several are tried in header-name order
    4. ``session-id`` / ``session_id`` / ``thread-id`` / ``conversation_id``, only when the
       ``user-agent`` names Codex
    5. ``x-session-id`` (also what vLLM itself reads)
    6. the body's ``metadata.user_id`` part after ``_session_`` (Anthropic-style clients)
    7. W3C ``baggage: session.id=...``
    8. the body's ``metadata.session_id``, then ``session_id``
    9. the body's ``user``, a weak fallback (one user may run several sessions), unless
       ``use_user`` is False.

    Header names are matched case-insensitively; empty values are skipped.

    Args:
        headers: request headers as a mapping or as (name, value) pairs.
        body: the decoded request body, if any.
        use_user: whether ``user`` may stand in for a session id.
        lowered: ``headers`` is already a mapping with lower-cased names, one value each
            (the router's HTTP server gives it so); it is then read as it is.
    """
    h = headers if lowered and isinstance(headers, Mapping) else _lower_headers(headers)
    for name in ("x-litellm-trace-id", "x-litellm-session-id"):
        value = h.get(name)
        if value:
            return SessionRef(value, f"header:{name}")
    for name in sorted(n for n in h if n.endswith("-session-id")):
        if name in ("x-litellm-session-id", "x-session-id"):
            continue
        if _VENDOR_SESSION_HEADER.fullmatch(name) and _VENDOR_SESSION_VALUE.fullmatch(h[name]):
            return SessionRef(h[name], f"header:{name}")
    if "codex" in h.get("user-agent", "").lower():
        for name in _CODEX_HEADERS:
            value = h.get(name)
            if value:
                return SessionRef(value, f"header:{name}")
    value = h.get("x-session-id")
    if value:
        return SessionRef(value, "header:x-session-id")
    metadata = body.get("metadata") if body is not None else None
    if isinstance(metadata, dict):
        user_id = metadata.get("user_id")
        if isinstance(user_id, str) and "_session_" in user_id:
            tail = user_id.split("_session_", 1)[1]
            if tail:
                return SessionRef(tail, "body:metadata.user_id")
    baggage = h.get("baggage")
    if baggage:
        found = _baggage_session(baggage)
        if found:
            return SessionRef(found, "header:baggage")
    if body is not None:
        if isinstance(metadata, dict):
            meta_session = metadata.get("session_id")
            if isinstance(meta_session, str) and meta_session:
                return SessionRef(meta_session, "body:metadata.session_id")
        session_id = body.get("session_id")
        if isinstance(session_id, str) and session_id:
            return SessionRef(session_id, "body:session_id")
        user = body.get("user")
        if use_user and isinstance(user, str) and user:
            return SessionRef(user, "body:user")
    return None


# --------------------------------------------------------------------------------------------
# /v1/models (the router's own, and the simulated engine's)
# --------------------------------------------------------------------------------------------


def model_card(
    *,
    id: str,
    created: int,
    max_model_len: int | None,
    permission_id: str,
    root: str | None = None,
    parent: str | None = None,
) -> dict[str, Any]:
    """One ``ModelCard`` of ``/v1/models``. A LoRA card has ``parent`` set and no length."""
    return {
        "id": id,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root if root is not None else id,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [
            {
                "id": permission_id,
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }


def models_response(cards: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The ``/v1/models`` body: ``{"object": "list", "data": [...]}``."""
    return {"object": "list", "data": [dict(c) for c in cards]}
