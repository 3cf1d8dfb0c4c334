"""Data-parallel ranks behind a gateway: ``kvroute epp`` names the rank it picked with
``X-data-parallel-rank`` in the request headers it sets, and lists no other rank of the same
engine as a fallback (they share its address), over the real ext_proc gRPC stream
(docs/data-parallel.md, docs/epp.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from kvroute.config import parse_config
from kvroute.core.hashing import BlockHasher
from kvroute.core.index import TenantScope
from kvroute.core.types import ReplicaId, TenantName
from kvroute.engine.model import StepTiming
from kvroute.sim.server import SimServer, SimServerConfig

pytestmark = pytest.mark.integration

grpc = pytest.importorskip("grpc", reason="kvroute epp needs grpcio: pip install 'kvroute[epp]'")
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from kvroute.shell.epp_runtime import EppRuntime

MODEL = "sim-model"


def _headers(pairs: dict[str, str]) -> Any:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                       for k, v in pairs.items()])


class _Exchange:
    def __init__(self, stub: Any) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.call = stub.Process(self._requests())

    async def _requests(self) -> AsyncIterator[Any]:
        while (message := await self.queue.get()) is not None:
            yield message

    async def read(self) -> Any:
        return await asyncio.wait_for(self.call.read(), 10.0)

    async def close(self) -> None:
        await self.queue.put(None)
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
            await asyncio.wait_for(self.call.read(), 5.0)


@pytest.mark.parametrize("size", [{"data_parallel_size": 2}, {}], ids=["configured", "found"])
def test_the_picker_names_the_rank_and_lists_no_sibling_rank_as_fallback(
        base_port: int, size: dict[str, int]) -> None:
    """With ``data_parallel_size`` set, or left out and read from ``/metrics`` (the picker
    learns the ranks discovery found at start-up, shell/dp_discovery.py)."""
    rng = random.Random(8)
    content = " ".join(f"w{rng.getrandbits(40):x}" for _ in range(300))
    messages = [{"role": "user", "content": content}]
    engine = SimServer(SimServerConfig(
        model=MODEL, data_parallel_size=2, num_gpu_blocks=400, max_model_len=2048,
        kv_events=f"tcp://127.0.0.1:{base_port}", kv_topic="",
        timing=StepTiming(fixed_s=0.001, prefill_token_s=0.00005, decode_seq_s=0.0002,
                          context_token_s=0.0)))

    async def body() -> None:
        async with engine, aiohttp.ClientSession() as session:
            config = parse_config({
                "listen": {"host": "127.0.0.1", "port": 0},
                "pools": {"main": {"model": MODEL, "replicas": [{
                    "name": "e0", "url": engine.url, **size,
                    "kv_events": f"tcp://127.0.0.1:{base_port}"}]}},
                "routes": {"assistant": {"pools": ["main"]}},
                "retries": {"max_retries": 1},
                "discovery": {"health_interval_s": 0.5, "metrics_interval_s": 0.5,
                              "models_interval_s": 5, "timeout_s": 1.0},
                "log_level": "warning",
            }, env={})
            async with (EppRuntime(config, grpc_port=0, health_port=0, fallbacks=1,
                                   env={}) as rt,
                        grpc.aio.insecure_channel(f"127.0.0.1:{rt.grpc_port}") as channel):
                # rank 1 computes the prompt (straight to the engine); its events reach the
                # picker's index under e0.dp1 (its own port)
                chat = {"model": MODEL, "messages": messages, "max_tokens": 2}
                async with session.post(engine.url + "/v1/chat/completions", json=chat,
                                        headers={"X-data-parallel-rank": "1"}) as resp:
                    assert resp.status == 200
                async with session.post(engine.url + "/tokenize",
                                        json={"model": MODEL, "messages": messages}) as resp:
                    ids = (await resp.json())["tokens"]
                hashes = BlockHasher("sha256", 16).wire_hashes(ids)
                scope = TenantScope(TenantName("default"))
                deadline = time.monotonic() + 20.0
                while rt.router.core.index.match(hashes, scope).get(ReplicaId("e0.dp1")) is None:
                    assert time.monotonic() < deadline, "rank 1's events never arrived"
                    await asyncio.sleep(0.05)
                # the same prompt through the picker: rank 1, named; no sibling fallback
                request = {**chat, "model": "assistant"}
                raw = json.dumps(request).encode()
                ex = _Exchange(ep_grpc.ExternalProcessorStub(channel))
                for message in (
                        ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=_headers({
                            ":method": "POST", ":path": "/v1/chat/completions",
                            "content-type": "application/json",
                            "content-length": str(len(raw))}))),
                        ep.ProcessingRequest(request_body=ep.HttpBody(body=raw,
                                                                      end_of_stream=True))):
                    await ex.queue.put(message)
                head = await ex.read()
                mutation = head.request_headers.response.header_mutation
                added = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
                address = engine.url.removeprefix("http://")
                assert added["x-gateway-destination-endpoint"] == address
                assert added["x-data-parallel-rank"] == "1"
                await ex.close()

    asyncio.run(asyncio.wait_for(body(), 60.0))
