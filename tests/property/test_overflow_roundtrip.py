"""Properties of the overflow codec: it never raises, and format → parse gives the numbers back.

The round trip is the contract the reactive path relies on: whatever an engine of any style
sends for any numbers, the router reads the same numbers out of it (or knows they are a floor).
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.wire.overflow import OverflowKind, OverflowParam, parse_overflow
from kvroute.wire.overflow_styles import (
    STYLES,
    OverflowCase,
    check_overflow,
    format_overflow,
    style_cases,
)

FAST = settings(max_examples=300, deadline=None)

statuses = st.sampled_from([200, 400, 404, 413, 422, 429, 500]) | st.integers(-1, 1000)


@FAST
@given(status=statuses, body=st.binary(max_size=2048))
def test_any_bytes_give_an_overflow_or_none(status: int, body: bytes) -> None:
    got = parse_overflow(status, body)
    assert got is None or got.kind in OverflowKind


@FAST
@given(status=statuses, body=st.text(max_size=2048))
def test_any_text_gives_an_overflow_or_none(status: int, body: str) -> None:
    parse_overflow(status, body)


# Text built from the engines' own fragments reaches the regexes far more often than noise.
FRAGMENTS = [
    "data: ", "\n\n", "{", "}", '"error"', '"message"', ":", ",", '"', "This model's ",
    "maximum context length is ", "tokens. ", "However, ", "you requested ", "your prompt contains ",
    "at least ", "input tokens", "output tokens", "characters", " (more than ", "(parameter=",
    "input_tokens", ", value=", ")", "max_tokens", "=", "cannot be greater than max_model_len=",
    "must be at least 1, got ", "0", "1", "99999999999999999999999", "-", "`inputs` tokens + ",
    "`max_new_tokens` must be <= ", "Given: ", "request (", (" tokens) exceeds the available "
    "context size ("), "n_ctx", "n_prompt_tokens", "context_length_exceeded", "[DONE]", "\r\n",
]


@FAST
@given(status=statuses, parts=st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=5),
                                       max_size=40))
def test_engine_like_fragments_never_raise(status: int, parts: list[str]) -> None:
    body = "".join(parts)
    got = parse_overflow(status, body)
    if got is not None:
        for n in (got.window, got.prompt_tokens, got.requested_output_tokens, got.prompt_chars):
            assert n is None or 0 <= n < 10**15


@FAST
@given(
    status=statuses,
    obj=st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
            st.sampled_from(["error", "message", "object", "code", "param", "type", "n_ctx",
                             "n_prompt_tokens", "detail", "error_type"]) | st.text(max_size=4),
            inner, max_size=5),
        max_leaves=12,
    ),
)
def test_any_json_shape_never_raises(status: int, obj: object) -> None:
    text = json.dumps(obj)
    parse_overflow(status, text)
    parse_overflow(status, f"data: {text}\n\n")


# --- round trip ------------------------------------------------------------------------------

CASES = [(style, case) for style in STYLES for case in sorted(style_cases(style))]
counts = st.integers(min_value=0, max_value=2_000_000)


@st.composite
def overflow_inputs(draw: st.DrawFn) -> tuple[str, OverflowCase, dict[str, object]]:
    style, case = draw(st.sampled_from(CASES))
    window = draw(st.integers(min_value=1, max_value=1_000_000))
    args: dict[str, object] = {"window": window}
    if case is OverflowCase.MAX_TOKENS:
        args["max_tokens"] = draw(st.integers(window + 1, window * 3))
        args["max_tokens_param"] = draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))
    elif case is OverflowCase.NO_ROOM:
        args["prompt_tokens"] = window
    elif case is OverflowCase.TEXT:
        args["prompt_chars"] = draw(counts)
        args["max_chars"] = draw(counts)
        args["max_tokens"] = draw(st.none() | st.integers(0, window))
    elif case is OverflowCase.PROMPT:
        args["prompt_tokens"] = draw(st.integers(window, window * 3))
        if style in ("vllm-0.10", "vllm-0.10.1-0.15", "sglang", "sglang-0.4", "llamacpp",
                     "tgi", "openai"):
            args["max_tokens"] = draw(st.none() | st.integers(0, window))
    else:  # TOTAL: any prompt, an output that makes the sum too large
        output = draw(st.integers(1, window * 2))
        args["max_tokens"] = output
        args["prompt_tokens"] = draw(st.integers(max(0, window - output + 1), window * 2))
    args["stream"] = draw(st.booleans())
    return style, case, args


@settings(max_examples=600, deadline=None)
@given(overflow_inputs())
def test_format_then_parse_gives_the_numbers_back(
    sample: tuple[str, OverflowCase, dict[str, object]],
) -> None:
    style, case, args = sample
    resp = format_overflow(style, case, **args)  # type: ignore[arg-type]
    got = parse_overflow(resp.status, resp.body)
    assert got is not None, resp
    window = args["window"]
    prompt = args.get("prompt_tokens")
    output = args.get("max_tokens")
    assert isinstance(window, int)

    # which family of wording
    expected_style = {"sglang-0.4": "sglang"}.get(style, style)
    if case is OverflowCase.NO_ROOM:
        expected_style = "vllm"  # one wording shared by every vLLM since 0.16
    assert got.style == expected_style

    if case is OverflowCase.NO_ROOM:
        assert (got.kind, got.window, got.prompt_tokens) == (OverflowKind.PROMPT, None, None)
        assert got.parameter is OverflowParam.MAX_TOKENS
        return
    if case is OverflowCase.MAX_TOKENS:
        assert got.kind is OverflowKind.OUTPUT
        assert (got.window, got.requested_output_tokens) == (window, output)
        assert got.parameter == args["max_tokens_param"]
        return

    if style == "tgi" and case is OverflowCase.PROMPT:
        assert (got.window, got.max_input_tokens) == (None, window - 1)
    else:
        assert got.window == window

    reserves_output = style in ("vllm-0.16-0.17", "vllm-0.18-0.31")
    if case is OverflowCase.TEXT:
        assert (got.prompt_chars, got.max_chars, got.prompt_tokens) == (
            args["prompt_chars"], args["max_chars"], None)
        assert got.parameter is OverflowParam.INPUT_TEXT
        printed_output = (output or 0) if reserves_output else None
        assert got.requested_output_tokens == printed_output
        expect_kind = OverflowKind.TOTAL if printed_output else OverflowKind.PROMPT
        assert got.kind is expect_kind
        return

    assert isinstance(prompt, int)
    assert got.prompt_tokens == prompt
    if reserves_output:
        printed_out: int | None = output if isinstance(output, int) else 0
    elif case is OverflowCase.TOTAL:
        printed_out = output if isinstance(output, int) else None
    else:
        printed_out = None
    assert got.requested_output_tokens == printed_out

    # a floor exactly where the engine's truncation would produce this count
    if style == "vllm-0.32":
        floor = prompt == window + 1
    elif reserves_output:
        floor = prompt == window - (printed_out or 0) + 1
    else:
        floor = False
    assert got.prompt_is_lower_bound is floor

    if case is OverflowCase.TOTAL and prompt < window:
        assert got.kind is OverflowKind.TOTAL
        if not floor:
            assert got.room_for_output_tokens == window - prompt
    else:
        assert got.kind is OverflowKind.PROMPT


@settings(max_examples=600, deadline=None)
@given(
    style=st.sampled_from(STYLES),
    window=st.integers(1, 100_000),
    prompt=st.integers(0, 300_000),
    output=st.none() | st.integers(1, 200_000),
    text=st.booleans(),
)
def test_check_overflow_accepts_exactly_what_fits(
    style: str, window: int, prompt: int, output: int | None, text: bool
) -> None:
    """Accepted requests fit (or are clamped by the styles that clamp); rejections parse."""
    resp = check_overflow(style, window=window, prompt_tokens=prompt, max_tokens=output,
                          prompt_is_text=text)
    fits_prompt = prompt < window
    total = prompt + (output or 0)
    if style == "vllm-0.32":
        should_reject = prompt >= window or (output is not None and output > window)
    elif style == "llamacpp":
        should_reject = not fits_prompt
    elif style == "vllm-0.10" and output is not None:
        should_reject = total > window
    elif style in ("vllm-0.16-0.17", "vllm-0.18-0.31"):
        should_reject = total > window or (output is None and prompt == window)
    elif style == "tgi":
        should_reject = prompt > window - 1 or total > window
    elif style == "openai":
        should_reject = prompt > window or total > window
    elif style == "sglang-0.4":
        should_reject = not fits_prompt or (output is not None and total >= window)
    else:
        should_reject = not fits_prompt or total > window
    assert (resp is not None) is should_reject
    if resp is not None:
        got = parse_overflow(resp.status, resp.body)
        assert got is not None
        if got.prompt_tokens is not None:
            assert got.prompt_tokens <= prompt
            assert got.prompt_tokens == prompt or got.prompt_is_lower_bound
