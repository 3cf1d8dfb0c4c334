"""Micro benchmark: the garbage collector's pauses in a router serving the soak's traffic.

Usage::

    .venv/bin/python benchmarks/micro/bench_soak_gc.py [--requests N] [--thresholds A,B,C]
        [--engine-blocks 4096] [--json OUT]

The real application (``build_app``, as ``bench_handler.py`` builds it: local bundled
tokenizer, piece cache, block-hash memo, index, sessions, metrics) serves ``kvroute bench
soak``'s stream (``soak_requests``: shared system prompts, growing sessions, unique prompts)
in process, back to back, with the engine's ``BlockStored`` event applied after each answer
and a ``BlockRemoved`` for the oldest blocks once an engine holds more than
``--engine-blocks`` (as the soak's engines evict). Start-up is collected and frozen as
``kvroute serve`` does (``shell.heap.freeze_startup_heap``); ``--thresholds`` then sets the
collector's thresholds (``gc.set_threshold``; default: what ``freeze_startup_heap`` leaves).

A ``gc.callbacks`` probe times every collection in this thread's CPU time (so another
process on the machine does not inflate it; it does slow it through shared caches) and wall
time. Reported per generation: collections, the sum and max of their CPU ms, and how many
were over 10 ms; for full collections also when they came (request number). At the end, the
tracked objects of the oldest generation (what a full collection walks). Figures:
``docs/benchmarks.md#long-run-memory-and-p99``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from bench_handler import ANSWER, config_for, mocked

from kvroute.bench.soak import SoakSpec, soak_requests
from kvroute.config import Secrets
from kvroute.core.events import BlockRemoved, BlockStored, EventBatch
from kvroute.core.types import ReplicaId
from kvroute.shell.app import build_app
from kvroute.shell.heap import freeze_startup_heap
from kvroute.shell.metrics import RouterMetrics
from kvroute.shell.proxy import UpstreamReply
from kvroute.shell.runtime import build_core
from kvroute.shell.state import MemoryState, MonotonicClock
from kvroute.tokenize.hf import bundled_tokenizer_dir
from kvroute.tokenize.prompt import LocalTokenizer


class SlowUpstream:
    """The engine's side of ``Upstream.open``: a whole answer after ``delay_s``, so requests
    overlap and their objects live through collections as a live router's do."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    async def open(self, url: str, body: bytes, *, stream: bool,
                   headers: Any = None) -> UpstreamReply:
        await asyncio.sleep(self.delay_s)
        return UpstreamReply(200, {"Content-Type": "application/json"}, ANSWER, None)

    async def close(self) -> None:
        return None


async def run(n: int, replicas: int, engine_blocks: int,
              thresholds: tuple[int, int, int] | None, in_flight: int,
              engine_ms: float) -> dict[str, Any]:
    config = config_for(replicas)
    core = build_core(config, clock=MonotonicClock())
    metrics = RouterMetrics()
    tokenizer = LocalTokenizer.load("sim", str(bundled_tokenizer_dir()), metrics)
    app = build_app(config, core=core,
                    upstream=SlowUpstream(engine_ms / 1e3),  # type: ignore[arg-type]
                    secrets=Secrets({}, None, {}), metrics=metrics,
                    state=MemoryState(max_pins=2000), tokenizers={"sim": tokenizer})
    router = app.router
    bodies = [r.body for r in soak_requests(SoakSpec(seconds=n / 200.0, rate=200.0,
                                                           sample_s=min(10.0, n / 200.0)))]
    seq = dict.fromkeys((f"e{i}" for i in range(replicas)), 0)
    held: dict[str, deque[int]] = {f"e{i}": deque() for i in range(replicas)}
    original_route = core.route
    freeze_startup_heap()
    if thresholds is not None:
        gc.set_threshold(*thresholds)
    done = [0]
    pauses: list[tuple[int, int, float, float]] = []
    started = [0.0, 0.0]

    def probe(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[:] = [time.thread_time(), time.perf_counter()]
        else:
            pauses.append((int(info["generation"]), done[0],
                           (time.thread_time() - started[0]) * 1e3,
                           (time.perf_counter() - started[1]) * 1e3))

    gc.callbacks.append(probe)
    cpu0 = time.process_time()
    slots = asyncio.Semaphore(in_flight)

    def store(decision: Any) -> None:
        """The chosen engine's events for the prompt: its blocks stored, the oldest it held
        beyond ``engine_blocks`` removed."""
        replica = decision.replica
        hashes = tuple(decision.block_hashes)
        events: list[Any] = [BlockStored(hashes, None, (), 16, None, "GPU", None,
                                         (None,) * len(hashes), 0, "full_attention")]
        held[replica].extend(hashes)
        if len(held[replica]) > engine_blocks:
            out = [held[replica].popleft() for _ in range(len(held[replica]) - engine_blocks)]
            events.append(BlockRemoved(tuple(out)))
        core.apply_events(ReplicaId(replica), EventBatch(
            seq=seq[replica], ts=0.0, events=tuple(events), data_parallel_rank=0))
        seq[replica] += 1

    def routed(request: Any) -> Any:
        decision = original_route(request)
        store(decision)
        return decision

    core.route = routed  # type: ignore[method-assign]

    async def one(i: int, body: bytes) -> None:
        try:
            response = await router.chat(mocked(body))
            if response.status != 200:
                raise AssertionError(f"request {i} answered {response.status}")
            done[0] += 1
        finally:
            slots.release()

    tasks: set[asyncio.Task[None]] = set()
    try:
        for i, body in enumerate(bodies):
            await slots.acquire()
            task = asyncio.create_task(one(i, body))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)
    finally:
        gc.callbacks.remove(probe)
    cpu_s = time.process_time() - cpu0
    by_gen: dict[str, Any] = {}
    for g in range(3):
        mine = [p for p in pauses if p[0] == g]
        cpu = [p[2] for p in mine]
        by_gen[str(g)] = {"collections": len(mine), "cpu_ms_sum": round(sum(cpu), 1),
                          "cpu_ms_max": round(max(cpu), 2) if cpu else None,
                          "wall_ms_max": round(max(p[3] for p in mine), 2) if mine else None,
                          "over_10ms": sum(1 for c in cpu if c > 10)}
    full = [(p[1], round(p[2], 1)) for p in pauses if p[0] == 2]
    return {"requests": n, "thresholds": list(gc.get_threshold()),
            "cpu_ms_per_request": round(cpu_s * 1e3 / n, 3), "by_generation": by_gen,
            "full_collections_at": full, "tracked_oldest": len(gc.get_objects(2)),
            "frozen": gc.get_freeze_count()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--engine-blocks", type=int, default=4096)
    parser.add_argument("--thresholds", default=None,
                        help="gen0,gen1,gen2 for gc.set_threshold after the freeze")
    parser.add_argument("--in-flight", type=int, default=32,
                        help="requests at once (default 32)")
    parser.add_argument("--engine-ms", type=float, default=20.0,
                        help="the canned engine's delay before answering (default 20 ms)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    thresholds = None
    if args.thresholds:
        parts = [int(x) for x in args.thresholds.split(",")]
        if len(parts) != 3 or min(parts) < 1:
            parser.error(f"--thresholds {args.thresholds!r}: three integers >= 1, e.g. 700,10,10")
        thresholds = (parts[0], parts[1], parts[2])
    report = asyncio.run(run(args.requests, args.replicas, args.engine_blocks, thresholds,
                             args.in_flight, args.engine_ms))
    print(json.dumps(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
