"""The simulated vLLM server over real HTTP and ZMQ on loopback (in this process's loop).

Each test builds exactly the server it needs (``SimServer`` as an async context manager), talks
to it with aiohttp and ZMQ, and is bounded in time. KV events are read through the replay
socket where possible (deterministic: no PUB/SUB slow-joiner window); the live PUB path is
checked against the replay copy.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from kvroute.core.errors import ConfigError
from kvroute.core.events import AllBlocksCleared, BlockStored, EventBatch
from kvroute.core.hashing import BlockHasher
from kvroute.engine.model import StepTiming
from kvroute.sim.server import SimServer, SimServerConfig
from kvroute.tokenize.sim_vocab import BuiltinTokenizer
from kvroute.tokenize.words import to_text
from kvroute.wire import openai as oa
from kvroute.wire.overflow_styles import STYLES, check_overflow, style_rejects_overlong_total
from kvroute.wire.prom import parse_exposition, parse_vllm_metrics
from kvroute.wire.sse import SSEDecoder
from kvroute.wire.vllm_events import (
    ReplayBatch,
    ReplayEnd,
    decode_message,
    decode_replay_reply,
    encode_replay_request,
)

pytestmark = pytest.mark.integration

TEST_SECONDS = 8.0


def config(**kw: Any) -> SimServerConfig:
    base: dict[str, Any] = {"model": "tiny", "max_model_len": 128, "block_size": 16,
                                "num_gpu_blocks": 256, "kv_replay": "tcp://127.0.0.1:0",
                                "enable_prompt_tokens_details": True}
    base.update(kw)
    return SimServerConfig(**base)


def run(cfg: SimServerConfig, body: Callable[[SimServer, aiohttp.ClientSession], Awaitable[None]]) -> None:
    async def main() -> None:
        async with SimServer(cfg) as server, aiohttp.ClientSession() as session:
            await body(server, session)

    asyncio.run(asyncio.wait_for(main(), TEST_SECONDS))


async def post(session: aiohttp.ClientSession, server: SimServer, path: str,
               body: dict[str, Any]) -> tuple[int, Any]:
    async with session.post(server.url + path, json=body) as resp:
        raw = await resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw.decode()


async def stream_events(session: aiohttp.ClientSession, server: SimServer, path: str,
                        body: dict[str, Any]) -> list[Any]:
    decoder = SSEDecoder()
    events = []
    async with session.post(server.url + path, json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        async for chunk in resp.content.iter_any():
            events.extend(decoder.feed(chunk))
    events.extend(decoder.flush())
    assert events[-1].is_done
    return [e.json() for e in events[:-1]]


async def replay_all(server: SimServer, start: int = 0) -> list[EventBatch]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        assert server.kv_replay_endpoint is not None
        sock.connect(server.kv_replay_endpoint)
        await sock.send_multipart(encode_replay_request(start))
        out: list[EventBatch] = []
        for _ in range(10_000):
            reply = decode_replay_reply(await asyncio.wait_for(sock.recv_multipart(), 3.0))
            if isinstance(reply, ReplayEnd):
                return out
            assert isinstance(reply, ReplayBatch) and reply.topic == b"kv"
            out.append(reply.batch)
        raise AssertionError("replay never ended")
    finally:
        sock.close()
        ctx.term()


async def settled_replay(server: SimServer, count: int) -> list[EventBatch]:
    """Replay until at least ``count`` batches are buffered (the publisher thread is async)."""
    for _ in range(100):
        batches = await replay_all(server)
        if len(batches) >= count:
            return batches
        await asyncio.sleep(0.02)
    raise AssertionError(f"fewer than {count} batches were ever buffered")


def stored(batches: list[EventBatch]) -> list[BlockStored]:
    return [e for b in batches for e in b.events if isinstance(e, BlockStored)]


# ------------------------------------------------------------------------------ generation


def test_chat_and_completions_unary_and_streamed_with_usage() -> None:
    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        msgs = [{"role": "user", "content": to_text(range(200, 230))}]
        status, chat = await post(s, server, "/v1/chat/completions",
                                  {"model": "tiny", "messages": msgs, "max_tokens": 5, "seed": 3})
        assert status == 200 and chat["object"] == "chat.completion"
        assert chat["id"].startswith("chatcmpl-")
        choice = chat["choices"][0]
        assert choice["finish_reason"] == "length"
        assert len(choice["message"]["content"].split()) == 5
        assert chat["usage"]["completion_tokens"] == 5
        assert chat["usage"]["prompt_tokens"] == 30 + 5  # 30 words + ChatML wrapping

        status, comp = await post(s, server, "/v1/completions",
                                  {"model": "tiny", "prompt": list(range(200, 240))})
        assert status == 200 and comp["object"] == "text_completion"
        assert comp["usage"]["completion_tokens"] == 16  # vLLM's completions default
        assert comp["usage"]["prompt_tokens"] == 40

        events = await stream_events(s, server, "/v1/chat/completions", {
            "model": "tiny", "messages": msgs, "max_tokens": 4, "stream": True, "seed": 3,
            "stream_options": {"include_usage": True}})
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        content = [e["choices"][0]["delta"]["content"] for e in events[1:-1]]
        assert len(content) == 4
        assert "".join(content) == " ".join(choice["message"]["content"].split()[:4])
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4

        events = await stream_events(s, server, "/v1/completions", {
            "model": "tiny", "prompt": "hello world", "max_tokens": 3, "stream": True})
        assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, "length"]
        assert all("usage" not in e for e in events)

    run(config(), body)


def test_same_request_gives_same_text_and_seed_changes_it() -> None:
    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        req = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 6, "seed": 1}
        _, a = await post(s, server, "/v1/completions", req)
        _, b = await post(s, server, "/v1/completions", req)
        _, c = await post(s, server, "/v1/completions", req | {"seed": 2})
        assert a["choices"][0]["text"] == b["choices"][0]["text"] != c["choices"][0]["text"]

    run(config(), body)


def test_repeated_prompt_reports_cached_tokens_and_metrics_count_hits() -> None:
    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        req = {"model": "tiny", "prompt": list(range(300, 370)), "max_tokens": 1}
        _, first = await post(s, server, "/v1/completions", req)
        _, second = await post(s, server, "/v1/completions", req)
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}
        async with s.get(server.url + "/metrics") as resp:
            text = await resp.text()
        m = parse_vllm_metrics(text, "tiny")
        assert m.prefix_cache_queries_total == 140
        assert m.prefix_cache_hits_total == 64
        assert m.block_size == 16 and m.prefix_caching_hash_algo == "sha256"
        assert m.enable_prefix_caching is True and m.num_malformed == 0
        assert m.num_requests_running == 0 and m.num_requests_waiting == 0
        assert "vllm:time_to_first_token_seconds_count{" in text
        assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 2.0' in text

    run(config(), body)


def test_usage_has_no_prompt_details_unless_enabled() -> None:
    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        _, out = await post(s, server, "/v1/completions",
                            {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1})
        assert out["usage"]["prompt_tokens_details"] is None

    run(config(enable_prompt_tokens_details=False), body)


def test_max_tokens_is_clamped_to_the_window_as_vllm_0_32_does() -> None:
    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        _, out = await post(s, server, "/v1/completions",
                            {"model": "tiny", "prompt": [300] * 120, "max_tokens": 100})
        assert out["usage"] == {"prompt_tokens": 120, "total_tokens": 128, "completion_tokens": 8,
                                "prompt_tokens_details": None, "completion_tokens_details": None}
        assert out["choices"][0]["finish_reason"] == "length"

    run(config(enable_prompt_tokens_details=False), body)


def test_sglang_router_style_body_is_accepted() -> None:
    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        status, out = await post(s, server, "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 3, "no_stop_trim": False, "ignore_eos": False,
            "separate_reasoning": True, "return_hidden_states": False, "x-custom": {"a": 1}})
        assert status == 200
        assert out["usage"]["completion_tokens"] == 3

    run(config(), body)


def test_n_choices() -> None:
    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        _, out = await post(s, server, "/v1/completions",
                            {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "n": 3})
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        assert out["usage"]["completion_tokens"] == 6
        events = await stream_events(s, server, "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
            "n": 2, "stream": True})
        finals = sorted(e["choices"][0]["index"] for e in events
                        if e["choices"][0]["finish_reason"] == "length")
        assert finals == [0, 1]

    run(config(), body)


# ------------------------------------------------------------------------------ errors


def test_unknown_model_cache_salt_and_thinking_budget_errors_match_vllm() -> None:
    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        msgs = [{"role": "user", "content": "hi"}]
        status, out = await post(s, server, "/v1/chat/completions", {"model": "nope", "messages": msgs})
        assert (status, out) == (404, {"error": {
            "message": "The model `nope` does not exist. Valid aliases: tiny.",
            "type": "NotFoundError", "param": "model", "code": 404}})
        status, out = await post(s, server, "/v1/chat/completions",
                                 {"model": "tiny", "messages": msgs, "max_tokens": 1,
                                  "cache_salt": "a/b"})
        assert status == 400 and out["error"]["param"] == "cache_salt"
        assert out["error"]["message"].startswith("Parameter 'cache_salt' must be at most 128")
        status, out = await post(s, server, "/v1/chat/completions",
                                 {"model": "tiny", "messages": msgs, "max_tokens": 1,
                                  "thinking_token_budget": 10})
        assert status == 400 and out["error"]["message"].startswith(
            "thinking_token_budget is set but reasoning_config is not configured")
        status, out = await post(s, server, "/v1/completions",
                                 {"model": "tiny", "prompt": ["a", "b"]})
        assert status == 400 and "one prompt per request" in out["error"]["message"]

    run(config(), body)


@pytest.mark.parametrize("style", STYLES)
def test_every_error_style_words_overflow_like_its_engine(style: str) -> None:
    window = 64

    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        # Prompt alone over the window (token ids: reported untruncated).
        req = {"model": "tiny", "prompt": list(range(100, 180)), "max_tokens": 4}
        expected = check_overflow(style, window=window, prompt_tokens=80, max_tokens=4,
                                  prompt_is_text=False)
        assert expected is not None
        async with s.post(server.url + "/v1/completions", json=req) as resp:
            assert resp.status == expected.status
            assert await resp.read() == expected.body
            assert resp.headers["Content-Type"] == expected.content_type
        # Prompt + max_tokens over the window: rejected, or clamped to the window.
        req = {"model": "tiny", "prompt": list(range(100, 140)), "max_tokens": 40}
        expected = check_overflow(style, window=window, prompt_tokens=40, max_tokens=40,
                                  prompt_is_text=False)
        async with s.post(server.url + "/v1/completions", json=req) as resp:
            raw = await resp.read()
            if style_rejects_overlong_total(style):
                assert expected is not None
                assert (resp.status, raw) == (expected.status, expected.body)
            else:
                assert expected is None and resp.status == 200
                out = json.loads(raw)
                assert out["usage"]["completion_tokens"] == window - 40
                assert out["choices"][0]["finish_reason"] == "length"

    run(config(max_model_len=window, error_style=style, kv_events=None, kv_replay=None), body)


def test_text_prompt_over_the_window_reports_at_least_window_plus_one() -> None:
    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        status, out = await post(s, server, "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": "fox " * 200}],
            "max_tokens": 10})
        assert status == 400
        assert out["error"]["message"] == (
            "This model's maximum context length is 128 tokens. However, your prompt contains "
            "at least 129 input tokens, which exceeds this limit even without any output "
            "tokens. Please reduce the length of the input prompt. "
            "(parameter=input_tokens, value=129)")

    run(config(), body)


# ------------------------------------------------------------------------------ events


def test_tokenize_ids_are_what_the_engine_hashes_and_replay_matches_live() -> None:
    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        msgs = [{"role": "system", "content": to_text(range(1000, 1040))},
                {"role": "user", "content": "what is this"}]
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        _, tok = await post(s, server, "/tokenize", {"model": "tiny", "messages": msgs,
                                                     "tools": tools})
        ids = tok["tokens"]
        assert tok["count"] == len(ids) and tok["max_model_len"] == 128 and len(ids) >= 48
        _, render = await post(s, server, "/v1/chat/completions/render",
                               {"model": "tiny", "messages": msgs, "tools": tools})
        assert render["token_ids"] == ids and render["features"] is None
        assert render["sampling_params"]["max_tokens"] == 128 - len(ids)

        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        assert server.kv_events_endpoint is not None
        sub.connect(server.kv_events_endpoint)
        live: list[EventBatch] = []
        try:
            # Close the slow-joiner window: send unique prompts until one batch arrives.
            for i in range(50):
                await post(s, server, "/v1/completions",
                           {"model": "tiny", "prompt": [7000 + i] * 16, "max_tokens": 1})
                try:
                    live.append(decode_message(await asyncio.wait_for(sub.recv_multipart(), 0.1)))
                    break
                except TimeoutError:
                    continue
            assert live, "the PUB socket never delivered a batch"
            status, _ = await post(s, server, "/v1/chat/completions",
                                   {"model": "tiny", "messages": msgs, "tools": tools,
                                    "max_tokens": 1})
            assert status == 200
            last = live[-1].seq
            batches = await settled_replay(server, last + 2)
            while live[-1].seq < batches[-1].seq:
                live.append(decode_message(await asyncio.wait_for(sub.recv_multipart(), 2.0)))
        finally:
            sub.close()
            ctx.term()
        assert [b.seq for b in batches] == list(range(len(batches)))
        assert [b.seq for b in live] == list(range(live[0].seq, live[0].seq + len(live)))
        assert live == batches[live[0].seq:]
        chat_events = stored(batches[last + 1:])
        hashes = [h for e in chat_events for h in e.block_hashes]
        assert hashes == BlockHasher("sha256", 16).wire_hashes(ids)
        assert chat_events[0].parent_block_hash is None
        assert all(e.block_size == 16 and e.medium == "GPU" for e in chat_events)
        assert all(b.data_parallel_rank == 0 for b in batches)

    run(config(), body)


def test_cache_salt_isolates_prefixes_and_enters_block_zero() -> None:
    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        prompt = list(range(201, 271))

        async def cached(salt: str | None) -> int:
            req: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
            if salt is not None:
                req["cache_salt"] = salt
            _, out = await post(s, server, "/v1/completions", req)
            return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])

        assert [await cached(None), await cached("salt1"), await cached("salt1"),
                await cached("salt2"), await cached(None)] == [0, 0, 64, 0, 64]
        events = stored(await settled_replay(server, 3))
        hasher = BlockHasher("sha256", 16)
        assert [list(e.block_hashes) for e in events[:2]] == [
            hasher.wire_hashes(prompt), hasher.wire_hashes(prompt, cache_salt="salt1")]
        assert events[1].extra_keys == (["salt1"], None, None, None)

    run(config(), body)


def test_reset_prefix_cache_clears_and_publishes_all_blocks_cleared() -> None:
    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        req = {"model": "tiny", "prompt": list(range(201, 271)), "max_tokens": 1}
        await post(s, server, "/v1/completions", req)
        async with s.post(server.url + "/reset_prefix_cache") as resp:
            assert resp.status == 200
        _, again = await post(s, server, "/v1/completions", req)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        batches = await settled_replay(server, 3)
        kinds = [[type(e).__name__ for e in b.events] for b in batches]
        assert kinds[1] == ["AllBlocksCleared"]
        assert isinstance(batches[1].events[0], AllBlocksCleared)

    run(config(), body)


# ------------------------------------------------------------------------------ disconnect


def test_client_disconnect_aborts_the_request_in_the_engine() -> None:
    slow = StepTiming(fixed_s=0.02)

    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        req = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 100, "stream": True}
        async with s.post(server.url + "/v1/completions", json=req) as resp:
            await resp.content.readline()  # the first token's event
            assert server.driver is not None and server.driver.num_live == 1
            resp.close()
        for _ in range(200):
            if server.driver.num_live == 0:
                break
            await asyncio.sleep(0.01)
        assert server.driver.num_live == 0
        assert server.engine.metrics().request_success_total == {"abort": 1}
        assert not server.engine.has_work()

    run(config(timing=slow), body)


def test_non_streamed_disconnect_aborts_too() -> None:
    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        req = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 100}
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(post(s, server, "/v1/completions", req), 0.2)
        for _ in range(200):
            if server.engine.metrics().request_success_total.get("abort"):
                break
            await asyncio.sleep(0.01)
        assert server.engine.metrics().request_success_total == {"abort": 1}

    run(config(timing=StepTiming(fixed_s=0.02)), body)


# ------------------------------------------------------------------------------ small routes


def test_admin_routes_and_probes() -> None:
    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        async def get(path: str) -> tuple[int, bytes]:
            async with s.get(server.url + path) as resp:
                return resp.status, await resp.read()

        assert await get("/health") == (200, b"")
        assert await get("/version") == (200, b'{"version":"0.32.0"}')
        assert await get("/load") == (200, b'{"server_load":0}')
        status, raw = await get("/v1/models")
        card = json.loads(raw)["data"][0]
        assert card["id"] == "tiny" and card["max_model_len"] == 128 and card["owned_by"] == "vllm"
        status, raw = await get("/kv_event_sources")
        source = json.loads(raw)["0"]
        assert source["endpoint"] == server.kv_events_endpoint
        assert source["replay_endpoint"] == server.kv_replay_endpoint
        assert source["topic"] == "kv" and source["publisher"] == "zmq"
        for probe in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
            assert (await get(probe))[0] == 404
        _, out = await post(s, server, "/detokenize", {"model": "tiny", "tokens": [406, 368]})
        assert out == {"prompt": to_text([406, 368])}
        _, out = await post(s, server, "/tokenize", {"model": "tiny", "prompt": "da di",
                                                     "return_token_strs": True})
        assert out["token_strs"] == ["da", "di"]
        # vLLM words the flag conflict by where it is caught: explicit flags by the request
        # validator, the default add_generation_prompt by the chat-template code.
        msgs = [{"role": "user", "content": "x"}]
        for path in ("/tokenize", "/v1/chat/completions"):
            status, out = await post(s, server, path, {
                "model": "tiny", "messages": msgs, "continue_final_message": True,
                "add_generation_prompt": True})
            assert (status, out["error"]["message"], out["error"]["param"]) == (
                400, ("Cannot set both `continue_final_message` and `add_generation_prompt` "
                      "to True."), None)
            status, out = await post(s, server, path, {
                "model": "tiny", "messages": msgs, "continue_final_message": True})
            assert status == 400 and out["error"]["param"] is None
            assert out["error"]["message"].startswith(
                "continue_final_message and add_generation_prompt are not compatible. Use ")

        # sglang-router's HTTP/2 prior-knowledge probe: a 400, and the server carries on.
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        await writer.drain()
        first = await asyncio.wait_for(reader.read(100), 2.0)
        writer.close()
        assert first.split(b"\r\n")[0].split(b" ")[1] == b"400"
        assert (await get("/health"))[0] == 200

        # A body over the limit: a 413 in the engine's error shape that says the limit.
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n{\"model\": "
                     % (oa.DEFAULT_MAX_BODY_BYTES + 1))
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 2.0)  # the server closes after it
        writer.close()
        status = int(answer.split(b"\r\n")[0].split(b" ")[1])
        out = json.loads(answer.partition(b"\r\n\r\n")[2])
        assert status == 413 and out["error"]["code"] == 413
        assert str(oa.DEFAULT_MAX_BODY_BYTES) in out["error"]["message"]
        assert (await get("/health"))[0] == 200

    run(config(), body)


def test_render_routes_answer_vllms_403_when_disabled() -> None:
    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        status, out = await post(s, server, "/v1/completions/render",
                                 {"model": "tiny", "prompt": "hi"})
        assert status == 403
        assert out["error"]["message"].startswith("Scale-out endpoints are disabled.")

    run(config(render_endpoints=False), body)


# ------------------------------------------------------------------------------ vLLM's checks


def test_text_precheck_rejects_long_text_with_vllms_input_text_error() -> None:
    """vLLM's character pre-check: more than window x max_chars_per_token characters of text."""

    def text_error(chars: int) -> dict[str, Any]:
        return {"error": {
            "message": "This model's maximum context length is 128 tokens. However, your prompt "
                       f"contains {chars} characters (more than 384 characters, which is the "
                       "upper bound for 128 input tokens). Please reduce the length of the "
                       f"input prompt. (parameter=input_text, value={chars})",
            "type": "BadRequestError", "param": "input_text", "code": 400}}

    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        assert server.max_chars_per_token == 3
        text = "ab " * 200  # 600 characters, 200 tokens
        status, out = await post(s, server, "/v1/completions",
                                 {"model": "tiny", "prompt": text, "max_tokens": 4})
        assert (status, out) == (400, text_error(600))
        msgs = [{"role": "user", "content": text}]
        rendered = server.tokenizer.render_chat(msgs)  # chat: the template's text is checked
        status, out = await post(s, server, "/v1/chat/completions",
                                 {"model": "tiny", "messages": msgs, "max_tokens": 4})
        assert (status, out) == (400, text_error(len(rendered)))
        # max_tokens over the window is checked first, as in vLLM.
        status, out = await post(s, server, "/v1/completions",
                                 {"model": "tiny", "prompt": text, "max_tokens": 129})
        assert status == 400 and out["error"]["param"] == "max_tokens"
        # Under the character bound but over the window: the token-count error.
        status, out = await post(s, server, "/v1/completions",
                                 {"model": "tiny", "prompt": "a " * 150, "max_tokens": 4})
        assert status == 400 and out["error"]["param"] == "input_tokens"
        assert "at least 129 input tokens" in out["error"]["message"]
        # Token ids are never character-checked.
        status, out = await post(s, server, "/v1/completions",
                                 {"model": "tiny", "prompt": [300] * 200, "max_tokens": 4})
        assert status == 400 and out["error"]["param"] == "input_tokens"

    run(config(max_chars_per_token=3), body)


def test_builtin_tokenizer_has_no_character_bound_by_default() -> None:
    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        assert server.max_chars_per_token is None
        status, out = await post(s, server, "/v1/completions",
                                 {"model": "tiny", "prompt": "abcdefgh " * 200, "max_tokens": 4})
        assert status == 400 and out["error"]["param"] == "input_tokens"

    run(config(), body)


@pytest.mark.parametrize(("root", "tokenizer", "expected"), [
    (None, None, "tiny"),
    (None, "/models/tiny-llama", "/models/tiny-llama"),
    ("Qwen/Qwen3-8B", "/models/tiny-llama", "Qwen/Qwen3-8B"),
])
def test_models_card_root(root: str | None, tokenizer: str | None, expected: str) -> None:
    async def main() -> None:
        # The tokenizer path only names the root here; the tokenizer object is the built-in.
        cfg = config(root=root, tokenizer=tokenizer, aliases=("tiny-alias",), kv_events=None,
                     kv_replay=None)
        async with SimServer(cfg, tokenizer=BuiltinTokenizer()) as server, \
                aiohttp.ClientSession() as s:
            async with s.get(server.url + "/v1/models") as resp:
                cards = (await resp.json())["data"]
            assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
                ("tiny", expected, None), ("tiny-alias", expected, None)]
            assert server.ready_info()["root"] == expected

    asyncio.run(asyncio.wait_for(main(), TEST_SECONDS))


# ------------------------------------------------------------------------------ publisher socket


def test_vllm_socket_mode_connects_to_a_bound_subscriber() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.bind("tcp://127.0.0.1:0")
        endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
        try:
            cfg = config(kv_events=endpoint, kv_events_socket="vllm")
            async with SimServer(cfg) as server, aiohttp.ClientSession() as s:
                assert server.kv_events_endpoint == endpoint and server.kv_events_connect
                assert server.ready_info()["kv_events_connect"] is True
                async with s.get(server.url + "/kv_event_sources") as resp:
                    assert (await resp.json())["0"]["endpoint"] == endpoint
                batch = None
                for i in range(50):  # bounded: the connect completes asynchronously
                    await post(s, server, "/v1/completions",
                               {"model": "tiny", "prompt": [5000 + i] * 16, "max_tokens": 1})
                    try:
                        batch = decode_message(await asyncio.wait_for(sub.recv_multipart(), 0.1))
                        break
                    except TimeoutError:
                        continue
                assert batch is not None and stored([batch])
        finally:
            sub.close()
            ctx.term()

    asyncio.run(asyncio.wait_for(main(), TEST_SECONDS))


def test_vllm_socket_mode_still_binds_wildcard_free_and_ipc_endpoints(tmp_path: Any) -> None:
    async def main() -> None:
        ipc = f"ipc://{tmp_path}/kv.sock"
        async with SimServer(config(kv_events=ipc, kv_events_socket="vllm")) as server:
            assert server.kv_events_endpoint == ipc and not server.kv_events_connect
        async with SimServer(config()) as server:  # "bind": a free port on loopback
            assert server.kv_events_endpoint is not None and not server.kv_events_connect
            assert server.kv_events_endpoint.startswith("tcp://127.0.0.1:")

    asyncio.run(asyncio.wait_for(main(), TEST_SECONDS))


def test_vllm_socket_mode_refuses_to_connect_to_port_zero() -> None:
    with pytest.raises(ConfigError, match="connect"):
        config(kv_events="tcp://127.0.0.1:0", kv_events_socket="vllm")
    with pytest.raises(ConfigError, match="'bind' .* or 'vllm'"):
        config(kv_events_socket="connect")


# ------------------------------------------------------------------------------ fault injection


async def arm(s: aiohttp.ClientSession, server: SimServer, **faults: Any) -> dict[str, Any]:
    status, state = await post(s, server, "/sim/faults", faults)
    assert status == 200, state
    return dict(state)


def test_faults_endpoint_is_off_by_default() -> None:
    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        status, _ = await post(s, server, "/sim/faults", {"fail_next": 1})
        assert status == 404
        status, _ = await post(s, server, "/v1/completions",
                               {"model": "tiny", "prompt": [1, 2], "max_tokens": 1})
        assert status == 200

    run(config(), body)


def test_fault_requests_are_validated_and_nothing_changes_on_error() -> None:
    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        async with s.get(server.url + "/sim/faults") as resp:
            initial = await resp.json()
        assert initial["fail_next"] == 0 and initial["drop_events"] == 0
        assert initial["fired"] == {"events_dropped": 0, "requests_failed": 0,
                                    "requests_stalled": 0, "requests_killed": 0}
        status, out = await post(s, server, "/sim/faults", {"fail_next": 2, "drop_evnts": 1})
        assert status == 400 and "unknown key(s) ['drop_evnts']" in out["error"]["message"]
        status, out = await post(s, server, "/sim/faults", {"fail_next": 2, "status": 200})
        assert status == 400 and "'status' must be an integer >= 400" in out["error"]["message"]
        status, out = await post(s, server, "/sim/faults", {"stall_first_byte_s": -1})
        assert status == 400 and "stall_first_byte_s" in out["error"]["message"]
        status, out = await post(s, server, "/sim/faults", {"drop_events": True})
        assert status == 400 and "'drop_events' must be an integer >= 0" in out["error"]["message"]
        async with s.get(server.url + "/sim/faults") as resp:
            assert await resp.json() == initial
        state = await arm(s, server, fail_next=1, drop_events=3)
        assert (state["fail_next"], state["drop_events"]) == (1, 3)
        async with s.delete(server.url + "/sim/faults") as resp:
            assert (await resp.json())["fail_next"] == 0
        state = await arm(s, server, fail_next=1, clear=True, kill_mid_stream_after_tokens=2)
        assert (state["fail_next"], state["kill_mid_stream_after_tokens"]) == (1, 2)

    run(config(fault_injection=True), body)


def test_fail_next_answers_before_the_first_byte_and_the_engine_never_sees_it() -> None:
    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        await arm(s, server, fail_next=2, status=503)
        req = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}
        status, out = await post(s, server, "/v1/completions", req)
        assert status == 503 and out["error"]["code"] == 503
        assert out["error"]["message"].startswith("Simulated failure: /sim/faults armed fail_next")
        async with s.post(server.url + "/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "x"}],
                "stream": True}) as resp:
            assert resp.status == 503
            assert resp.headers["Content-Type"] == "application/json"
        status, out = await post(s, server, "/v1/completions", req)
        assert status == 200 and out["usage"]["completion_tokens"] == 2
        assert server.engine.metrics().request_success_total == {"length": 1}
        async with s.get(server.url + "/sim/faults") as resp:
            state = await resp.json()
        assert state["fail_next"] == 0 and state["fired"]["requests_failed"] == 2

    run(config(fault_injection=True), body)


def test_stall_delays_the_first_byte_for_the_next_requests_only() -> None:
    stall = 0.4

    async def first_byte_s(s: aiohttp.ClientSession, server: SimServer) -> float:
        t0 = asyncio.get_running_loop().time()
        async with s.post(server.url + "/v1/completions", json={
                "model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2, "stream": True}) as resp:
            assert resp.status == 200
            await resp.content.readline()
            elapsed = asyncio.get_running_loop().time() - t0
            await resp.read()
        return elapsed

    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        await arm(s, server, stall_first_byte_s=stall, stall_next=1)
        assert await first_byte_s(s, server) >= stall
        assert await first_byte_s(s, server) < stall
        # Without stall_next it holds until disarmed; a client giving up costs the engine nothing.
        await arm(s, server, stall_first_byte_s=stall)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(first_byte_s(s, server), stall / 2)
        assert await first_byte_s(s, server) >= stall
        state = await arm(s, server, stall_first_byte_s=0)
        assert await first_byte_s(s, server) < stall
        assert state["fired"]["requests_stalled"] == 3
        # 5 requests, 4 completed: the one abandoned during its stall never reached the engine.
        assert server.engine.metrics().request_success_total == {"length": 4}

    run(config(fault_injection=True), body)


def test_kill_mid_stream_closes_the_connection_after_k_tokens_and_aborts() -> None:
    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        await arm(s, server, kill_mid_stream_after_tokens=3, kill_next=2)
        decoder = SSEDecoder()
        events: list[Any] = []
        with pytest.raises(aiohttp.ClientPayloadError):
            async with s.post(server.url + "/v1/completions", json={
                    "model": "tiny", "prompt": [1, 2, 3], "max_tokens": 10,
                    "stream": True}) as resp:
                assert resp.status == 200
                async for chunk in resp.content.iter_any():
                    events.extend(decoder.feed(chunk))
        assert [e.is_done for e in events] == [False] * 3  # 3 token chunks, no [DONE]
        # Unary: the connection closes with no response at all.
        with pytest.raises(aiohttp.ClientError):
            await post(s, server, "/v1/completions",
                       {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 10})
        for _ in range(200):
            if server.engine.metrics().request_success_total.get("abort") == 2:
                break
            await asyncio.sleep(0.01)
        assert server.engine.metrics().request_success_total == {"abort": 2}
        # kill_next=2 is used up: the next stream completes.
        events = await stream_events(s, server, "/v1/completions", {
            "model": "tiny", "prompt": [1, 2, 3], "max_tokens": 10, "stream": True})
        assert len(events) == 10
        async with s.get(server.url + "/sim/faults") as resp:
            state = await resp.json()
        assert state["kill_mid_stream_after_tokens"] is None
        assert state["fired"]["requests_killed"] == 2

    run(config(fault_injection=True, timing=StepTiming(fixed_s=0.002)), body)


def test_drop_events_makes_a_gap_on_pub_that_replay_fills() -> None:
    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        assert server.kv_events_endpoint is not None
        sub.connect(server.kv_events_endpoint)
        try:
            first: EventBatch | None = None
            for i in range(50):  # close the slow-joiner window
                await post(s, server, "/v1/completions",
                           {"model": "tiny", "prompt": [7000 + i] * 16, "max_tokens": 1})
                try:
                    first = decode_message(await asyncio.wait_for(sub.recv_multipart(), 0.1))
                    break
                except TimeoutError:
                    continue
            assert first is not None
            await arm(s, server, drop_events=2)
            for i in range(3):  # one new block each: one batch each
                status, _ = await post(s, server, "/v1/completions",
                                       {"model": "tiny", "prompt": [8000 + i] * 16,
                                        "max_tokens": 1})
                assert status == 200
            after = decode_message(await asyncio.wait_for(sub.recv_multipart(), 3.0))
            assert after.seq == first.seq + 3  # first.seq + 1 and + 2 were never sent
            batches = await settled_replay(server, after.seq + 1)
        finally:
            sub.close()
            ctx.term()
        assert [b.seq for b in batches] == list(range(after.seq + 1))
        assert batches[after.seq] == after
        gap = stored(batches[first.seq + 1:after.seq])
        assert [list(e.token_ids) for e in gap] == [[8000] * 16, [8001] * 16]
        async with s.get(server.url + "/sim/faults") as resp:
            state = await resp.json()
        assert state["drop_events"] == 0 and state["fired"]["events_dropped"] == 2

    run(config(fault_injection=True), body)


def test_natural_answers_end_with_stop_like_a_model_and_max_tokens_still_caps() -> None:
    """Issue #25: a one-word chat used to generate to the window (131K tokens)."""
    from kvroute.sim.answer_lengths import AnswerLengths

    lengths = AnswerLengths(seed=3)
    hello = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}]}

    async def body(server: SimServer, session: aiohttp.ClientSession) -> None:
        status, out = await post(session, server, "/v1/chat/completions", hello)
        assert status == 200 and out["choices"][0]["finish_reason"] == "stop"
        n = out["usage"]["completion_tokens"]
        assert 1 <= n < 4000
        status, again = await post(session, server, "/v1/chat/completions", hello)
        assert again["usage"]["completion_tokens"] == n  # deterministic per request
        capped = await post(session, server, "/v1/chat/completions", {**hello, "max_tokens": 2})
        assert capped[1]["choices"][0]["finish_reason"] == "length"
        assert capped[1]["usage"]["completion_tokens"] == 2
        # vLLM's ignore_eos: run to max_tokens whatever the drawn length.
        long = max(n + 5, 20)
        status, ignored = await post(session, server, "/v1/chat/completions",
                                     {**hello, "max_tokens": long, "ignore_eos": True})
        assert ignored["choices"][0]["finish_reason"] == "length"
        assert ignored["usage"]["completion_tokens"] == long
        events = await stream_events(session, server, "/v1/chat/completions",
                                     {**hello, "stream": True})
        finishes = [e["choices"][0]["finish_reason"] for e in events
                    if isinstance(e, dict) and e.get("choices")]
        assert finishes[-1] == "stop"

    run(config(max_model_len=8192, num_gpu_blocks=2048, answer_lengths=lengths), body)


def test_eos_after_wins_over_natural_lengths() -> None:
    from kvroute.sim.answer_lengths import AnswerLengths

    async def body(server: SimServer, session: aiohttp.ClientSession) -> None:
        status, out = await post(session, server, "/v1/chat/completions",
                                 {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and out["choices"][0]["finish_reason"] == "stop"
        assert out["usage"]["completion_tokens"] == 7

    run(config(answer_lengths=AnswerLengths(), eos_after_tokens=7), body)


# ------------------------------------------------------------------------------ own stalls


def test_a_stalled_loop_shows_as_late_steps_on_metrics() -> None:
    # Steps of 10 ms; once the first token is out, the server's loop is blocked for 150 ms
    # (what a collection or a descheduled process does): the step due meanwhile runs at
    # least 140 ms late, which /metrics reports in kvroute_sim_step_lateness_seconds.
    async def body(server: SimServer, s: aiohttp.ClientSession) -> None:
        req = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 30, "stream": True}
        async with s.post(server.url + "/v1/completions", json=req) as resp:
            await resp.content.readline()
            asyncio.get_running_loop().call_soon(time.sleep, 0.15)
            await resp.read()
        async with s.get(server.url + "/metrics") as resp:
            text = await resp.text()
        late = {smp.labels["le"]: smp.value
                for smp in parse_exposition(text, names=("kvroute_sim_step_",)).samples
                if smp.name == "kvroute_sim_step_lateness_seconds_bucket"}
        assert late["+Inf"] >= 30  # one observation a step
        assert late["+Inf"] - late["0.1"] >= 1  # the stalled one
        # vLLM's series are still served beside it.
        assert parse_vllm_metrics(text, "tiny").num_malformed == 0

    run(config(timing=StepTiming(fixed_s=0.01)), body)
