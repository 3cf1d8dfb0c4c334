"""``pools.<name>.report_hits`` on the live path, against a simulated engine over real HTTP+ZMQ.

The router adds ``vllm_xargs: {"kv_cache_report_mode": "full"}`` to what it forwards; the
simulated engine (like vLLM 0.32) then publishes a ``BlockStored`` for a repeated prompt's
hit blocks. The router must take that as a touch: its index keeps one entry per block (a
copy counted per re-announcement would outlive the engine's only ``BlockRemoved``), and its
LRU view counts the touches.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from gateway import RouterThread

from kvroute.config import parse_config
from kvroute.sim.launcher import ReplicaSpec, start_fleet

pytestmark = pytest.mark.integration

MODEL = "sim-model"


@pytest.fixture(scope="module")
def router() -> Iterator[RouterThread]:
    fleet = start_fleet([ReplicaSpec(name="s0", pool="main", model=MODEL,
                                     extra_args=("--timing", "0.001,0.00005,0.0002,0"))],
                        timeout_s=30.0)
    try:
        replicas = [{"name": r.name, "url": r.url, "kv_events": r.kv_events,
                     "kv_replay": r.kv_replay} for r in fleet.replicas]
        config = parse_config({
            "listen": {"host": "127.0.0.1", "port": 0},
            "pools": {"main": {"model": MODEL, "replicas": replicas, "report_hits": True}},
            "routes": {"assistant": {"pools": ["main"]}},
            "discovery": {"health_interval_s": 0.5, "metrics_interval_s": 0.5,
                          "models_interval_s": 5, "timeout_s": 1.0},
            "log_level": "warning",
        }, env={})
        with RouterThread(config) as rt:
            yield rt
    finally:
        fleet.stop()


def _post(router: RouterThread, prompt: str) -> dict[str, str]:
    body = {"model": "assistant", "prompt": prompt, "max_tokens": 1}
    request = urllib.request.Request(router.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=20) as reply:
        reply.read()
        return dict(reply.headers.items())


def _state(router: RouterThread) -> tuple[int, int, int]:
    """(index entries, extra copies, touches in the LRU view)."""
    async def read() -> tuple[int, int, int]:
        assert router.runtime is not None
        core = router.runtime.core
        assert core.recency is not None, "report_hits turns the LRU view on"
        stats = core.index.stats()
        return stats.num_entries, stats.num_extra_copies, core.recency.stats().num_touches

    return router.call(read())


def _wait(router: RouterThread, done: Any, what: str) -> tuple[int, int, int]:
    deadline = time.monotonic() + 10.0
    while True:
        state = _state(router)
        if done(state):
            return state
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {state}"
        time.sleep(0.05)


def test_a_repeated_prompt_touches_its_blocks_without_adding_copies(router: RouterThread) -> None:
    rng = random.Random(4)
    prompt = " ".join(f"w{rng.getrandbits(32):x}" for _ in range(120))
    _wait(router, lambda s: True, "the router")
    _post(router, prompt)
    entries, copies, touches = _wait(router, lambda s: s[0] > 0, "the first request's blocks")
    assert (copies, touches) == (0, 0)
    head = _post(router, prompt)
    assert int(head["x-kvroute-cached-tokens"]) > 0
    after = _wait(router, lambda s: s[2] > touches, "the hit's re-announcement")
    # The hit touched its blocks: no entry and no copy added (a copy would outlive the
    # engine's one BlockRemoved per block).
    assert after[:2] == (entries, 0)
    assert after[2] == int(head["x-kvroute-cached-tokens"]) // 16
