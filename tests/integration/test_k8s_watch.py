"""Kubernetes discovery against recorded API responses, served by a fake API server on loopback.

No cluster runs here. ``FakeApiServer`` answers the EndpointSlice list and watch requests of
``shell/k8s_watch.py`` with the recorded objects of ``tests/data/k8s/`` (shaped as the
``discovery.k8s.io/v1`` API reference shows them), in a scripted order, so the real aiohttp
client path runs: list, a watch stream of MODIFIED/BOOKMARK events (scale-out, scale-in), an
``ERROR`` event with code 410 (relist), DELETED, an HTTP 410 answer (relist), and a watch held
open until the test ends. Authentication comes from a kubeconfig written by the test.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kvroute.shell.k8s_watch import EndpointSliceWatcher, K8sApi, K8sConfigError
from kvroute.wire.k8s_endpoints import EndpointDiff, EngineEndpoint, PortNames

pytestmark = pytest.mark.integration

DATA = Path(__file__).resolve().parents[1] / "data" / "k8s"
TOKEN = "eyJhbGciOiJSUzI1NiJ9.recorded-test-token"
SELECTOR = "kubernetes.io/service-name=vllm"
PATH = "/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices"


class FakeApiServer:
    """Answers the scripted requests in order; each step checks the request it expects."""

    def __init__(self, script: list[tuple[bool, str | None, str]] | None = None,
                 recordings: dict[str, bytes] | None = None) -> None:
        # (expect watch?, expected resourceVersion, what to answer)
        self.recordings = recordings or {}
        self.script: list[tuple[bool, str | None, str]] = script or [
            (False, None, "list_initial.json"),
            (True, "48211", "watch_scale.jsonl"),
            (True, "48263", "watch_gone.jsonl"),      # ERROR 410 event -> relist
            (False, None, "list_after_gone.json"),
            (True, "49120", "watch_delete.jsonl"),    # stream ends -> watch again from 49140
            (True, "49140", "http-410"),              # HTTP 410 -> relist
            (False, None, "list_after_gone.json"),
            (True, "49120", "hold"),
        ]
        self.step = 0
        self.problems: list[str] = []
        self.holding = asyncio.Event()
        self._release = asyncio.Event()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def slices(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"kind": "Status", "code": 401}, status=401)
        if self.step >= len(self.script):
            self.problems.append(f"unexpected request {request.query_string}")
            return web.Response(status=500)
        watch, version, answer = self.script[self.step]
        self.step += 1
        q = request.query
        if q.get("labelSelector") != SELECTOR:
            self.problems.append(f"step {self.step}: labelSelector {q.get('labelSelector')!r}")
        if (q.get("watch") == "1") != watch or (watch and q.get("resourceVersion") != version):
            self.problems.append(f"step {self.step}: expected watch={watch} rv={version}, "
                                 f"got {dict(q)}")
        if answer == "http-410":
            return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                      "reason": "Expired", "code": 410}, status=410)
        if answer.endswith(".json"):
            body = self.recordings.get(answer) or (DATA / answer).read_bytes()
            return web.Response(body=body, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        if answer == "hold":
            self.holding.set()
            await self._release.wait()  # held open until the test stops the server
            return resp
        stream = self.recordings.get(answer) or (DATA / answer).read_bytes()
        for line in stream.splitlines(keepends=True):
            await resp.write(line)
        await resp.write_eof()
        return resp

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(PATH, self.slices)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()


def _kubeconfig(tmp_path: Path, server: str) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: test\n"
        f"clusters:\n- name: c\n  cluster:\n    server: {server}\n"
        "contexts:\n- name: test\n  context:\n    cluster: c\n    user: u\n    namespace: llm\n"
        f"users:\n- name: u\n  user:\n    token: {TOKEN}\n")
    return path


def test_list_watch_follows_scale_out_scale_in_and_relists_on_410(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvroute.shell.k8s_watch")
    changes: list[tuple[EndpointDiff, list[str]]] = []

    def on_change(diff: EndpointDiff, engines: Mapping[str, EngineEndpoint]) -> None:
        changes.append((diff, sorted(engines)))

    async def scenario() -> EndpointSliceWatcher:
        server = FakeApiServer()
        await server.start()
        try:
            api = K8sApi.from_kubeconfig(_kubeconfig(tmp_path, server.url))
            async with aiohttp.ClientSession() as session:
                watcher = EndpointSliceWatcher(
                    api, session, namespace="llm", label_selector=SELECTOR,
                    ports=PortNames(http="http", kv_events="kv-events"), on_change=on_change,
                    retry_s=0.05)
                task = asyncio.create_task(watcher.run())
                await asyncio.wait_for(server.holding.wait(), 10)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert server.problems == []
            return watcher
        finally:
            await server.stop()

    watcher = asyncio.run(scenario())
    a, b, c, d = ("vllm-7d9f8c6b5-abcde", "vllm-7d9f8c6b5-fghij", "vllm-7d9f8c6b5-klmno",
                  "vllm-7d9f8c6b5-pqrst")
    assert [names for _, names in changes] == [
        [a, b],        # list
        [a, b, c],     # scale-out: the new pod became ready
        [a, c],        # scale-in: its pod is terminating
        [a, c, d],     # relist after 410: c re-pointed to a new address, d in a new slice
        [a, c],        # DELETED slice
        [a, c, d],     # relist after HTTP 410
    ]
    relist = changes[3][0]
    assert relist.changed == (EngineEndpoint(c, "http://10.244.1.30:8000", "tcp://10.244.1.30:5557"),)
    assert (watcher.num_lists, watcher.num_errors) == (3, 0)
    assert sum("410 Gone" in r.getMessage() for r in caplog.records) == 2


def test_credentials_are_refused_with_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(K8sConfigError, match="not running in a pod"):
        K8sApi.in_cluster({})
    with pytest.raises(K8sConfigError, match="service-account token"):
        K8sApi.in_cluster({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"},
                          sa_dir=tmp_path)
    cfg = tmp_path / "kc"
    cfg.write_text(json.dumps({"current-context": "x", "contexts": [
        {"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "clusters": [{"name": "c", "cluster": {"server": "https://10.0.0.1:6443"}}],
        "users": [{"name": "u", "user": {"client-certificate-data": "..."}}]}))
    with pytest.raises(K8sConfigError, match="bearer tokens only"):
        K8sApi.from_kubeconfig(cfg)
    with pytest.raises(K8sConfigError, match="no context 'y'"):
        K8sApi.from_kubeconfig(cfg, context="y")


def test_a_slice_of_two_thousand_endpoints_is_one_long_watch_line(tmp_path: Path) -> None:
    empty = json.loads((DATA / "list_initial.json").read_text())
    template = empty["items"].pop()
    endpoints = [{"addresses": [f"10.245.{i // 250}.{i % 250}"], "conditions": {"ready": True},
                  "targetRef": {"kind": "Pod", "namespace": "llm", "name": f"vllm-{i:04d}"}}
                 for i in range(2000)]
    event = {"type": "ADDED", "object": {**template, "endpoints": endpoints,
                                         "metadata": {**template["metadata"],
                                                      "resourceVersion": "48300"}}}
    line = json.dumps(event).encode() + b"\n"
    assert len(line) > 256 * 1024
    seen: list[int] = []

    async def scenario() -> None:
        server = FakeApiServer(
            script=[(False, None, "empty.json"), (True, "48211", "big.jsonl"),
                    (True, "48300", "hold")],
            recordings={"empty.json": json.dumps(empty).encode(), "big.jsonl": line})
        await server.start()
        try:
            api = K8sApi.from_kubeconfig(_kubeconfig(tmp_path, server.url))
            async with aiohttp.ClientSession() as session:
                watcher = EndpointSliceWatcher(
                    api, session, namespace="llm", label_selector=SELECTOR, ports=PortNames(),
                    on_change=lambda diff, engines: seen.append(len(engines)), retry_s=0.05)
                task = asyncio.create_task(watcher.run())
                await asyncio.wait_for(server.holding.wait(), 10)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert server.problems == []
            assert watcher.num_errors == 0
        finally:
            await server.stop()

    asyncio.run(scenario())
    assert seen == [2000]
