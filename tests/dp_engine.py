"""What the data-parallel suites ask of a simulated DP engine over HTTP: a chat answer
(optionally pinned to a rank) and the wire block hashes of a prompt as the engine tokenizes
it (``tests/integration/test_dp_ranks_live.py``, ``test_dp_ranks_discovered.py``)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from kvroute.core.hashing import BlockHasher


async def chat(session: aiohttp.ClientSession, url: str, model: str,
               messages: list[dict[str, str]], headers: dict[str, str] | None = None,
               ) -> tuple[dict[str, str], dict[str, Any]]:
    """POST a two-token chat to ``url``; (response headers, body). Asserts a 200."""
    body = {"model": model, "messages": messages, "max_tokens": 2}
    async with session.post(url + "/v1/chat/completions", data=json.dumps(body),
                            headers={"Content-Type": "application/json",
                                     **(headers or {})}) as resp:
        assert resp.status == 200, await resp.text()
        return dict(resp.headers), json.loads(await resp.read())


async def block_hashes(session: aiohttp.ClientSession, url: str, model: str,
                       messages: list[dict[str, str]]) -> list[int]:
    """The prompt's ids from the engine's ``/tokenize``, hashed as the sim engine does
    (sha256, 16-token blocks)."""
    async with session.post(url + "/tokenize", data=json.dumps(
            {"model": model, "messages": messages})) as resp:
        ids = (await resp.json())["tokens"]
    return list(BlockHasher("sha256", 16).wire_hashes(ids))
