"""Benchmark: streamed requests per second one simulated vLLM server sustains (``zero`` profile).

Starts one ``kvroute sim serve`` child (its own process, so it gets one core) with the
``zero`` timing profile, then drives it from this process with a bounded closed-loop load
generator over loopback (aiohttp, ``--concurrency`` streams in flight, ``--requests`` in
total, ``--max-seconds`` at most). Each request is a streamed chat completion of a short
prompt (unique first word, so no two share a cache block) with ``max_tokens`` output tokens
and ``stream_options.include_usage``. Every stream is read to ``[DONE]`` and checked.

Reports requests/s, tokens/s and per-request latency avg/p50/p99/max in ms, plus the server
child's CPU seconds (from /proc) per request, and writes JSON with ``--json``.

    .venv/bin/python benchmarks/micro/bench_sim_server.py [--requests 5000] [--concurrency 64]
        [--max-tokens 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import statistics
import time
from pathlib import Path

import aiohttp

from kvroute.bench.provenance import git_sha
from kvroute.sim.launcher import ReplicaSpec, start_fleet


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime + stime
    return ticks / 100.0


async def _one(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int) -> tuple[float, int]:
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": f"w{i} " + "hello world " * 12}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    chunks = 0
    done = False
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"status {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if line.startswith(b"data: [DONE]"):
                done = True
            elif line.startswith(b"data: "):
                chunks += 1
    if not done:
        raise RuntimeError(f"request {i}: stream ended without [DONE]")
    return time.perf_counter() - t0, chunks


async def drive(url: str, requests: int, concurrency: int, max_tokens: int,
                max_seconds: float) -> dict[str, float]:
    connector = aiohttp.TCPConnector(limit=concurrency)
    latencies: list[float] = []
    counter = iter(range(requests))
    deadline = time.perf_counter() + max_seconds

    async def worker(session: aiohttp.ClientSession) -> None:
        for i in counter:
            if time.perf_counter() > deadline:
                return
            seconds, _ = await _one(session, url, i, max_tokens)
            latencies.append(seconds)

    async with aiohttp.ClientSession(connector=connector) as session:
        # Warm-up: connections and the server's first requests are not measured.
        await asyncio.gather(*(_one(session, url, -1 - k, max_tokens) for k in range(concurrency)))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    lat = sorted(latencies)
    n = len(lat)
    return {
        "requests": n,
        "wall_s": wall,
        "requests_per_s": n / wall,
        "tokens_per_s": n * max_tokens / wall,
        "latency_avg_ms": statistics.fmean(lat) * 1e3,
        "latency_p50_ms": lat[n // 2] * 1e3,
        "latency_p99_ms": lat[min(n - 1, int(n * 0.99))] * 1e3,
        "latency_max_ms": lat[-1] * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-seconds", type=float, default=60.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    spec = ReplicaSpec(profile="zero", max_model_len=4096, num_gpu_blocks=8192)
    with start_fleet([spec]) as fleet:
        replica = fleet.replicas[0]
        pid = fleet.processes[0].pid
        gc.collect()
        cpu0 = _cpu_seconds(pid)
        result = asyncio.run(drive(replica.url, args.requests, args.concurrency,
                                   args.max_tokens, args.max_seconds))
        cpu = _cpu_seconds(pid) - cpu0
    result["server_cpu_s"] = cpu
    result["server_cpu_ms_per_request"] = cpu / max(1, result["requests"]) * 1e3
    result["server_requests_per_cpu_s"] = result["requests"] / cpu if cpu else float("inf")
    sha = git_sha(short=True, timeout_s=None) or ""
    meta = {"config": vars(args) | {"json": str(args.json)}, "git": sha,
            "python": platform.python_version()}
    print(f"{'metric':<28}{'value':>12}")
    for key, value in result.items():
        print(f"{key:<28}{value:>12.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"meta": meta, "result": result}, indent=2))


if __name__ == "__main__":
    main()
