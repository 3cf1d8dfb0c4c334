"""sim/openai_answers.py: the engine's answer bodies against vLLM 0.32's vectors and field order."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from kvroute.sim import openai_answers as answers

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


def test_completion_usage_matches_vllm_shape() -> None:
    ex = _example("/v1/completions", lambda e: e["status"] == 200)
    expected = ex["response"]["usage"]
    got = answers.usage(120, 8)
    assert got == expected
    assert list(got) == list(expected), "field order must match vLLM's"
    resp = answers.completion_response(id="cmpl-1", created=1, model="tiny", text="x",
                                       finish_reason="length", usage_info=got)  # fmt: skip
    assert resp["usage"] == expected
    assert resp["choices"][0]["finish_reason"] == ex["response"]["finish_reason"]


def test_usage_cached_tokens_and_stream_form() -> None:
    assert answers.usage(10, 2, cached_tokens=8)["prompt_tokens_details"] == {"cached_tokens": 8}
    assert answers.usage(10, 2, full=False) == {
        "prompt_tokens": 10,
        "total_tokens": 12,
        "completion_tokens": 2,
    }
    assert answers.usage(10, 2, cached_tokens=0, full=False)["prompt_tokens_details"] == {
        "cached_tokens": 0
    }


def test_chat_completion_response_order() -> None:
    resp = answers.chat_completion_response(
        id="chatcmpl-1", created=5, model="m", content="hello", finish_reason="stop",
        usage_info=answers.usage(3, 1),
    )  # fmt: skip
    assert list(resp) == [
        "id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
        "usage", "prompt_logprobs", "prompt_token_ids", "kv_transfer_params",
    ]  # fmt: skip
    assert resp["object"] == "chat.completion"
    choice = resp["choices"][0]
    assert list(choice) == [
        "index",
        "message",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "token_ids",
    ]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"] == "hello"


def test_stream_chunks() -> None:
    first = answers.chat_chunk(id="c", created=1, model="m", role="assistant", content="")
    assert first["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    last = answers.chat_chunk(
        id="c", created=1, model="m", content="", finish_reason="length", final=True
    )
    assert (
        last["choices"][0]["finish_reason"] == "length"
        and last["choices"][0]["stop_reason"] is None
    )
    usage_chunk = answers.chat_usage_chunk(
        id="c", created=1, model="m", usage_info=answers.usage(1, 1, full=False)
    )
    assert usage_chunk["choices"] == [] and usage_chunk["object"] == "chat.completion.chunk"
    text = answers.completion_chunk(id="cmpl", created=1, model="m", text="a")
    assert text["object"] == "text_completion"
    assert list(text["choices"][0]) == ["index", "text", "logprobs", "finish_reason", "stop_reason"]


def test_tokenize_responses_match_vllm() -> None:
    for ex in _http_examples():
        if ex["path"] == "/tokenize":
            resp = ex["response"]
            built = answers.tokenize_response(resp["tokens"], max_model_len=resp["max_model_len"],
                                              token_strs=resp["token_strs"])  # fmt: skip
            assert (
                answers.encode_json(built)
                == json.dumps(resp, separators=(",", ":"), ensure_ascii=False).encode()
            )
        if ex["path"] == "/detokenize":
            assert answers.detokenize_response(ex["response"]["prompt"]) == ex["response"]


def test_encode_json_is_compact_and_ordered() -> None:
    assert answers.encode_json({"b": 1, "a": [1.5, None]}) == b'{"b":1,"a":[1.5,null]}'
    assert msgspec.json.decode(answers.encode_json(answers.usage(1, 2))) == answers.usage(1, 2)


def test_reasoning_goes_where_vllm_032_puts_it() -> None:
    """``message.reasoning`` (not ``reasoning_content``); a delta's ``content`` comes first."""
    body = answers.chat_completion_response(
        id="c", created=1, model="m", content=None, finish_reason="length",
        usage_info=answers.usage(2, 3, reasoning_tokens=3), reasoning="let me see")
    message = body["choices"][0]["message"]
    assert message["reasoning"] == "let me see" and message["content"] is None
    assert "reasoning_content" not in message
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
    chunk = answers.chat_chunk(id="c", created=1, model="m", content="4", reasoning=" so")
    assert list(chunk["choices"][0]["delta"].items()) == [("content", "4"), ("reasoning", " so")]
    only = answers.chat_chunk(id="c", created=1, model="m", reasoning="hm")
    assert only["choices"][0]["delta"] == {"reasoning": "hm"}
