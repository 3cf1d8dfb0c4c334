"""LoRA adapters on the live path: kvroute in front of simulated engines serving adapters.

Two ``kvroute sim serve`` engines with ``--lora-modules`` (s0: ``ad1`` and ``ad2``; s1:
``ad1`` only, at another path) and ``--enable-prompt-tokens-details``, so
``usage.prompt_tokens_details.cached_tokens`` is what the *engine* found in its cache. The
router must: route a request naming an adapter as its ``model`` (vLLM's way) through the
route whose pool lists it, forward it under the adapter's name, hash it with vLLM's
``("lora", name, path)`` extra key using the path the chosen replica loaded it from, and send
it only to replicas listing the adapter. The proof of the hash: the router's predicted cached
tokens (``x-kvroute-cached-tokens``) equal the engine's on the repeat, and the base model's
same prompt is predicted (and found) uncached.
"""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from gateway import RouterThread

from kvroute.config import parse_config
from kvroute.sim.launcher import ReplicaSpec, start_fleet

pytestmark = pytest.mark.integration

TIMING = "0.001,0.00005,0.0002,0"
ROUTE = "assistant"
MODEL = "sim-model"


@pytest.fixture(scope="module")
def router() -> Iterator[RouterThread]:
    loras = {"s0": ("ad1=/adapters/ad1", "ad2=/adapters/ad2"), "s1": ("ad1=/elsewhere/ad1",)}
    specs = [
        ReplicaSpec(name=name, pool="main", model=MODEL, enable_prompt_tokens_details=True,
                    extra_args=("--timing", TIMING, "--max-loras", "2",
                                *[arg for module in modules for arg in ("--lora-modules", module)]))
        for name, modules in loras.items()
    ]
    fleet = start_fleet(specs, timeout_s=30.0)
    try:
        replicas = [{"name": r.name, "url": r.url, "kv_events": r.kv_events,
                     "kv_replay": r.kv_replay, "prefill_rate_tps": 20_000.0}
                    for r in fleet.replicas]
        config = parse_config({
            "listen": {"host": "127.0.0.1", "port": 0},
            "pools": {"main": {"model": MODEL, "replicas": replicas}},
            "routes": {ROUTE: {"pools": ["main"]}},
            "policy": {"name": "kvroute", "seed": 3},
            "discovery": {"health_interval_s": 0.5, "metrics_interval_s": 0.5,
                          "models_interval_s": 5, "timeout_s": 1.0},
            "timeouts": {"connect_s": 1.0, "first_byte_s": 10.0, "total_s": 20.0},
            "log_level": "warning",
        }, env={})
        with RouterThread(config) as rt:
            yield rt
    finally:
        fleet.stop()


def _post(router: RouterThread, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    request = urllib.request.Request(router.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=20) as reply:
            return reply.status, dict(reply.headers.items()), json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers.items()), json.loads(exc.read())


def _prompt(seed: int, n: int = 150) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.getrandbits(32):x}" for _ in range(n))


def _cached(answer: Any) -> int:
    details = answer["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def test_router_lists_the_adapters_with_their_route_as_parent(router: RouterThread) -> None:
    with urllib.request.urlopen(router.url + "/v1/models", timeout=10) as reply:
        cards = {card["id"]: card for card in json.loads(reply.read())["data"]}
    assert set(cards) == {ROUTE, "ad1", "ad2"}
    assert cards["ad2"]["parent"] == ROUTE and cards["ad2"]["root"] == "/adapters/ad2"
    assert cards["ad1"]["parent"] == ROUTE and cards["ad1"]["max_model_len"] is None


def test_adapter_requests_hash_with_the_lora_key(router: RouterThread) -> None:
    prompt = _prompt(1)
    status, head, first = _post(router, {"model": "ad1", "prompt": prompt, "max_tokens": 2})
    assert status == 200, first
    assert first["model"] == "ad1"  # forwarded under the adapter's name, not the base model's
    assert head["x-kvroute-approximate"] == "false"
    # s1 loaded ad1 from another path: its blocks would hash differently, so the pool's key
    # (the path most replicas use, ties to the smaller) leaves only s0 for ad1.
    replica = head["x-kvroute-replica"]
    assert replica == "s0"
    status, head2, again = _post(router, {"model": "ad1", "prompt": prompt, "max_tokens": 2})
    assert status == 200, again
    assert head2["x-kvroute-replica"] == replica
    assert _cached(again) > 0
    assert int(head2["x-kvroute-cached-tokens"]) == _cached(again)
    # The base model's blocks of the same tokens are other blocks: nothing predicted or found.
    status, head3, base = _post(router, {"model": ROUTE, "prompt": prompt, "max_tokens": 2})
    assert status == 200, base
    assert int(head3["x-kvroute-cached-tokens"]) == _cached(base) == 0


def test_an_adapter_goes_only_where_it_is_listed(router: RouterThread) -> None:
    for seed in range(10, 16):
        status, head, answer = _post(router, {"model": "ad2", "prompt": _prompt(seed, 40),
                                               "max_tokens": 1})
        assert status == 200, answer
        assert head["x-kvroute-replica"] == "s0"


def test_an_unknown_adapter_is_a_404_naming_the_routes(router: RouterThread) -> None:
    status, _, answer = _post(router, {"model": "ad9", "prompt": "hello", "max_tokens": 1})
    assert status == 404
    assert "ad9" in answer["error"]["message"] and ROUTE in answer["error"]["message"]


@pytest.fixture(scope="module")
def loading_router() -> Iterator[RouterThread]:
    """Two engines that list no adapter but load one on demand; the pool declares ``ad7``."""
    specs = [ReplicaSpec(name=f"t{i}", pool="main", model=MODEL,
                         enable_prompt_tokens_details=True,
                         extra_args=("--timing", TIMING, "--allow-runtime-lora"))
             for i in range(2)]
    fleet = start_fleet(specs, timeout_s=30.0)
    try:
        replicas = [{"name": r.name, "url": r.url, "kv_events": r.kv_events,
                     "kv_replay": r.kv_replay} for r in fleet.replicas]
        config = parse_config({
            "listen": {"host": "127.0.0.1", "port": 0},
            "pools": {"main": {"model": MODEL, "replicas": replicas,
                               "lora_adapters": {"ad7": "/adapters/ad7"}}},
            "routes": {ROUTE: {"pools": ["main"]}},
            "discovery": {"health_interval_s": 0.5, "metrics_interval_s": 0.5,
                          "models_interval_s": 5, "timeout_s": 1.0},
            "log_level": "warning",
        }, env={})
        with RouterThread(config) as rt:
            yield rt
    finally:
        fleet.stop()


def test_a_declared_adapter_is_loaded_on_demand_once(loading_router: RouterThread) -> None:
    prompt = _prompt(21)
    status, head, first = _post(loading_router, {"model": "ad7", "prompt": prompt,
                                                 "max_tokens": 2})
    assert status == 200, first
    assert first["model"] == "ad7"
    replica = head["x-kvroute-replica"]
    status, head2, again = _post(loading_router, {"model": "ad7", "prompt": prompt,
                                                  "max_tokens": 2})
    assert status == 200, again
    assert head2["x-kvroute-replica"] == replica  # loaded once, where it now lives
    assert int(head2["x-kvroute-cached-tokens"]) == _cached(again) > 0
    status, _, missing = _post(loading_router, {"model": "ad8", "prompt": "x", "max_tokens": 1})
    assert status == 404 and "ad8" in missing["error"]["message"]
