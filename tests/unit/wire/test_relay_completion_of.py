"""Reading ``finish_reason`` and ``usage`` from a whole answer: the typed fast path gives
exactly what the lenient walk over a generic decode gives, for any JSON shape."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from kvroute.wire.relay import completion_of, completion_of_any

scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 5), st.sampled_from(
    ["stop", "length", "tool_calls", ""]), st.floats(allow_nan=False, allow_infinity=False))
choice = st.one_of(
    scalars,
    st.fixed_dictionaries({}, optional={
        "index": st.one_of(st.integers(-2, 4), scalars),
        "finish_reason": st.one_of(st.sampled_from(["stop", "length", None]), scalars),
        "message": st.fixed_dictionaries({"role": st.just("assistant"),
                                          "content": st.text(max_size=20)}),
    }),
)
answer = st.one_of(
    scalars,
    st.lists(scalars, max_size=3),
    st.fixed_dictionaries({}, optional={
        "choices": st.one_of(st.lists(choice, max_size=4), scalars),
        "usage": st.one_of(st.none(), st.dictionaries(st.sampled_from(
            ["prompt_tokens", "completion_tokens", "total_tokens"]), st.integers(0, 99)),
            scalars, st.lists(scalars, max_size=2)),
        "id": st.text(max_size=8),
    }),
)


@given(answer)
def test_the_typed_read_agrees_with_the_lenient_one(doc: Any) -> None:
    body = json.dumps(doc).encode()
    assert completion_of(body) == completion_of_any(body)


def test_a_null_index_means_the_choices_position_in_both_reads() -> None:
    body = b'{"choices": [{"index": null, "finish_reason": "stop"}]}'
    assert completion_of(body) == completion_of_any(body) == (["stop"], None)


def test_a_usual_answer_and_bytes_that_are_not_json() -> None:
    body = (b'{"id":"c1","choices":[{"index":0,"finish_reason":"length","message":'
            b'{"role":"assistant","content":"hi"}}],"usage":{"prompt_tokens":7}}')
    assert completion_of(body) == (["length"], {"prompt_tokens": 7})
    assert completion_of(b"{not json") == ([], None)
