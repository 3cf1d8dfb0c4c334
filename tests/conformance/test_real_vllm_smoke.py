"""First conformance checks against a real vLLM 0.32.0 CPU engine (tiny random Llama).

What a router relies on, checked on the real thing rather than on our reading of the source:

1. discovery: ``/v1/models`` carries ``max_model_len``; ``/metrics`` carries the block size and
   hash algorithm in ``vllm:cache_config_info`` and the prefix-cache hit counter;
2. hash parity: ``BlockStored`` hashes on the ZMQ stream equal ``kvroute.core.hashing`` of the
   ``/tokenize`` ids (plain and with ``cache_salt``), decoded with ``kvroute.wire.vllm_events``,
   and the replay socket returns the same bytes;
3. prefix caching: a shared ~900-token system prompt gives exactly its whole-block tokens as
   ``vllm:prefix_cache_hits_total``;
4. overflow: an over-long prompt gives the exact 400 body of
   docs/reference/vllm-engine-contract.md §3.1.

Engines come from the session fixtures in ``conftest.py`` (started once, in parallel). Every
request uses a fresh nonce at the start of its first message, so no test depends on what an
earlier test left in the cache.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
import realvllm
from realvllm import RealVllmEngine, chat, http_json, http_text, metric_samples, metric_total

from kvroute.core.events import BlockStored, EventBatch
from kvroute.core.hashing import BlockHasher
from kvroute.wire.vllm_events import decode_message, decode_replay_reply

pytestmark = pytest.mark.realvllm

BLOCK = realvllm.CPU_BLOCK_SIZE
WINDOW = realvllm.DEFAULT_MAX_MODEL_LEN




def _wait_for_change(read: Any, before: float, timeout_s: float = 10.0) -> float:
    """Poll a counter until it differs from ``before`` (metrics lag the HTTP answer slightly)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = float(read())
        if value != before or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------
# 1. discovery
# ---------------------------------------------------------------------------------------------


def test_models_and_metrics_expose_window_block_size_and_hash_algo(
    real_vllm_pair: list[RealVllmEngine],
) -> None:
    for engine in real_vllm_pair:
        status, models = http_json("GET", engine.url + "/v1/models")
        assert status == 200, models
        (card,) = models["data"]
        assert card["id"] == engine.model
        assert card["max_model_len"] == WINDOW
        assert card["root"] == str(engine.model_dir)

        metrics = http_text(engine.url + "/metrics")
        (info,) = [labels for labels, _ in metric_samples(metrics, "vllm:cache_config_info")]
        assert info["block_size"] == str(BLOCK), info
        assert info["prefix_caching_hash_algo"] == "sha256", info
        assert info["enable_prefix_caching"] == "True", info
        hits = metric_samples(metrics, "vllm:prefix_cache_hits_total")
        assert hits, "vllm:prefix_cache_hits_total missing from /metrics"
        assert all(labels.get("model_name") == engine.model for labels, _ in hits)


# ---------------------------------------------------------------------------------------------
# 2. hash parity on the live KV-event stream
# ---------------------------------------------------------------------------------------------


def _stored_blocks(messages: list[list[bytes]]) -> tuple[list[EventBatch], list[BlockStored]]:
    batches = [decode_message(frames) for frames in messages]
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    return batches, stored


@pytest.mark.parametrize("cache_salt", [None, "tenant-a-salt"], ids=["plain", "salted"])
def test_block_stored_hashes_equal_kvroute_hashes(
    real_vllm_engine: RealVllmEngine, cache_salt: str | None
) -> None:
    engine = real_vllm_engine
    messages = [
        {"role": "system", "content": f"Nonce {realvllm.nonce()}. " + realvllm.filler_text(1, 40)},
        {"role": "user", "content": realvllm.filler_text(2, 20)},
    ]
    prompt_ids = realvllm.tokenize_chat(engine, messages)
    assert len(prompt_ids) >= 3 * BLOCK, f"prompt too short for 3 blocks: {len(prompt_ids)}"
    num_prompt_blocks = len(prompt_ids) // BLOCK

    params: dict[str, Any] = {"max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
    if cache_salt is not None:
        params["cache_salt"] = cache_salt
    with realvllm.EventTap(engine) as tap:
        tap.wait_live()
        resp = chat(engine, messages, **params)
        # /tokenize (chat form) and the completion agree on the prompt ids
        # (docs/reference/vllm-engine-contract.md §3.3).
        assert resp["prompt_token_ids"] == prompt_ids
        output_ids = resp["choices"][0]["token_ids"]
        assert len(output_ids) == 8
        # Hashing runs over prompt + generated tokens; blocks filled by decode are stored too,
        # except that the last sampled token is never computed, so it cannot complete a block.
        all_ids = prompt_ids + output_ids
        num_expected_blocks = (len(all_ids) - 1) // BLOCK
        tap.collect_until(
            lambda msgs: (
                sum(len(s.block_hashes) for s in _stored_blocks(msgs)[1]) >= num_expected_blocks
            )
        )
        tap.drain(wait_s=0.3)  # anything else this request caused
    batches, stored = _stored_blocks(tap.messages)

    seqs = [b.seq for b in batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"gap in live seqs {seqs}"
    assert all(frames[0] == engine.topic.encode() for frames in tap.messages)

    hasher = BlockHasher(algo="sha256", block_size=BLOCK)
    expected = hasher.wire_hashes(all_ids, cache_salt=cache_salt)
    got = [h for s in stored for h in s.block_hashes]
    assert len(got) == num_expected_blocks >= num_prompt_blocks
    assert got == expected[: len(got)]
    assert [t for s in stored for t in s.token_ids] == all_ids[: len(got) * BLOCK]
    assert stored[0].parent_block_hash is None
    for prev, cur in itertools.pairwise(stored):
        assert cur.parent_block_hash == prev.block_hashes[-1]
    assert {s.block_size for s in stored} == {BLOCK}
    assert {s.medium for s in stored} == {"GPU"}
    extra = [k for s in stored for k in (s.extra_keys or (None,) * len(s.block_hashes))]
    if cache_salt is None:
        assert extra == [None] * len(got)
    else:  # the salt enters block 0 only, untagged on the wire (contract §1.6/§2.4 in
        # docs/reference/vllm-engine-contract.md)
        first = extra[0]
        assert isinstance(first, list | tuple) and list(first) == [cache_salt], first
        assert extra[1:] == [None] * (len(got) - 1)
    # Hashes without the salt differ from block 0 on: the salt isolates tenants.
    if cache_salt is not None:
        unsalted = hasher.wire_hashes(all_ids)
        assert all(a != b for a, b in zip(got, unsalted, strict=False))

    # The replay socket returns the very bytes that were published live.
    live = {b.seq: frames[2] for b, frames in zip(batches, tap.messages, strict=True)}
    replies = realvllm.replay(engine, start_seq=seqs[0])
    replayed = {}
    for frames in replies:
        reply = decode_replay_reply(frames)
        assert getattr(reply, "topic", None) == engine.topic.encode()
        replayed[int.from_bytes(frames[2], "big")] = frames[3]
    assert {seq: replayed.get(seq) for seq in live} == live


# ---------------------------------------------------------------------------------------------
# 3. prefix-cache hits
# ---------------------------------------------------------------------------------------------


def test_shared_system_prompt_hits_its_whole_blocks(real_vllm_other: RealVllmEngine) -> None:
    engine = real_vllm_other
    system = {"role": "system", "content": f"Nonce {realvllm.nonce()}. " + realvllm.filler_text(3, 40)}  # ~935 tokens
    first = [system, {"role": "user", "content": "First question about the harbour."}]
    second = [system, {"role": "user", "content": "A different question about lamps."}]
    ids1 = realvllm.tokenize_chat(engine, first)
    ids2 = realvllm.tokenize_chat(engine, second)
    common = next(i for i, (a, b) in enumerate(zip(ids1, ids2, strict=False)) if a != b)
    # Hits are whole blocks of the shared prefix, never covering a request's last token.
    expected_hits = min(common, len(ids2) - 1) // BLOCK * BLOCK
    assert expected_hits == 896, f"fixture drift: shared prefix {common} tokens"

    def hits() -> float:
        return metric_total(engine, "vllm:prefix_cache_hits_total")

    def queries() -> float:
        return metric_total(engine, "vllm:prefix_cache_queries_total")

    h0, q0 = hits(), queries()
    chat(engine, first, max_tokens=1)
    q1 = _wait_for_change(queries, q0)
    h1 = hits()
    assert (q1 - q0, h1 - h0) == (len(ids1), 0)

    chat(engine, second, max_tokens=1)
    q2 = _wait_for_change(queries, q1)
    h2 = _wait_for_change(hits, h1)
    assert (q2 - q1, h2 - h1) == (len(ids2), expected_hits)


# ---------------------------------------------------------------------------------------------
# 4. context overflow
# ---------------------------------------------------------------------------------------------


def _overflow_body(num_tokens: int, at_least: bool) -> dict[str, Any]:
    qualifier = "at least " if at_least else ""
    return {
        "error": {
            "message": (
                f"This model's maximum context length is {WINDOW} tokens. However, your prompt "
                f"contains {qualifier}{num_tokens} input tokens, which exceeds this limit even "
                "without any output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={num_tokens})"
            ),
            "type": "BadRequestError",
            "param": "input_tokens",
            "code": 400,
        }
    }


def test_over_long_chat_prompt_gives_the_exact_400(real_vllm_engine: RealVllmEngine) -> None:
    engine = real_vllm_engine
    messages = [{"role": "user", "content": realvllm.filler_text(4, 260)}]
    assert len(realvllm.tokenize_chat(engine, messages)) > WINDOW + 1
    body = {"model": engine.model, "messages": messages, "max_tokens": 4}
    status, resp = http_json("POST", engine.url + "/v1/chat/completions", body)
    # Text prompts are tokenized with truncation to max_model_len + 1: "at least 2049".
    assert (status, resp) == (400, _overflow_body(WINDOW + 1, at_least=True))


def test_over_long_token_prompt_reports_its_true_length(real_vllm_engine: RealVllmEngine) -> None:
    engine = real_vllm_engine
    prompt = [300] * (WINDOW + 52)
    body = {"model": engine.model, "prompt": prompt, "max_tokens": 4}
    status, resp = http_json("POST", engine.url + "/v1/completions", body)
    assert (status, resp) == (400, _overflow_body(WINDOW + 52, at_least=False))
