"""Disaggregated prefill/decode through ``kvroute serve``: vLLM's two-step protocol over
real HTTP and ZMQ on loopback, against ``kvroute sim serve`` engines playing both roles.

The router sends a split request's prompt to the prefill engine with ``max_tokens: 1`` and
``kv_transfer_params: {do_remote_decode: true}``, then the client's request to the decode
engine with the ``kv_transfer_params`` the prefill answered; the decode engine pulls the
blocks (``--kv-transfer-s-per-token``) and computes only the last prompt token, which its
``usage.prompt_tokens_details.cached_tokens`` shows. Faults: a prefill engine that answers
503 or is gone leaves the request colocated on the decode engine; a decode engine that
fails before its first byte is retried on another.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import pytest

from kvroute.config import RouterConfig
from kvroute.shell.runtime import RouterRuntime
from kvroute.sim.launcher import Fleet

pytestmark = pytest.mark.integration

ROUTE = "assistant"
POOL = "small"
FleetFactory = Callable[..., Fleet]
ConfigFor = Callable[..., RouterConfig]
ROLES = ("prefill", "decode", "decode")
BLOCK = 16  # the simulated engines' default block size


def run(coro: Any, timeout_s: float = 40.0) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout_s))


def words(rng: random.Random, n: int) -> str:
    """``n`` distinct words: the simulated tokenizer makes each one token."""
    return " ".join(f"w{rng.getrandbits(40):x}" for _ in range(n))


def pd_fleet(make_fleet: FleetFactory) -> Fleet:
    return make_fleet(3, fault_injection=True, enable_prompt_tokens_details=True,
                      extra=("--kv-transfer-s-per-token", "0.00001"))


def pd_config(fleet: Fleet, config_for: ConfigFor, mode: str = "always") -> RouterConfig:
    replicas = [{"name": r.name, "url": r.url, "kv_events": r.kv_events, "role": role,
                 "prefill_rate_tps": 20_000.0}
                for r, role in zip(fleet.replicas, ROLES, strict=True)]
    return config_for(fleet, pools={POOL: {"model": "sim-model", "replicas": replicas,
                                           "disaggregation": {"mode": mode}}},
                      retries={"max_retries": 2})


async def ask(session: aiohttp.ClientSession, url: str, content: str,
              max_tokens: int = 6) -> tuple[Mapping[str, str], int, dict[str, Any]]:
    """One streamed chat request; its headers, the tokens streamed and the usage chunk."""
    body = {"model": ROUTE, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        headers = resp.headers.copy()
        raw = (await resp.read()).decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = next(c["usage"] for c in chunks if c.get("usage"))
    return headers, usage["completion_tokens"], usage


async def faults(session: aiohttp.ClientSession, url: str,
                 arm: Mapping[str, Any] | None = None) -> dict[str, Any]:
    if arm is None:
        async with session.get(url + "/sim/faults") as resp:
            return dict(await resp.json())
    async with session.post(url + "/sim/faults", json=arm) as resp:
        assert resp.status == 200
        return dict(await resp.json())


def test_a_split_request_runs_the_two_step_protocol(make_fleet: FleetFactory,
                                                    config_for: ConfigFor) -> None:
    fleet = pd_fleet(make_fleet)
    prefill = fleet.replicas[0]
    rng = random.Random(5)

    async def main() -> None:
        async with (RouterRuntime(pd_config(fleet, config_for), env={}) as rt,
                    aiohttp.ClientSession() as session):
            headers, tokens, usage = await ask(session, rt.url, words(rng, 300))
            assert headers["x-kvroute-prefill-replica"] == prefill.name
            assert headers["x-kvroute-replica"] in (fleet.replicas[1].name,
                                                    fleet.replicas[2].name)
            assert tokens == 6  # the decode engine's answer, streamed as one response
            prompt = usage["prompt_tokens"]
            # every full block but the last token's came over the link: not computed on D
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert cached == (prompt - 1) // BLOCK * BLOCK
            async with session.get(prefill.url + "/metrics") as resp:
                text = await resp.text()
            computed = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith("vllm:prompt_tokens_total")]
            assert computed == [float(prompt)]  # the prefill engine computed the prompt
            # the prefill answer's parameters, checked by the decode engine: a decode request
            # whose parameters locate too few blocks is refused, not silently recomputed
            body = {"model": "sim-model", "prompt": words(rng, 100), "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "e",
                                           "remote_block_ids": [0], "remote_host": "h",
                                           "remote_port": 1}}
            async with session.post(fleet.replicas[1].url + "/v1/completions",
                                    json=body) as resp:
                assert resp.status == 400 and "another prompt" in await resp.text()

    run(main())


def test_a_failed_prefill_is_colocated_and_a_failed_decode_retried(
        make_fleet: FleetFactory, config_for: ConfigFor) -> None:
    fleet = pd_fleet(make_fleet)
    prefill, d1, d2 = fleet.replicas
    rng = random.Random(6)

    async def main() -> None:
        async with (RouterRuntime(pd_config(fleet, config_for), env={}) as rt,
                    aiohttp.ClientSession() as session):
            # P answers 503: the decode replica prefills the request itself
            await faults(session, prefill.url, {"fail_next": 1, "status": 503})
            headers, tokens, usage = await ask(session, rt.url, words(rng, 200))
            assert "x-kvroute-prefill-replica" not in headers and tokens == 6
            assert usage["prompt_tokens_details"]["cached_tokens"] == 0
            assert (await faults(session, prefill.url))["fired"]["requests_failed"] == 1
            # D answers 503 before its first byte: another decode replica serves it. The
            # fault is armed on the decode replica the router is expected to choose next:
            # the one that served last for three requests (a replica that prefilled for
            # itself carries a prefill duty for a while, so the other keeps winning), then
            # the other one for three (were the choices to alternate).
            decoders = {d1.name: d1, d2.name: d2}
            last = headers["x-kvroute-replica"]
            served: list[str] = []
            for attempt in range(6):  # until the armed replica was chosen first (bounded)
                armed = last if attempt < 3 else next(n for n in decoders if n != last)
                other = next(n for n in decoders if n != armed)
                await faults(session, decoders[other].url, {"fail_next": 0})
                await faults(session, decoders[armed].url, {"fail_next": 1, "status": 503})
                fired = (await faults(session, decoders[armed].url))["fired"]["requests_failed"]
                headers, tokens, _ = await ask(session, rt.url, words(rng, 200))
                last = headers["x-kvroute-replica"]
                served.append(last)
                now = (await faults(session, decoders[armed].url))["fired"]["requests_failed"]
                if now > fired:
                    assert last == other and tokens == 6
                    break
            else:
                pytest.fail(f"the armed decode replica was never chosen first (served {served})")
            await faults(session, d1.url, {"fail_next": 0})
            await faults(session, d2.url, {"fail_next": 0})
            # P dies: every request is still answered, colocated
            fleet.processes[0].send_signal(signal.SIGKILL)
            fleet.processes[0].wait()
            for _ in range(2):
                headers, tokens, usage = await ask(session, rt.url, words(rng, 200))
                assert "x-kvroute-prefill-replica" not in headers and tokens == 6
                assert headers["x-kvroute-replica"] in (d1.name, d2.name)

    run(main())
