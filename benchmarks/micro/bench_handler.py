"""Micro benchmark: kvroute's own CPU per request through its real HTTP handler, in µs.

Usage::

    .venv/bin/python benchmarks/micro/bench_handler.py [--requests N] [--repeats R]
        [--replicas 8] [--gap-ms G] [--workload shared|unique] [--json OUT]

What ``kvroute bench overhead``'s ``kvroute-local`` router does per request, minus the sockets:
``Router.handle`` (``shell/app.py``) of the real application (``build_app``) is called with
a request as the router's HTTP server hands it over (``http/server.Request``, body
read), and its upstream is a canned engine answer
(a whole chat completion with ``usage``), so every step of the router runs as served: body
read, parse, admission, session, tier plan, local tokenization with the bundled Hugging Face
tokenizer (chat template + piece cache), block hashing, the index lookup, the ``kvroute`` cost
model over 8 replicas, load and prediction bookkeeping, metrics, the forwarded body, the
response with its ``x-kvroute-*`` headers and the completion's usage. After each request the
engine's ``BlockStored`` event for the prompt's blocks is applied to the index on the chosen
replica (as the engine would send it); that is timed separately (``events``).

The workload is the overhead benchmark's: ``generated_shared_prefix`` with 32 groups of a
~2,200-character system prompt and a short question (~1,500 tokens with the bundled
tokenizer's 1,024-token vocabulary, ~94 blocks of 16); ``--workload unique`` sends its ``u``
phases' short prompts instead (``bench/overhead_short.py``: ~600-token chats nobody sent
before, every request of every series new).

Hot and cold: by default the requests run back to back, so the CPU's caches and branch
predictors hold the handler's code and data from one request to the next (the figure a
saturated router approaches). ``--gap-ms G`` sleeps ``G`` ms before each request, outside
the timed part, as a live router idles between requests at ``1000 / G`` requests/s; the
handler then starts cold. On the 2-vCPU KVM machines here that makes a large difference
(``docs/benchmarks.md``, "Hot and cold"): it is why a live router at 150 requests/s spends
about three times the back-to-back figure on each request.

Not included: the HTTP server's protocol (parsing the HTTP request, writing the response) and
the engine client (sending to the engine, reading its answer): about a bare relay's cost
(``kvroute bench overhead``'s ``passthrough``), measured live. Figures are per request: the
mean, p50 and max of ``handle`` in µs, how many calls took over 1 ms (stalls: a live router's
p99), and this process's CPU µs per request over the series (all threads: the piece cache's
check thread too); the best of ``R`` repeats. CPU time is noisy on a shared machine: compare runs side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvroute.bench.live_client import build_live_requests
from kvroute.bench.overhead import _WORKLOAD
from kvroute.bench.overhead_short import short_unique_requests
from kvroute.bench.workloads import WORKLOADS
from kvroute.config import Secrets, parse_config
from kvroute.core.events import BlockStored, EventBatch
from kvroute.core.types import ReplicaId
from kvroute.http.server import Request
from kvroute.shell.app import build_app
from kvroute.shell.metrics import RouterMetrics
from kvroute.shell.proxy import UpstreamReply
from kvroute.shell.runtime import build_core
from kvroute.shell.state import MonotonicClock
from kvroute.tokenize.hf import bundled_tokenizer_dir
from kvroute.tokenize.prompt import LocalTokenizer

ANSWER = json.dumps({
    "id": "cmpl-bench", "object": "chat.completion", "created": 0, "model": "sim-model",
    "choices": [{"index": 0, "finish_reason": "length",
                 "message": {"role": "assistant", "content": "a b c d e f g h"}}],
    "usage": {"prompt_tokens": 1500, "completion_tokens": 8, "total_tokens": 1508},
}).encode()


class CannedUpstream:
    """The engine's side of ``Upstream.open``: a whole answer, at once, for every call."""

    async def open(self, url: str, body: bytes, *, stream: bool,
                   headers: Any = None) -> UpstreamReply:
        return UpstreamReply(200, {"Content-Type": "application/json"}, ANSWER, None)

    async def close(self) -> None:
        return None


def config_for(replicas: int) -> Any:
    return parse_config({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {"sim": {
            "model": "sim-model", "tokenizer": {"local": str(bundled_tokenizer_dir())},
            "block_size": 16, "hash_algo": "sha256",
            "replicas": [{"name": f"e{i}", "url": f"http://127.0.0.1:{9000 + i}"}
                         for i in range(replicas)],
        }},
        "routes": {"sim-model": {"pools": ["sim"]}},
        "policy": {"name": "kvroute", "seed": 0},
        "retries": {"max_retries": 0},
        "warm_ahead": {"enabled": False},
        "log_level": "warning",
    }, env={})


def mocked(body: bytes) -> Request:
    headers = {"content-type": "application/json", "content-length": str(len(body))}
    request = Request(None, "POST", "/v1/chat/completions", "", headers, "1.1", True)
    request.body = body
    return request


def _bodies(workload: str, count: int, label: str) -> list[bytes]:
    if workload == "unique":
        return [r.body for r in short_unique_requests(count, model="sim-model", label=label)]
    pool = WORKLOADS["generated_shared_prefix"](**_WORKLOAD, seed=0, with_messages=True)
    bodies = [r.body for r in build_live_requests(pool, model="sim-model")]
    return [bodies[i % len(bodies)] for i in range(count)]


async def run(n: int, repeats: int, replicas: int, gap_ms: float = 0.0,
              workload: str = "shared") -> dict[str, Any]:
    config = config_for(replicas)
    core = build_core(config, clock=MonotonicClock())
    metrics = RouterMetrics()
    tokenizer = LocalTokenizer.load("sim", str(bundled_tokenizer_dir()), metrics)
    app = build_app(config, core=core, upstream=CannedUpstream(),  # type: ignore[arg-type]
                    secrets=Secrets({}, None, {}), metrics=metrics, tokenizers={"sim": tokenizer})
    router = app.router
    seq = dict.fromkeys((f"e{i}" for i in range(replicas)), 0)

    results: list[dict[str, float]] = []
    walks: list[Any] = []
    original_route = core.route

    def recording_route(request: Any) -> Any:
        decision = original_route(request)
        walks.append(decision)
        return decision

    core.route = recording_route  # type: ignore[method-assign]

    async def series(count: int, label: str) -> dict[str, float]:
        samples: list[int] = []
        event_ns: list[int] = []
        requests = [mocked(body) for body in _bodies(workload, count, label)]
        gap_s = gap_ms / 1e3
        gc.collect()
        cpu0 = time.process_time()
        for i, request in enumerate(requests):
            if gap_s:
                await asyncio.sleep(gap_s)  # the loop idles in epoll, as a live router does
            t0 = time.perf_counter_ns()
            response = await router.chat(request)
            t1 = time.perf_counter_ns()
            samples.append(t1 - t0)
            if response.status != 200:
                raise AssertionError(f"request {i} answered {response.status}: "
                                     f"{getattr(response, 'text', '')}")
            decision = walks.pop()
            replica = decision.replica
            event = BlockStored(tuple(decision.block_hashes), None, (), 16, None, "GPU", None,
                                (None,) * len(decision.block_hashes), 0, "full_attention")
            core.apply_events(ReplicaId(replica), EventBatch(
                seq=seq[replica], ts=0.0, events=(event,), data_parallel_rank=0))
            seq[replica] += 1
            event_ns.append(time.perf_counter_ns() - t1)
        cpu_us = (time.process_time() - cpu0) * 1e6 / count
        return {"handle_mean_us": statistics.fmean(samples) / 1e3,
                "handle_p50_us": statistics.median(samples) / 1e3,
                "handle_max_us": max(samples) / 1e3,
                "handle_over_1ms": float(sum(1 for ns in samples if ns > 1_000_000)),
                "events_mean_us": statistics.fmean(event_ns) / 1e3,
                "cpu_us_per_request": cpu_us}

    await series(min(n, 500), "warm-up")  # caches, memo, index, learned rates
    for k in range(repeats):
        results.append(await series(n, f"series-{k}"))
    best = min(results, key=lambda r: r["cpu_us_per_request"])
    return {"best": best, "all": results}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--gap-ms", type=float, default=0.0,
                        help="idle this many ms before each request (cold start; default 0: "
                             "back to back)")
    parser.add_argument("--workload", choices=("shared", "unique"), default="shared",
                        help="shared: the overhead benchmark's shared-prefix groups; unique: "
                             "its u phases' ~600-token prompts nobody sent before")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.gap_ms < 0:
        parser.error(f"--gap-ms {args.gap_ms:g} must be >= 0 (0: back to back)")
    report = asyncio.run(run(args.requests, args.repeats, args.replicas, args.gap_ms,
                             args.workload))
    best = report["best"]
    spacing = f"{args.gap_ms:g} ms idle before each" if args.gap_ms else "back to back"
    print(f"kvroute handler, in process ({args.workload}: {args.requests} requests {spacing}, best of "
          f"{args.repeats} by CPU; {args.replicas} replicas, local bundled tokenizer)")
    for key, value in best.items():
        print(f"  {key:22} {value:9.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            **report, "requests": args.requests, "replicas": args.replicas,
            "gap_ms": args.gap_ms, "workload": args.workload,
            "python": sys.version.split()[0], "machine": platform.machine()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
