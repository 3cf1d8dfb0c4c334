"""``shell/app.py``'s limits on what parses but no engine should get: ``n``, and the depth
measure that tells a too-deep body (400) from a bug (500) after a ``RecursionError``."""

from __future__ import annotations

import json

import pytest

from kvroute.shell.app import MAX_N, check_n, json_depth
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
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                       **extra}).encode()


def test_n_over_openais_limit_is_refused() -> None:
    check_n(parse_request(body(n=MAX_N), "chat"))
    with pytest.raises(RequestError, match="'n' is 1000000000000000000000000000000") as info:
        check_n(parse_request(body(n=10**30), "chat"))
    assert info.value.param == "n" and info.value.status == 400
