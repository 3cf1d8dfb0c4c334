"""A real LiteLLM proxy (PyPI ``litellm[proxy]``) in front of kvroute, in front of
``kvroute sim serve`` engines — the deployment users run.

One LiteLLM proxy, one kvroute router (on its own thread, so the tests can read its session
state) and four simulated engines are started once for the module:

======================  ==========================  =========================================
engines (pool)          window, served model         kvroute routes
======================  ==========================  =========================================
c0, c1 (``chat``)       the sim default, sim-model   ``assistant`` → [chat]
s0 (``small``)          2,048, sim-small             ``tiered`` → [small, large];
                                                     ``small-only`` → [small]
l0 (``large``)          8,192, sim-large             ``tiered``; ``large-only`` → [large]
======================  ==========================  =========================================

LiteLLM serves one model group per route (same names) with ``hosted_vllm/``, header
forwarding on (``forward_client_headers_to_llm_api``, or kvroute never sees a session id),
and ``context_window_fallbacks: small-only → large-only``.

The small engine words its overflow like vLLM 0.16-0.17 ("You passed … context length is
only …"), a text LiteLLM does *not* recognise as a context-window error (reference §1.1
live matrix). So a LiteLLM fallback that fires here proves that kvroute itself answered with
OpenAI's wording, not that the engine's text happened to match.

The simulated tokenizer makes each distinct word one token, so prompt sizes are exact.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from gateway import (
    LITELLM_VERSION,
    LiteLLMModel,
    LiteLLMProxy,
    RouterThread,
    litellm_config,
    litellm_proxy,
    require_litellm,
)

from kvroute.config import parse_config
from kvroute.core.session import session_key
from kvroute.sim.launcher import Fleet, ReplicaSpec, start_fleet
from kvroute.wire.sse import SSEDecoder

pytestmark = pytest.mark.integration

TIMING = "0.001,0.00005,0.0002,0"  # as tests/integration/conftest.py: fast, CI-sized
SMALL_WINDOW = 2048
LARGE_WINDOW = 8192
CHAT_REPLICAS = ("c0", "c1")

def words(rng: random.Random, n: int, tag: str = "w") -> str:
    """``n`` distinct words: ``n`` tokens for the simulated tokenizer."""
    return " ".join(f"{tag}{rng.getrandbits(40):x}" for _ in range(n))


@dataclass(frozen=True, slots=True)
class Stack:
    fleet: Fleet
    router: RouterThread
    proxy: LiteLLMProxy


def _spec(name: str, pool: str, model: str, window: int | None = None,
          style: str = "vllm-0.32") -> ReplicaSpec:
    return ReplicaSpec(name=name, pool=pool, model=model, max_model_len=window,
                       error_style=style, extra_args=("--timing", TIMING))


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    install = require_litellm()  # skip before starting anything
    fleet = start_fleet([
        _spec("c0", "chat", "sim-model"),
        _spec("c1", "chat", "sim-model"),
        _spec("s0", "small", "sim-small", SMALL_WINDOW, style="vllm-0.16-0.17"),
        _spec("l0", "large", "sim-large", LARGE_WINDOW),
    ], timeout_s=30.0)
    try:
        pools: dict[str, Any] = {}
        for r in fleet.replicas:
            pool = pools.setdefault(r.pool, {"model": r.model, "replicas": []})
            pool["replicas"].append({"name": r.name, "url": r.url, "kv_events": r.kv_events,
                                     "kv_replay": r.kv_replay, "prefill_rate_tps": 20_000.0})
        config = parse_config({
            "listen": {"host": "127.0.0.1", "port": 0},
            "pools": pools,
            "routes": {"assistant": {"pools": ["chat"]},
                       "tiered": {"pools": ["small", "large"]},
                       "small-only": {"pools": ["small"]},
                       "large-only": {"pools": ["large"]}},
            "policy": {"name": "kvroute", "seed": 7},
            "discovery": {"health_interval_s": 0.5, "metrics_interval_s": 0.5,
                          "models_interval_s": 5, "timeout_s": 1.0},
            "timeouts": {"connect_s": 1.0, "first_byte_s": 10.0, "total_s": 20.0},
            "log_level": "warning",
        }, env={})
        with RouterThread(config) as router:
            api_base = router.url + "/v1"
            models = [LiteLLMModel(name, name, api_base)
                      for name in ("assistant", "tiered", "small-only", "large-only")]
            # A LiteLLM group whose kvroute route does not exist: kvroute's own 404.
            models.append(LiteLLMModel("ghost", "no-such-route", api_base))
            gateway_config = litellm_config(
                models, context_window_fallbacks={"small-only": ["large-only"]})
            with litellm_proxy(gateway_config, install=install, ready_timeout_s=120.0) as proxy:
                yield Stack(fleet, router, proxy)
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def bare_proxy(stack: Stack) -> Iterator[LiteLLMProxy]:
    """A second proxy, started only for the two tests that need it: header forwarding off,
    and a group (``small-direct``) that talks to the small engine directly, bypassing kvroute,
    with ``context_window_fallbacks: small-direct → large-direct`` (kvroute's large route)."""
    engine = stack.fleet.by_pool("small")[0]
    api_base = stack.router.url + "/v1"
    config = litellm_config(
        [LiteLLMModel("assistant", "assistant", api_base),
         LiteLLMModel("small-direct", engine.model, engine.url + "/v1"),
         LiteLLMModel("large-direct", "large-only", api_base)],
        context_window_fallbacks={"small-direct": ["large-direct"]},
        forward_client_headers=False)
    with litellm_proxy(config, install=stack.proxy.install, ready_timeout_s=120.0) as proxy:
        yield proxy


def chat_body(model: str, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": messages, "temperature": 0.0, **extra}


def ok_json(status: int, raw: bytes, proxy: LiteLLMProxy) -> Any:
    assert status == 200, f"{status}: {raw[:1000]!r}\nLiteLLM log tail:\n{proxy.log_tail(2000)}"
    return json.loads(raw)


def _direct(stack: Stack, path: str, body: Any) -> tuple[int, dict[str, str], bytes]:
    """Call kvroute itself (no gateway); ``(status, lower-cased headers, raw body)``."""
    req = urllib.request.Request(stack.router.url + path, data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=20.0) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def test_installed_litellm_is_the_stamped_version() -> None:
    """The venv really holds the version setup.sh stamped (a hand-upgraded venv is caught)."""
    install = require_litellm()
    out = subprocess.run(
        [str(install.venv / "bin" / "python"), "-c",
         "import importlib.metadata as m; print(m.version('litellm'))"],
        capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == install.version
    assert install.version == (os.environ.get("KVROUTE_LITELLM_VERSION") or LITELLM_VERSION)


# --------------------------------------------------------------------------------------------
# Chat through the gateway
# --------------------------------------------------------------------------------------------


def test_chat_non_streaming_returns_usage_and_kvroute_headers(stack: Stack) -> None:
    rng = random.Random(11)
    messages = [{"role": "user", "content": words(rng, 120)}]
    status, headers, raw = stack.proxy.post(
        "/v1/chat/completions", chat_body("assistant", messages, max_tokens=5))
    body = ok_json(status, raw, stack.proxy)
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 5  # one word per simulated token
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    # The engine counted the same prompt as kvroute's tokenizer would: ask kvroute directly.
    direct_status, _, direct_raw = _direct(stack, "/v1/chat/completions",
                                           chat_body("assistant", messages, max_tokens=1))
    assert direct_status == 200
    assert usage["prompt_tokens"] == json.loads(direct_raw)["usage"]["prompt_tokens"]
    assert 120 <= usage["prompt_tokens"] <= 140  # 120 words + the chat template's framing
    # LiteLLM relays upstream headers with an ``llm_provider-`` prefix.
    assert headers["llm_provider-x-kvroute-pool"] == "chat"
    assert headers["llm_provider-x-kvroute-replica"] in CHAT_REPLICAS
    assert headers["x-litellm-model-group"] == "assistant"


def test_chat_streaming_relays_chunks_and_final_usage(stack: Stack) -> None:
    rng = random.Random(12)
    body = chat_body("assistant", [{"role": "user", "content": words(rng, 60)}],
                     max_tokens=6, stream=True, stream_options={"include_usage": True})
    status, headers, raw = stack.proxy.post("/v1/chat/completions", body)
    assert status == 200, raw[:1000]
    assert headers["content-type"].startswith("text/event-stream")
    decoder = SSEDecoder()
    events = [e.data for e in decoder.feed(raw) + decoder.flush()]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in chunks if c.get("choices"))
    assert len(text.split()) == 6
    finishes = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
    assert "length" in finishes
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 6
    assert usage[-1]["prompt_tokens"] >= 60


def test_completions_pass_through(stack: Stack) -> None:
    rng = random.Random(13)
    status, _, raw = stack.proxy.post(
        "/v1/completions", {"model": "assistant", "prompt": words(rng, 40), "max_tokens": 3})
    body = ok_json(status, raw, stack.proxy)
    assert body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["prompt_tokens"] >= 40
    assert len(body["choices"][0]["text"].split()) == 3
    # NOTE: LiteLLM 1.108.7 relays upstream headers (``llm_provider-*``) for chat only, not
    # for text completions, so the kvroute headers cannot be checked here.


# --------------------------------------------------------------------------------------------
# Sessions: the header LiteLLM forwards reaches kvroute and pins the session
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("header", ["x-litellm-session-id", "x-session-id"])
def test_session_header_reaches_kvroute_and_pins_the_session(stack: Stack, header: str) -> None:
    rng = random.Random(header)
    router = stack.router
    assert router.runtime is not None and router.runtime.state is not None
    state = router.runtime.state
    for s in range(3):
        session = f"sess-{header[2:6]}-{s}-{rng.getrandbits(32):08x}"
        messages = [{"role": "system", "content": words(rng, 200, "sys")}]
        replicas = []
        for turn in range(3):
            messages.append({"role": "user", "content": words(rng, 20)})
            status, headers, raw = stack.proxy.post(
                "/v1/chat/completions", chat_body("assistant", messages, max_tokens=4),
                headers={header: session})
            reply = ok_json(status, raw, stack.proxy)
            messages.append({"role": "assistant",
                             "content": reply["choices"][0]["message"]["content"]})
            replicas.append(headers["llm_provider-x-kvroute-replica"])
        assert len(set(replicas)) == 1, f"session {session} moved: {replicas}"
        # kvroute keyed its pin on the very id the client sent to LiteLLM (tenant "default").
        record = router.call(state.get_session(session_key("default", "assistant", session)))
        pinned = None if record is None else record.pin
        assert pinned == replicas[0], (session, pinned, replicas)


def test_without_header_forwarding_kvroute_sees_no_session(stack: Stack,
                                                           bare_proxy: LiteLLMProxy) -> None:
    """The reference's warning, checked: ``forward_client_headers_to_llm_api`` is required;
    without it the same session header never reaches kvroute."""
    rng = random.Random(14)
    session = f"sess-unforwarded-{rng.getrandbits(32):08x}"
    status, _, raw = bare_proxy.post(
        "/v1/chat/completions",
        chat_body("assistant", [{"role": "user", "content": words(rng, 30)}], max_tokens=2),
        headers={"x-litellm-session-id": session})
    ok_json(status, raw, bare_proxy)
    assert stack.router.runtime is not None and stack.router.runtime.state is not None
    key = session_key("default", "assistant", session)
    assert stack.router.call(stack.router.runtime.state.get_session(key)) is None


# --------------------------------------------------------------------------------------------
# Errors pass through in OpenAI's shape
# --------------------------------------------------------------------------------------------


def _openai_error(raw: bytes) -> dict[str, Any]:
    error = json.loads(raw)["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str)
    return dict(error)


def test_kvroute_bad_request_passes_through_as_openai_400(stack: Stack) -> None:
    status, _, raw = stack.proxy.post(
        "/v1/chat/completions",
        chat_body("assistant", [{"role": "user", "content": "hello"}], max_tokens=0))
    assert status == 400, raw
    error = _openai_error(raw)
    assert "max_tokens must be at least 1" in error["message"]  # kvroute's own validation
    assert str(error["code"]) == "400"


def test_kvroute_unknown_route_passes_through_as_openai_404(stack: Stack) -> None:
    status, _, raw = stack.proxy.post(
        "/v1/chat/completions", chat_body("ghost", [{"role": "user", "content": "hello"}],
                                          max_tokens=2))
    assert status == 404, raw
    error = _openai_error(raw)
    assert "The model `no-such-route` does not exist. This router serves:" in error["message"]


# --------------------------------------------------------------------------------------------
# Small-window overflow: kvroute's tiers, or kvroute's 400 + LiteLLM's context fallback
# --------------------------------------------------------------------------------------------


def test_a_short_prompt_stays_on_the_small_tier(stack: Stack) -> None:
    """Control for the escalation test: the tiered route does use its small pool."""
    rng = random.Random(15)
    status, headers, raw = stack.proxy.post(
        "/v1/chat/completions",
        chat_body("tiered", [{"role": "user", "content": words(rng, 300)}], max_tokens=8))
    ok_json(status, raw, stack.proxy)
    assert headers["llm_provider-x-kvroute-pool"] == "small"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_kvroute_tiers_escalate_an_overlong_prompt(stack: Stack, stream: bool) -> None:
    """3,000 prompt tokens do not fit the 2,048 pool: kvroute serves them from the 8,192 one,
    and LiteLLM never needs its own fallback."""
    rng = random.Random(16 + stream)
    body = chat_body("tiered", [{"role": "user", "content": words(rng, 3000)}], max_tokens=8,
                     stream=stream)
    status, headers, raw = stack.proxy.post("/v1/chat/completions", body)
    assert status == 200, raw[:1000]
    assert headers["llm_provider-x-kvroute-pool"] == "large"
    assert headers["x-litellm-attempted-fallbacks"] == "0"
    assert headers["x-litellm-model-group"] == "tiered"
    if not stream:
        assert json.loads(raw)["usage"]["completion_tokens"] == 8


def test_kvroute_answers_an_openai_worded_400_when_no_pool_fits(stack: Stack) -> None:
    """With a single small pool, kvroute's answer is OpenAI's overflow 400 — the wording
    LiteLLM's ``context_window_fallbacks`` recognises — whatever the engine's own text."""
    rng = random.Random(17)
    status, _, raw = _direct(stack, "/v1/chat/completions", chat_body(
        "small-only", [{"role": "user", "content": words(rng, 3000)}], max_tokens=8))
    assert status == 400, raw[:500]
    error = json.loads(raw)["error"]
    assert error["message"].startswith(
        f"This model's maximum context length is {SMALL_WINDOW} tokens.")
    assert error["code"] == "context_length_exceeded"
    assert error["type"] == "invalid_request_error"
    assert "You passed" not in error["message"]  # not the engine's vLLM 0.16 text


def test_litellm_context_window_fallback_reacts_to_kvroute_400(stack: Stack) -> None:
    rng = random.Random(18)
    status, headers, raw = stack.proxy.post(
        "/v1/chat/completions",
        chat_body("small-only", [{"role": "user", "content": words(rng, 3000)}], max_tokens=8))
    body = ok_json(status, raw, stack.proxy)
    assert headers["x-litellm-attempted-fallbacks"] == "1"
    assert headers["x-litellm-model-group"] == "large-only"
    assert headers["llm_provider-x-kvroute-pool"] == "large"
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["prompt_tokens"] >= 3000


def test_without_kvroute_rewording_litellm_would_not_fall_back(
        bare_proxy: LiteLLMProxy) -> None:
    """Why the rewording matters: the engine's own vLLM 0.16 text, sent straight to LiteLLM
    (bypassing kvroute), is a plain 400 there, and the fallback never fires."""
    rng = random.Random(19)
    status, headers, raw = bare_proxy.post("/v1/chat/completions", chat_body(
        "small-direct", [{"role": "user", "content": words(rng, 3000)}], max_tokens=8))
    assert status == 400, raw[:500]
    message = json.loads(raw)["error"]["message"]
    assert "You passed" in message and "context length is only" in message
    assert headers.get("x-litellm-attempted-fallbacks", "0") == "0"
