"""The router consults the gate's verdict file, live, on ``kvroute sim serve`` engines.

* A hot update on a version-salted route: with no verdict the new version keeps its own salt
  (the engine misses the old blocks, the refusal is counted); once ``gate.verdicts`` holds a
  passing ``shared-store`` verdict for (new, old), the router picks the file up without a
  restart and the new version reuses the old salt (the engine serves the old blocks, no
  refusal).
* A disaggregated pool whose prefill engine runs other weights than its decode engine: no
  split without a passing ``cross-engine`` verdict (the decode engine computes the prompt,
  the tokens billed to the gate), the two-step protocol once the verdict is written.
* The verdict book's cache-settings audit: a verdict recorded under an FP8 KV cache is
  stale for an engine reporting ``cache_dtype=auto``."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest

from kvroute.config import RouterConfig, parse_config
from kvroute.core.gate import PairKey, Verdict, VerdictStore
from kvroute.core.types import ReplicaId
from kvroute.core.verdict_book import PD_PATH, SALT_PATH
from kvroute.shell.gate_store import save_store
from kvroute.shell.runtime import RouterRuntime
from kvroute.shell.shadow_replay import Endpoint, read_policy
from kvroute.sim.launcher import Fleet, ReplicaSpec, start_fleet

pytestmark = pytest.mark.integration

MODEL, POOL, ROUTE = "sim-model", "small", "assistant"


def model_dir(path: Path, version: str) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "sim", "version": version}))
    return str(path)


@pytest.fixture
def fleets() -> Iterator[list[Fleet]]:
    started: list[Fleet] = []
    yield started
    for fleet in started:
        fleet.stop()


def config(fleet: Fleet, verdicts: Path) -> RouterConfig:
    replicas = [{"name": r.name, "url": r.url, "kv_events": r.kv_events,
                 "kv_replay": r.kv_replay} for r in fleet.replicas]
    return parse_config({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {POOL: {"model": MODEL, "replicas": replicas}},
        "routes": {ROUTE: {"pools": [POOL], "version_salt": True}},
        "gate": {"verdicts": str(verdicts)},
        "discovery": {"health_interval_s": 0.5, "metrics_interval_s": 0.5,
                      "models_interval_s": 0.2, "timeout_s": 1.0},
        "timeouts": {"connect_s": 1.0, "first_byte_s": 5.0, "total_s": 10.0},
        "log_level": "warning",
    }, env={})


async def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)


async def ask(http: aiohttp.ClientSession, url: str, content: str) -> int:
    """The engine's cached prompt tokens for one turn of session ``c1``."""
    body = {"model": ROUTE, "messages": [{"role": "user", "content": content}],
            "max_tokens": 2}
    async with http.post(url + "/v1/chat/completions", json=body,
                         headers={"x-session-id": "c1"}) as resp:
        data = await resp.json()
        assert resp.status == 200, data
        return int(data["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_passing_shared_store_verdict_lets_the_new_version_keep_the_old_salt(
        tmp_path: Path, fleets: list[Fleet]) -> None:
    root = model_dir(tmp_path / "m", "v1")
    fleet = start_fleet([ReplicaSpec(name="s0", pool=POOL, model=MODEL, root=root,
                                     enable_prompt_tokens_details=True)], timeout_s=120.0)
    fleets.append(fleet)
    verdicts = tmp_path / "verdicts.json"
    prefix = " ".join(f"w{random.Random(3).randrange(10_000)}{i}" for i in range(300))
    s0 = ReplicaId("s0")

    async def body() -> None:
        async with RouterRuntime(config(fleet, verdicts), env={}) as rt, \
                aiohttp.ClientSession() as http:
            def refusals() -> float:
                value = rt.metrics.value("kvroute_gate_refusals_total",
                                         {"path": SALT_PATH, "reason": "none"})
                return 0.0 if value is None else value

            await wait_for(lambda: rt.core.versions.version(s0) == "v:v1", "v1 read")
            await ask(http, rt.url, prefix)
            assert await ask(http, rt.url, prefix + " again") > 0  # warm on v1
            old = rt.core.versions.identity_of("v:v1")
            model_dir(tmp_path / "m", "v2")  # new weights behind the running engine
            await wait_for(lambda: rt.core.versions.version(s0) == "v:v2", "v2 read")
            assert await ask(http, rt.url, prefix + " one") == 0  # own salt: recompute
            assert refusals() == 1.0

            new = rt.core.versions.identity_of("v:v2")
            assert old is not None and new is not None
            key = PairKey(new.version, new.tokenizer, old.version, old.tokenizer, SALT_PATH)
            loaded = rt.verdict_file.num_loads if rt.verdict_file is not None else 0
            save_store(verdicts, VerdictStore([Verdict(key, True, "replay passed")]))
            await wait_for(lambda: rt.verdict_file is not None
                           and rt.verdict_file.num_loads > loaded, "the verdict file reloaded")
            assert await ask(http, rt.url, prefix + " two") > 0  # the v1 blocks serve v2
            assert refusals() == 1.0  # no new refusal
            assert rt.metrics.value("kvroute_gate_verdicts") == 1.0

    async def bounded() -> None:
        await asyncio.wait_for(body(), 90.0)

    asyncio.run(bounded())


def test_a_verdict_measured_under_other_cache_settings_is_stale_for_the_router(
        tmp_path: Path, fleets: list[Fleet]) -> None:
    """The verdict book audits the cache settings a verdict recorded against what the
    engine reports (``vllm:cache_config_info``): a passing ``shared-store`` verdict with either
    side measured under an FP8 KV cache does not let the new version keep the old salt on
    an engine with ``cache_dtype=auto`` (the engine misses v1's blocks); the same verdict
    under the engine's own settings does (it serves them)."""
    root = model_dir(tmp_path / "m", "v1")
    fleet = start_fleet([ReplicaSpec(name="s0", pool=POOL, model=MODEL, root=root,
                                     enable_prompt_tokens_details=True)], timeout_s=120.0)
    fleets.append(fleet)
    verdicts = tmp_path / "verdicts.json"
    rng = random.Random(5)
    cases = (("serving", "fp8", False), ("source", "fp8", False), ("serving", "auto", True))
    # One prefix per case, each warm under v1's salt before the update.
    prefixes = [" ".join(f"w{rng.randrange(10_000)}{i}" for i in range(300)) for _ in cases]
    s0 = ReplicaId("s0")

    async def body() -> None:
        async with RouterRuntime(config(fleet, verdicts), env={}) as rt, \
                aiohttp.ClientSession() as http:
            await wait_for(lambda: rt.core.versions.version(s0) == "v:v1", "v1 read")
            for prefix in prefixes:
                await ask(http, rt.url, prefix)
                assert await ask(http, rt.url, prefix + " again") > 0  # warm on v1
            old = rt.core.versions.identity_of("v:v1")
            model_dir(tmp_path / "m", "v2")  # new weights behind the running engine
            await wait_for(lambda: rt.core.versions.version(s0) == "v:v2", "v2 read")
            new = rt.core.versions.identity_of("v:v2")
            assert old is not None and new is not None
            key = PairKey(new.version, new.tokenizer, old.version, old.tokenizer, SALT_PATH)
            # What a replay on this engine records (one engine: both sides' settings).
            read = await read_policy(http, {"serving": Endpoint(fleet.replicas[0].url, MODEL)})
            measured = {**read, **{"source." + k.removeprefix("serving."): v
                                   for k, v in read.items()}}
            assert measured["serving.cache_dtype"] == "auto"
            # The source, v1, runs nowhere now: the settings it last ran under count.
            for (side, cache_dtype, used), prefix in zip(cases, prefixes, strict=True):
                policy = {**measured, f"{side}.cache_dtype": cache_dtype}
                loaded = rt.verdict_file.num_loads if rt.verdict_file is not None else 0
                save_store(verdicts, VerdictStore([Verdict(key, True, "replay passed",
                                                           cache_policy=policy)]))

                def reloaded(after: int = loaded) -> bool:
                    return rt.verdict_file is not None and rt.verdict_file.num_loads > after

                await wait_for(reloaded, "the file reloaded")
                ruling = rt.core.verdicts.allows(new.version, old.version, SALT_PATH)
                assert ruling.status == ("pass" if used else "stale"), ruling
                if not used:
                    assert f"{side}.cache_dtype: fp8 -> auto on s0" in ruling.reason
                cached = await ask(http, rt.url, prefix + " after")
                assert (cached > 0) == used, (side, cache_dtype, cached)

    async def bounded() -> None:
        await asyncio.wait_for(body(), 90.0)

    asyncio.run(bounded())


def test_a_cross_version_split_waits_for_a_passing_cross_engine_verdict(
        tmp_path: Path, fleets: list[Fleet]) -> None:
    specs = [ReplicaSpec(name=name, pool=POOL, model=MODEL,
                         root=model_dir(tmp_path / version, version),
                         enable_prompt_tokens_details=True,
                         extra_args=("--kv-transfer-s-per-token", "0.00001"))
             for name, version in (("p0", "v1"), ("d0", "v2"))]
    fleet = start_fleet(specs, timeout_s=120.0)
    fleets.append(fleet)
    verdicts = tmp_path / "verdicts.json"
    replicas = [{"name": r.name, "url": r.url, "kv_events": r.kv_events, "role": role}
                for r, role in zip(fleet.replicas, ("prefill", "decode"), strict=True)]
    cfg = parse_config({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {POOL: {"model": MODEL, "replicas": replicas,
                         "disaggregation": {"mode": "always"}}},
        "routes": {ROUTE: {"pools": [POOL]}},
        "gate": {"verdicts": str(verdicts)},
        "discovery": {"health_interval_s": 0.5, "metrics_interval_s": 0.5,
                      "models_interval_s": 0.2, "timeout_s": 1.0},
        "timeouts": {"connect_s": 1.0, "first_byte_s": 5.0, "total_s": 10.0},
        "log_level": "warning",
    }, env={})
    rng = random.Random(9)

    async def turn(http: aiohttp.ClientSession, url: str) -> tuple[str | None, int]:
        """(the prefill replica header, the decode engine's cached prompt tokens)."""
        content = " ".join(f"w{rng.getrandbits(40):x}" for _ in range(300))
        body = {"model": ROUTE, "messages": [{"role": "user", "content": content}],
                "max_tokens": 4}
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            data = await resp.json()
            assert resp.status == 200, data
            return (resp.headers.get("x-kvroute-prefill-replica"),
                    int(data["usage"]["prompt_tokens_details"]["cached_tokens"]))

    async def body() -> None:
        async with RouterRuntime(cfg, env={}) as rt, aiohttp.ClientSession() as http:
            def metric(name: str, labels: dict[str, str]) -> float:
                value = rt.metrics.value(name, labels)
                return 0.0 if value is None else value

            refused = {"path": PD_PATH, "reason": "none"}
            await wait_for(lambda: {rt.core.versions.version(ReplicaId(n))
                                    for n in ("p0", "d0")} == {"v:v1", "v:v2"}, "versions")
            prefill, cached = await turn(http, rt.url)
            assert prefill is None and cached == 0  # colocated: d0 computed the prompt
            assert metric("kvroute_gate_refusals_total", refused) == 1.0
            assert metric("kvroute_recompute_tokens_total",
                          {"route": ROUTE, "scenario": "gate"}) > 0

            old = rt.core.versions.identity_of("v:v1")
            new = rt.core.versions.identity_of("v:v2")
            assert old is not None and new is not None
            key = PairKey(new.version, new.tokenizer, old.version, old.tokenizer, PD_PATH)
            loaded = rt.verdict_file.num_loads if rt.verdict_file is not None else 0
            save_store(verdicts, VerdictStore([Verdict(key, True, "replay passed")]))
            await wait_for(lambda: rt.verdict_file is not None
                           and rt.verdict_file.num_loads > loaded, "the verdict file reloaded")
            prefill, cached = await turn(http, rt.url)
            assert prefill == "p0" and cached > 0  # the KV came over from p0's weights
            assert metric("kvroute_gate_refusals_total", refused) == 1.0

    async def bounded() -> None:
        await asyncio.wait_for(body(), 90.0)

    asyncio.run(bounded())
