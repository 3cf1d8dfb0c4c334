"""Limits on request bodies that parse but must not reach an engine as they are.

Shared by the two front doors that accept OpenAI requests, ``shell/app.py`` (``kvroute
serve``) and ``shell/picker.py`` (``kvroute epp``):

* a body nested too deeply for the interpreter to decode is a 400, not a ``RecursionError``
  (a 500 with a traceback before: 100,000 nested brackets);
* ``n`` over ``MAX_N`` is a 400 (an engine asked for 10**30 completions tries to schedule
  them);
* a body that decodes but is too deep to encode again for the engine (about 970 levels)
  fails with ``RecursionError`` later; ``too_deep`` tells such a body (the client's doing)
  from a bug of ours. Nothing scans bodies up front: counting brackets cost about as much
  as decoding the body, on every request.
"""

from __future__ import annotations

from typing import Any, Final

from kvroute.wire.openai import Endpoint, ParsedRequest, RequestError, parse_request

__all__ = ["MAX_JSON_DEPTH", "MAX_N", "TOO_DEEP", "json_depth", "parse_within_limits",
           "too_deep"]

MAX_JSON_DEPTH: Final = 100
"""Nesting of arrays and objects beyond which a ``RecursionError`` is the body's doing.
OpenAI requests nest a few levels (a tool's JSON schema a few more)."""

MAX_N: Final = 128
"""The most completions one request may ask for (``n``): OpenAI's own limit."""

TOO_DEEP: Final = ("Request body nests arrays and objects too deeply for this router (it "
                   "reads up to about 970 levels, OpenAI requests nest a few; over "
                   f"{MAX_JSON_DEPTH} is never needed). Send a flatter JSON document.")


def json_depth(value: Any, limit: int) -> int:
    """How deeply ``value`` (decoded JSON) nests arrays and objects, counted up to ``limit``
    + 1 (iteratively: it measures documents too deep to recurse into)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, dict | list))
    return deepest


def too_deep(parsed: ParsedRequest) -> bool:
    """Whether a ``RecursionError`` met while handling ``parsed`` is its body's doing."""
    return json_depth(parsed.body, MAX_JSON_DEPTH) > MAX_JSON_DEPTH


def parse_within_limits(raw: bytes, endpoint: Endpoint, *, max_body_bytes: int,
                        ) -> ParsedRequest:
    """``wire.openai.parse_request``, and the limits above.

    Raises:
        RequestError: what ``parse_request`` raises; 400 for a body too deep to decode or
            ``n`` over ``MAX_N``, saying what to send instead.
    """
    try:
        parsed = parse_request(raw, endpoint, max_body_bytes=max_body_bytes)
    except RecursionError:
        raise RequestError(TOO_DEEP) from None
    if parsed.n > MAX_N:
        raise RequestError(f"'n' is {parsed.n}, over the {MAX_N} completions one request may "
                           f"ask for. Send n <= {MAX_N}, or several requests.", param="n")
    return parsed
