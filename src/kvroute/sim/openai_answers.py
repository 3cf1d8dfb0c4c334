"""The bodies a simulated vLLM engine answers with, in vLLM 0.32's field names and order.

Owns the engine side of the OpenAI-compatible API: ``UsageInfo`` (``usage``), the
``chat.completion`` and ``text_completion`` objects and their streamed chunks, the usage
chunk, and the ``/tokenize`` and ``/detokenize`` bodies, plus ``encode_json``, the compact
order-keeping encoder every one of them goes through. Shapes follow
``tests/data/vllm-vectors-0.32.json`` (``http_examples_v0_32``).

Why here and not in ``wire/openai.py``: the router never builds these answers, it relays the
engine's bytes. Only the simulated engine (``sim/server.py``) does, so they sit with it. The
``/v1/models`` card and list stay in ``wire.openai``: the router serves its own.

Pure: no I/O, no clock, no randomness. Ids and ``created`` are passed in by the caller.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import msgspec

__all__ = [
    "chat_chunk",
    "chat_completion_response",
    "chat_usage_chunk",
    "completion_chunk",
    "completion_response",
    "detokenize_response",
    "encode_json",
    "tokenize_response",
    "usage",
]

_JSON_ENCODER: Final = msgspec.json.Encoder()


def encode_json(obj: Any) -> bytes:
    """Compact JSON, key order preserved (what every builder here is meant to go through)."""
    return _JSON_ENCODER.encode(obj)


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    *,
    cached_tokens: int | None = None,
    full: bool = True,
    reasoning_tokens: int | None = None,
) -> dict[str, Any]:
    """vLLM's ``UsageInfo``.

    Args:
        prompt_tokens: prompt length in tokens.
        completion_tokens: generated tokens.
        cached_tokens: prefix-cache hits; when given, ``prompt_tokens_details`` is
            ``{"cached_tokens": n}`` (vLLM with ``--enable-prompt-tokens-details``).
        full: the non-streamed form (``model_dump``: every field, nulls included, as in the
            0.32 vectors). False gives the streamed usage chunk's form (``exclude_unset``:
            only the fields vLLM sets).
        reasoning_tokens: with a reasoning parser, the thinking tokens among the completion
            tokens (``completion_tokens_details.reasoning_tokens``).
    """
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    details = {"cached_tokens": cached_tokens} if cached_tokens is not None else None
    thinking = {"reasoning_tokens": reasoning_tokens} if reasoning_tokens is not None else None
    if full:
        out["prompt_tokens_details"] = details
        out["completion_tokens_details"] = thinking
    else:
        if details is not None:
            out["prompt_tokens_details"] = details
        if thinking is not None:
            out["completion_tokens_details"] = thinking
    return out


def chat_completion_response(
    *,
    id: str,
    created: int,
    model: str,
    content: str | None,
    finish_reason: str | None,
    usage_info: Mapping[str, Any],
    stop_reason: int | str | None = None,
    prompt_token_ids: list[int] | None = None,
    token_ids: list[int] | None = None,
    reasoning: str | None = None,
) -> dict[str, Any]:
    """A non-streamed ``chat.completion`` object with one choice, in vLLM's field order.

    ``reasoning`` is what a reasoning parser split off the text (vLLM 0.32 names it
    ``message.reasoning``; ``reasoning_content`` is only accepted, renamed, in requests).
    """
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": [],
        "reasoning": reasoning,
    }
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "token_ids": token_ids,
    }
    return {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": dict(usage_info),
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_token_ids,
        "kv_transfer_params": None,
    }


def chat_chunk(
    *,
    id: str,
    created: int,
    model: str,
    content: str | None = None,
    role: str | None = None,
    finish_reason: str | None = None,
    stop_reason: int | str | None = None,
    final: bool = False,
    index: int = 0,
    reasoning: str | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``, with the fields vLLM sets (it dumps ``exclude_unset``).

    The first chunk carries ``role="assistant", content=""``; content chunks carry
    ``content``; thinking chunks (with a reasoning parser) carry ``reasoning``, and the
    chunk where the thinking ends carries both, in ``DeltaMessage``'s order (``content``
    first); the last chunk (``final=True``) carries ``finish_reason`` and ``stop_reason``.
    """
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta["reasoning"] = reasoning
    choice: dict[str, Any] = {
        "index": index,
        "delta": delta,
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    if final:
        choice["stop_reason"] = stop_reason
    return {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def chat_usage_chunk(
    *, id: str, created: int, model: str, usage_info: Mapping[str, Any], chat: bool = True
) -> dict[str, Any]:
    """The last chunk sent when ``stream_options.include_usage`` is true: no choices."""
    return {
        "id": id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": dict(usage_info),
    }


def completion_response(
    *,
    id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    usage_info: Mapping[str, Any],
    stop_reason: int | str | None = None,
    prompt_token_ids: list[int] | None = None,
    token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """A non-streamed ``text_completion`` object with one choice, in vLLM's field order."""
    choice = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "token_ids": token_ids,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_token_ids,
    }
    return {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": dict(usage_info),
        "kv_transfer_params": None,
    }


def completion_chunk(
    *,
    id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None = None,
    stop_reason: int | str | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk (vLLM sets all four choice fields)."""
    return {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        ],
    }


def tokenize_response(
    tokens: Sequence[int], *, max_model_len: int, token_strs: Sequence[str] | None = None
) -> dict[str, Any]:
    """The ``/tokenize`` body (no length check: counts above ``max_model_len`` are fine)."""
    return {
        "count": len(tokens),
        "max_model_len": max_model_len,
        "tokens": list(tokens),
        "token_strs": list(token_strs) if token_strs is not None else None,
    }


def detokenize_response(prompt: str) -> dict[str, Any]:
    """The ``/detokenize`` body."""
    return {"prompt": prompt}
