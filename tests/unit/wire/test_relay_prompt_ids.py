"""Token-id prompts: checked in C at parse, taken as array('I') for hashing."""

from __future__ import annotations

import json
from array import array

import pytest

from kvroute.wire.openai import RequestError, parse_request
from kvroute.wire.relay import prompt_ids_from_body


def test_token_id_prompts_come_back_as_32_bit_arrays_or_lists() -> None:
    ids = [0, 5, 2**31, 2**32 - 1]
    got = prompt_ids_from_body(parse_request(
        json.dumps({"model": "m", "prompt": ids}).encode(), "completions"))
    assert isinstance(got, array) and got.typecode == "I" and list(got) == ids
    wide = [1, 2**40]
    got = prompt_ids_from_body(parse_request(
        json.dumps({"model": "m", "prompt": wide}).encode(), "completions"))
    assert got == wide


@pytest.mark.parametrize("prompt, says", [
    ([1, True, 3], "prompt\\[1\\] is boolean"),
    ([1, 2, -3], "prompt\\[2\\]"),
    ([1, 2.5], "prompt\\[1\\]"),
])
def test_a_bad_token_id_is_named_after_the_fast_check_fails(prompt: list[object],
                                                             says: str) -> None:

    with pytest.raises(RequestError, match=says):
        parse_request(json.dumps({"model": "m", "prompt": prompt}).encode(), "completions")
