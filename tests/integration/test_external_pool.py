"""External OpenAI-compatible provider pools, end to end on loopback.

A second ``kvroute sim serve`` process stands in for the provider. The simulator checks no
API key, so the test puts a tiny aiohttp proxy in front of it that answers 401 unless
``Authorization: Bearer <key>`` carries the provider's key, and records every request it
forwarded (path, model, whether ``cache_salt`` was sent). The route under test is
``[small, cloud]``: a small local engine (2,048 tokens) and the provider (8,192 tokens).

What must hold (the issue): a request whose model maps into the provider's catalog escalates
there (sent under the provider's model name, with its key, without our ``cache_salt``); a
model that does not map stays local, gets OpenAI's overflow 400, and the log says why; the
catalog can be read from the provider's ``/v1/models`` instead of configured.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import string
from collections.abc import Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvroute.config import RouterConfig, parse_config, resolve_secrets
from kvroute.core.errors import ConfigError
from kvroute.shell.runtime import RouterRuntime
from kvroute.sim.launcher import Fleet, ReplicaSpec, start_fleet

pytestmark = pytest.mark.integration

SMALL_MODEL = "sim-small"
PROVIDER_MODEL = "provider-large"
SMALL_WINDOW = 2048
PROVIDER_WINDOW = 8192
TIMING = "0.001,0.00002,0.0002,0"
KEY_ENV = "KVROUTE_TEST_PROVIDER_KEY"
KEY = "sk-test-provider-0123456789"


def run(coro: Coroutine[Any, Any, None], timeout_s: float = 20.0) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout_s))


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    """The small local engine and the provider's engine (two ``kvroute sim serve``)."""
    specs = [
        ReplicaSpec(name="s0", pool="small", model=SMALL_MODEL, max_model_len=SMALL_WINDOW,
                    error_style="vllm-0.18-0.31", extra_args=("--timing", TIMING)),
        ReplicaSpec(name="p0", pool="provider", model=PROVIDER_MODEL,
                    max_model_len=PROVIDER_WINDOW, extra_args=("--timing", TIMING)),
    ]
    started = start_fleet(specs, timeout_s=30.0)
    try:
        yield started
    finally:
        started.stop()


@dataclass
class Seen:
    """What the auth proxy forwarded (or refused)."""

    requests: list[dict[str, Any]] = field(default_factory=list)
    refused: int = 0
    models_reads: int = 0


class AuthProxy:
    """``Authorization: Bearer KEY`` or 401; then forward to the provider's engine."""

    def __init__(self, upstream: str, key: str) -> None:
        self.upstream = upstream
        self.key = key
        self.seen = Seen()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.url = ""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            self.seen.refused += 1
            return web.json_response({"error": {"message": "Incorrect API key provided.",
                                                "type": "invalid_request_error",
                                                "code": "invalid_api_key"}}, status=401)
        assert self._session is not None
        body = await request.read()
        if request.method == "GET":
            self.seen.models_reads += request.path == "/v1/models"
        else:
            doc = json.loads(body)
            self.seen.requests.append({"path": request.path, "model": doc.get("model"),
                                       "cache_salt": "cache_salt" in doc,
                                       "max_tokens": doc.get("max_tokens")})
        async with self._session.request(request.method, self.upstream + request.path,
                                         data=body or None,
                                         headers={"Content-Type": "application/json"}) as up:
            raw = await up.read()
            return web.Response(status=up.status, body=raw,
                                content_type=up.content_type or "application/json")

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()


def config(fleet: Fleet, proxy_url: str, *, catalog: Mapping[str, str] | None,
           routes: tuple[str, ...], key_env: str = KEY_ENV,
           extra_external: Mapping[str, Any] | None = None) -> RouterConfig:
    small = fleet.by_pool("small")[0]
    external: dict[str, Any] = {"url": proxy_url, "api_key_env": key_env, "catalog": catalog,
                                **(extra_external or {})}
    data: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {
            "small": {"model": SMALL_MODEL, "tokenizer": "engine",
                      "replicas": [{"name": "s0", "url": small.url,
                                    "prefill_rate_tps": 50_000.0}]},
            "cloud": {"external": external},
        },
        "routes": {name: {"pools": ["small", "cloud"]} for name in routes},
        "discovery": {"health_interval_s": 0.5, "metrics_interval_s": 1.0,
                      "models_interval_s": 30, "timeout_s": 1.0},
        "timeouts": {"connect_s": 1.0, "first_byte_s": 8.0, "total_s": 10.0},
        "log_level": "warning",
    }
    return parse_config(data, env={})


def words(n: int, seed: int = 0) -> str:
    """``n`` three-letter words: one simulated token each, heuristic estimate ≈ exact."""
    rng = random.Random(seed)
    return " ".join("".join(rng.choice(string.ascii_lowercase) for _ in range(3))
                    for _ in range(n))


async def chat(session: aiohttp.ClientSession, url: str, model: str, text: str, *,
               stream: bool = False, **extra: Any) -> tuple[int, Mapping[str, str], bytes]:
    body = {"model": model, "messages": [{"role": "user", "content": text}],
            "max_tokens": 16, "stream": stream, **extra}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        return resp.status, resp.headers.copy(), await resp.read()


def external_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "kvroute.tiers" and "external pool 'cloud'" in r.getMessage()]


# -- a configured catalog -----------------------------------------------------------------------


def test_configured_catalog_escalates_mapped_model_and_keeps_others_local(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)
    caplog.set_level(logging.INFO, logger="kvroute.tiers")
    proxy = AuthProxy(fleet.by_pool("provider")[0].url, KEY)

    async def body() -> None:
        await proxy.start()
        try:
            cfg = config(fleet, proxy.url, catalog={"assistant": PROVIDER_MODEL},
                         routes=("assistant", "other"))
            async with RouterRuntime(cfg, env={KEY_ENV: KEY}) as rt, aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=10)
            ) as session:
                long_text = words(3000, seed=1)
                # In the catalog: too long for 'small' → the provider, under its model name.
                status, headers, raw = await chat(session, rt.url, "assistant", long_text,
                                                  cache_salt="client-salt")
                assert status == 200, raw
                assert headers["x-kvroute-pool"] == "cloud"
                assert headers["x-kvroute-replica"] == "cloud-ext0"
                assert json.loads(raw)["choices"][0]["message"]["content"]
                assert proxy.seen.refused == 0
                assert proxy.seen.requests == [{"path": "/v1/chat/completions",
                                                "model": PROVIDER_MODEL, "cache_salt": False,
                                                "max_tokens": 16}]
                # Streaming goes the same way.
                status, headers, raw = await chat(session, rt.url, "assistant",
                                                  words(3000, seed=2), stream=True)
                assert status == 200 and headers["x-kvroute-pool"] == "cloud"
                assert b"data: [DONE]" in raw
                # Short prompts of the same model stay on the small engine.
                status, headers, _ = await chat(session, rt.url, "assistant", words(50))
                assert status == 200 and headers["x-kvroute-pool"] == "small"
                assert len(proxy.seen.requests) == 2
                # Not in the catalog: stays local → OpenAI's overflow 400, with the reason.
                status, headers, raw = await chat(session, rt.url, "other", long_text)
                assert status == 400, raw
                error = json.loads(raw)["error"]
                assert error["message"].startswith(
                    f"This model's maximum context length is {SMALL_WINDOW} tokens.")
                assert error["code"] == "context_length_exceeded"
                assert error["type"] == "invalid_request_error"
                assert headers["x-kvroute-pool"] == "none"
                assert len(proxy.seen.requests) == 2  # never reached the provider
                lines = external_lines(caplog)
                assert any("model 'other' not in the catalog of 'cloud'" in line
                           and "stays local" in line for line in lines), lines
                # Nothing about the provider in the KV index, and no warm-ahead to it.
                assert rt.core.index.stats().num_entries_by_replica.get("cloud-ext0", 0) == 0
                assert (rt.metrics.value("kvroute_warm_total",
                                         {"outcome": "fired", "reason": "cloud"}) or 0) == 0
        finally:
            await proxy.stop()

    run(body())


def test_wrong_provider_key_is_refused_by_the_provider(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key sent is the configured one: with another key the provider's 401 comes back."""
    monkeypatch.setenv(KEY_ENV, "sk-wrong")
    proxy = AuthProxy(fleet.by_pool("provider")[0].url, KEY)

    async def body() -> None:
        await proxy.start()
        try:
            cfg = config(fleet, proxy.url, catalog={"assistant": PROVIDER_MODEL},
                         routes=("assistant",))
            async with RouterRuntime(cfg, env={KEY_ENV: "sk-wrong"}) as rt, \
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
                status, headers, raw = await chat(session, rt.url, "assistant",
                                                  words(3000, seed=3))
                assert status == 401, raw
                assert headers["x-kvroute-pool"] == "cloud"
                assert proxy.seen.refused == 1 and not proxy.seen.requests
        finally:
            await proxy.stop()

    run(body())


# -- the catalog read from the provider's /v1/models ----------------------------------------------


def test_catalog_from_models(fleet: Fleet, monkeypatch: pytest.MonkeyPatch,
                             caplog: pytest.LogCaptureFixture) -> None:
    """No configured catalog: the provider's ``/v1/models`` (read with its key) decides, and
    a listed model keeps its own name."""
    monkeypatch.setenv(KEY_ENV, KEY)
    caplog.set_level(logging.INFO, logger="kvroute.tiers")
    proxy = AuthProxy(fleet.by_pool("provider")[0].url, KEY)

    async def body() -> None:
        await proxy.start()
        try:
            cfg = config(fleet, proxy.url, catalog=None, routes=(PROVIDER_MODEL, "assistant"))
            assert cfg.pools["cloud"].external is not None
            assert cfg.pools["cloud"].external.catalog_from_models
            async with RouterRuntime(cfg, env={KEY_ENV: KEY}) as rt, aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=10)
            ) as session:
                assert proxy.seen.models_reads >= 1 and proxy.seen.refused == 0
                assert rt.discovery is not None
                catalog = rt.discovery.external_catalog("cloud")
                assert catalog is not None and PROVIDER_MODEL in catalog.models
                assert catalog.windows[PROVIDER_MODEL] == PROVIDER_WINDOW
                long_text = words(3000, seed=4)
                status, headers, raw = await chat(session, rt.url, PROVIDER_MODEL, long_text)
                assert status == 200, raw
                assert headers["x-kvroute-pool"] == "cloud"
                assert proxy.seen.requests[-1]["model"] == PROVIDER_MODEL
                # The provider's window is read from its card: over it → 400 at once.
                status, _, raw = await chat(session, rt.url, PROVIDER_MODEL,
                                            words(PROVIDER_WINDOW + 100, seed=5))
                assert status == 400, raw
                assert f"maximum context length is {PROVIDER_WINDOW}" in raw.decode()
                assert len(proxy.seen.requests) == 1
                # 'assistant' is not on the provider's list: stays local.
                status, _, raw = await chat(session, rt.url, "assistant", long_text)
                assert status == 400, raw
                assert f"maximum context length is {SMALL_WINDOW}" in raw.decode()
                lines = external_lines(caplog)
                assert any("model 'assistant' not in the catalog of 'cloud'" in line
                           for line in lines), lines
        finally:
            await proxy.stop()

    run(body())


def test_unreadable_catalog_keeps_requests_local(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A provider that refuses the catalog read (wrong key) leaves the catalog unknown: the
    request is not sent there on a guess, and the log says why."""
    monkeypatch.setenv(KEY_ENV, "sk-wrong")
    caplog.set_level(logging.INFO, logger="kvroute.tiers")
    proxy = AuthProxy(fleet.by_pool("provider")[0].url, KEY)

    async def body() -> None:
        await proxy.start()
        try:
            cfg = config(fleet, proxy.url, catalog=None, routes=(PROVIDER_MODEL,))
            async with RouterRuntime(cfg, env={KEY_ENV: "sk-wrong"}) as rt, \
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
                assert rt.discovery is not None
                assert rt.discovery.external_catalog("cloud") is None
                assert proxy.seen.refused >= 1
                status, _, raw = await chat(session, rt.url, PROVIDER_MODEL,
                                            words(3000, seed=6))
                assert status == 400, raw
                assert not proxy.seen.requests
                lines = external_lines(caplog)
                assert any("catalog of 'cloud' unknown" in line for line in lines), lines
        finally:
            await proxy.stop()

    run(body())


# -- configuration errors -------------------------------------------------------------------------


def _data(external: Any, **route: Any) -> dict[str, Any]:
    return {
        "pools": {"small": {"model": "m", "replicas": [{"name": "s0",
                                                         "url": "http://127.0.0.1:1"}]},
                  "cloud": {"external": external}},
        "routes": {"assistant": {"pools": ["small", "cloud"], **route}},
    }


@pytest.mark.parametrize(("external", "key", "fix"), [
    ({"api_key_env": KEY_ENV, "catalog": {"assistant": "x"}}, "pools.cloud.external.url",
     "base URL"),
    ({"url": "http://127.0.0.1:2/v1", "catalog": {"assistant": "x"}},
     "pools.cloud.external.url", "kvroute adds /v1"),
    ({"url": "http://127.0.0.1:2", "catalog": {"chat": "x"}},
     "pools.cloud.external.catalog.chat", "Catalog keys are the model names clients send"),
    ({"url": "http://127.0.0.1:2", "catalog_from_models": False},
     "pools.cloud.external.catalog_from_models", "Configure catalog"),
    ({"url": "http://127.0.0.1:2", "catalog": []}, "pools.cloud.external.catalog",
     "catalog: {assistant: provider-model-name}"),
    ({"url": "http://127.0.0.1:2", "api_key_env": "sk-live-abc"},
     "pools.cloud.external.api_key_env", "environment variable"),
    ({"url": "http://127.0.0.1:2", "catalogue": {}}, "pools.cloud.external.catalogue",
     "did you mean 'catalog'"),
])
def test_external_config_errors_name_the_key_and_the_fix(external: Any, key: str,
                                                          fix: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(_data(external), env={})
    assert str(err.value).startswith(key), err.value
    assert fix in str(err.value), err.value


def test_external_pool_takes_no_engine_keys() -> None:
    data = _data({"url": "http://127.0.0.1:2"})
    data["pools"]["cloud"]["model"] = "x"
    with pytest.raises(ConfigError, match=r"^pools\.cloud\.model: cannot be set on an external"):
        parse_config(data, env={})


def test_provider_key_must_be_exported() -> None:
    cfg = parse_config(_data({"url": "http://127.0.0.1:2", "api_key_env": KEY_ENV}), env={})
    with pytest.raises(ConfigError, match=rf"pools\.cloud\.external\.api_key_env: .*{KEY_ENV}"):
        resolve_secrets(cfg, env={})
    secrets = resolve_secrets(cfg, env={KEY_ENV: KEY})
    assert secrets.provider_keys == {"cloud": KEY}
    assert KEY not in repr(secrets)


def test_proactive_switch_parses() -> None:
    assert parse_config(_data({"url": "http://127.0.0.1:2"}), env={}).routes[
        "assistant"].proactive is True
    assert parse_config(_data({"url": "http://127.0.0.1:2"}, proactive=False),
                        env={}).routes["assistant"].proactive is False
    with pytest.raises(ConfigError, match=r"^routes\.assistant\.proactive: must be true or false"):
        parse_config(_data({"url": "http://127.0.0.1:2"}, proactive="no"), env={})
