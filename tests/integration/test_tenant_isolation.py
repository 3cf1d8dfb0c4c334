"""The README's security claims, end to end with a router and a ``kvroute sim serve`` engine.

* Two tenants sending the same prompt share no KV block in the engine (the engine's own
  ``usage.prompt_tokens_details.cached_tokens`` says so), and the second tenant's answer
  carries no header that differs from a control answer to a prompt nobody sent before.
  The same run with both tenants opted out (``cache_salt: false``) shows the sharing, so
  the check can fail.
* Admin endpoints answer no request without the admin key.
* No secret (tenant keys, admin key, salt secret, derived salts) reaches the router's logs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import pytest

from kvroute.config import RouterConfig, derive_cache_salt
from kvroute.shell.runtime import RouterRuntime
from kvroute.sim.launcher import Fleet

pytestmark = pytest.mark.integration

ROUTE = "assistant"
ENV = {"ACME_KEY": "key-acme-7f3a", "BETA_KEY": "key-beta-19c2", "ADMIN_KEY": "key-admin-55e1",
       "KVROUTE_SALT_SECRET": "salt-secret-0b9d",
       "KVROUTE_CLUSTER_SECRET": "cluster-secret-4c2e-0123456789"}
VARYING = {"date", "content-length"}
"""Headers whose values differ between any two answers (framing, clock)."""


def tenants(*, salted: bool) -> list[dict[str, Any]]:
    extra = {} if salted else {"cache_salt": False}
    return [{"name": "acme", "api_key_env": "ACME_KEY", **extra},
            {"name": "beta", "api_key_env": "BETA_KEY", **extra}]


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.getrandbits(40):x}" for _ in range(n))


async def ask(session: aiohttp.ClientSession, url: str, key: str, content: str,
              ) -> tuple[Mapping[str, str], int]:
    """One chat request as a tenant: the answer's headers (lower-cased) and the engine's
    count of prompt tokens served from its cache (-1: the engine does not report it)."""
    body = {"model": ROUTE, "messages": [{"role": "user", "content": content}],
            "max_tokens": 2}
    async with session.post(url + "/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as resp:
        assert resp.status == 200, await resp.text()
        usage = (await resp.json())["usage"]
        headers = {k.lower(): v for k, v in resp.headers.items()}
    details = usage.get("prompt_tokens_details") or {}
    return headers, int(details.get("cached_tokens", -1))


def signal(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k not in VARYING}


async def same_prompt(config: RouterConfig, rng: random.Random) -> tuple[int, dict[str, str],
                                                                          dict[str, str]]:
    """acme sends a prompt twice (its blocks are then cached), beta sends the same prompt:
    beta's cached tokens, beta's headers, and beta's headers for a fresh prompt."""
    prompt = words(rng, 200)
    async with RouterRuntime(config, env=ENV) as rt, aiohttp.ClientSession() as session:
        _, _ = await ask(session, rt.url, ENV["ACME_KEY"], prompt)
        _, acme_cached = await ask(session, rt.url, ENV["ACME_KEY"], prompt)
        assert acme_cached >= 192, "acme's own prefix must be cached for the check to mean much"
        control, _ = await ask(session, rt.url, ENV["BETA_KEY"], words(rng, 200))
        beta, beta_cached = await ask(session, rt.url, ENV["BETA_KEY"], prompt)
    return beta_cached, signal(beta), signal(control)


def test_two_tenants_with_the_same_prompt_share_no_block_and_no_header_signal(
        make_fleet: Callable[..., Fleet], config_for: Callable[..., RouterConfig]) -> None:
    fleet = make_fleet(1, extra=("--enable-prompt-tokens-details",))
    rng = random.Random(26)

    beta_cached, beta, control = asyncio.run(asyncio.wait_for(
        same_prompt(config_for(fleet, tenants=tenants(salted=True)), rng), 30))
    assert beta_cached == 0
    assert not [k for k in beta if k.startswith("x-kvroute-")]
    assert beta == control

    # Opted out, the same steps do share the engine's blocks: the check above can fail.
    shared_cached, _, _ = asyncio.run(asyncio.wait_for(
        same_prompt(config_for(fleet, tenants=tenants(salted=False)), rng), 30))
    assert shared_cached >= 192


def test_admin_endpoints_answer_nothing_without_the_admin_key(
        shared_fleet: Fleet, config_for: Callable[..., RouterConfig]) -> None:
    config = config_for(shared_fleet, tenants=tenants(salted=True), admin_key_env="ADMIN_KEY")
    admin = ENV["ADMIN_KEY"]
    attempts: list[tuple[str, Mapping[str, str]]] = [
        ("", {}), ("", {"Authorization": "Bearer"}), ("", {"Authorization": f"Basic {admin}"}),
        ("", {"Authorization": admin}), ("", {"Authorization": f"Bearer {admin[:-1]}"}),
        ("", {"Authorization": f"Bearer {admin}0"}), ("", {"Authorization": f"Bearer {admin.upper()}"}),
        ("", {"Authorization": f"Bearer {ENV['ACME_KEY']}"}), (f"?key={admin}", {}),
        ("", {"X-Api-Key": admin}), ("", {"Cookie": f"admin={admin}"}),
    ]

    async def main() -> None:
        async with RouterRuntime(config, env=ENV) as rt, aiohttp.ClientSession() as session:
            for path in ("/admin/index", "/admin/state"):
                for query, headers in attempts:
                    async with session.get(rt.url + path + query, headers=headers) as resp:
                        body = await resp.read()
                        assert resp.status in (401, 403), (path, query, headers, resp.status)
                        assert set(json.loads(body)["error"]) >= {"message", "type", "code"}
                async with session.get(rt.url + path,
                                       headers={"Authorization": f"Bearer {admin}"}) as resp:
                    assert resp.status == 200

    asyncio.run(asyncio.wait_for(main(), 30))


def test_no_secret_reaches_the_logs(shared_fleet: Fleet, config_for: Callable[..., RouterConfig],
                                    caplog: pytest.LogCaptureFixture) -> None:
    # With the cluster bus on (the real NATS if it runs; routing goes on alone if not), so
    # the cluster secret is read and used as well.
    config = config_for(shared_fleet, tenants=tenants(salted=True), admin_key_env="ADMIN_KEY",
                        log_level="debug",
                        cluster={"bus": "nats", "url": "nats://127.0.0.1:4222",
                                 "subject": f"kvroute.test.{random.Random().getrandbits(32):x}"})
    secrets = [*ENV.values(), derive_cache_salt(ENV["KVROUTE_SALT_SECRET"], "acme"),
               derive_cache_salt(ENV["KVROUTE_SALT_SECRET"], "beta")]
    rng = random.Random(27)

    async def main() -> None:
        async with RouterRuntime(config, env=ENV) as rt, aiohttp.ClientSession() as session:
            assert rt.cluster is not None  # the cluster secret was read and is in use
            for key in (ENV["ACME_KEY"], ENV["BETA_KEY"]):
                await ask(session, rt.url, key, words(rng, 40))
            for key in (ENV["ADMIN_KEY"], ENV["ACME_KEY"] + "x", ENV["ADMIN_KEY"] + "x"):
                for path in ("/admin/state", "/v1/chat/completions"):
                    async with session.get(rt.url + path,
                                           headers={"Authorization": f"Bearer {key}"}) as resp:
                        await resp.read()
            async with session.post(rt.url + "/v1/chat/completions", data=b"{not json",
                                    headers={"Authorization": f"Bearer {ENV['ACME_KEY']}"}) as resp:
                assert resp.status == 400

    with caplog.at_level(logging.DEBUG):
        asyncio.run(asyncio.wait_for(main(), 30))
    assert [r for r in caplog.records if r.name.startswith("kvroute")], "no router logs captured"
    for record in caplog.records:
        text = record.getMessage() + (record.exc_text or "") + repr(record.__dict__)
        leaked = [secret for secret in secrets if secret in text]
        assert not leaked, f"{record.name} logged {leaked}: {record.getMessage()[:200]}"
