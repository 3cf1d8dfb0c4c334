"""Context-window tiers end to end: a 2,048-token pool and an 8,192-token pool behind one route.

Real ``kvroute sim serve`` engines on loopback (``sim.launcher.start_fleet``), the router in
the test's event loop (``RouterRuntime``). Each small engine words its overflow errors as one
engine family does (``--error-style``), so the reactive path meets every wording.

How the tests control the estimate, honestly:

* The simulated tokenizer makes each whitespace-separated word one token. Words of three
  letters (four bytes with the space) make the router's heuristic band ``[bytes/4, bytes/3]``
  bracket the true count, as for English prose; with ``tokenizer: engine`` the router also
  gets exact counts from ``/tokenize``. That is the proactive setting.
* Words of one letter (two bytes a token, like digit-heavy or CJK-poor-tokenizer text) make
  the estimate LOW by a third to a half, and ``tokenizer: none`` takes away the exact count:
  the router then sends requests that do not fit, and only the reactive path can save them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import signal
import string
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from typing import Any, Self

import aiohttp
import pytest
from aiohttp import web

from kvroute.config import RouterConfig, parse_config
from kvroute.core.types import ReplicaId
from kvroute.shell.runtime import RouterRuntime
from kvroute.sim.launcher import Fleet, ReplicaHandle, ReplicaSpec, start_fleet
from kvroute.wire.overflow import OverflowKind, gateway_recognises_overflow, parse_overflow
from kvroute.wire.prom import parse_vllm_metrics

pytestmark = pytest.mark.integration

SMALL_MODEL = "sim-small"
LARGE_MODEL = "sim-large"
SMALL_WINDOW = 2048
LARGE_WINDOW = 8192
TIMING = "0.001,0.00002,0.0002,0"
STYLES = ("vllm-0.32", "vllm-0.18-0.31", "vllm-0.16-0.17", "vllm-0.10.1-0.15", "vllm-0.10",
          "sglang", "sglang-0.4", "llamacpp", "tgi")
REJECTING = "vllm-0.18-0.31"
"""The small engine of the proactive tests rejects prompt + max_tokens over its window, so any
doomed attempt would show as an overflow answer."""


def run(coro: Coroutine[Any, Any, None], timeout_s: float = 15.0) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout_s))


def small_spec(style: str, *, name: str | None = None, window: int = SMALL_WINDOW) -> ReplicaSpec:
    return ReplicaSpec(name=name or f"s-{style}", pool=f"small-{style}", model=SMALL_MODEL,
                       max_model_len=window, error_style=style, extra_args=("--timing", TIMING))


def large_spec(name: str = "l0") -> ReplicaSpec:
    return ReplicaSpec(name=name, pool="large", model=LARGE_MODEL, max_model_len=LARGE_WINDOW,
                       extra_args=("--timing", TIMING))


def replica_entry(r: ReplicaHandle) -> dict[str, Any]:
    rep: dict[str, Any] = {"name": r.name, "url": r.url, "prefill_rate_tps": 50_000.0}
    if r.kv_events:
        rep["kv_events"] = r.kv_events
    if r.kv_replay:
        rep["kv_replay"] = r.kv_replay
    return rep


def tier_config(smalls: Sequence[ReplicaHandle], large: Sequence[dict[str, Any]], *,
                tokenizer: str = "engine", warm: Mapping[str, Any] | None = None,
                env: Mapping[str, str] | None = None, **overrides: Any) -> RouterConfig:
    """One route per small engine (``r-<style>``), each ``[small-<style>, large]``."""
    pools: dict[str, Any] = {"large": {"model": LARGE_MODEL, "tokenizer": tokenizer,
                                       "replicas": list(large)}}
    routes: dict[str, Any] = {}
    for r in smalls:
        pools[r.pool] = {"model": SMALL_MODEL, "tokenizer": tokenizer,
                         "replicas": [replica_entry(r)]}
        routes["r-" + r.pool.removeprefix("small-")] = {"pools": [r.pool, "large"]}
    data: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": pools,
        "routes": routes,
        "policy": {"name": "kvroute", "seed": 7},
        "discovery": {"health_interval_s": 0.5, "metrics_interval_s": 1.0,
                      "models_interval_s": 30, "timeout_s": 1.0},
        "timeouts": {"connect_s": 1.0, "first_byte_s": 8.0, "total_s": 10.0},
        "warm_ahead": {"enabled": True, **(warm or {})},
        "log_level": "warning",
    }
    data.update(overrides)
    return parse_config(data, env=env or {})


@pytest.fixture(scope="module")
def style_fleet() -> Iterator[Fleet]:
    """One small engine per error style and one large engine, shared by the module."""
    fleet = start_fleet([*(small_spec(s) for s in STYLES), large_spec()], timeout_s=30.0)
    try:
        yield fleet
    finally:
        fleet.stop()


def smalls_of(fleet: Fleet) -> list[ReplicaHandle]:
    return [r for r in fleet.replicas if r.pool.startswith("small-")]


def large_of(fleet: Fleet) -> list[dict[str, Any]]:
    return [replica_entry(r) for r in fleet.by_pool("large")]


# -- text and requests ----------------------------------------------------------------------


def words3(rng: random.Random, n: int) -> str:
    """``n`` three-letter words: one token each, four bytes each (heuristic ≈ exact)."""
    letters = string.ascii_lowercase
    return " ".join("".join(rng.choice(letters) for _ in range(3)) for _ in range(n))


def words1(rng: random.Random, n: int) -> str:
    """``n`` one-letter words: one token each, two bytes each (heuristic ≈ 0.5-0.67×)."""
    return " ".join(rng.choice(string.ascii_lowercase) for _ in range(n))


def chat_body(route: str, messages: list[dict[str, Any]], *, max_tokens: int | None = 16,
              stream: bool = False, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": route, "messages": messages, "stream": stream}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra)
    return body


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


class Reply:
    def __init__(self, status: int, headers: Mapping[str, str], raw: bytes,
                 elapsed_s: float) -> None:  # fmt: skip
        self.status = status
        self.headers = headers
        self.raw = raw
        self.elapsed_s = elapsed_s

    @property
    def pool(self) -> str:
        return self.headers.get("x-kvroute-pool", "")

    def json(self) -> dict[str, Any]:
        if self.raw.startswith(b"data:"):
            return self._from_stream()
        doc = json.loads(self.raw)
        assert isinstance(doc, dict)
        return doc

    def _from_stream(self) -> dict[str, Any]:
        text, finish, usage = [], None, None
        for line in self.raw.decode().splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = json.loads(line[6:])
            assert "error" not in doc, doc
            for choice in doc.get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
                finish = choice.get("finish_reason") or finish
            usage = doc.get("usage") or usage
        return {"choices": [{"message": {"content": "".join(text)}, "finish_reason": finish}],
                "usage": usage}

    def content(self) -> str:
        return str(self.json()["choices"][0]["message"]["content"])


class Client:
    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session = session
        self.url = url

    async def chat(self, body: Mapping[str, Any], session_id: str | None = None) -> Reply:
        headers = {"Content-Type": "application/json"}
        if session_id is not None:
            headers["x-session-id"] = session_id
        started = time.monotonic()
        async with self.session.post(self.url + "/v1/chat/completions",
                                     data=json.dumps(body).encode(), headers=headers) as resp:
            raw = await resp.read()
            return Reply(resp.status, resp.headers.copy(), raw, time.monotonic() - started)


async def engine_metrics(session: aiohttp.ClientSession, url: str, model: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    parsed = parse_vllm_metrics(text, model)
    assert parsed.found, f"{url}/metrics has no vllm series for {model}"
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                     "vllm:request_success_total", "vllm:prompt_tokens_total"):
            if line.startswith((name + "{", name + " ")):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def counter(rt: RouterRuntime, name: str, **labels: str) -> float:
    return rt.metrics.value(f"kvroute_{name}_total", dict(labels)) or 0.0


def overflows(rt: RouterRuntime, replica: str) -> float:
    return counter(rt, "upstream_errors", replica=replica, kind="overflow")


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)


async def with_router(config: RouterConfig, body: Callable[[RouterRuntime, Client], Awaitable[None]],
                      env: Mapping[str, str] | None = None) -> None:
    async with RouterRuntime(config, env=env or {}) as rt, aiohttp.ClientSession() as session:
        await body(rt, Client(session, rt.url))


# -- proactive: growing sessions ------------------------------------------------------------


@pytest.mark.parametrize("warm_on", [True, False], ids=["warm", "no-warm"])
def test_a_growing_session_crosses_the_small_window_without_a_failure(
    style_fleet: Fleet, warm_on: bool,
) -> None:
    """Every turn 200; no doomed attempt on the small engine; the escalated prefill is mostly
    a cache hit on the large engine when warm-ahead is on, and not when it is off."""
    rng = random.Random(11 if warm_on else 12)
    small = next(r for r in smalls_of(style_fleet) if r.pool == f"small-{REJECTING}")
    large = style_fleet.by_pool("large")[0]
    env = {} if warm_on else {"KVROUTE_WARM_AHEAD": "0"}
    config = tier_config([small], large_of(style_fleet), env=env)
    route = f"r-{REJECTING}"
    # Turn 1: a 1,482-word system prompt, 1,500 prompt tokens (over 0.6 × 2,048: warm-ahead
    # fires); each later turn adds 260 (a 32-token answer and a 222-word question, with
    # framing); turn 3 (2,020 + max_tokens 32) no longer fits the small window and escalates.
    # The output floor is min(256, max_tokens) = 32 here.
    messages: list[dict[str, Any]] = [{"role": "system", "content": words3(rng, 1482)},
                                      user(words3(rng, 10))]

    async def body(rt: RouterRuntime, c: Client) -> None:
        async with aiohttp.ClientSession() as direct:
            small_before = await engine_metrics(direct, small.url, SMALL_MODEL)
            pools: list[str] = []
            ratio = None
            for turn in range(5):
                stream = turn % 2 == 1
                if turn == 2 and warm_on:
                    # Warmed at 0.73 and again at 0.86 of the window (one growth stage each).
                    await wait_for(lambda: counter(rt, "warm", outcome="completed",
                                                   reason="large") == 2, what="the warm-ups")
                before = await engine_metrics(direct, large.url, LARGE_MODEL)
                reply = await c.chat(chat_body(route, messages, max_tokens=32, stream=stream),
                                     session_id="grow-" + str(warm_on))
                assert reply.status == 200, reply.raw[:300]
                pools.append(reply.pool)
                if reply.pool == "large" and ratio is None:
                    after = await engine_metrics(direct, large.url, LARGE_MODEL)
                    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
                    queries = (after["vllm:prefix_cache_queries_total"]
                               - before["vllm:prefix_cache_queries_total"])
                    ratio = hits / queries
                messages.extend([{"role": "assistant", "content": reply.content()},
                                 user(words3(rng, 222))])
            small_after = await engine_metrics(direct, small.url, SMALL_MODEL)
        assert pools == [f"small-{REJECTING}"] * 2 + ["large"] * 3, pools
        assert ratio is not None
        print(f"escalated prefill cached on the large engine: {ratio:.3f} (warm {warm_on})")
        if warm_on:
            assert ratio > 0.7, f"escalated prefill only {ratio:.2f} cached"
            assert counter(rt, "warm", outcome="hit", reason="") == 1
        else:
            assert ratio < 0.05, f"{ratio:.2f} cached without warm-ahead"
            assert counter(rt, "warm", outcome="fired", reason="large") == 0
            assert counter(rt, "warm", outcome="skipped", reason="disabled") == 5
        # The proactive path made no doomed attempt: the small engine answered every request
        # the router sent it, and the router saw no overflow anywhere.
        served = small_after["vllm:request_success_total"] - small_before["vllm:request_success_total"]
        assert served == 2
        assert overflows(rt, small.name) == 0 and overflows(rt, large.name) == 0
        assert counter(rt, "escalations", from_pool=small.pool, to_pool="large",
                       kind="proactive") == 1  # the session stays on large afterwards

    run(with_router(config, body, env))


# -- reactive: the estimate is wrong ----------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("style", STYLES)
def test_the_reactive_path_recovers_from_every_engines_overflow(
    style_fleet: Fleet, style: str, stream: bool,
) -> None:
    """No tokenizer and two-byte tokens: the router's estimate is about 0.6× the truth, so it
    sends prompts that do not fit; each engine's own rejection is parsed and acted on."""
    rng = random.Random(hash((style, stream)) & 0xFFFF)
    small = next(r for r in smalls_of(style_fleet) if r.pool == f"small-{style}")
    config = tier_config([small], large_of(style_fleet), tokenizer="none")
    route = f"r-{style}"

    async def body(rt: RouterRuntime, c: Client) -> None:
        # 2,400 tokens (the estimate says ≈1,600): over the small window on any engine.
        reply = await c.chat(chat_body(route, [user(words1(rng, 2400))], max_tokens=64,
                                       stream=stream))
        assert reply.status == 200, reply.raw[:400]
        assert reply.pool == "large"
        assert reply.json()["usage"]["prompt_tokens"] == 2405
        assert overflows(rt, small.name) == 1
        assert counter(rt, "escalations", from_pool=small.pool, to_pool="large",
                       kind="reactive") == 1
        # 1,705 tokens with max_tokens 600: the prompt fits, prompt + output does not.
        # Rejecting engines are retried with a clamp (or escalated when their count is only
        # a lower bound); vLLM >= 0.32 and llama.cpp shorten the answer themselves.
        reply = await c.chat(chat_body(route, [user(words1(rng, 1700))], max_tokens=600,
                                       stream=stream))
        assert reply.status == 200, reply.raw[:400]
        doc = reply.json()
        assert doc["usage"]["prompt_tokens"] == 1705
        if reply.pool == small.pool:
            assert doc["choices"][0]["finish_reason"] == "length"
            assert doc["usage"]["completion_tokens"] == SMALL_WINDOW - 1705
            assert counter(rt, "cut_short", pool=small.pool) == 1
        else:
            assert doc["usage"]["completion_tokens"] == 600
        assert overflows(rt, small.name) <= 3  # bounded: 2 attempts per pool at most

    run(with_router(config, body))


def test_the_seed_failure_one_token_over_is_answered(style_fleet: Fleet) -> None:
    """The issue's case scaled to a 2,048 window: 1,537 prompt tokens + max_tokens 512 is one
    token over ("...for a total of at least 2049 tokens" on vLLM 0.18-0.31)."""
    rng = random.Random(21)
    small = next(r for r in smalls_of(style_fleet) if r.pool == f"small-{REJECTING}")
    route = f"r-{REJECTING}"
    content = words3(rng, 1532)  # + 5 tokens of chat framing = 1,537
    low_content = words1(rng, 1532)

    async def proactive(rt: RouterRuntime, c: Client) -> None:
        reply = await c.chat(chat_body(route, [user(content)], max_tokens=512))
        assert reply.status == 200, reply.raw[:400]
        doc = reply.json()
        assert reply.pool == small.pool  # stays on the fast tier, output clamped by one
        assert doc["usage"] == {**doc["usage"], "prompt_tokens": 1537, "completion_tokens": 511}
        assert doc["choices"][0]["finish_reason"] == "length"
        assert overflows(rt, small.name) == 0
        assert counter(rt, "cut_short", pool=small.pool) == 1

    async def reactive(rt: RouterRuntime, c: Client) -> None:
        reply = await c.chat(chat_body(route, [user(low_content)], max_tokens=512))
        assert reply.status == 200, reply.raw[:400]
        doc = reply.json()
        assert reply.pool == small.pool
        assert doc["usage"]["prompt_tokens"] == 1537
        assert doc["usage"]["completion_tokens"] == 511
        assert overflows(rt, small.name) == 1  # the engine's own seed message, then a clamp

    run(with_router(tier_config([small], large_of(style_fleet)), proactive))
    run(with_router(tier_config([small], large_of(style_fleet), tokenizer="none"), reactive))


def test_a_prompt_no_pool_can_hold_gets_openais_400_with_the_numbers(style_fleet: Fleet) -> None:
    rng = random.Random(31)
    small = next(r for r in smalls_of(style_fleet) if r.pool == f"small-{REJECTING}")
    large = style_fleet.by_pool("large")[0]
    route = f"r-{REJECTING}"

    async def body(rt: RouterRuntime, c: Client) -> None:
        async with aiohttp.ClientSession() as direct:
            before = await engine_metrics(direct, large.url, LARGE_MODEL)
            reply = await c.chat(chat_body(route, [user(words3(rng, 9000))], max_tokens=100))
            after = await engine_metrics(direct, large.url, LARGE_MODEL)
        assert reply.status == 400
        error = json.loads(reply.raw)["error"]
        assert error["message"] == (
            "This model's maximum context length is 8192 tokens. However, your messages "
            "resulted in 9005 tokens. Please reduce the length of the messages.")
        assert (error["type"], error["param"], error["code"]) == (
            "invalid_request_error", "messages", "context_length_exceeded")
        assert gateway_recognises_overflow(error["message"])
        parsed = parse_overflow(400, reply.raw)
        assert parsed is not None and parsed.kind is OverflowKind.PROMPT
        assert (parsed.window, parsed.prompt_tokens) == (8192, 9005)
        # Nothing was sent to an engine (only /tokenize was asked).
        assert after["vllm:request_success_total"] == before["vllm:request_success_total"]
        assert overflows(rt, small.name) == 0 and overflows(rt, large.name) == 0

    run(with_router(tier_config([small], large_of(style_fleet)), body))


# -- warm-ahead guards ------------------------------------------------------------------------


@pytest.mark.parametrize("rewarm", [0.1, 1.0])
def test_warm_ahead_fires_once_per_session_and_stage_per_cooldown(
    style_fleet: Fleet, rewarm: float,
) -> None:
    rng = random.Random(41)
    small = next(r for r in smalls_of(style_fleet) if r.pool == "small-vllm-0.32")
    config = tier_config([small], large_of(style_fleet), warm={"rewarm_fraction": rewarm})
    system = {"role": "system", "content": words3(rng, 1300)}  # ≈0.64 of the window

    async def body(rt: RouterRuntime, c: Client) -> None:
        for session in ("a", "b"):
            messages = [system]
            for turn in range(4):  # ≈ +50 tokens a turn: one growth stage at most
                messages.append(user(words3(rng, 12)))
                reply = await c.chat(chat_body("r-vllm-0.32", messages, max_tokens=8),
                                     session_id=session)
                assert reply.status == 200 and reply.pool == small.pool
                messages.append({"role": "assistant", "content": reply.content()})
        await wait_for(lambda: counter(rt, "warm", outcome="completed", reason="large") == 2,
                       what="one warm-up per session")
        assert counter(rt, "warm", outcome="fired", reason="large") == 2
        assert counter(rt, "warm", outcome="skipped", reason="cooldown") == 6
        # A session that grows into the next stage is warmed again unless rewarm is 1.
        messages.append(user(words3(rng, 300)))
        reply = await c.chat(chat_body("r-vllm-0.32", messages, max_tokens=8), session_id="b")
        assert reply.status == 200
        expected = 3 if rewarm < 1 else 2
        await wait_for(lambda: counter(rt, "warm", outcome="completed",
                                       reason="large") == expected, what="the warm-ups")
        await asyncio.sleep(0.1)
        assert counter(rt, "warm", outcome="fired", reason="large") == expected

    run(with_router(config, body))


def test_warm_ahead_skips_a_target_whose_model_is_unknown() -> None:
    """The large pool's engine never answered ``/v1/models``: its served model is unknown."""
    rng = random.Random(51)
    with start_fleet([small_spec("vllm-0.32")], timeout_s=20.0) as fleet:
        dead = {"name": "l-dead", "url": "http://127.0.0.1:9"}  # discard port: refused
        config = tier_config(smalls_of(fleet), [dead])

        async def body(rt: RouterRuntime, c: Client) -> None:
            messages = [user(words3(rng, 1400))]
            reply = await c.chat(chat_body("r-vllm-0.32", messages, max_tokens=8),
                                 session_id="unknown-target")
            assert reply.status == 200
            assert counter(rt, "warm", outcome="skipped", reason="target_model_unknown") == 1
            assert counter(rt, "warm", outcome="fired", reason="large") == 0

        run(with_router(config, body))


async def _hanging_engine(release: asyncio.Event) -> tuple[web.AppRunner, str]:
    """A large-pool engine that discovery finds healthy, serving ``sim-large`` with an 8,192
    window, whose completions never answer (until ``release``): every warm-up times out."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": LARGE_MODEL, "object": "model", "max_model_len": LARGE_WINDOW}]})

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def hang(request: web.Request) -> web.Response:
        await request.read()
        await release.wait()
        return web.json_response({"error": {"message": "released"}}, status=503)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    app.router.add_post("/v1/chat/completions", hang)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def test_a_failing_warm_up_only_costs_a_counter() -> None:
    rng = random.Random(61)
    with start_fleet([small_spec("vllm-0.32")], timeout_s=20.0) as fleet:

        async def main() -> None:
            release = asyncio.Event()
            runner, url = await _hanging_engine(release)
            try:
                config = tier_config(smalls_of(fleet), [{"name": "l-hang", "url": url}],
                                     warm={"timeout_s": 2.0})

                async def body(rt: RouterRuntime, c: Client) -> None:
                    started = time.monotonic()
                    reply = await c.chat(chat_body("r-vllm-0.32", [user(words3(rng, 1400))],
                                                   max_tokens=8), session_id="failing-warm")
                    answered_s = time.monotonic() - started
                    assert reply.status == 200 and reply.pool == "small-vllm-0.32"
                    # The answer did not wait for the warm-up, which is still hanging.
                    assert answered_s < 2.0
                    assert counter(rt, "warm", outcome="fired", reason="large") == 1
                    assert counter(rt, "warm", outcome="failed", reason="timeout") == 0
                    await wait_for(lambda: counter(rt, "warm", outcome="failed",
                                                   reason="timeout") == 1, timeout_s=5.0,
                                   what="the warm-up to time out")
                    # The router's own state is clean: no load left on the hanging replica.
                    assert rt.core.load.snapshot(ReplicaId("l-hang")).num_in_flight == 0
                    reply = await c.chat(chat_body("r-vllm-0.32", [user(words3(rng, 30))],
                                                   max_tokens=4))
                    assert reply.status == 200

                await with_router(config, body)
            finally:
                release.set()
                await runner.cleanup()

        run(main())


# -- stale windows ----------------------------------------------------------------------------


def test_a_stale_window_costs_one_reactive_round_trip_logged_and_counted(
    base_port: int, caplog: pytest.LogCaptureFixture,
) -> None:
    """The small engine restarts with ``--max-model-len 1024``; the router still believes
    2,048. One request pays one overflow round trip and teaches the router; the next one is
    placed proactively."""
    rng = random.Random(71)
    specs = [small_spec(REJECTING, name="s-stale"), large_spec("l-stale")]
    fleet = start_fleet(specs, base_port=base_port, timeout_s=20.0)
    try:
        config = tier_config(fleet.by_pool(f"small-{REJECTING}"), large_of(fleet))
        small = fleet.replicas[0]

        async def body(rt: RouterRuntime, c: Client) -> None:
            fleet.processes[0].send_signal(signal.SIGTERM)
            fleet.processes[0].wait(5)
            restarted = start_fleet([small_spec(REJECTING, name="s-stale", window=1024)],
                                    base_port=base_port, timeout_s=20.0)
            try:
                await wait_for(lambda: rt.core.is_healthy(ReplicaId(small.name)), timeout_s=8.0,
                               what="the restarted engine back in routing")
                assert rt.discovery is not None
                assert rt.discovery.pool_window(small.pool) == SMALL_WINDOW  # stale
                with caplog.at_level(logging.WARNING, logger="kvroute.tiers"):
                    first = await c.chat(chat_body(f"r-{REJECTING}", [user(words3(rng, 1500))],
                                                   max_tokens=64))
                assert first.status == 200 and first.pool == "large"
                assert overflows(rt, small.name) == 1
                assert counter(rt, "discovery", replica=small.name, outcome="stale_window") == 1
                assert any("stale window" in r.getMessage() and "1024" in r.getMessage()
                           for r in caplog.records)
                second = await c.chat(chat_body(f"r-{REJECTING}", [user(words3(rng, 1500))],
                                                max_tokens=64))
                assert second.status == 200 and second.pool == "large"
                assert overflows(rt, small.name) == 1  # no second round trip
                await wait_for(lambda: rt.discovery is not None
                               and rt.discovery.pool_window(small.pool) == 1024,
                               what="discovery to re-read the window")
            finally:
                restarted.stop()

        run(with_router(config, body), timeout_s=18.0)
    finally:
        fleet.stop()


# -- warm-ahead in flight: one per session, a bound per replica -------------------------------


class _GatedEngine:
    """A large-pool engine (``sim-large``, 8,192 window) whose completions wait for a gate:
    ``open(n)`` lets ``n`` waiting requests answer. It records every request's messages and
    the most requests it ever held at once, so the tests see exactly what was in flight."""

    def __init__(self) -> None:
        self.gate = asyncio.Semaphore(0)
        self.held = 0
        self.max_held = 0
        self.bodies: list[dict[str, Any]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    def open(self, n: int = 1) -> None:
        for _ in range(n):
            self.gate.release()

    async def _chat(self, request: web.Request) -> web.Response:
        self.bodies.append(json.loads(await request.read()))
        self.held += 1
        self.max_held = max(self.max_held, self.held)
        try:
            await self.gate.acquire()
        finally:
            self.held -= 1
        return web.json_response({
            "id": "cmpl-gated", "object": "chat.completion", "model": LARGE_MODEL,
            "choices": [{"index": 0, "finish_reason": "length",
                         "message": {"role": "assistant", "content": "x"}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    async def __aenter__(self) -> Self:
        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [
                {"id": LARGE_MODEL, "object": "model", "max_model_len": LARGE_WINDOW}]})

        async def ok(request: web.Request) -> web.Response:
            return web.Response(text="")

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_get("/health", ok)
        app.router.add_get("/metrics", ok)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.open(len(self.bodies) + 8)
        assert self.runner is not None
        await self.runner.cleanup()


def _gated_run(fleet: Fleet, warm: Mapping[str, Any],
               test: Callable[[RouterRuntime, Client, _GatedEngine], Awaitable[None]],
               timeout_s: float = 20.0) -> None:
    async def main() -> None:
        async with _GatedEngine() as engine:
            config = tier_config(smalls_of(fleet), [{"name": "l-gated", "url": engine.url}],
                                 warm=warm)
            await with_router(config, lambda rt, c: test(rt, c, engine))

    run(main(), timeout_s)


@pytest.fixture(scope="module")
def small_fleet() -> Iterator[Fleet]:
    with start_fleet([small_spec("vllm-0.32")], timeout_s=20.0) as fleet:
        yield fleet


def test_a_session_never_has_two_warm_ups_in_flight(small_fleet: Fleet) -> None:
    """Stage 0 is held by the engine; stage 1 waits behind it, stage 2 supersedes stage 1,
    and once stage 0 answers, stage 2 (not 1) is sent: one at a time, latest wins."""
    rng = random.Random(71)

    async def test(rt: RouterRuntime, c: Client, engine: _GatedEngine) -> None:
        messages = [user(words3(rng, 1290))]  # ≈0.63 of the window: stage 0
        sizes = []
        for turn in range(3):  # +225 words a turn: stages 0, 1, 2
            if turn:
                messages.append(user(words3(rng, 225)))
            reply = await c.chat(chat_body("r-vllm-0.32", messages, max_tokens=8),
                                 session_id="one-at-a-time")
            assert reply.status == 200 and reply.pool == "small-vllm-0.32", reply.raw[:200]
            sizes.append(len(messages))
        await wait_for(lambda: len(engine.bodies) == 1, what="stage 0's warm-up")
        await asyncio.sleep(0.2)  # time for a second warm-up to arrive, were it sent
        assert len(engine.bodies) == 1 and engine.held == 1
        assert counter(rt, "warm", outcome="fired", reason="large") == 1
        assert counter(rt, "warm", outcome="skipped", reason="superseded") == 1
        engine.open()
        await wait_for(lambda: len(engine.bodies) == 2, what="the latest stage's warm-up")
        engine.open()
        await wait_for(lambda: counter(rt, "warm", outcome="completed", reason="large") == 2,
                       what="both warm-ups to complete")
        assert engine.max_held == 1
        assert [len(b["messages"]) for b in engine.bodies] == [sizes[0], sizes[2]]
        assert all(b["max_tokens"] == 1 for b in engine.bodies)
        assert counter(rt, "warm", outcome="fired", reason="large") == 2
        assert not rt.core.load.snapshot(ReplicaId("l-gated")).num_in_flight

    _gated_run(small_fleet, {}, test)


@pytest.mark.parametrize("bound", [1, 2])
def test_warm_ups_per_replica_are_bounded_and_the_rest_deferred(small_fleet: Fleet,
                                                                 bound: int) -> None:
    """Four sessions cross the threshold together: the engine holds at most ``bound``
    warm-ups; the others wait in the router and are sent as slots free, none lost."""
    rng = random.Random(81)
    sessions = 4

    async def test(rt: RouterRuntime, c: Client, engine: _GatedEngine) -> None:
        for i in range(sessions):
            reply = await c.chat(chat_body("r-vllm-0.32", [user(words3(rng, 1300))],
                                           max_tokens=8), session_id=f"bound-{i}")
            assert reply.status == 200
        await wait_for(lambda: len(engine.bodies) == bound, what="the first warm-ups")
        await asyncio.sleep(0.2)
        assert len(engine.bodies) == bound and engine.held == bound
        assert counter(rt, "warm", outcome="fired", reason="large") == bound
        for sent in range(bound + 1, sessions + 1):
            engine.open()
            await wait_for(lambda n=sent: len(engine.bodies) == n,  # type: ignore[misc]
                           what=f"warm-up {sent} after a slot freed")
            assert engine.held == bound
        engine.open(bound)
        await wait_for(lambda: counter(rt, "warm", outcome="completed",
                                       reason="large") == sessions, what="every warm-up")
        assert engine.max_held == bound
        assert counter(rt, "warm", outcome="fired", reason="large") == sessions
        assert counter(rt, "warm", outcome="skipped", reason="replica_busy") == 0
        assert not rt.core.load.snapshot(ReplicaId("l-gated")).num_in_flight

    _gated_run(small_fleet, {"max_in_flight_per_replica": bound}, test)


def test_a_warm_up_that_waits_out_its_timeout_for_a_slot_is_skipped(small_fleet: Fleet) -> None:
    """Bound 1, timeout 2.5 s, the engine never answers: the first warm-up times out holding
    the slot, the second gets it and times out too, the third waited its whole timeout for a
    slot: ``skipped``/``replica_busy``, never sent. Both waiting warm-ups wake when the first
    times out; the one that loses the slot after routing waits out the rest of the same slot
    budget (it once got a fresh one there and raced the winner's timeout). The requests must
    fire their warm-ups within one timeout of each other, hence 2.5 s on a loaded machine."""
    rng = random.Random(91)

    async def test(rt: RouterRuntime, c: Client, engine: _GatedEngine) -> None:
        for i in range(3):
            reply = await c.chat(chat_body("r-vllm-0.32", [user(words3(rng, 1300))],
                                           max_tokens=8), session_id=f"busy-{i}")
            assert reply.status == 200
        await wait_for(lambda: counter(rt, "warm", outcome="skipped", reason="replica_busy")
                       == 1, timeout_s=10.0, what="the third warm-up to give up waiting")
        await wait_for(lambda: counter(rt, "warm", outcome="failed", reason="timeout") == 2,
                       timeout_s=10.0, what="the two sent warm-ups to time out")
        assert len(engine.bodies) == 2 and engine.max_held == 1
        assert counter(rt, "warm", outcome="fired", reason="large") == 2
        assert not rt.core.load.snapshot(ReplicaId("l-gated")).num_in_flight

    _gated_run(small_fleet, {"timeout_s": 2.5}, test, timeout_s=40.0)
