"""The router forwards the client's own bytes exactly when nothing in the body changes."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from kvroute.wire.openai import encode_request, parse_request
from kvroute.wire.relay import forward_body

limits = st.one_of(st.none(), st.integers(min_value=1, max_value=4096))


@given(
    model=st.sampled_from(["assistant", "qwen3-8b"]),
    target=st.sampled_from(["assistant", "qwen3-8b"]),
    sent_max=limits,
    sent_completion=limits,
    clamp=limits,
    body_salt=st.sampled_from([None, "tenant-a"]),
    router_salt=st.sampled_from([None, "tenant-a", "tenant-b"]),
    spacing=st.sampled_from([None, 2]),
)
def test_forwarded_body_decodes_like_the_re_encoded_one(
    model: str, target: str, sent_max: int | None, sent_completion: int | None,
    clamp: int | None, body_salt: str | None, router_salt: str | None, spacing: int | None,
) -> None:
    body: dict[str, object] = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                               "stream": False, "unknown_field": [1, 2]}
    if sent_max is not None:
        body["max_tokens"] = sent_max
    if sent_completion is not None:
        body["max_completion_tokens"] = sent_completion
    if body_salt is not None:
        body["cache_salt"] = body_salt
    raw = json.dumps(body, indent=spacing).encode()
    parsed = parse_request(raw, "chat")
    sent = forward_body(raw, parsed, max_tokens=clamp, model=target, cache_salt=router_salt)
    expected = encode_request(parsed, max_tokens=clamp, model=target, cache_salt=router_salt)
    assert json.loads(sent) == json.loads(expected)
    if sent is raw:
        # untouched bytes only when nothing changed
        assert model == target and router_salt in (None, body_salt)
