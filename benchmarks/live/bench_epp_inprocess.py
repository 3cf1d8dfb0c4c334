"""The picker's own CPU per request, without gRPC: ``kvroute epp``'s stream handler called
in process with the messages Envoy sends for one request (headers, body, its end; response
headers with the served endpoint, body, its end), answers serialized as they would be sent.

Set beside ``bench_epp_overhead.py``'s CPU per request of the ``kvroute epp`` process, the
difference is what the gRPC server (``grpc.aio``) and its event-loop wake-ups cost.
Engines: two ``kvroute sim serve`` processes with ``zero`` timing (discovery and the
``/tokenize`` calls the walk makes are real).

    PYTHONPATH=src python benchmarks/live/bench_epp_inprocess.py --requests 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from kvroute.config import parse_config
from kvroute.shell.epp_runtime import EppRuntime
from kvroute.shell.epp_server import _Stream
from kvroute.sim.launcher import ReplicaSpec, start_fleet

ANSWER = json.dumps({"choices": [{"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": "hi"}}],
                     "usage": {"prompt_tokens": 300, "completion_tokens": 8,
                               "total_tokens": 308}}).encode()


def headers(pairs: dict[str, str]) -> Any:
    return ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]))


async def main(requests: int) -> dict[str, float]:
    fleet = start_fleet([ReplicaSpec(name=f"e{i}", pool="small", model="sim-model",
                                     extra_args=("--timing", "0,0,0,0")) for i in range(2)],
                        timeout_s=30.0)
    try:
        replicas = [{"name": r.name, "url": r.url, "kv_events": r.kv_events,
                     "kv_replay": r.kv_replay} for r in fleet.replicas]
        config = parse_config({
            "listen": {"host": "127.0.0.1", "port": 0},
            "pools": {"small": {"model": "sim-model", "replicas": replicas}},
            "routes": {"assistant": {"pools": ["small"]}}, "log_level": "warning"}, env={})
        async with EppRuntime(config, grpc_port=0, health_port=0, env={}) as rt:
            picker = rt.picker
            assert picker is not None
            body = json.dumps({"model": "assistant", "max_tokens": 8, "messages": [
                {"role": "user", "content": "hello " * 300}]}).encode()
            head = ep.ProcessingRequest(request_headers=headers(
                {":method": "POST", ":path": "/v1/chat/completions",
                 "content-type": "application/json"}))
            request = [head, ep.ProcessingRequest(request_body=ep.HttpBody(body=body)),
                       ep.ProcessingRequest(request_body=ep.HttpBody(end_of_stream=True))]

            async def cycle() -> None:
                stream = _Stream(picker)
                answers = [a for m in request for a in await stream.on(m)]
                served = answers[0].request_headers.response.header_mutation.set_headers
                chosen = next(h.header.raw_value.decode() for h in served
                              if h.header.key == "x-gateway-destination-endpoint")
                response = [
                    ep.ProcessingRequest(response_headers=headers({
                        ":status": "200", "content-type": "application/json",
                        "x-gateway-destination-endpoint-served": chosen})),
                    ep.ProcessingRequest(response_body=ep.HttpBody(body=ANSWER)),
                    ep.ProcessingRequest(response_body=ep.HttpBody(end_of_stream=True))]
                answers += [a for m in response for a in await stream.on(m)]
                for answer in answers:
                    answer.SerializeToString()
                stream.close()

            for _ in range(50):
                await cycle()
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(requests):
                await cycle()
            return {"requests": requests,
                    "cpu_us_per_request": round((time.process_time() - cpu) / requests * 1e6, 1),
                    "wall_us_per_request": round((time.perf_counter() - wall) / requests * 1e6, 1)}
    finally:
        fleet.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    print(json.dumps(asyncio.run(main(parser.parse_args().requests))))
