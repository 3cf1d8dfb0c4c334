"""kvroute in front of a real vLLM 0.32 CPU engine serving two LoRA adapters.

The engine runs with ``--enable-lora --max-lora-rank 8 --max-loras 1 --lora-modules
ad1=<dir>/ad1 ad2=<dir>/ad2``; the adapters are written at test time with random weights for
the tiny Llama's ``q_proj``/``v_proj`` (``tests/lora_adapter.py``). vLLM's CPU backend loads
them (checked with vLLM 0.32.0 on this machine, 2026-12-01).

A third adapter, ``ad3``, is not loaded at start: the pool declares it
(``lora_adapters``) and the engine runs with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, so the
router loads it through ``/v1/load_lora_adapter`` at its first request.

The check: over a script that mixes the base model and the adapters on the same tokens, the
router's ``x-kvroute-cached-tokens`` equals the engine's Δ``vllm:prefix_cache_hits_total`` for
every request. One replica, so the router's *predicted* entries alone would claim a hit for
any repeat of the same tokens: only the right extra key (``("lora", name, path)`` with the
path from ``/v1/models``) makes the base model and each adapter miss each other's blocks as
the engine does. The router also lists the adapters on its ``/v1/models`` and reads
``vllm:lora_requests_info`` (``max_lora``) through discovery.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import realvllm
from lora_adapter import write_tiny_lora
from realvllm import RealVllmEngine

from kvroute.config import parse_config
from kvroute.core.types import PoolName, ReplicaId
from kvroute.shell.runtime import RouterRuntime

pytestmark = pytest.mark.realvllm

ROUTE = "assistant"
HITS = "vllm:prefix_cache_hits_total"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RealVllmEngine, Path]]:
    """The engine and the directory of the adapters written for it."""
    install = realvllm.require_real_vllm()
    adapters = tmp_path_factory.mktemp("loras")
    for seed, name in enumerate(("ad1", "ad2", "ad3"), start=1):
        write_tiny_lora(install.model_dir, adapters / name, seed=seed)
    extra = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "1", "--lora-modules",
             f"ad1={adapters / 'ad1'}", f"ad2={adapters / 'ad2'}")
    with realvllm.real_vllm_engines(1, extra_args=extra, install=install,
                                    extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
                                    ) as started:
        yield started[0], adapters


def _router_config(engine: RealVllmEngine, adapters: Path) -> Any:
    ad3 = str(adapters / "ad3")
    return parse_config({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {"main": {"model": engine.model, "lora_adapters": {"ad3": ad3}, "replicas": [{
            "name": "e0", "url": engine.url, "kv_events": engine.events_endpoint,
            "kv_events_bind": True, "kv_replay": engine.replay_endpoint,
            "kv_topic": engine.topic}]}},
        "routes": {ROUTE: {"pools": ["main"]}},
        "policy": {"name": "kvroute", "seed": 7},
        "discovery": {"health_interval_s": 0.5, "metrics_interval_s": 1.0,
                      "models_interval_s": 5.0, "timeout_s": 2.0},
        "timeouts": {"connect_s": 2.0, "first_byte_s": 60.0, "total_s": 120.0},
        "warm_ahead": {"enabled": False},
        "log_level": "warning",
    }, env={})


def _hits(engine: RealVllmEngine) -> float:
    return realvllm.metric_total(engine, HITS)


def _models(url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as reply:
        data: list[dict[str, Any]] = json.loads(reply.read())["data"]
        return data


def _post(url: str, body: dict[str, Any]) -> tuple[dict[str, str], Any]:
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return dict(reply.headers.items()), json.loads(reply.read())


def test_predicted_cached_tokens_equal_the_engines_per_adapter(
        engine: tuple[RealVllmEngine, Path]) -> None:
    engine_, adapters = engine

    async def main() -> list[tuple[str, int, float]]:
        runtime = RouterRuntime(_router_config(engine_, adapters), env={})
        await runtime.start()
        try:
            deadline = time.monotonic() + 30.0
            while runtime.core.pool(PoolName("main")).approximate or not \
                    runtime.core.replica_adapters(ReplicaId("e0")):
                assert time.monotonic() < deadline, "discovery did not read the engine in 30 s"
                await asyncio.sleep(0.05)
            cards = {c["id"]: c for c in (await asyncio.to_thread(_models, runtime.url))}
            assert cards["ad1"]["parent"] == ROUTE and cards["ad2"]["parent"] == ROUTE
            assert cards["ad1"]["root"].endswith("/ad1")
            text = realvllm.nonce() + " " + realvllm.filler_text(5, 40)
            longer = text + " " + realvllm.filler_text(6, 20)
            script = [("ad1", text), ("ad1", text), (ROUTE, text), ("ad2", text),
                      ("ad2", text), ("ad1", longer), (ROUTE, text),
                      ("ad3", text), ("ad3", text)]  # ad3: loaded on demand by the router
            seen: list[tuple[str, int, float]] = []
            for model, content in script:
                before = await asyncio.to_thread(_hits, engine_)
                head, answer = await asyncio.to_thread(_post, runtime.url, {
                    "model": model, "messages": [{"role": "user", "content": content}],
                    "max_tokens": 1})
                assert answer["model"] == (engine_.model if model == ROUTE else model)
                assert head["x-kvroute-approximate"] == "false"
                after = await asyncio.to_thread(_hits, engine_)
                seen.append((model, int(head["x-kvroute-cached-tokens"]), after - before))
            return seen
        finally:
            await runtime.stop()

    seen = asyncio.run(main())
    print("model, router cached, engine hits:", seen)
    assert [(m, float(c)) for m, c, _ in seen] == [(m, h) for m, _, h in seen]
    assert [c > 0 for _, c, _ in seen] == [False, True, False, False, True, True, True, False,
                                           True]
