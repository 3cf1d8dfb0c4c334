"""wire/openai.py: request parsing and validation, re-encoding, errors, sessions, models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvroute.wire import openai as oa
from kvroute.wire.openai import RequestError, parse_request

VECTORS = Path(__file__).resolve().parents[2] / "data" / "vllm-vectors-0.32.json"


def _http_examples() -> list[dict[str, Any]]:
    data = json.loads(VECTORS.read_text())
    examples: list[dict[str, Any]] = data["http_examples_v0_32"]
    return examples


def _example(path: str, predicate: Any) -> dict[str, Any]:
    for ex in _http_examples():
        if ex["path"] == path and predicate(ex):
            return ex
    raise AssertionError(f"no vLLM 0.32 example for {path}")


def make_chat(**fields: Any) -> bytes:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body.update(fields)
    return json.dumps(body).encode()


def make_completion(**fields: Any) -> bytes:
    body: dict[str, Any] = {"model": "m", "prompt": "hi"}
    body.update(fields)
    return json.dumps(body).encode()


def _error(raw: bytes, endpoint: oa.Endpoint = "chat", **kw: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_request(raw, endpoint, **kw)
    return info.value


# ---------------------------------------------------------------------------- parsing


def test_chat_fields_are_read() -> None:
    raw = make_chat(
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=100,
        max_completion_tokens=50,
        n=2,
        tools=[{"type": "function", "function": {"name": "f"}}],
        cache_salt="tenant-a",
        user="alice",
        session_id="s-1",
        vllm_xargs={"kv_cache_report_mode": "full"},
    )
    req = parse_request(raw, "chat")
    assert req.endpoint == "chat"
    assert req.model == "m"
    assert req.messages == [{"role": "user", "content": "hi"}]
    assert req.prompt is None
    assert req.stream is True and req.include_usage is True
    # vLLM: max_completion_tokens wins over max_tokens on chat.
    assert (req.max_tokens, req.max_tokens_param) == (50, "max_completion_tokens")
    assert req.n == 2
    assert req.tools == [{"type": "function", "function": {"name": "f"}}]
    assert req.cache_salt == "tenant-a"
    assert (req.user, req.session_id) == ("alice", "s-1")
    assert req.vllm_xargs == {"kv_cache_report_mode": "full"}
    assert req.body == json.loads(raw)


def test_defaults_when_fields_absent() -> None:
    req = parse_request(make_chat(), "chat")
    assert (req.stream, req.include_usage, req.max_tokens, req.max_tokens_param, req.n) == (
        False, False, None, None, 1,
    )  # fmt: skip
    assert (req.tools, req.cache_salt, req.user, req.session_id, req.vllm_xargs) == (
        None, None, None, None, None,
    )  # fmt: skip


def test_explicit_nulls_are_absent() -> None:
    req = parse_request(make_chat(max_tokens=None, stream=None, n=None, cache_salt=None), "chat")
    assert (req.max_tokens, req.stream, req.n, req.cache_salt) == (None, False, 1, None)


def test_metadata_session_id() -> None:
    req = parse_request(make_chat(metadata={"session_id": "meta-1"}), "chat")
    assert req.session_id == "meta-1"


@pytest.mark.parametrize(
    "prompt",
    ["hello", ["a", "b"], [1, 2, 3], [[1, 2], [3]], [0]],
)
def test_completion_prompt_forms(prompt: Any) -> None:
    req = parse_request(make_completion(prompt=prompt, max_tokens=7), "completions")
    assert req.prompt == prompt
    assert req.messages is None
    assert (req.max_tokens, req.max_tokens_param) == (7, "max_tokens")


def test_completion_prompt_embeds_without_prompt() -> None:
    raw = json.dumps({"model": "m", "prompt_embeds": "AAAA"}).encode()
    assert parse_request(raw, "completions").prompt is None


def test_content_parts_and_null_content_accepted() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]},
        {"role": "tool", "content": "r", "tool_call_id": "x"},
    ]
    assert parse_request(make_chat(messages=messages), "chat").messages == messages


# ---------------------------------------------------------------------------- errors


def test_malformed_json_names_position() -> None:
    err = _error(b'{"model": "m", "messages": [}')
    assert err.status == 400
    assert "not valid JSON" in err.message and "(byte 28)" in err.message


def test_truncated_json_names_end() -> None:
    err = _error(b'{"model": "m"')
    assert "ends at byte 13" in err.message


def test_invalid_utf8() -> None:
    err = _error(b'{"model": "\xff"}')
    assert "not valid JSON" in err.message and "UTF-8" in err.message


@pytest.mark.parametrize("raw,kind", [(b"[1]", "array"), (b'"x"', "string"), (b"3", "number")])
def test_body_not_object(raw: bytes, kind: str) -> None:
    err = _error(raw)
    assert err.message.startswith(f"Request body must be a JSON object, got {kind}")


def test_body_too_large_is_413() -> None:
    raw = make_chat()
    err = _error(raw, max_body_bytes=len(raw) - 1)
    assert err.status == 413
    assert err.type == "Request Entity Too Large"
    assert f"{len(raw)} bytes" in err.message and "max_body_bytes" in err.message
    assert parse_request(raw, "chat", max_body_bytes=len(raw)).model == "m"


def test_missing_model() -> None:
    err = _error(json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode())
    assert (err.param, err.status) == ("model", 400)
    assert "Missing 'model'" in err.message and "/v1/models" in err.message


@pytest.mark.parametrize("model", [3, "", {"a": 1}, ["m"]])
def test_bad_model_type(model: Any) -> None:
    err = _error(make_chat(model=model))
    assert err.param == "model"


def test_missing_messages_points_to_completions() -> None:
    err = _error(json.dumps({"model": "m", "prompt": "x"}).encode())
    assert err.param == "messages"
    assert "/v1/completions" in err.message


def test_missing_prompt_points_to_chat() -> None:
    err = _error(json.dumps({"model": "m"}).encode(), "completions")
    assert err.param == "prompt"
    assert "/v1/chat/completions" in err.message


def test_messages_object_instead_of_list() -> None:
    err = _error(make_chat(messages={}))
    assert err.param == "messages"
    assert "'messages' must be a list of message objects, got object {}" in err.message


def test_messages_empty() -> None:
    assert _error(make_chat(messages=[])).message.startswith("'messages' is empty")


def test_message_without_role() -> None:
    err = _error(make_chat(messages=[{"role": "user", "content": "a"}, {"content": "b"}]))
    assert err.param == "messages[1].role"
    assert "messages[1] has no 'role'" in err.message


def test_message_not_object() -> None:
    assert _error(make_chat(messages=["hi"])).param == "messages[0]"


def test_role_not_string() -> None:
    assert _error(make_chat(messages=[{"role": 1, "content": "x"}])).param == "messages[0].role"


@pytest.mark.parametrize("content", [5, {"text": "x"}, True])
def test_content_wrong_type(content: Any) -> None:
    err = _error(make_chat(messages=[{"role": "user", "content": content}]))
    assert err.param == "messages[0].content"
    assert "a string, a list of content parts or null" in err.message


def test_content_part_without_type() -> None:
    err = _error(make_chat(messages=[{"role": "user", "content": [{"text": "x"}]}]))
    assert err.param == "messages[0].content[0]"


def test_max_tokens_string() -> None:
    err = _error(make_chat(max_tokens="10"))
    assert err.param == "max_tokens"
    assert err.message == (
        '\'max_tokens\' must be an integer, got string "10". Send it as e.g. "max_tokens": 16.'
    )


@pytest.mark.parametrize("value", [1.5, True, [1]])
def test_max_tokens_other_wrong_types(value: Any) -> None:
    assert _error(make_chat(max_tokens=value)).param == "max_tokens"


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [0, -5])
def test_non_positive_max_tokens_vllm_wording(key: str, value: int) -> None:
    err = _error(make_chat(**{key: value}))
    assert err.param == key
    assert err.message == f"{key} must be at least 1, got {value}. (parameter={key}, value={value})"


def test_max_tokens_zero_matches_vllm_body() -> None:
    ex = _example(
        "/v1/completions",
        lambda e: (
            e["response"].get("error", {}).get("param") == "max_tokens"
            and "at least 1" in e["response"]["error"]["message"]
        ),
    )
    # vLLM reaches this through its clamp (prompt == window); kvroute through validation of
    # an explicit 0. Same text, type, param and code.
    err = _error(make_completion(max_tokens=0), "completions")
    assert json.loads(err.body()) == ex["response"]
    assert err.status == ex["status"]


@pytest.mark.parametrize(
    "field,value",
    [
        ("stream", "yes"),
        ("stream_options", True),
        ("n", 0),
        ("n", "2"),
        ("tools", {}),
        ("user", 5),
        ("session_id", 5),
        ("vllm_xargs", []),
    ],
)
def test_wrong_types_name_the_field(field: str, value: Any) -> None:
    err = _error(make_chat(**{field: value}))
    assert err.param == field
    assert err.status == 400


def test_include_usage_wrong_type() -> None:
    err = _error(make_chat(stream=True, stream_options={"include_usage": "yes"}))
    assert err.param == "stream_options.include_usage"


@pytest.mark.parametrize(
    "prompt", [[], [1, "a"], [[1], []], [-1], [True], [1.5], {}, 3, [[1, "x"]]]
)
def test_bad_prompts(prompt: Any) -> None:
    err = _error(make_completion(prompt=prompt), "completions")
    assert err.param == "prompt"


# ---------------------------------------------------------------------------- cache_salt


def test_cache_salt_error_is_vllms_exact_body() -> None:
    ex = _example("/v1/chat/completions", lambda e: "cache_salt" in e["request"])
    err = _error(json.dumps(ex["request"]).encode())
    assert err.status == ex["status"] == 400
    assert json.loads(err.body()) == ex["response"]


@pytest.mark.parametrize("salt", ["", "a" * 129, "a@b", "a/b", "a\\b", "a\x00b", 5, ["x"]])
def test_cache_salt_rejected(salt: Any) -> None:
    err = _error(make_chat(cache_salt=salt))
    assert err.param == "cache_salt"
    assert err.message.startswith("Parameter 'cache_salt' must be at most 128 characters")


@pytest.mark.parametrize("salt", ["a", "a" * 128, "tenant-A_1.b:c", "é"])
def test_cache_salt_accepted(salt: str) -> None:
    assert parse_request(make_chat(cache_salt=salt), "chat").cache_salt == salt


# ---------------------------------------------------------------------------- error bodies


def test_not_found_body_matches_vllm() -> None:
    ex = _example("/v1/chat/completions", lambda e: e["status"] == 404)
    body = oa.error_body(ex["response"]["error"]["message"], status=404, param="model")
    assert body == json.dumps(ex["response"], separators=(",", ":")).encode()


def test_every_vllm_error_example_round_trips_through_error_body() -> None:
    for ex in _http_examples():
        error = ex["response"].get("error") if isinstance(ex["response"], dict) else None
        if error is None:
            continue
        body = oa.error_body(error["message"], status=ex["status"], param=error["param"])
        assert json.loads(body) == ex["response"], ex["path"]


def test_error_body_field_order_and_openai_code() -> None:
    body = oa.error_body("too long", type="invalid_request_error", param="messages",
                         code="context_length_exceeded")  # fmt: skip
    assert body == (
        b'{"error":{"message":"too long","type":"invalid_request_error",'
        b'"param":"messages","code":"context_length_exceeded"}}'
    )


@pytest.mark.parametrize(
    "status,kind", [(400, "BadRequestError"), (404, "NotFoundError"), (500, "InternalServerError"),
                    (418, "BadRequestError"), (599, "InternalServerError")],
)  # fmt: skip
def test_error_type_for_status(status: int, kind: str) -> None:
    assert oa.error_type_for_status(status) == kind


def test_request_error_is_a_router_error() -> None:
    from kvroute.core.errors import RouterError

    assert issubclass(RequestError, RouterError)


# ---------------------------------------------------------------------------- re-encoding

KEEP = {
    "temperature": 0.7,
    "top_p": 0.95,
    "seed": 123456789012345678,
    "logit_bias": {"50256": -100},
    "chat_template_kwargs": {"enable_thinking": False},
    "unknown_vendor_field": {"nested": [1, 2.5, None, "ü"]},
}


def test_encode_without_changes_keeps_everything() -> None:
    raw = make_chat(**KEEP)
    req = parse_request(raw, "chat")
    out = oa.encode_request(req)
    assert json.loads(out) == json.loads(raw)
    assert list(json.loads(out)) == list(json.loads(raw))


def test_clamp_lowers_present_fields_in_place() -> None:
    req = parse_request(make_chat(max_tokens=500, max_completion_tokens=400, **KEEP), "chat")
    out = json.loads(oa.encode_request(req, max_tokens=100))
    assert (out["max_tokens"], out["max_completion_tokens"]) == (100, 100)
    original = json.loads(make_chat(max_tokens=500, max_completion_tokens=400, **KEEP))
    assert list(out) == list(original)
    assert {k: v for k, v in out.items() if not k.startswith("max_")} == {
        k: v for k, v in original.items() if not k.startswith("max_")
    }
    assert req.body["max_tokens"] == 500, "the parsed body must not be mutated"


def test_clamp_never_raises_a_smaller_limit() -> None:
    req = parse_request(make_chat(max_tokens=50), "chat")
    assert json.loads(oa.encode_request(req, max_tokens=100))["max_tokens"] == 50


def test_clamp_adds_max_tokens_when_absent() -> None:
    req = parse_request(make_chat(), "chat")
    out = json.loads(oa.encode_request(req, max_tokens=64))
    assert list(out)[-1] == "max_tokens" and out["max_tokens"] == 64


def test_clamp_rejects_zero() -> None:
    req = parse_request(make_chat(), "chat")
    with pytest.raises(ValueError, match="at least 1"):
        oa.encode_request(req, max_tokens=0)


def test_inject_salt_model_and_extra_fields() -> None:
    req = parse_request(make_chat(stream=True, stream_options={"include_usage": True}), "chat")
    out = json.loads(
        oa.encode_request(
            req,
            cache_salt="t1",
            model="served",
            stream=False,
            set_fields={"priority": 1},
            remove_fields=["user"],
        )
    )
    assert out["cache_salt"] == "t1" and out["model"] == "served" and out["priority"] == 1
    assert out["stream"] is False and "stream_options" not in out


def test_inject_invalid_salt_raises_request_error() -> None:
    req = parse_request(make_chat(), "chat")
    with pytest.raises(RequestError):
        oa.encode_request(req, cache_salt="a/b")


def test_warm_request_body() -> None:
    raw = make_chat(
        max_completion_tokens=900, n=3, stream=True, stream_options={"include_usage": True},
        cache_salt="s", tools=[{"type": "function", "function": {"name": "f"}}], **KEEP,
    )  # fmt: skip
    req = parse_request(raw, "chat")
    warm = json.loads(oa.warm_request_body(req, model="large"))
    original = json.loads(raw)
    assert warm["max_completion_tokens"] == 1 and "max_tokens" not in warm
    assert warm["n"] == 1 and warm["stream"] is False and "stream_options" not in warm
    assert warm["model"] == "large"
    for key in ("messages", "cache_salt", "tools", *KEEP):
        assert warm[key] == original[key]


def test_warm_request_body_adds_max_tokens() -> None:
    req = parse_request(make_completion(), "completions")
    warm = json.loads(oa.warm_request_body(req))
    assert warm == {"model": "m", "prompt": "hi", "max_tokens": 1, "stream": False}



def test_warm_chunk_body_is_a_token_id_completion_of_the_prefix() -> None:
    body = json.loads(oa.warm_chunk_body((5, 6, 7), model="large", cache_salt="tenant-a"))
    assert body == {"model": "large", "prompt": [5, 6, 7], "max_tokens": 1, "stream": False,
                    "cache_salt": "tenant-a"}
    # vLLM reads a list of ints as one token-id prompt: the router reads it back the same way.
    parsed = parse_request(oa.warm_chunk_body([5, 6, 7], model="m", cache_salt=None),
                           "completions")
    assert parsed.prompt == [5, 6, 7] and parsed.cache_salt is None and parsed.max_tokens == 1


def test_warm_chunk_body_rejects_an_empty_prefix_and_a_bad_salt() -> None:
    with pytest.raises(ValueError, match="at least one token id"):
        oa.warm_chunk_body([], model="m", cache_salt=None)
    with pytest.raises(RequestError, match="cache_salt"):
        oa.warm_chunk_body([1], model="m", cache_salt="a/b")


# ---------------------------------------------------------------------------- sessions


@pytest.mark.parametrize(
    "headers,expected,source",
    [
        ({"X-LiteLLM-Trace-Id": "t1", "x-litellm-session-id": "s1"}, "t1", "header:x-litellm-trace-id"),
        ({"x-session-id": "plain1234", "X-LiteLLM-Session-Id": "lite"}, "lite", "header:x-litellm-session-id"),
        ({"x-session-id": "plain1234", "X-Claude-Code-Session-Id": "abcd-1234"}, "abcd-1234",
         "header:x-claude-code-session-id"),
        # A vendor header whose value fails ^[A-Za-z0-9_-]{8,}$ is skipped.
        ({"x-claude-code-session-id": "short", "x-session-id": "plain"}, "plain", "header:x-session-id"),
        ({"x-claude-code-session-id": "has space!", "x-session-id": "p"}, "p", "header:x-session-id"),
        ({"session_id": "codex-1", "User-Agent": "codex_cli_rs/0.1"}, "codex-1", "header:session_id"),
        ({"session_id": "not-codex", "User-Agent": "curl/8"}, None, None),
        ({"baggage": "userId=x, session.id=bag-1;prop=1"}, "bag-1", "header:baggage"),
        ({}, None, None),
    ],
)  # fmt: skip
def test_session_headers_order(
    headers: dict[str, str], expected: str | None, source: str | None
) -> None:
    ref = oa.session_from_request(headers)
    if expected is None:
        assert ref is None
    else:
        assert ref == oa.SessionRef(expected, source or "")


def test_two_vendor_headers_pick_by_name_order() -> None:
    ref = oa.session_from_request(
        {"x-zeta-session-id": "zzzzzzzz", "x-alpha-session-id": "aaaaaaaa"}
    )
    assert ref == oa.SessionRef("aaaaaaaa", "header:x-alpha-session-id")


def test_session_headers_as_pairs() -> None:
    ref = oa.session_from_request([("X-Session-Id", "first"), ("x-session-id", "second")])
    assert ref == oa.SessionRef("first", "header:x-session-id")


def test_session_from_body_order() -> None:
    body = {"metadata": {"user_id": "user_ab_account_cd_session_sess-9", "session_id": "m"},
            "session_id": "b", "user": "u"}  # fmt: skip
    assert oa.session_from_request({}, body) == oa.SessionRef("sess-9", "body:metadata.user_id")
    body["metadata"] = {"session_id": "m"}
    assert oa.session_from_request({}, body) == oa.SessionRef("m", "body:metadata.session_id")
    del body["metadata"]
    assert oa.session_from_request({}, body) == oa.SessionRef("b", "body:session_id")
    del body["session_id"]
    assert oa.session_from_request({}, body) == oa.SessionRef("u", "body:user")
    assert oa.session_from_request({}, body, use_user=False) is None


def test_header_beats_body() -> None:
    ref = oa.session_from_request({"x-session-id": "h"}, {"session_id": "b"})
    assert ref == oa.SessionRef("h", "header:x-session-id")


# ---------------------------------------------------------------------------- /v1/models


def test_models_response_matches_vllm() -> None:
    ex = _example("/v1/models", lambda e: True)
    card = ex["response"]["data"][0]
    built = oa.models_response([
        oa.model_card(id=card["id"], created=card["created"], max_model_len=card["max_model_len"],
                      permission_id=card["permission"][0]["id"], root=card["root"])
    ])  # fmt: skip
    assert msgspec.json.encode(built) == json.dumps(ex["response"], separators=(",", ":")).encode()
