"""``shell/app.py``'s limits on what parses but no engine should get: nesting and ``n``."""

from __future__ import annotations

import json

import pytest

from kvroute.shell.app import MAX_JSON_DEPTH, MAX_N, _check_size, json_depth
from kvroute.wire.openai import RequestError, parse_request


def nested(depth: int) -> object:
    value: object = 0
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


@pytest.mark.parametrize("depth", [0, 1, 2, 7, 100, 101])
def test_json_depth_counts_arrays_and_objects(depth: int) -> None:
    assert json_depth(nested(depth), 1000) == depth


def test_json_depth_stops_counting_past_the_limit_without_recursing() -> None:
    assert json_depth(nested(100_000), 10) == 11


def body(**extra: object) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "[{[{"}],
                       **extra}).encode()


def test_a_body_at_the_depth_limit_passes_and_one_deeper_is_refused() -> None:
    # model, messages: the document itself is level 1, "x" adds its own levels.
    ok = body(x=nested(MAX_JSON_DEPTH - 1))
    _check_size(ok, parse_request(ok, "chat"))
    deep = body(x=nested(MAX_JSON_DEPTH))
    with pytest.raises(RequestError, match="more than 100 levels") as info:
        _check_size(deep, parse_request(deep, "chat"))
    assert info.value.status == 400


def test_n_over_openais_limit_is_refused() -> None:
    ok = body(n=MAX_N)
    _check_size(ok, parse_request(ok, "chat"))
    big = body(n=10**30)
    with pytest.raises(RequestError, match="'n' is 1000000000000000000000000000000") as info:
        _check_size(big, parse_request(big, "chat"))
    assert info.value.param == "n"
