"""The live dashboard, served by the router and rendered by a real headless Chromium.

The router (``RouterRuntime``) runs in a thread of its own event loop in front of two
simulated engines that report prompt-token details; a bounded set of requests (sessions that
repeat their prefix, unique prompts, one prompt too long for every tier) gives the page
something to show. ``/dashboard/data`` is checked as JSON, then Debian's ``chromium`` loads
``/dashboard`` headless (``--dump-dom`` after the page's script ran, and ``--screenshot``):
the rendered tables must hold every replica, both hit rates and the refusal. Skipped with
the reason when ``chromium`` is not installed (``apt-get install -y chromium``; ``.ci/run``
installs it).

``KVROUTE_DASHBOARD_SCREENSHOT=docs/img/dashboard.png`` keeps the screenshot (how the one in
``docs/img/`` was made).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from tiered_fleet import fleet_config, mixed_traffic, send, tier_specs, words

from kvroute.config import RouterConfig
from kvroute.shell.runtime import RouterRuntime
from kvroute.sim.launcher import start_fleet

pytestmark = pytest.mark.integration

CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars", "--window-size=1500,860",
)


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path is not None:
            return path
    pytest.skip("headless Chromium is not installed (apt-get install -y chromium; "
                ".ci/run installs it)")


class RouterThread:
    """A router on its own event loop in a thread, so a blocking browser can talk to it."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.rt: RouterRuntime | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="router", daemon=True)

    def _main(self) -> None:
        async def serve() -> None:
            self._stop = asyncio.Event()
            async with RouterRuntime(self.config, env={}) as rt:
                self.rt = rt
                self.ready.set()
                await self._stop.wait()

        try:
            self.loop.run_until_complete(serve())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            self._error = exc
            self.ready.set()

    def __enter__(self) -> RouterRuntime:
        self.thread.start()
        assert self.ready.wait(30), "the router did not start within 30 s"
        if self._error is not None:
            raise self._error
        assert self.rt is not None
        return self.rt

    def __exit__(self, *exc: object) -> None:
        stop = self._stop
        if stop is not None:
            self.loop.call_soon_threadsafe(stop.set)
        self.thread.join(30)
        self.loop.close()


def traffic(url: str) -> None:
    asyncio.run(asyncio.wait_for(mixed_traffic(url), 60))


class LiveLoad:
    """Long answers streaming while the browser looks (bounded: 4 requests, cancelled on
    exit, each at most 3,000 tokens)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        rng = random.Random(12)
        async with aiohttp.ClientSession() as session:
            tasks = [asyncio.create_task(send(session, self.url, words(rng, 600 + 300 * i),
                                              max_tokens=3000)) for i in range(4)]
            while not self.stop.is_set():
                await asyncio.sleep(0.05)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> None:
        self.thread.start()

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


@pytest.fixture(scope="module")
def router() -> Iterator[RouterRuntime]:
    fleet = start_fleet(tier_specs(), timeout_s=30.0)
    try:
        with RouterThread(fleet_config(fleet)) as rt:
            traffic(rt.url)
            yield rt
    finally:
        fleet.stop()


def get_json(url: str) -> Any:
    async def main() -> Any:
        async with aiohttp.ClientSession() as session, session.get(url) as resp:
            assert resp.status == 200
            return json.loads(await resp.read())

    return asyncio.run(asyncio.wait_for(main(), 10))


def test_dashboard_data_holds_tiers_replicas_hit_rates_warm_ups_and_refusals(
        router: RouterRuntime) -> None:
    data = get_json(router.url + "/dashboard/data")
    assert [(p["name"], p["window"]) for p in data["pools"]] == [("small", 2048),
                                                                  ("large", 8192)]
    assert {r["name"]: r["pool"] for r in data["replicas"]} == {
        "small-0": "small", "small-1": "small", "large-0": "large"}
    assert all(r["healthy"] and r["prefix_caching"] is True for r in data["replicas"])
    compared = sum(p["drift"]["compared"] for p in data["pools"])
    assert compared == 22  # every answered request reported its cached tokens
    assert not any(p["drift"]["alarm"] for p in data["pools"])
    # A warm-up still computing when its escalated turn arrives may make one prediction
    # optimistic on a loaded machine; the rest agree with what the engines report.
    assert sum(p["drift"]["agree"] for p in data["pools"]) >= compared - 2
    predicted = max(r["predicted_hit_ratio"] or 0 for r in data["replicas"])
    measured = max(r["reported_hit_ratio"] or 0 for r in data["replicas"])
    assert predicted > 0.3 and measured > 0.3  # the growing sessions hit their prefixes
    assert data["warm"].get("fired", 0) >= 1
    refusal = data["refusals"][0]
    assert refusal["status"] == 400 and refusal["reason"].startswith("no_fit")


def test_headless_chromium_renders_the_dashboard(router: RouterRuntime) -> None:
    browser = chromium()
    with tempfile.TemporaryDirectory(prefix="kvroute-chromium-") as profile, \
            LiveLoad(router.url):
        flags = [*CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=4000"]
        dom = subprocess.run([browser, *flags, "--dump-dom", router.url + "/dashboard"],
                             capture_output=True, text=True, timeout=90, check=True).stdout
        assert 'data-loaded="1"' in dom, dom[-2000:]  # the script fetched and rendered
        assert '<div id="error"></div>' in dom  # no fetch failed
        for replica in ("small-0", "small-1", "large-0"):
            assert f"<td>{replica}</td>" in dom
        assert "no_fit" in dom and "exact" in dom and "fired" in dom
        shot = Path(profile) / "dashboard.png"
        subprocess.run([browser, *flags, f"--screenshot={shot}", router.url + "/dashboard"],
                       capture_output=True, timeout=90, check=True)
        png = shot.read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
        keep = os.environ.get("KVROUTE_DASHBOARD_SCREENSHOT")
        if keep:
            Path(keep).write_bytes(png)
