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
from gateway import RouterThread, one_engine_router

pytestmark = pytest.mark.integration

MODEL = "sim-model"


@pytest.fixture(scope="module")
def router() -> Iterator[RouterThread]:
    with one_engine_router(model=MODEL, pool={"report_hits": True}) as rt:
        yield rt


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
