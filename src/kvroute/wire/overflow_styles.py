"""Numbers → the exact context-overflow response each engine sends (``--error-style``).

Owns the other direction of :mod:`kvroute.wire.overflow`: given a style (an engine and version
range), an overflow case and the numbers, produce the status, content type and body bytes that
engine produces, verbatim. The simulated engine uses it to reject requests the way the engine
it imitates would, and the router uses style ``"openai"`` for its own 400 when no pool can hold
a prompt. Pure: no I/O, no ambient state.

Sources: vLLM texts read from the PyPI wheels 0.6.6 … 0.33.0 (``renderers/params.py``,
``entrypoints/openai/serving_engine.py``), SGLang ``srt/managers/tokenizer_manager.py``,
llama.cpp ``tools/server/server-context.cpp``, TGI ``router/src/validation.rs``; bodies are
compact JSON with the engines' own key order (Starlette, orjson, nlohmann ``ordered_json``,
serde all write without spaces). The one exception is SGLang 0.4.x's in-stream error, written
with Python's default ``json.dumps`` separators.

Behaviour each style encodes (:func:`check_overflow`), with L = window, P = prompt tokens,
O = ``max_tokens`` (``None`` when the client sent none):

==================  ==========================================  ====================  ==========
style               rejects                                     P + O > L             P capped
==================  ==========================================  ====================  ==========
vllm-0.32 (0.33)    O > L; chars > L·k; P > L; P == L (no room)  clamped silently      L + 1
vllm-0.18-0.31      chars > (L-O)·k; P > L - O                  rejected              L - O + 1
vllm-0.16-0.17      chars > (L-O)·k; P > L - O                  rejected              L - O + 1
vllm-0.10.1-0.15    P ≥ L; P + O > L                            rejected              no
vllm-0.10           P + O > L; P ≥ L when O is None             rejected              no
sglang (0.5.x)      P ≥ L; P + O > L                            rejected              no
sglang-0.4          P ≥ L; P + O ≥ L (200 + SSE when streaming)  rejected              no
llamacpp            P ≥ n_ctx                                   truncated at n_ctx    no
tgi                 P > max_input_tokens; P + O > L (422)       rejected              no
openai              P > L; P + O > L                            rejected              no
==================  ==========================================  ====================  ==========

"P capped" is vLLM ≥0.16's tokenizer truncation of *text* prompts at ``max_input + 1``: the
reported count is then a lower bound (0.18+ says "at least", 0.16-0.17 does not).

Not verified against a running engine, and marked so in the tests' sample file: the tail of
vLLM 0.16-0.17's character pre-check message (the reference elides it), and the "no room"
rejection on 0.16-0.31 (the long-standing sampling check ``max_tokens must be at least 1``,
reached when no ``max_tokens`` was sent and P == L).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Final, Literal

from kvroute.core.errors import ConfigError

__all__ = [
    "DEFAULT_STYLE",
    "STYLES",
    "STYLE_ALIASES",
    "ErrorResponse",
    "OverflowCase",
    "check_overflow",
    "format_overflow",
    "resolve_style",
    "style_cases",
    "style_rejects_overlong_total",
]

STYLES: Final[tuple[str, ...]] = (
    "vllm-0.32",
    "vllm-0.18-0.31",
    "vllm-0.16-0.17",
    "vllm-0.10.1-0.15",
    "vllm-0.10",
    "sglang",
    "sglang-0.4",
    "llamacpp",
    "tgi",
    "openai",
)
DEFAULT_STYLE: Final = "vllm-0.32"
STYLE_ALIASES: Final[dict[str, str]] = {"vllm": "vllm-0.32", "vllm-0.33": "vllm-0.32"}

MaxTokensParam = Literal["max_tokens", "max_completion_tokens"]

_JSON: Final = "application/json"
_LLAMACPP_JSON: Final = "application/json; charset=utf-8"
_SSE: Final = "text/event-stream"


class OverflowCase(enum.StrEnum):
    """Which check rejected the request (the cases differ in wording, not only numbers)."""

    PROMPT = "prompt"
    """The prompt alone is over the window (each engine's own > or ≥)."""
    TOTAL = "total"
    """Prompt + ``max_tokens`` is over the window (only styles that reject it)."""
    MAX_TOKENS = "max_tokens"
    """``max_tokens`` alone is over the window (vLLM ≥0.32's own check)."""
    NO_ROOM = "no_room"
    """The prompt is exactly the window: the output clamp is 0 (vLLM ≥0.16)."""
    TEXT = "text"
    """The character pre-check fired before tokenizing (vLLM ≥0.16)."""


@dataclass(frozen=True, slots=True)
class ErrorResponse:
    """One HTTP error response, byte-exact: what an engine (or the router) sends."""

    status: int
    body: bytes
    content_type: str

    @property
    def headers(self) -> tuple[tuple[str, str], ...]:
        """The headers the engine sets for this response (content type only)."""
        return (("content-type", self.content_type),)

    @property
    def message(self) -> str:
        """The human-readable text inside the body (for logs and tests)."""
        payload = self.body
        if self.content_type == _SSE:
            payload = payload.split(b"\n", 1)[0].removeprefix(b"data: ")
        obj = json.loads(payload)
        err = obj.get("error", obj)
        return str(err if isinstance(err, str) else err["message"])


_CASES: Final[dict[str, frozenset[OverflowCase]]] = {
    "vllm-0.32": frozenset(
        {OverflowCase.PROMPT, OverflowCase.MAX_TOKENS, OverflowCase.NO_ROOM, OverflowCase.TEXT}
    ),
    "vllm-0.18-0.31": frozenset(
        {OverflowCase.PROMPT, OverflowCase.TOTAL, OverflowCase.NO_ROOM, OverflowCase.TEXT}
    ),
    "vllm-0.16-0.17": frozenset(
        {OverflowCase.PROMPT, OverflowCase.TOTAL, OverflowCase.NO_ROOM, OverflowCase.TEXT}
    ),
    "vllm-0.10.1-0.15": frozenset({OverflowCase.PROMPT, OverflowCase.TOTAL}),
    "vllm-0.10": frozenset({OverflowCase.PROMPT, OverflowCase.TOTAL}),
    "sglang": frozenset({OverflowCase.PROMPT, OverflowCase.TOTAL}),
    "sglang-0.4": frozenset({OverflowCase.PROMPT, OverflowCase.TOTAL}),
    "llamacpp": frozenset({OverflowCase.PROMPT}),
    "tgi": frozenset({OverflowCase.PROMPT, OverflowCase.TOTAL}),
    "openai": frozenset({OverflowCase.PROMPT, OverflowCase.TOTAL}),
}


def resolve_style(style: str) -> str:
    """The canonical name of ``style`` (aliases such as ``vllm-0.33`` resolved).

    Raises:
        ConfigError: ``style`` is not a known style; the message lists the valid names.
    """
    name = STYLE_ALIASES.get(style, style)
    if name not in _CASES:
        valid = ", ".join(STYLES + tuple(STYLE_ALIASES))
        raise ConfigError(f"unknown error style {style!r}; use one of: {valid}")
    return name


def style_cases(style: str) -> frozenset[OverflowCase]:
    """The overflow cases this engine version has a rejection for."""
    return _CASES[resolve_style(style)]


def style_rejects_overlong_total(style: str) -> bool:
    """Whether prompt + ``max_tokens`` over the window is rejected (else clamped/truncated).

    vLLM ≥0.32 clamps ``max_tokens`` to ``window - prompt`` and answers 200 with
    ``finish_reason: "length"``; llama.cpp stops generating at the context end. Every other
    style answers with a 400 (422 for TGI).
    """
    return OverflowCase.TOTAL in style_cases(style)


# --- texts -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Numbers:
    window: int
    prompt: int | None
    out: int | None
    param: MaxTokensParam
    chars: int | None
    max_chars: int | None
    max_input: int | None


def _need(value: int | None, name: str, style: str, case: OverflowCase) -> int:
    if value is None:
        raise ConfigError(f"error style {style!r}, case {case.value!r} needs {name}; pass it")
    return value


def _vllm_suffix(param: str, value: int) -> str:
    return f" (parameter={param}, value={value})"


def _text(style: str, case: OverflowCase, n: _Numbers) -> tuple[str, str | None]:
    """(message, vLLM ``param``) for one style and case; numbers already validated."""
    L = n.window

    def prompt() -> int:
        return _need(n.prompt, "prompt_tokens", style, case)

    def out() -> int:
        return _need(n.out, "max_tokens", style, case)

    def chars() -> int:
        return _need(n.chars, "prompt_chars", style, case)

    def max_chars() -> int:
        return _need(n.max_chars, "max_chars", style, case)

    if case is OverflowCase.NO_ROOM:
        return "max_tokens must be at least 1, got 0." + _vllm_suffix("max_tokens", 0), "max_tokens"
    if style == "vllm-0.32":
        if case is OverflowCase.PROMPT:
            P = prompt()
            q = "at least " if P == L + 1 else ""
            return (
                f"This model's maximum context length is {L} tokens. However, your prompt "
                f"contains {q}{P} input tokens, which exceeds this limit even without any output "
                f"tokens. Please reduce the length of the input prompt."
                + _vllm_suffix("input_tokens", P),
                "input_tokens",
            )
        if case is OverflowCase.TEXT:
            C = chars()
            return (
                f"This model's maximum context length is {L} tokens. However, your prompt "
                f"contains {C} characters (more than {max_chars()} characters, which is the upper "
                f"bound for {L} input tokens). Please reduce the length of the input prompt."
                + _vllm_suffix("input_text", C),
                "input_text",
            )
        O = out()
        return (
            f"{n.param}={O} cannot be greater than max_model_len={L}. Please request fewer "
            f"output tokens." + _vllm_suffix(n.param, O),
            n.param,
        )
    if style == "vllm-0.18-0.31":
        O = n.out or 0
        if case is OverflowCase.TEXT:
            C = chars()
            return (
                f"This model's maximum context length is {L} tokens. However, you requested {O} "
                f"output tokens and your prompt contains {C} characters (more than {max_chars()} "
                f"characters, which is the upper bound for {L - O} input tokens). Please reduce "
                f"the length of the input prompt or the number of requested output tokens."
                + _vllm_suffix("input_text", C),
                "input_text",
            )
        P = prompt()
        q = "at least " if P == L - O + 1 else ""
        return (
            f"This model's maximum context length is {L} tokens. However, you requested {O} "
            f"output tokens and your prompt contains {q}{P} input tokens, for a total of {q}"
            f"{P + O} tokens. Please reduce the length of the input prompt or the number of "
            f"requested output tokens." + _vllm_suffix("input_tokens", P),
            "input_tokens",
        )
    if style == "vllm-0.16-0.17":
        O = n.out or 0
        if case is OverflowCase.TEXT:
            C = chars()
            return (
                f"You passed {C} input characters and requested {O} output tokens. However, the "
                f"model's context length is only {L} tokens, resulting in a maximum input length "
                f"of {L - O} tokens (at most {max_chars()} characters). Please reduce the length "
                f"of the input prompt." + _vllm_suffix("input_text", C),
                "input_text",
            )
        P = prompt()
        return (
            f"You passed {P} input tokens and requested {O} output tokens. However, the model's "
            f"context length is only {L} tokens, resulting in a maximum input length of {L - O} "
            f"tokens. Please reduce the length of the input prompt."
            + _vllm_suffix("input_tokens", P),
            "input_tokens",
        )
    if style == "vllm-0.10.1-0.15":
        P = prompt()
        if case is OverflowCase.PROMPT:
            return (
                (f"This model's maximum context length is {L} tokens. However, your request has "
                f"{P} input tokens. Please reduce the length of the input messages."),
                None,
            )
        O = out()
        return (
            (f"'max_tokens' or 'max_completion_tokens' is too large: {O}. This model's maximum "
            f"context length is {L} tokens and your request has {P} input tokens ({O} > {L} - "
            f"{P})."),
            None,
        )
    if style in ("vllm-0.10", "openai"):
        P = prompt()
        if case is OverflowCase.TOTAL:
            O = out()
            return (
                (f"This model's maximum context length is {L} tokens. However, you requested "
                f"{P + O} tokens ({P} in the messages, {O} in the completion). Please reduce the "
                f"length of the messages or completion."),
                None,
            )
        if style == "openai":
            return (
                (f"This model's maximum context length is {L} tokens. However, your messages "
                f"resulted in {P} tokens. Please reduce the length of the messages."),
                None,
            )
        return (
            (f"This model's maximum context length is {L} tokens. However, you requested {P} "
            f"tokens in the messages, Please reduce the length of the messages."),
            None,
        )
    if style in ("sglang", "sglang-0.4"):
        P = prompt()
        if case is OverflowCase.PROMPT:
            return (
                f"The input ({P} tokens) is longer than the model's context length ({L} tokens).",
                None,
            )
        O = out()
        return (
            (f"Requested token count exceeds the model's maximum context length of {L} tokens. "
            f"You requested a total of {P + O} tokens: {P} tokens from the input messages and "
            f"{O} tokens for the completion. Please reduce the number of tokens in the input "
            f"messages or the completion to fit within the limit."),
            None,
        )
    if style == "llamacpp":
        return (
            (f"request ({prompt()} tokens) exceeds the available context size ({L} tokens), try "
            f"increasing it"),
            None,
        )
    # tgi
    P = prompt()
    if case is OverflowCase.PROMPT:
        max_input = n.max_input if n.max_input is not None else L - 1
        return (f"Input validation error: `inputs` must have less than {max_input} tokens. " \
               f"Given: {P}"), None
    return (
        (f"Input validation error: `inputs` tokens + `max_new_tokens` must be <= {L}. Given: {P} "
        f"`inputs` tokens and {out()} `max_new_tokens`"),
        None,
    )


def _compact(obj: object) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _body(style: str, message: str, param: str | None, n: _Numbers, stream: bool) -> ErrorResponse:
    if style in ("vllm-0.10", "sglang", "sglang-0.4"):
        flat = {"object": "error", "message": message, "type": "BadRequestError", "param": None,
                "code": 400}
        if style == "sglang-0.4" and stream:  # 200, then the error as the first SSE event
            event = json.dumps({"error": flat})
            return ErrorResponse(200, f"data: {event}\n\ndata: [DONE]\n\n".encode(), _SSE)
        return ErrorResponse(400, _compact(flat), _JSON)
    if style.startswith("vllm-"):
        return ErrorResponse(400, _compact({"error": {"message": message, "type":
                                                      "BadRequestError", "param": param,
                                                      "code": 400}}), _JSON)
    if style == "llamacpp":
        err = {"code": 400, "message": message, "type": "exceed_context_size_error",
               "n_prompt_tokens": n.prompt, "n_ctx": n.window}
        return ErrorResponse(400, _compact({"error": err}), _LLAMACPP_JSON)
    if style == "tgi":
        return ErrorResponse(422, _compact({"error": message, "error_type": "validation"}), _JSON)
    return ErrorResponse(400, _compact({"error": {"message": message, "type":
                                                  "invalid_request_error", "param": "messages",
                                                  "code": "context_length_exceeded"}}), _JSON)


def format_overflow(
    style: str,
    case: OverflowCase | str,
    *,
    window: int,
    prompt_tokens: int | None = None,
    max_tokens: int | None = None,
    max_tokens_param: MaxTokensParam = "max_tokens",
    prompt_chars: int | None = None,
    max_chars: int | None = None,
    max_input_tokens: int | None = None,
    stream: bool = False,
) -> ErrorResponse:
    """The exact response ``style``'s engine sends for ``case`` with these numbers.

    The numbers are printed as given: apply the engine's truncation first (or use
    :func:`check_overflow`, which does). "at least" appears where the engine prints it
    (vLLM ≥0.32: ``prompt_tokens == window + 1``; 0.18-0.31: ``== window - max_tokens + 1``).

    Args:
        style: A name from :data:`STYLES` or :data:`STYLE_ALIASES`.
        case: Which check fired; must be in :func:`style_cases`.
        window: The context window (``max_model_len``, ``n_ctx``, ``max_total_tokens``).
        prompt_tokens: The prompt size the engine reports.
        max_tokens: The requested output; ``None`` when the client sent none (vLLM 0.16-0.31
            then print 0).
        max_tokens_param: The field name vLLM ≥0.32 echoes for ``MAX_TOKENS``.
        prompt_chars: Characters of the prompt, for ``TEXT``.
        max_chars: The pre-check's character bound ("more than X characters"), for ``TEXT``.
        max_input_tokens: TGI's input limit; defaults to ``window - 1`` as TGI does.
        stream: The request asked for a stream; only SGLang 0.4.x answers differently.

    Raises:
        ConfigError: unknown style, a case the style does not have, or a number the case
            needs is missing or negative.
    """
    name = resolve_style(style)
    try:
        the_case = OverflowCase(case)
    except ValueError:
        valid = ", ".join(c.value for c in OverflowCase)
        raise ConfigError(f"unknown overflow case {case!r}; use one of: {valid}") from None
    if the_case not in _CASES[name]:
        have = ", ".join(sorted(c.value for c in _CASES[name]))
        raise ConfigError(
            f"error style {name!r} has no {the_case.value!r} rejection (it has: {have})"
            + ("; it clamps max_tokens instead" if the_case is OverflowCase.TOTAL else "")
        )
    if max_tokens_param not in ("max_tokens", "max_completion_tokens"):
        raise ConfigError(
            f"max_tokens_param {max_tokens_param!r} is invalid; use max_tokens or "
            "max_completion_tokens"
        )
    numbers = {"window": window, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
               "prompt_chars": prompt_chars, "max_chars": max_chars,
               "max_input_tokens": max_input_tokens}
    for key, value in numbers.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise ConfigError(f"{key}={value!r} is invalid; pass a non-negative int")
    n = _Numbers(window, prompt_tokens, max_tokens, max_tokens_param, prompt_chars, max_chars,
                 max_input_tokens)
    message, param = _text(name, the_case, n)
    return _body(name, message, param, n, stream)


def check_overflow(
    style: str,
    *,
    window: int,
    prompt_tokens: int,
    max_tokens: int | None,
    max_tokens_param: MaxTokensParam = "max_tokens",
    prompt_chars: int | None = None,
    max_chars_per_token: int | None = None,
    prompt_is_text: bool = True,
    max_input_tokens: int | None = None,
    stream: bool = False,
) -> ErrorResponse | None:
    """Validate a request as ``style``'s engine does; its rejection, or ``None`` if accepted.

    Applies the engine's checks in its order, its > or ≥, and vLLM ≥0.16's truncation of text
    prompts (the reported count is then capped, see the module table). ``None`` means the
    engine runs the request; whether it clamps ``max_tokens`` is
    :func:`style_rejects_overlong_total`'s answer.

    Args:
        prompt_tokens: The true prompt size.
        max_tokens: The requested output, ``None`` when the client sent none.
        prompt_chars: Characters of a text prompt; with ``max_chars_per_token`` it enables
            vLLM ≥0.16's character pre-check.
        prompt_is_text: ``False`` for token-id prompts, which vLLM reports untruncated.
        Other arguments as for :func:`format_overflow`.

    Raises:
        ConfigError: as for :func:`format_overflow`.
    """
    name = resolve_style(style)
    L, P, O = window, prompt_tokens, max_tokens

    def fmt(case: OverflowCase, **numbers: int | None) -> ErrorResponse:
        numbers.setdefault("prompt_tokens", P)
        return format_overflow(name, case, window=L, max_tokens=O,
                               max_tokens_param=max_tokens_param, stream=stream,
                               max_input_tokens=max_input_tokens, **numbers)

    def text_precheck(max_input: int) -> ErrorResponse | None:
        if prompt_chars is None or max_chars_per_token is None or max_input < 0:
            return None
        bound = max_input * max_chars_per_token
        if prompt_chars > bound:
            return fmt(OverflowCase.TEXT, prompt_chars=prompt_chars, max_chars=bound)
        return None

    if name == "vllm-0.32":
        if O is not None and O > L:
            return fmt(OverflowCase.MAX_TOKENS)
        if (rejected := text_precheck(L)) is not None:
            return rejected
        if P > L:
            return fmt(OverflowCase.PROMPT, prompt_tokens=min(P, L + 1) if prompt_is_text else P)
        return fmt(OverflowCase.NO_ROOM) if P == L else None
    if name in ("vllm-0.18-0.31", "vllm-0.16-0.17"):
        max_input = L - (O or 0)
        if (rejected := text_precheck(max_input)) is not None:
            return rejected
        if P > max_input:
            shown = min(P, max_input + 1) if prompt_is_text and max_input >= 0 else P
            case = OverflowCase.TOTAL if O else OverflowCase.PROMPT
            return fmt(case, prompt_tokens=shown)
        return fmt(OverflowCase.NO_ROOM) if O is None and P == L else None
    if name == "tgi":
        limit = max_input_tokens if max_input_tokens is not None else L - 1
        if P > limit:
            return fmt(OverflowCase.PROMPT)
        if O is not None and P + O > L:
            return fmt(OverflowCase.TOTAL)
        return None
    if name == "openai":
        if P > L:
            return fmt(OverflowCase.PROMPT)
        return fmt(OverflowCase.TOTAL) if O is not None and P + O > L else None
    if name == "vllm-0.10" and O is not None:
        return fmt(OverflowCase.TOTAL) if P + O > L else None
    if P >= L:  # vllm-0.10 without max_tokens, vllm-0.10.1-0.15, sglang*, llamacpp
        return fmt(OverflowCase.PROMPT)
    if O is None or name == "llamacpp":
        return None
    over = P + O >= L if name == "sglang-0.4" else P + O > L
    return fmt(OverflowCase.TOTAL) if over else None
