"""A router whose pool's engines come from the Kubernetes API follows scale-out and scale-in.

No cluster: a fake API server on loopback answers the EndpointSlice list with one slice and
then streams watch events the test pushes (``ADDED`` a second engine's slice, ``DELETED``
the first's). The slices are the recorded ``tests/data/k8s/list_initial.json`` slice with
its endpoint and ports replaced by real simulated engines (``sim.server.SimServer``, HTTP
and ZMQ KV events on loopback), one engine per slice because each engine has its own ports.
Requests go through the real ``RouterRuntime`` (``kvroute serve``) and through the picker of
``kvroute epp`` (``Picker.pick``, the ext_proc server's entry point).
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvroute.config import ReplicaConfig, parse_config
from kvroute.core.router import ReplicaSpec
from kvroute.core.types import PoolName, ReplicaId
from kvroute.shell.discovery import Discovery
from kvroute.shell.epp_runtime import EppRuntime
from kvroute.shell.metrics import RouterMetrics
from kvroute.shell.picker import Picked
from kvroute.shell.runtime import RouterRuntime, build_core
from kvroute.shell.state import MonotonicClock
from kvroute.sim.server import SimServer, SimServerConfig

pytestmark = pytest.mark.integration

DATA = Path(__file__).resolve().parents[1] / "data" / "k8s"
TOKEN = "recorded-test-token"
SELECTOR = "kubernetes.io/service-name=vllm"
PATH = "/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices"
TEST_SECONDS = 20.0


def _slice(name: str, version: str, pod: str, engine: SimServer) -> dict[str, Any]:
    """The recorded slice, pointing at ``engine`` (its HTTP and KV-event ports)."""
    template = json.loads((DATA / "list_initial.json").read_text())["items"][0]
    obj = copy.deepcopy(template)
    obj["metadata"].update(name=name, resourceVersion=version)
    endpoint = obj["endpoints"][0]
    endpoint["addresses"] = ["127.0.0.1"]
    endpoint["targetRef"]["name"] = pod
    kv = engine.kv_events_endpoint
    assert kv is not None
    obj["endpoints"] = [endpoint]
    obj["ports"] = [{"name": "http", "protocol": "TCP", "port": engine.port},
                    {"name": "kv-events", "protocol": "TCP", "port": int(kv.rsplit(":", 1)[1])}]
    return obj


class FakeApiServer:
    """A list of the given slices, then a watch that streams what the test pushes."""

    def __init__(self, initial: list[dict[str, Any]]) -> None:
        self.initial = initial
        self.events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def slices(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"kind": "Status", "code": 401}, status=401)
        if request.query.get("watch") != "1":
            return web.json_response({"kind": "EndpointSliceList",
                                      "apiVersion": "discovery.k8s.io/v1",
                                      "metadata": {"resourceVersion": "100"},
                                      "items": self.initial})
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        while (event := await self.events.get()) is not None:
            await resp.write(json.dumps(event).encode() + b"\n")
        return resp

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(PATH, self.slices)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        self.events.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()


async def _until(what: str, check: Callable[[], bool]) -> None:
    while not check():
        await asyncio.sleep(0.02)  # bounded by the test's overall deadline


def _config(tmp_path: Path, api_url: str) -> Any:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "c", "cluster": {"server": api_url}}],
        "contexts": [{"name": "t", "context": {"cluster": "c", "user": "u"}}],
        "users": [{"name": "u", "user": {"token": TOKEN}}]}))
    return parse_config({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {"k8s": {"model": "tiny", "kubernetes": {
            "namespace": "llm", "label_selector": SELECTOR, "kubeconfig": str(kubeconfig)}}},
        "routes": {"tiny": {"pools": ["k8s"]}},
        "discovery": {"health_interval_s": 0.2, "metrics_interval_s": 0.2,
                      "models_interval_s": 5, "timeout_s": 1.0},
        "timeouts": {"connect_s": 1.0, "first_byte_s": 5.0, "total_s": 10.0},
        "log_level": "warning",
    }, env={})


def _scenario(tmp_path: Path,
              drive: Callable[[Any, FakeApiServer, list[SimServer]], Awaitable[None]]) -> None:
    async def main() -> None:
        cfg = SimServerConfig(model="tiny", max_model_len=512, block_size=16,
                              num_gpu_blocks=256, eos_after_tokens=4)
        async with SimServer(cfg) as e0, SimServer(cfg) as e1:
            api = FakeApiServer([_slice("vllm-a", "90", "vllm-pod-0", e0)])
            await api.start()
            try:
                await drive(_config(tmp_path, api.url), api, [e0, e1])
            finally:
                await api.stop()

    asyncio.run(asyncio.wait_for(main(), TEST_SECONDS))


def test_serve_routes_to_engines_as_they_join_and_leave(tmp_path: Path) -> None:
    served: list[str] = []

    async def drive(config: Any, api: FakeApiServer, engines: list[SimServer]) -> None:
        async with RouterRuntime(config, env={}) as rt, aiohttp.ClientSession() as client:
            async def ask(prompt: str) -> str:
                async with client.post(rt.url + "/v1/completions", json={
                        "model": "tiny", "prompt": prompt, "max_tokens": 4}) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
                    return resp.headers["x-kvroute-replica"]

            pod0, pod1 = ReplicaId("vllm-pod-0"), ReplicaId("vllm-pod-1")
            assert rt.members is not None and rt.discovery is not None
            await _until("pod-0 healthy", lambda: rt.core.is_healthy(pod0))
            assert pod0 in rt.subscribers  # its KV events are read
            served.append(await ask("hello there"))
            api.events.put_nowait({"type": "ADDED",
                                   "object": _slice("vllm-b", "101", "vllm-pod-1", engines[1])})
            await _until("pod-1 healthy", lambda: rt.core.has_replica(pod1)
                         and rt.core.is_healthy(pod1))
            assert pod1 in rt.subscribers
            api.events.put_nowait({"type": "DELETED",
                                   "object": _slice("vllm-a", "102", "vllm-pod-0", engines[0])})
            await _until("pod-0 gone", lambda: not rt.core.has_replica(pod0))
            assert pod0 not in rt.subscribers
            assert rt.discovery.member_url(pod0) is None
            for i in range(4):
                served.append(await ask(f"question {i} after the scale-in"))
            async with client.get(rt.url + "/health") as resp:
                assert resp.status == 200
                assert (await resp.json())["healthy_replicas"] == {"k8s": 1}
            async with client.get(rt.url + "/dashboard/data") as resp:
                assert resp.status == 200, await resp.text()
                shown = [row["name"] for row in (await resp.json())["replicas"]]
            assert shown == [pod1]

    _scenario(tmp_path, drive)
    assert served == ["vllm-pod-0"] + ["vllm-pod-1"] * 4


def test_epp_names_the_joined_engine_and_forgets_the_one_that_left(tmp_path: Path) -> None:
    async def drive(config: Any, api: FakeApiServer, engines: list[SimServer]) -> None:
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4}).encode()
        async with EppRuntime(config, grpc_port=0, health_port=0, env={}) as epp:
            rt, picker = epp.router, epp.picker
            assert picker is not None
            pod0, pod1 = ReplicaId("vllm-pod-0"), ReplicaId("vllm-pod-1")
            await _until("pod-0 healthy", lambda: rt.core.is_healthy(pod0))
            a0 = f"127.0.0.1:{engines[0].port}"
            a1 = f"127.0.0.1:{engines[1].port}"
            assert picker.served_replica(a0) == pod0
            api.events.put_nowait({"type": "ADDED",
                                   "object": _slice("vllm-b", "101", "vllm-pod-1", engines[1])})
            await _until("pod-1 healthy", lambda: rt.core.has_replica(pod1)
                         and rt.core.is_healthy(pod1))
            api.events.put_nowait({"type": "DELETED",
                                   "object": _slice("vllm-a", "102", "vllm-pod-0", engines[0])})
            await _until("pod-0 gone", lambda: not rt.core.has_replica(pod0))
            assert picker.served_replica(a0) is None
            picked = await picker.pick("/v1/completions", {"content-type": "application/json"},
                                       body, None)
            assert isinstance(picked, Picked)
            assert picked.endpoints == (a1,)
            picked.walk.finish()

    _scenario(tmp_path, drive)


def test_a_probe_out_when_its_replica_leaves_changes_nothing(tmp_path: Path) -> None:
    """Discovery drops the answer of a probe whose replica left while it was out (no
    ``RouterCore`` call for a replica the core no longer knows)."""
    async def main() -> None:
        entered, release = asyncio.Event(), asyncio.Event()

        vectors = json.loads((DATA.parent / "vllm-vectors-0.32.json").read_text())
        models = next(e for e in vectors["http_examples_v0_32"]
                      if e["path"] == "/v1/models")["response"]
        models["data"][0]["id"] = "tiny"

        async def health(_: web.Request) -> web.Response:
            return web.Response()

        async def model_list(_: web.Request) -> web.Response:
            entered.set()
            await release.wait()  # the replica leaves while this answer is out
            return web.json_response(models)

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", model_list)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        config = _config(tmp_path, "http://127.0.0.1:1")
        core = build_core(config, clock=MonotonicClock())
        pod = ReplicaId("vllm-pod-9")
        try:
            async with aiohttp.ClientSession() as session:
                discovery = Discovery(config, core, session, RouterMetrics())
                core.add_replica(PoolName("k8s"), ReplicaSpec(pod))
                discovery.add_replica(PoolName("k8s"), ReplicaConfig(name=pod, url=url))
                probing = asyncio.create_task(discovery.refresh_now())
                await entered.wait()
                discovery.remove_replica(pod)
                core.remove_replica(pod)
                release.set()
                await probing  # would raise KeyError from the core without the guard
                assert not core.has_replica(pod) and discovery.member_url(pod) is None
                assert discovery.num_loop_errors == 0
        finally:
            release.set()
            await runner.cleanup()

    asyncio.run(asyncio.wait_for(main(), TEST_SECONDS))
