"""``shell/request_limits.py``: what parses but no engine should get (``n``, a body too deep
to decode), and the depth measure that tells a too-deep body (400) from a bug (500) after a
``RecursionError``."""

from __future__ import annotations

import json

import pytest

from kvroute.shell.request_limits import MAX_N, json_depth, parse_within_limits, too_deep
from kvroute.wire.openai import RequestError


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


def parse(raw: bytes) -> object:
    return parse_within_limits(raw, "chat", max_body_bytes=1 << 24)


def test_n_over_openais_limit_is_refused() -> None:
    parse(body(n=MAX_N))
    with pytest.raises(RequestError, match="'n' is 1000000000000000000000000000000") as info:
        parse(body(n=10**30))
    assert info.value.param == "n" and info.value.status == 400


def test_a_body_too_deep_to_decode_is_a_400_not_a_recursion_error() -> None:
    raw = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(RequestError, match="too deeply") as info:
        parse(raw)
    assert info.value.status == 400


def test_too_deep_tells_a_deep_body_from_a_shallow_one() -> None:
    # The document is level 1; "x" adds its own levels.
    shallow = parse_within_limits(body(x=nested(99)), "chat", max_body_bytes=1 << 24)
    deep = parse_within_limits(body(x=nested(100)), "chat", max_body_bytes=1 << 24)
    assert not too_deep(shallow) and too_deep(deep)
