"""Prompt tokenizers against real HTTP servers on loopback.

* ``FakeVllm`` answers ``/tokenize`` only with the exact request/response pairs recorded from
  vLLM 0.32 (``tests/data/vllm-vectors-0.32.json``, ``http_examples_v0_32``), so a body that
  differs from what vLLM was sent fails the test; it also serves ``/health``, ``/v1/models``
  and ``/metrics`` so the real ``Discovery`` can find it.
* Two ``kvroute sim serve`` processes loaded with a small Hugging Face tokenizer directory
  (built here with ``tokenizers``) check that engine mode and local mode give the same ids,
  and that those ids are what the engine counts as the prompt of a chat completion.
* The check of ``local`` and ``auto`` tokenizers against the engines' ``/tokenize``: a match
  kept (or adopted), a mismatch falling back, an engine that cannot answer, a model root
  that is not on this host, and the router running it at start.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import random
import sys
import typing
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvroute.config import RouterConfig, parse_config
from kvroute.core.clock import ManualClock
from kvroute.core.errors import ConfigError
from kvroute.core.peer_policies import make_policy
from kvroute.core.router import PoolSpec, ReplicaSpec, RouterCore
from kvroute.http.client import EngineClient
from kvroute.shell.discovery import Discovery
from kvroute.shell.metrics import TOKENIZER_CHECKS, TOKENIZER_MODES, RouterMetrics
from kvroute.shell.runtime import RouterRuntime
from kvroute.sim.launcher import Fleet, start_fleet
from kvroute.sim.launcher import ReplicaSpec as SimReplica
from kvroute.tokenize.check import PROBES, CheckResult, TokenizerCheck
from kvroute.tokenize.prompt import (
    ApproximateTokenizer,
    EngineTokenizer,
    LocalTokenizer,
    PromptTokenizer,
    SwitchingTokenizer,
    build_tokenizers,
)
from kvroute.wire.openai import ParsedRequest, parse_request
from kvroute.wire.prom import EngineStats, render_vllm_metrics

pytestmark = pytest.mark.integration

TEST_SECONDS = 8.0
VECTORS = Path(__file__).resolve().parents[1] / "data" / "vllm-vectors-0.32.json"
_EXAMPLES = json.loads(VECTORS.read_text())["http_examples_v0_32"]
MODELS_EXAMPLE = next(e for e in _EXAMPLES if e["path"] == "/v1/models")["response"]
TOKENIZE_EXAMPLES = [e for e in _EXAMPLES if e["path"] == "/tokenize"]
HELLO = [{"role": "user", "content": "Hello world"}]


def _normalised(body: dict[str, Any]) -> dict[str, Any]:
    """A /tokenize body with vLLM's defaults filled in and output-only options dropped."""
    out = {k: v for k, v in body.items() if k != "return_token_strs"}
    if "messages" in out:
        out.setdefault("add_generation_prompt", True)
    else:
        out.setdefault("add_special_tokens", True)
    return out


class FakeVllm:
    """vLLM-shaped ``/health``, ``/v1/models``, ``/metrics`` and a recorded ``/tokenize``."""

    def __init__(self) -> None:
        self.health_status = 200
        self.tokenize_status = 200
        self.hang = False
        self.received: list[dict[str, Any]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response(copy.deepcopy(MODELS_EXAMPLE))

    async def metrics(self, _: web.Request) -> web.Response:
        text = render_vllm_metrics(
            [EngineStats()], model_name="tiny",
            cache_config={"block_size": "16", "prefix_caching_hash_algo": "sha256"},
        )
        return web.Response(text=text, content_type="text/plain")

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.received.append(body)
        if self.hang:
            await asyncio.sleep(30)  # longer than any tokenize timeout; cancelled at shutdown
        if self.tokenize_status != 200:
            return web.json_response({"error": {"message": "boom"}}, status=self.tokenize_status)
        for example in TOKENIZE_EXAMPLES:
            if _normalised(example["request"]) == _normalised(body):
                return web.json_response(example["response"])
        return web.json_response(
            {"error": {"message": f"no recorded vLLM answer for {body}"}}, status=400
        )

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def make_config(pools: dict[str, dict[str, Any]]) -> RouterConfig:
    doc = {
        "pools": pools,
        "routes": {"m": {"pools": list(pools)}},
        "discovery": {"timeout_s": 3.0},
    }
    return parse_config(doc, env={})


def make_core(config: RouterConfig) -> RouterCore:
    specs = [
        PoolSpec(pool.name, tuple(ReplicaSpec(r.name) for r in pool.replicas))
        for pool in config.pools.values()
    ]
    rng = random.Random(0)
    return RouterCore(specs, lambda: make_policy("round_robin", rng), clock=ManualClock())


def chat(messages: list[dict[str, Any]], **extra: Any) -> ParsedRequest:
    body = {"model": "m", "messages": messages, **extra}
    return parse_request(json.dumps(body).encode(), "chat")


def completion(prompt: Any, **extra: Any) -> ParsedRequest:
    body = {"model": "m", "prompt": prompt, **extra}
    return parse_request(json.dumps(body).encode(), "completions")


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), TEST_SECONDS))


@asynccontextmanager
async def clients() -> AsyncIterator[tuple[aiohttp.ClientSession, EngineClient]]:
    """The router's two clients: aiohttp's for discovery, the engine client for /tokenize."""
    client = EngineClient(connect_timeout_s=2.0, total_timeout_s=30.0)
    try:
        async with aiohttp.ClientSession() as session:
            yield session, client
    finally:
        await client.close()


class Rig:
    def __init__(self, config: RouterConfig,
                 clients: tuple[aiohttp.ClientSession, EngineClient]) -> None:
        session, self.client = clients
        self.metrics = RouterMetrics()
        self.core = make_core(config)
        self.discovery = Discovery(config, self.core, session, self.metrics,
                                   clock=ManualClock())
        self.tokenizers = build_tokenizers(config, self.discovery, self.client, self.metrics)

    def count(self, pool: str, outcome: str) -> float:
        return self.metrics.value(
            "kvroute_tokenize_total", {"pool": pool, "outcome": outcome}
        ) or 0.0


@asynccontextmanager
async def fakes(n: int) -> AsyncIterator[list[FakeVllm]]:
    servers = [FakeVllm() for _ in range(n)]
    for s in servers:
        await s.start()
    try:
        yield servers
    finally:
        for s in servers:
            await s.stop()


def engine_pool(servers: list[FakeVllm], **extra: Any) -> dict[str, Any]:
    """A pool of ``servers`` on the engines' ``/tokenize`` (``extra`` may say otherwise)."""
    return {
        "model": "tiny",
        "tokenizer": "engine",
        "replicas": [{"name": f"r{i}", "url": s.url} for i, s in enumerate(servers)],
        **extra,
    }


def test_engine_mode_sends_vllms_own_request_shapes() -> None:
    async def go() -> None:
        async with fakes(1) as (a,), clients() as session:
            rig = Rig(make_config({"p": engine_pool([a])}), session)
            await rig.discovery.refresh_now()
            tok = rig.tokenizers["p"]
            assert isinstance(tok, EngineTokenizer) and tok.mode == "engine"
            assert await tok.token_ids(chat(HELLO)) == [
                0, 30, 94, 360, 94, 32, 406, 368, 201, 30, 94, 67, 334, 399, 94, 32,
            ]
            assert await tok.token_ids(chat(HELLO, add_generation_prompt=False)) == [
                0, 30, 94, 360, 94, 32, 406, 368, 201,
            ]
            assert await tok.token_ids(completion("Hello world")) == [406, 368]
            assert a.received[0] == {
                "model": "tiny", "messages": HELLO, "add_generation_prompt": True,
            }
            assert a.received[2] == {
                "model": "tiny", "prompt": "Hello world", "add_special_tokens": True,
            }
            assert rig.count("p", "ok") == 3

    run(go)


def test_identical_prompts_are_tokenized_once() -> None:
    """A burst of five identical prompts (siblings) makes one call; a repeat within the TTL
    none; a different prompt its own; a stale entry is asked again."""
    async def go() -> None:
        async with fakes(1) as (a,), clients() as session:
            rig = Rig(make_config({"p": engine_pool([a])}), session)
            await rig.discovery.refresh_now()
            tok = rig.tokenizers["p"]
            assert isinstance(tok, EngineTokenizer)
            burst = await asyncio.gather(*(tok.token_ids(chat(HELLO)) for _ in range(5)))
            assert all(ids == burst[0] and ids is not burst[0] for ids in burst[1:])
            assert len(a.received) == 1
            assert (rig.count("p", "ok"), rig.count("p", "shared")) == (1, 4)
            again = await tok.token_ids(chat(HELLO))
            assert again == burst[0] and len(a.received) == 1 and rig.count("p", "cached") == 1
            assert await tok.token_ids(completion("Hello world")) == [406, 368]
            assert len(a.received) == 2
            tok.recent_ttl_s = 0.0  # every entry is now stale
            await asyncio.sleep(0.01)
            assert await tok.token_ids(chat(HELLO)) == burst[0]
            assert len(a.received) == 3

    run(go)


def test_a_failed_call_is_shared_as_a_failure_and_not_remembered() -> None:
    async def go() -> None:
        async with fakes(1) as (a,), clients() as session:
            rig = Rig(make_config({"p": engine_pool([a])}), session)
            await rig.discovery.refresh_now()
            tok = rig.tokenizers["p"]
            a.tokenize_status = 500
            both = await asyncio.gather(tok.token_ids(chat(HELLO)), tok.token_ids(chat(HELLO)))
            assert both == [None, None] and len(a.received) == 1
            a.tokenize_status = 200
            assert await tok.token_ids(chat(HELLO)) is not None
            assert len(a.received) == 2

    run(go)


def test_engine_mode_forwards_tools_and_template_options() -> None:
    async def go() -> None:
        async with fakes(1) as (a,), clients() as session:
            rig = Rig(make_config({"p": engine_pool([a])}), session)
            await rig.discovery.refresh_now()
            tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
            await rig.tokenizers["p"].token_ids(
                chat(HELLO, tools=tools, chat_template_kwargs={"enable_thinking": False},
                     temperature=0.2, max_tokens=5)
            )
            assert a.received[-1] == {
                "model": "tiny", "messages": HELLO, "add_generation_prompt": True,
                "tools": tools, "chat_template_kwargs": {"enable_thinking": False},
            }

    run(go)


def test_token_ids_and_unsupported_prompts_need_no_call() -> None:
    async def go() -> None:
        async with fakes(1) as (a,), clients() as session:
            rig = Rig(make_config({"p": engine_pool([a])}), session)
            await rig.discovery.refresh_now()
            tok = rig.tokenizers["p"]
            assert await tok.token_ids(completion([5, 6, 7])) == [5, 6, 7]
            assert await tok.token_ids(completion([[5, 6]])) == [5, 6]
            image = [{"role": "user", "content": [
                {"type": "text", "text": "what is this"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ]}]
            assert await tok.token_ids(chat(image)) is None  # mm hashes: cannot reproduce
            assert await tok.token_ids(completion(["a", "b"])) is None  # several prompts
            assert a.received == []
            assert rig.count("p", "token_ids") == 2
            assert rig.count("p", "unsupported") == 2

    run(go)


def test_round_robin_over_healthy_replicas_only() -> None:
    async def go() -> None:
        async with fakes(3) as servers, clients() as session:
            rig = Rig(make_config({"p": engine_pool(servers)}), session)
            await rig.discovery.refresh_now()
            tok = rig.tokenizers["p"]
            assert isinstance(tok, EngineTokenizer)
            tok.recent_ttl_s = -1.0  # no answer reused: every call goes to a replica
            for _ in range(6):
                assert await tok.token_ids(chat(HELLO)) is not None
            assert [len(s.received) for s in servers] == [2, 2, 2]
            servers[1].health_status = 503
            await rig.discovery.refresh_now()
            await rig.discovery.refresh_now()
            assert rig.discovery.healthy_replicas("p") == ["r0", "r2"]
            for _ in range(4):
                assert await tok.token_ids(chat(HELLO)) is not None
            assert [len(s.received) for s in servers] == [4, 2, 4]

    run(go)


def test_failures_return_none_are_counted_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def go() -> None:
        async with fakes(1) as (a,), clients() as session:
            rig = Rig(make_config({"p": engine_pool([a])}), session)
            await rig.discovery.refresh_now()
            tok = rig.tokenizers["p"]
            assert isinstance(tok, EngineTokenizer)
            a.tokenize_status = 500
            assert await tok.token_ids(chat(HELLO)) is None
            assert await tok.token_ids(chat(HELLO)) is None
            assert rig.count("p", "error") == 2 and tok.failing
            a.tokenize_status = 200
            assert await tok.token_ids(chat(HELLO)) is not None
            assert not tok.failing

    with caplog.at_level(logging.WARNING, logger="kvroute.tokenize.prompt"):
        run(go)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([m for m in warnings if "routed APPROXIMATELY" in m]) == 1
    assert len([m for m in warnings if "exact routing resumed" in m]) == 1


def test_timeout_and_no_replica() -> None:
    async def go() -> None:
        async with fakes(1) as (a,), clients() as session:
            config = make_config({"p": engine_pool([a])})
            rig = Rig(config, session)
            await rig.discovery.refresh_now()
            tok = EngineTokenizer(config.pools["p"], rig.discovery, rig.client, rig.metrics,
                                  timeout_s=0.2)
            a.hang = True
            loop = asyncio.get_running_loop()
            started = loop.time()
            assert await tok.token_ids(chat(HELLO)) is None
            assert loop.time() - started < 2.0
            assert rig.count("p", "timeout") == 1
            a.hang = False
            a.health_status = 503
            await rig.discovery.refresh_now()
            await rig.discovery.refresh_now()
            assert await tok.token_ids(chat(HELLO)) is None
            assert rig.count("p", "no_replica") == 1

    run(go)


def test_a_refused_tokenize_moves_to_the_next_replica_and_takes_the_dead_one_out() -> None:
    """Nothing listens on one replica's port: the answer comes at once, so the next healthy
    replica is asked and the request keeps its exact tokens; the dead replica is reported
    to discovery (out of routing at once), as a refused inference request would be."""

    async def go() -> None:
        async with fakes(2) as (a, b), clients() as session:
            config = make_config({"p": engine_pool([a, b])})
            rig = Rig(config, session)
            await rig.discovery.refresh_now()
            tok = EngineTokenizer(config.pools["p"], rig.discovery, rig.client, rig.metrics)
            tok.recent_ttl_s = -1.0  # every call asks an engine (the fakes know one prompt)
            await a.stop()
            for _ in range(2):  # whichever replica the round robin starts on
                assert await tok.token_ids(chat(HELLO)) is not None
                assert not tok.failing
            assert rig.count("p", "refused") == 1 and rig.count("p", "ok") == 2
            assert rig.discovery.healthy_replicas("p") == [config.pools["p"].replicas[1].name]
            assert len(b.received) == 2
            await b.stop()
            assert await tok.token_ids(chat(HELLO)) is None  # no replica left to ask
            assert tok.failing

    run(go)


def test_approximate_mode_is_visible_in_metrics(caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        async with fakes(2) as (a, b), clients() as session:
            config = make_config({
                "exact": engine_pool([a]),
                "approx": {"model": "tiny", "tokenizer": "none",
                           "replicas": [{"name": "x0", "url": b.url}]},
            })
            rig = Rig(config, session)
            await rig.discovery.refresh_now()
            tok = rig.tokenizers["approx"]
            assert isinstance(tok, ApproximateTokenizer) and tok.mode == "approximate"
            assert await tok.token_ids(chat(HELLO)) is None
            assert b.received == []
            value = rig.metrics.value
            assert value("kvroute_tokenizer_mode", {"pool": "approx", "mode": "approximate"}) == 1
            assert value("kvroute_tokenizer_mode", {"pool": "approx", "mode": "engine"}) == 0
            assert value("kvroute_tokenizer_mode", {"pool": "exact", "mode": "engine"}) == 1
            assert value("kvroute_pool_approximate", {"pool": "approx"}) == 1
            assert value("kvroute_pool_approximate", {"pool": "exact"}) == 0
            body, content_type = rig.metrics.render()
            assert b'kvroute_pool_approximate{pool="approx"} 1.0' in body
            assert content_type.startswith("text/plain")

    with caplog.at_level(logging.WARNING, logger="kvroute.tokenize.prompt"):
        run(go)
    assert any("pool approx: tokenizer none" in r.getMessage() for r in caplog.records)


# -- local mode and the simulated engine ------------------------------------------------------

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t.function.name }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}</s>{% endif %}{% endif %}"
)
WORDS = [
    "user", "assistant", "system", "hello", "world", "the", "quick", "brown", "fox", "jumps",
    "over", "lazy", "dog", "#", "Tools", "get_weather",
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(specials + WORDS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials[:4])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 0)])
    root = tmp_path_factory.mktemp("hf-tiny")
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE,
    }))
    return root


@pytest.fixture(scope="module")
def sim_fleet(hf_dir: Path) -> Iterator[Fleet]:
    specs = [
        SimReplica(name=f"s{i}", pool="p", model="tiny", tokenizer=str(hf_dir),
                   max_model_len=256)
        for i in range(2)
    ]
    with start_fleet(specs, timeout_s=20.0) as running:
        yield running


def test_engine_and_local_modes_agree_with_the_engine(sim_fleet: Fleet, hf_dir: Path) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    conversation = [
        {"role": "system", "content": "the quick brown fox"},
        {"role": "user", "content": [{"type": "text", "text": "hello world"}]},
        {"role": "assistant", "content": "jumps over"},
        {"role": "user", "content": "the lazy dog"},
    ]
    requests = [
        chat(conversation),
        chat(conversation, tools=tools),
        chat(conversation, chat_template_kwargs={"enable_thinking": False}),
        chat(conversation, add_generation_prompt=False, continue_final_message=True),
        completion("hello world the lazy dog"),
        completion("hello world", add_special_tokens=False),
    ]

    async def go() -> None:
        async with clients() as both:
            session = both[0]
            replicas = [{"name": h.name, "url": h.url} for h in sim_fleet.replicas]
            config = make_config({
                "eng": {"model": "tiny", "replicas": replicas},
                "loc": {"model": "tiny", "tokenizer": {"local": str(hf_dir)},
                        "replicas": [{"name": "l0", "url": replicas[0]["url"]}]},
            })
            rig = Rig(config, both)
            await rig.discovery.refresh_now()
            engine: PromptTokenizer = rig.tokenizers["eng"]
            checked = rig.tokenizers["loc"]  # a local tokenizer the router checks at start
            assert isinstance(checked, SwitchingTokenizer) and checked.mode == "local"
            local = checked.local
            assert isinstance(local, LocalTokenizer)
            for req in requests:
                via_engine = await engine.token_ids(req)
                via_local = await local.token_ids(req)
                assert via_engine is not None and via_local is not None, req.body
                assert via_engine == list(via_local), req.body  # a list and an array('I')
            assert rig.count("eng", "ok") == len(requests)
            # The ids are what the engine counts as the prompt of the completion itself.
            ids = await engine.token_ids(chat(conversation, tools=tools))
            assert ids is not None and ids[0] == 0  # BOS written by the template
            async with session.post(
                replicas[1]["url"] + "/v1/chat/completions",
                json={"model": "tiny", "messages": conversation, "tools": tools,
                      "max_tokens": 1},
            ) as resp:
                answer = await resp.json()
            assert answer["usage"]["prompt_tokens"] == len(ids)

    run(go)


def test_local_mode_errors_name_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        hf_dir: Path) -> None:
    metrics = RouterMetrics()
    with pytest.raises(ConfigError, match=r"pools\.p\.tokenizer\.local: .*no tokenizer\.json"):
        LocalTokenizer.load("p", str(tmp_path), metrics)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if the extra were not installed
    with pytest.raises(ConfigError, match=r"pip install 'kvroute\[hf\]'"):
        LocalTokenizer.load("p", str(hf_dir), metrics)


def test_local_mode_template_error_returns_none(hf_dir: Path, tmp_path: Path) -> None:
    strict = tmp_path / "strict"
    strict.mkdir()
    (strict / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    (strict / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
        "{% if messages[0].role != 'system' %}{{ raise_exception('system message first') }}"
        "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )}))
    metrics = RouterMetrics()
    tok = LocalTokenizer.load("p", str(strict), metrics)

    async def go() -> None:
        # A content list with a non-text part never reaches the template (unsupported) ...
        assert await tok.token_ids(chat([{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}])) is None
        # ... a template that raises is a None, not an exception ...
        assert await tok.token_ids(chat(HELLO)) is None
        # ... and one it accepts is encoded.
        ids = await tok.token_ids(chat([{"role": "system", "content": "hello world"}]))
        assert ids is not None and list(ids) == [8, 9]

    run(go)
    assert metrics.value("kvroute_tokenize_total", {"pool": "p", "outcome": "unsupported"}) == 1
    assert metrics.value("kvroute_tokenize_total", {"pool": "p", "outcome": "error"}) == 1
    assert metrics.value("kvroute_tokenize_total", {"pool": "p", "outcome": "ok"}) == 1


# -- the check of local and auto tokenizers (tokenize/check.py) -------------------------------

CONVERSATION = [
    {"role": "system", "content": "the quick brown fox"},
    {"role": "user", "content": "hello world"},
]


@pytest.fixture(scope="module")
def other_dir(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``hf_dir`` with a chat template that writes one word more: same vocabulary, other ids
    (as an engine started with its own ``--chat-template`` would give)."""
    root = tmp_path_factory.mktemp("hf-other")
    (root / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "hello " + config["chat_template"]
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def sim_pool(fleet: Fleet, tokenizer: Any) -> dict[str, Any]:
    """A pool of ``fleet``'s replicas serving ``tiny`` with the given tokenizer setting."""
    return {"model": "tiny", "tokenizer": tokenizer,
            "replicas": [{"name": h.name, "url": h.url} for h in fleet.replicas]}


def check_of(rig: Rig, pool: str) -> tuple[TokenizerCheck, SwitchingTokenizer]:
    target = rig.tokenizers[pool]
    assert isinstance(target, SwitchingTokenizer)
    check = TokenizerCheck(
        pool=pool, model="tiny", target=target, discovery=rig.discovery, client=rig.client,
        metrics=rig.metrics, load=lambda path: LocalTokenizer.load(pool, path, rig.metrics),
    )
    return check, target


def check_gauges(metrics: RouterMetrics, pool: str) -> dict[str, float | None]:
    return {result: metrics.value("kvroute_tokenizer_check", {"pool": pool, "result": result})
            for result in TOKENIZER_CHECKS}


def mode_of(metrics: RouterMetrics, pool: str) -> str:
    modes = [m for m in TOKENIZER_MODES
             if metrics.value("kvroute_tokenizer_mode", {"pool": pool, "mode": m}) == 1]
    assert len(modes) == 1, modes
    return modes[0]


def test_the_check_results_are_the_exported_ones() -> None:
    assert typing.get_args(CheckResult) == TOKENIZER_CHECKS


def test_a_matching_local_tokenizer_is_verified_and_kept(sim_fleet: Fleet, hf_dir: Path) -> None:
    async def go() -> None:
        async with clients() as both:
            rig = Rig(make_config({"loc": sim_pool(sim_fleet, {"local": str(hf_dir)})}), both)
            check, target = check_of(rig, "loc")
            assert check_gauges(rig.metrics, "loc")["pending"] == 1
            await rig.discovery.refresh_now()
            assert await check.check_once() == "verified"
            assert f"{len(PROBES)} probes matched" in check.detail
            assert target.mode == "local" and isinstance(target.local, LocalTokenizer)
            assert mode_of(rig.metrics, "loc") == "local"
            gauges = check_gauges(rig.metrics, "loc")
            assert gauges["verified"] == 1 and gauges["pending"] == 0
            assert rig.count("loc", "ok") == 0  # the probes are not requests

    run(go)


def test_a_local_tokenizer_that_differs_falls_back_to_the_engines(
        sim_fleet: Fleet, other_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        async with clients() as both:
            rig = Rig(make_config({"loc": sim_pool(sim_fleet, {"local": str(other_dir)})}), both)
            check, target = check_of(rig, "loc")
            await rig.discovery.refresh_now()
            with caplog.at_level(logging.ERROR, logger="kvroute.tokenize.check"):
                assert await check.check_once() == "mismatch"
            assert "first difference at position 0" in check.detail, check.detail
            assert target.mode == "engine" and target.local is None
            assert mode_of(rig.metrics, "loc") == "engine"
            assert check_gauges(rig.metrics, "loc")["mismatch"] == 1
            [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
            assert "does NOT give the engines' ids" in record.getMessage()
            assert "pools.loc.tokenizer.local" in record.getMessage()
            # Requests now get the engines' own ids, through /tokenize.
            ids = await target.token_ids(chat(CONVERSATION))
            assert rig.count("loc", "ok") == 1
            async with both[0].post(sim_fleet.replicas[0].url + "/tokenize", json={
                    "model": "tiny", "messages": CONVERSATION}) as resp:
                assert ids == (await resp.json())["tokens"]

    run(go)


def test_auto_adopts_the_engines_model_directory_when_it_matches(sim_fleet: Fleet) -> None:
    async def go() -> None:
        async with clients() as both:
            rig = Rig(make_config({"a": sim_pool(sim_fleet, "auto")}), both)
            check, target = check_of(rig, "a")
            assert target.mode == "engine" and mode_of(rig.metrics, "a") == "engine"
            await rig.discovery.refresh_now()
            before = await target.token_ids(chat(CONVERSATION))  # via /tokenize
            assert await check.check_once() == "verified", check.detail
            assert target.mode == "local" and isinstance(target.local, LocalTokenizer)
            assert mode_of(rig.metrics, "a") == "local"
            after = await target.token_ids(chat([*CONVERSATION, {"role": "assistant",
                                                                  "content": "jumps"}]))
            assert after is not None and before is not None
            assert list(after)[:len(before) - 2] == before[:-2]  # same ids, longer chat
            assert target.local is not None and target.local.pieces.misses > 0

    run(go)


def test_auto_stays_on_the_engines_when_their_directory_is_not_here_or_differs(
        hf_dir: Path, other_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    specs = [
        SimReplica(name="hub", pool="p", model="tiny", tokenizer=str(hf_dir),
                   root="acme/tiny-model", max_model_len=256),
        SimReplica(name="other", pool="p", model="tiny", tokenizer=str(hf_dir),
                   root=str(other_dir), max_model_len=256),
    ]

    async def go(fleet: Fleet) -> None:
        async with clients() as both:
            hub, other = ({"name": h.name, "url": h.url} for h in fleet.replicas)
            rig = Rig(make_config({
                "a": {"model": "tiny", "replicas": [hub], "tokenizer": "auto"},
                "b": {"model": "tiny", "replicas": [other], "tokenizer": "auto"},
            }), both)
            (check_a, a), (check_b, b) = check_of(rig, "a"), check_of(rig, "b")
            await rig.discovery.refresh_now()
            with caplog.at_level(logging.INFO, logger="kvroute.tokenize.check"):
                assert await check_a.check_once() == "no_local"
                assert await check_b.check_once() == "mismatch"
            assert "'acme/tiny-model' is not a directory with tokenizer.json" in check_a.detail
            assert a.mode == "engine" and b.mode == "engine"
            assert check_gauges(rig.metrics, "a")["no_local"] == 1
            assert check_gauges(rig.metrics, "b")["mismatch"] == 1
            assert any(r.levelno == logging.WARNING and "gives other ids" in r.getMessage()
                       for r in caplog.records)

    with start_fleet(specs, timeout_s=20.0) as fleet:
        run(lambda: go(fleet))


def test_a_local_tokenizer_stays_unverified_when_the_engine_cannot_tokenize(
        hf_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        async with clients() as both, fakes(1) as servers:
            servers[0].tokenize_status = 404  # no /tokenize: not a vLLM, or an old one
            pool = engine_pool(servers, tokenizer={"local": str(hf_dir)})
            rig = Rig(make_config({"loc": pool}), both)
            check, target = check_of(rig, "loc")
            await rig.discovery.refresh_now()
            with caplog.at_level(logging.WARNING, logger="kvroute.tokenize.check"):
                assert await check.check_once() == "unverifiable"
            assert "HTTP 404" in check.detail
            assert target.mode == "local" and mode_of(rig.metrics, "loc") == "local"
            assert any("UNVERIFIED" in r.getMessage() for r in caplog.records)

    run(go)


def test_the_router_checks_at_start_and_serves_through_the_switch(
        sim_fleet: Fleet) -> None:
    data: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {"p": {"model": "tiny", "tokenizer": "auto", "replicas": [
            {"name": h.name, "url": h.url} for h in sim_fleet.replicas]}},
        "routes": {"m": {"pools": ["p"]}},
        "discovery": {"health_interval_s": 0.5, "metrics_interval_s": 0.5},
        "log_level": "warning",
    }
    config = parse_config(data, env={})

    async def go() -> None:
        async with RouterRuntime(config, env={}) as rt, aiohttp.ClientSession() as session:
            check = rt.tokenizer_checks["p"]
            for _ in range(100):
                if check.rounds:
                    break
                await asyncio.sleep(0.05)
            assert check.result == "verified", check.detail
            rt.sync_metrics()
            piece = {"pool": "p", "stat": "hits"}
            hits_before = rt.metrics.value("kvroute_token_piece_cache", piece) or 0.0
            for question in ("hello world", "the lazy dog"):
                async with session.post(rt.url + "/v1/chat/completions", json={
                        "model": "m", "max_tokens": 1, "messages": [
                            CONVERSATION[0], {"role": "user", "content": question}]}) as resp:
                    assert resp.status == 200, await resp.text()
            async with session.get(rt.url + "/metrics") as resp:
                text = await resp.text()
            assert 'kvroute_tokenizer_mode{mode="local",pool="p"} 1.0' in text
            assert 'kvroute_tokenizer_check{pool="p",result="verified"} 1.0' in text
            # The second request found the system prompt's piece: served in-process.
            assert (rt.metrics.value("kvroute_token_piece_cache", piece) or 0.0) > hits_before

    run(go)


def test_later_rounds_ask_each_replica_in_turn_and_switch_both_ways(
        sim_fleet: Fleet, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def go() -> None:
        async with clients() as both:
            rig = Rig(make_config({"a": sim_pool(sim_fleet, "auto")}), both)
            check, target = check_of(rig, "a")
            await rig.discovery.refresh_now()
            with caplog.at_level(logging.DEBUG, logger="kvroute.tokenize.check"):
                assert await check.check_once() == "verified"
                asked = [check.detail.split()[-4]]  # "... matched URL id for id"
                assert await check.check_once() == "verified"
                asked.append(check.detail.split()[-4])
            assert sorted(asked) == sorted(h.url + "/tokenize" for h in sim_fleet.replicas)
            adopted = target.local
            assert adopted is not None
            infos = [r for r in caplog.records if r.levelno == logging.INFO]
            assert len(infos) == 1  # the second round confirmed: logged at debug only
            # The engines now tokenize differently (as after a restart on another revision):
            # the next round goes back to /tokenize and forgets the loaded directory ...
            real = type(adopted).encode_body
            monkeypatch.setattr(type(adopted), "encode_body",
                                lambda self, body: [*real(self, body), 1])
            assert await check.check_once() == "mismatch"
            assert target.mode == "engine" and mode_of(rig.metrics, "a") == "engine"
            # ... and a round after the directory is right again adopts it afresh.
            monkeypatch.setattr(type(adopted), "encode_body", real)
            assert await check.check_once() == "verified"
            assert target.mode == "local" and target.local is not adopted
            assert check.rounds == 4

    run(go)
