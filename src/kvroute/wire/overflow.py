"""Context-window overflow rejections → numbers: the router's reactive backstop.

Owns :func:`parse_overflow`, which reads an engine's rejection (HTTP status plus body) and
decides whether it says "this request does not fit the context window", and if so what the
engine reported: the window, the prompt size (exact or only a lower bound), the requested
output, the character count of the text pre-check, and which request field was at fault.
The opposite direction, numbers → an engine's exact bytes, lives in
:mod:`kvroute.wire.overflow_styles`.

Pure: no I/O, no logging, no ambient state (``tests/unit/test_layering.py``).

Why a table of wordings and not one clever regex: vLLM alone changed its wording five times
(≤0.10.0, 0.10.1-0.15, 0.16-0.17, 0.18-0.31, ≥0.32) and its JSON envelope once (flat → nested
at 0.10.1); SGLang, llama.cpp, TGI and the hosted APIs each have their own. A parser that knows
one wording fails *silently* on the others, so every known wording is a named row below, each
row is tested against the verbatim text in ``tests/data/overflow_samples.json``, and anything
that only carries a generic overflow marker is still classified (``OverflowKind.UNSPECIFIED``)
rather than dropped.

Decisions, each deliberate:

* **Lower bounds.** vLLM ≥0.16 tokenizes a text prompt with truncation at ``max_input + 1``, so
  the reported count may be a floor. ``prompt_is_lower_bound`` is set when the text says
  "at least", when the 0.16-0.17 form reports ``prompt == window - output + 1``, or when the
  ≥0.32 form reports ``prompt == window + 1``. A caller must not compute a clamp from a floor.
* **"max_tokens must be at least 1, got 0" is an overflow.** vLLM ≥0.32 clamps ``max_tokens``
  to ``window - prompt``; a prompt of exactly the window clamps it to 0 and the sampling check
  rejects that. For the router it means "the prompt fills the window", so it parses as
  ``OverflowKind.PROMPT`` with no numbers. The same text would come back if a client literally
  sent ``max_tokens: 0``; the router never forwards 0, so it cannot be confused. Any other
  value ("got -3") is a client error and is not an overflow.
* **Output caps are not overflows.** OpenAI's "max_tokens is too large: O. This model supports
  at most M completion tokens" and TGI's "`max_new_tokens` must be <= X" limit the output on
  its own, not the window; they return ``None``. vLLM ≥0.32's
  "max_tokens=O cannot be greater than max_model_len=L" *is* about the window (``OUTPUT``).
* **Where it looks.** Statuses 400, 413 and 422 with a JSON body in any engine's envelope, or
  plain text; and an SSE stream (any status, typically a 200 from SGLang 0.4.x) whose *first*
  ``data:`` event is an error object. An overflow after content has streamed cannot be
  recovered by retrying, so later events are not read. Other statuses (404, 429, 5xx) are
  never overflows. Only the first ``MAX_SCAN_CHARS`` characters are examined.
* **Never raises.** Arbitrary bytes give an :class:`Overflow` or ``None`` (hypothesis-tested).
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Any, Final

from kvroute.core.tiers import OverflowNumbers, OverflowPart

__all__ = [
    "MAX_SCAN_CHARS",
    "OVERFLOW_STATUSES",
    "Overflow",
    "OverflowKind",
    "OverflowParam",
    "gateway_recognises_overflow",
    "overflow_numbers",
    "parse_overflow",
]

MAX_SCAN_CHARS: Final = 16_384
"""Characters of a body that are examined; overflow errors are a few hundred bytes, and a
gateway-wrapped one a few KiB. Bounds the cost of a hostile or huge error body."""

OVERFLOW_STATUSES: Final = frozenset({400, 413, 422})
"""Statuses whose body is read as a possible overflow (besides a stream's first SSE event)."""


class OverflowKind(enum.StrEnum):
    """What did not fit, as far as the engine's words tell.

    The router's reaction follows from it: ``TOTAL`` and ``OUTPUT`` can be fixed by clamping
    the output on the same backend; ``PROMPT`` only by a larger window; ``UNSPECIFIED`` is an
    overflow whose wording carries no usable numbers (escalate, or ask ``/tokenize``).
    """

    PROMPT = "prompt"
    """The prompt alone leaves no room for output (it is over, or exactly at, the window)."""
    TOTAL = "total"
    """Prompt plus requested output is over the window; the prompt alone may fit."""
    OUTPUT = "output"
    """The requested output alone is larger than the window."""
    UNSPECIFIED = "unspecified"
    """Recognised as an overflow, but the text does not say which part is too long."""


class OverflowParam(enum.StrEnum):
    """The request field at fault, normalised across engines.

    Taken from the engine's own statement (vLLM's ``(parameter=X, value=Y)`` suffix, a field
    named in the wording, the JSON ``param``) and otherwise left ``None``: a "prompt + output"
    text blames neither field by itself.
    """

    INPUT_TOKENS = "input_tokens"
    INPUT_TEXT = "input_text"
    MAX_TOKENS = "max_tokens"
    MAX_COMPLETION_TOKENS = "max_completion_tokens"


@dataclass(frozen=True, slots=True)
class Overflow:
    """One recognised context-window overflow, with every number the engine reported.

    Invariants: every count is a non-negative int or ``None`` (not reported);
    ``prompt_is_lower_bound`` implies ``prompt_tokens is not None``; ``prompt_chars`` is a
    character count and never a token count.
    """

    kind: OverflowKind
    style: str
    """The wording recognised: a name from ``overflow_styles.STYLES`` when the text is one of
    those engines' (``"vllm-0.32"``, ``"sglang"``, ...), else ``"vllm"`` (a wording every
    vLLM since 0.16 shares: "max_tokens must be at least 1, got 0"), ``"vllm-engine"`` (the
    engine core's backstop), ``"azure"``, ``"anthropic"``, ``"gemini"`` or ``"unrecognised"``
    (markers only). SGLang 0.4's wording is SGLang's. Informational."""
    status: int
    message: str
    """The text the numbers were read from (the envelope's message, or the raw body)."""
    window: int | None = None
    """The context window (``max_model_len``, ``n_ctx``, TGI's ``max_total_tokens``)."""
    prompt_tokens: int | None = None
    prompt_is_lower_bound: bool = False
    requested_output_tokens: int | None = None
    """Output tokens the engine counted against the window (0 when the client sent none to a
    vLLM 0.18-0.31 engine). TGI may report less than requested (it caps at 1024)."""
    total_tokens: int | None = None
    """Prompt + output as the engine stated it, when it stated it."""
    prompt_chars: int | None = None
    max_chars: int | None = None
    """The character bound the text pre-check compared against ("more than X characters")."""
    max_input_tokens: int | None = None
    """The input limit the engine stated (TGI ``max_input_tokens``, vLLM "maximum input length
    of N tokens" or "the upper bound for N input tokens")."""
    parameter: OverflowParam | None = None

    @property
    def total_requested_tokens(self) -> int | None:
        """Prompt + output: as stated, else computed when both parts are known."""
        if self.total_tokens is not None:
            return self.total_tokens
        if self.prompt_tokens is not None and self.requested_output_tokens is not None:
            return self.prompt_tokens + self.requested_output_tokens
        return None

    @property
    def room_for_output_tokens(self) -> int | None:
        """Output tokens that would fit next to this prompt: ``window - prompt``.

        ``None`` unless the window and an *exact* prompt count are known; never negative.
        This is the clamp a reactive retry may use (minus the caller's safety margin).
        """
        if self.window is None or self.prompt_tokens is None or self.prompt_is_lower_bound:
            return None
        return max(0, self.window - self.prompt_tokens)


# --- wordings --------------------------------------------------------------------------------

_N = "[0-9]{1,15}"  # bounded, so int() can never hit the int-digits limit


def _g(name: str) -> str:
    return f"(?P<{name}>{_N})"


@dataclass(frozen=True, slots=True)
class _Wording:
    style: str
    pattern: re.Pattern[str]
    kind: OverflowKind | None
    """Fixed kind, or ``None``: derived from the numbers (a prompt + output comparison)."""
    param: OverflowParam | None = None
    floor_rule: str = ""
    """"window+1": prompt == window + 1 is a floor; "max_input+1": prompt == window-out+1 is."""


def _w(
    style: str,
    regex: str,
    kind: OverflowKind | None,
    param: OverflowParam | None = None,
    floor_rule: str = "",
) -> _Wording:
    return _Wording(style, re.compile(regex, re.IGNORECASE | re.DOTALL | re.ASCII), kind, param, floor_rule)


_P, _T, _O = OverflowKind.PROMPT, None, OverflowKind.OUTPUT
_IN, _TXT, _MT = OverflowParam.INPUT_TOKENS, OverflowParam.INPUT_TEXT, OverflowParam.MAX_TOKENS
_CTX = rf"maximum context length is {_g('ctx')} tokens\. "
_CHARS_BOUND = (
    rf"(?: \(more than {_g('maxchars')} characters, which is the upper bound for "
    rf"{_g('maxin')} input tokens\))?"
)

# First match wins; more specific wordings come before their prefixes.
_WORDINGS: Final[tuple[_Wording, ...]] = (
    _w("vllm-0.10", _CTX + rf"However, you requested {_g('total')} tokens \({_g('prompt')} in "
       rf"the messages, {_g('out')} in the completion\)", _T),
    _w("vllm-0.10", _CTX + rf"However, you requested {_g('prompt')} tokens in the "
       r"(?:messages|input)", _P, _IN),
    _w("vllm-0.10.1-0.15", rf"'max_tokens' or 'max_completion_tokens' is too large: {_g('out')}"
       rf"\. This model's maximum context length is {_g('ctx')} tokens and your request has "
       rf"{_g('prompt')} input tokens", _T, _MT),
    _w("vllm-0.10.1-0.15", _CTX + rf"However, your request has {_g('prompt')} input tokens",
       _P, _IN),
    _w("vllm-0.16-0.17", rf"You passed {_g('prompt')} input tokens and requested {_g('out')} "
       rf"output tokens\. However, the model's context length is only {_g('ctx')} tokens"
       rf"(?:, resulting in a maximum input length of {_g('maxin')} tokens)?", _T, _IN,
       "max_input+1"),
    _w("vllm-0.16-0.17", rf"You passed {_g('chars')} input characters and requested {_g('out')} "
       rf"output tokens\. However, the model's context length is only {_g('ctx')} tokens"
       rf"(?:, resulting in a maximum input length of {_g('maxin')} tokens \(at most "
       rf"{_g('maxchars')} characters\))?", _T, _TXT),
    # The context sentence is optional: 0.18/0.19's non-renderer path also states the window
    # at the end ("(P + O = T > L)"), and quoted excerpts often start at "However".
    _w("vllm-0.18-0.31", rf"(?:{_CTX})?However, you requested {_g('out')} output tokens and "
       rf"your prompt contains (?P<atleast>at least )?{_g('prompt')} input tokens(?:, for a "
       rf"total of (?:at least )?{_g('total')} tokens)?(?: \({_N} \+ {_N} = {_N} > "
       rf"{_g('ctx2')}\))?", _T, _IN, "max_input+1"),
    _w("vllm-0.18-0.31", rf"(?:{_CTX})?However, you requested {_g('out')} output tokens and "
       rf"your prompt contains {_g('chars')} characters" + _CHARS_BOUND, _T, _TXT),
    _w("vllm-0.32", _CTX + rf"However, your prompt contains (?P<atleast>at least )?"
       rf"{_g('prompt')} input tokens", _P, _IN, "window+1"),
    _w("vllm-0.32", _CTX + rf"However, your prompt contains {_g('chars')} characters"
       + _CHARS_BOUND, _P, _TXT),
    _w("vllm-0.32", rf"(?P<param>max_tokens|max_completion_tokens) ?= ?{_g('out')} ?cannot be "
       rf"greater than max_model_len ?= ?{_g('ctx')}", _O),
    _w("vllm", r"(?P<param>max_tokens|max_completion_tokens) must be at least 1, got "
       r"0(?!\.?[0-9])", _P),
    _w("vllm-engine", rf"The decoder prompt \(length {_g('prompt')}\) (?:plus the number of "
       rf"requested output tokens \(at least 1\) )?is longer than the maximum model length of "
       rf"{_g('ctx')}", _P, _IN),
    _w("sglang", rf"The input \({_g('prompt')} tokens\) is longer than the model's context "
       rf"length \({_g('ctx')} tokens\)", _P, _IN),
    _w("sglang", rf"exceeds the model's maximum context length of {_g('ctx')} tokens\. You "
       rf"requested a total of {_g('total')} tokens: {_g('prompt')} tokens from the input "
       rf"messages and {_g('out')} tokens for the completion", _T),
    _w("llamacpp", rf"(?:request|input) \({_g('prompt')} tokens\) (?:exceeds the available "
       rf"context size|is larger than the max context size) \({_g('ctx')} tokens\)", _P, _IN),
    _w("tgi", rf"`inputs` tokens \+ `max_new_tokens` must be <= {_g('ctx')}\. Given: "
       rf"{_g('prompt')} `inputs` tokens and {_g('out')} `max_new_tokens`", _T),
    _w("tgi", rf"`inputs` must have less than {_g('maxin')} tokens\. Given: {_g('prompt')}",
       _P, _IN),
    _w("openai", _CTX + rf"However, your messages resulted in {_g('prompt')} tokens", _P, _IN),
    _w("azure", rf"Input tokens exceed the configured limit of {_g('ctx')} tokens\. Your "
       rf"messages resulted in {_g('prompt')} tokens", _P, _IN),
    _w("anthropic", rf"input length and `max_tokens` exceed context limit: {_g('prompt')} \+ "
       rf"{_g('out')} > {_g('ctx')}", _T),
    _w("anthropic", rf"prompt is too long: {_g('prompt')} tokens > {_g('ctx')} maximum", _P, _IN),
    _w("gemini", rf"The input token count \({_g('prompt')}\) exceeds the maximum number of "
       rf"tokens allowed \({_g('ctx')}\)", _P, _IN),
)

# An overflow whose wording is not in the table (OpenAI Responses API, future engines).
_MARKERS: Final = re.compile(
    r"maximum context length|context length is only|context_length_exceeded"
    r"|exceed_context_size_error|exceeds the available context size"
    r"|is longer than the (?:model's context length|maximum model length)"
    r"|larger than the max context size|`inputs` tokens \+ `max_new_tokens`"
    r"|`inputs` must have less than|cannot be greater than max_model_len"
    r"|exceeds the context window|prompt is too long|exceed context limit"
    r"|input token count \([0-9]+\) exceeds",
    re.IGNORECASE | re.ASCII,
)
# Every wording and marker contains one of these: one cheap scan rules out most non-overflows.
_HINTS: Final = re.compile(
    r"context|max_model_len|must be at least 1|maximum model length|`inputs`|prompt is too long"
    r"|token count|configured limit|input tokens|output tokens",
    re.IGNORECASE | re.ASCII,
)
_SUFFIX: Final = re.compile(r"\(parameter=(?P<p>[A-Za-z_]{1,40}), value=(?P<v>[^)]{0,40})\)")
_PARAM_NAMES: Final = {
    "input_tokens": OverflowParam.INPUT_TOKENS,
    "input_text": OverflowParam.INPUT_TEXT,
    "max_tokens": OverflowParam.MAX_TOKENS,
    "max_completion_tokens": OverflowParam.MAX_COMPLETION_TOKENS,
    "messages": OverflowParam.INPUT_TOKENS,
    "input": OverflowParam.INPUT_TOKENS,
    "prompt": OverflowParam.INPUT_TOKENS,
}
_DIGITS: Final = re.compile(r"[0-9]{1,15}", re.ASCII)

# LiteLLM's ``is_error_str_context_window_exceeded`` (1.108.7): lower-cased substring match.
_LITELLM_SUBSTRINGS: Final = (
    "exceed context limit",
    "this model's maximum context length is",
    "string too long. expected a string with maximum length",
    "model's maximum context limit",
    "is longer than the model's context length",
    "input tokens exceed the configured limit",
    "`inputs` tokens + `max_new_tokens` must be",
    "exceeds the available context size",
    "exceeds the maximum number of tokens allowed",
)
_LITELLM_PAIRS: Final = (
    ("current length is", "while limit is"),
    ("maximum input length is", "tokens"),
    ("input too long:", "input tokens, limit is"),
)


# --- envelope --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Envelope:
    message: str | None = None
    param: str | None = None
    code: object = None
    type: str | None = None
    n_ctx: int | None = None
    n_prompt_tokens: int | None = None


def _as_count(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 10**15:
        return value
    return None


def _envelope(obj: object) -> _Envelope | None:
    """Read an error object in any engine's JSON shape; ``None`` if it is not one."""
    if not isinstance(obj, dict):
        return None
    err: Any = obj.get("error")
    if isinstance(err, dict):  # vLLM >=0.10.1, llama.cpp, OpenAI, SGLang 0.4 SSE
        source: dict[Any, Any] = err
    elif isinstance(err, str):  # TGI: {"error": "...", "error_type": "validation"}
        return _Envelope(message=err, type=_str_or_none(obj.get("error_type")))
    elif "message" in obj or obj.get("object") == "error":  # vLLM <=0.10.0, SGLang
        source = obj
    elif isinstance(obj.get("detail"), str):  # FastAPI HTTPException
        return _Envelope(message=obj["detail"])
    else:
        return None
    return _Envelope(
        message=_str_or_none(source.get("message")),
        param=_str_or_none(source.get("param")),
        code=source.get("code"),
        type=_str_or_none(source.get("type")),
        n_ctx=_as_count(source.get("n_ctx")),
        n_prompt_tokens=_as_count(source.get("n_prompt_tokens")),
    )


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _load_json(text: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested beyond the recursion limit
        return None


def _first_sse_data(text: str) -> str | None:
    """The data of the first SSE event that has any, joined per the SSE rules."""
    data: list[str] = []
    for line in text.splitlines():
        if not line:
            if data:
                break
            continue
        if line.startswith("data:"):
            value = line[5:]
            data.append(value.removeprefix(" "))
    return "\n".join(data) if data else None


def _looks_like_sse(text: str) -> bool:
    head = text.lstrip()
    return head.startswith(("data:", "event:", "id:", ":", "retry:"))


# --- parsing ---------------------------------------------------------------------------------


def parse_overflow(status: int, body: bytes | str) -> Overflow | None:
    """Decide whether an engine's error response is a context-window overflow.

    Args:
        status: The HTTP status of the response.
        body: The body as received: JSON in any engine's shape, plain text, or the start of an
            SSE stream (only its first ``data:`` event is read).

    Returns:
        The overflow with every number the engine reported, or ``None`` when the response is
        not an overflow (other 4xx errors, successes, other statuses, unreadable bodies).
        Never raises.
    """
    if isinstance(body, (bytes, bytearray, memoryview)):
        text = bytes(body[: MAX_SCAN_CHARS * 4]).decode("utf-8", errors="replace")
    else:
        text = str(body)
    text = text[:MAX_SCAN_CHARS]
    if _looks_like_sse(text):
        data = _first_sse_data(text)
        if data is None:
            return None
        env = _envelope(_load_json(data))
        if env is None or env.message is None:
            return None
        code = env.code
        event_status = code if isinstance(code, int) and not isinstance(code, bool) else status
        return _classify(event_status, env, [env.message])
    if not isinstance(status, int) or status not in OVERFLOW_STATUSES:
        return None
    env = _envelope(_load_json(text))
    if env is None:
        return _classify(status, _Envelope(), [text])
    texts = [env.message, text] if env.message else [text]
    return _classify(status, env, texts)


def _classify(status: int, env: _Envelope, texts: list[str]) -> Overflow | None:
    for text in (t for t in texts if _HINTS.search(t)):
        for wording in _WORDINGS:
            match = wording.pattern.search(text)
            if match is not None:
                return _from_match(status, env, text, wording, match)
    text = texts[0]
    code_says = env.code == "context_length_exceeded" or env.type == "exceed_context_size_error"
    if not code_says and not any(_MARKERS.search(t) for t in texts):
        return None
    prompt = env.n_prompt_tokens
    param = _param_from(text, env, None)
    suffix = _SUFFIX.search(text)
    if prompt is None and suffix is not None and suffix["p"] == "input_tokens":
        prompt = _int(suffix["v"])
    return Overflow(
        kind=OverflowKind.UNSPECIFIED,
        style="unrecognised",
        status=status,
        message=text,
        window=env.n_ctx,
        prompt_tokens=prompt,
        parameter=param,
    )


def _int(value: str | None) -> int | None:
    if value is None or _DIGITS.fullmatch(value.strip()) is None:
        return None
    return int(value.strip())


def _param_from(text: str, env: _Envelope, named: OverflowParam | None) -> OverflowParam | None:
    """The engine's own statement of the field at fault, most explicit source first."""
    suffix = _SUFFIX.search(text)
    if suffix is not None and suffix["p"] in _PARAM_NAMES:
        return _PARAM_NAMES[suffix["p"]]
    if named is not None:
        return named
    if env.param is not None and env.param in _PARAM_NAMES:
        return _PARAM_NAMES[env.param]
    return None


def _from_match(
    status: int, env: _Envelope, text: str, wording: _Wording, match: re.Match[str]
) -> Overflow:
    groups = match.groupdict()
    window = _int(groups.get("ctx"))
    if window is None:
        window = _int(groups.get("ctx2"))
    if window is None:
        window = env.n_ctx
    prompt = _int(groups.get("prompt"))
    if prompt is None:
        prompt = env.n_prompt_tokens
    out = _int(groups.get("out"))
    chars = _int(groups.get("chars"))
    max_input = _int(groups.get("maxin"))
    reserves_output = wording.style in ("vllm-0.16-0.17", "vllm-0.18-0.31")
    if max_input is None and reserves_output and window is not None and out is not None:
        max_input = window - out if window >= out else None  # these reserve it: L - O

    lower_bound = prompt is not None and bool(groups.get("atleast"))
    if prompt is not None and window is not None:
        if wording.floor_rule == "window+1" and prompt == window + 1:
            lower_bound = True
        if wording.floor_rule == "max_input+1" and out is not None and prompt == window - out + 1:
            lower_bound = True

    kind = wording.kind
    if kind is None:  # a prompt + output comparison: which part is too long?
        if not out or (prompt is not None and window is not None and prompt >= window):
            kind = OverflowKind.PROMPT
        else:
            kind = OverflowKind.TOTAL
    named = wording.param
    if groups.get("param"):
        named = _PARAM_NAMES[groups["param"].lower()]
    style = wording.style
    if style == "vllm-0.10" and env.code == "context_length_exceeded":
        style = "openai"  # OpenAI's legacy wording is vLLM <=0.10.0's; the envelope differs
    return Overflow(
        kind=kind,
        style=style,
        status=status,
        message=text,
        window=window,
        prompt_tokens=prompt,
        prompt_is_lower_bound=lower_bound,
        requested_output_tokens=out,
        total_tokens=_int(groups.get("total")),
        prompt_chars=chars,
        max_chars=_int(groups.get("maxchars")),
        max_input_tokens=max_input,
        parameter=_param_from(text, env, named),
    )


def gateway_recognises_overflow(message: str) -> bool:
    """Whether LiteLLM (1.108.7) would map this error text to ``ContextWindowExceededError``.

    LiteLLM decides by lower-cased substring match, after excluding validation errors on the
    OpenAI ``user`` field. The router uses this to decide whether an engine's overflow can be
    passed through to a gateway as is, or must be rewritten into OpenAI's wording (style
    ``"openai"``) so that ``context_window_fallbacks`` fires.
    """
    text = message.lower()
    if "string_above_max_length" in text or (
        "invalid 'user'" in text and "string too long" in text
    ):
        return False
    if any(s in text for s in _LITELLM_SUBSTRINGS):
        return True
    return any(a in text and b in text.split(a, 1)[1] for a, b in _LITELLM_PAIRS)


def overflow_numbers(overflow: Overflow) -> OverflowNumbers:
    """The parsed rejection as the walk's plain numbers (``core/tiers.OverflowNumbers``;
    ``OverflowPart`` has ``OverflowKind``'s values, so the kind converts by value)."""
    return OverflowNumbers(
        part=OverflowPart(overflow.kind.value),
        window=overflow.window,
        prompt_tokens=overflow.prompt_tokens,
        prompt_is_lower_bound=overflow.prompt_is_lower_bound,
        requested_output_tokens=overflow.requested_output_tokens,
    )
