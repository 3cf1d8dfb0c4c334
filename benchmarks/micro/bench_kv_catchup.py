"""Micro benchmark: a KV-event catch-up, as a router that starts beside a busy engine makes it.

Usage::

    .venv/bin/python benchmarks/micro/bench_kv_catchup.py [--batches N] [--repeats R]
        [--json OUT]

A child process runs the engine's publisher (``shell/kv_publisher.KVEventPublisher``, the one
``kvroute sim serve`` runs) and publishes ``N`` batches before anyone listens, so they sit in
its replay buffer (vLLM keeps 10,000). Each batch is one ``BlockStored`` of 8 blocks with
their 128 token ids: a request's new blocks. This process then starts an ``EventSubscriber``
(``shell/zmq_events.py``) as the router does (token ids not decoded, batches applied to a
``RouterCore``'s prefix index), and the child publishes one more batch: the subscriber's first
message, which is not sequence 0, so it replays the whole buffer before delivering it.

Figures, the best of ``R`` repeats by CPU: this process's CPU µs per replayed batch (receive,
decode, apply), the catch-up's wall time, and how late a 1 ms timer on the same loop ran
meanwhile (p99 and max, ms): what a request arriving during a catch-up waits for, on top of
its own work. To compare two versions, run this file with ``PYTHONPATH`` pointed at each
``src``; interleave the runs (CPU time is noisy on a shared machine).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

_CHILD = """
import sys
from kvroute.core.events import BlockStored
from kvroute.shell.kv_publisher import KVEventPublisher

count = int(sys.argv[1])
with KVEventPublisher(buffer_steps=count + 10) as pub:
    for i in range(count + 1):
        hashes = tuple(range(i * 8, i * 8 + 8))
        event = BlockStored(hashes, i * 8 - 1 if i else None, tuple(range(128)), 16)
        if i == count:
            pub.wait_sent()  # sent to no one: only the replay buffer holds them
            print(pub.endpoint, pub.replay_endpoint, flush=True)
            sys.stdin.readline()  # the subscriber is listening: send its first message
        pub.publish((event,), ts=float(i))
    pub.wait_sent()
    sys.stdin.readline()  # stay up until the subscriber is done
"""


def _core() -> Any:
    from kvroute.config import parse_config
    from kvroute.shell.runtime import build_core
    from kvroute.shell.state import MonotonicClock

    config = parse_config({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {"p": {"model": "m", "block_size": 16, "hash_algo": "sha256",
                        "replicas": [{"name": "e0", "url": "http://127.0.0.1:9"}]}},
        "routes": {"m": {"pools": ["p"]}},
    }, env={})
    return build_core(config, clock=MonotonicClock())


def _run(batches: int) -> dict[str, float]:
    """One catch-up against a fresh publisher child."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(batches)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    try:
        endpoint, replay_endpoint = child.stdout.readline().split()
        return asyncio.run(_catch_up(batches, child.stdin, endpoint, replay_endpoint))
    finally:
        child.stdin.close()
        child.wait(timeout=30)
        child.stdout.close()


async def _catch_up(batches: int, go: IO[str], endpoint: str,
                    replay_endpoint: str) -> dict[str, float]:
    from kvroute.core.types import ReplicaId
    from kvroute.shell.zmq_events import EventSubscriber

    core = _core()
    applied = [0]

    def on_batch(replica: ReplicaId, batch: Any) -> None:
        applied[0] += 1
        core.apply_events(replica, batch)

    def on_reset(replica: ReplicaId, reason: str) -> None:
        raise AssertionError(f"the catch-up reset the index: {reason}")

    sub = EventSubscriber(ReplicaId("e0"), endpoint, on_batch=on_batch, on_reset=on_reset,
                          replay_endpoint=replay_endpoint, topic="kv", token_ids=False,
                          replay_timeout=30.0)
    sub.start()
    await sub.wait_connected()
    await asyncio.sleep(0.3)  # the subscription reaches the publisher
    lags: list[float] = []
    done = asyncio.Event()

    async def timer() -> None:
        while not done.is_set():
            due = time.perf_counter() + 1e-3
            await asyncio.sleep(1e-3)
            lags.append(time.perf_counter() - due)

    gc.collect()
    watch = asyncio.create_task(timer())
    cpu0, wall0 = time.process_time(), time.perf_counter()
    go.write("go\n")
    go.flush()
    deadline = wall0 + 60.0
    while applied[0] < batches + 1:
        if time.perf_counter() > deadline:
            raise AssertionError(f"caught up {applied[0]} of {batches + 1} in 60 s")
        await asyncio.sleep(1e-3)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    done.set()
    await watch
    await sub.stop()
    if sub.stats.replayed_batches != batches:
        raise AssertionError(f"replayed {sub.stats.replayed_batches} of {batches}")
    lags.sort()
    return {"cpu_us_per_batch": cpu * 1e6 / batches, "wall_s": wall,
            "timer_late_p99_ms": lags[int(0.99 * (len(lags) - 1))] * 1e3,
            "timer_late_max_ms": lags[-1] * 1e3}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--batches", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.batches < 1 or args.repeats < 1:
        parser.error("--batches and --repeats must be >= 1")
    runs = [_run(args.batches) for _ in range(args.repeats)]
    best = min(runs, key=lambda r: r["cpu_us_per_batch"])
    print(f"KV-event catch-up of {args.batches} buffered batches (best of {args.repeats} by "
          "CPU)")
    for key, value in best.items():
        print(f"  {key:22} {value:9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "best": best, "all": runs, "batches": args.batches,
            "python": sys.version.split()[0], "machine": platform.machine()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
