"""Micro benchmark: KV-event catch-ups, as a router that starts beside busy engines makes them.

Usage::

    .venv/bin/python benchmarks/micro/bench_kv_catchup.py [--batches N] [--replicas K]
        [--no-turns] [--repeats R] [--json OUT]

``K`` child processes each run an engine's publisher (``sim/kv_publisher.KVEventPublisher``,
the one ``kvroute sim serve`` runs) and publish ``N`` batches before anyone listens, so they
sit in its replay buffer (vLLM keeps 10,000). Each batch is one ``BlockStored`` of 8 blocks
with their 128 token ids: a request's new blocks. This process then starts one
``EventSubscriber`` (``shell/zmq_events.py``) per child as the router does (token ids not
decoded, batches applied to one ``RouterCore``'s prefix index; with ``K`` > 1 they share a
``catch_up_turns`` lock unless ``--no-turns``), and every child publishes one more batch at
once: each subscriber's first message, which is not sequence 0, so each replays its engine's
whole buffer before delivering it.

Figures, the best of ``R`` repeats by CPU: this process's CPU µs per replayed batch (receive,
decode, apply), the wall time until every subscriber has caught up, and how late a 1 ms timer
on the same loop ran meanwhile (p99 and max, ms): what each step of a request arriving during
the catch-ups waits for, on top of its own work. To compare two versions, run this file with
``PYTHONPATH`` pointed at each ``src``; interleave the runs (CPU time is noisy on a shared
machine).
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
from kvroute.sim.kv_publisher import KVEventPublisher

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


def _core(replicas: int) -> Any:
    from kvroute.config import parse_config
    from kvroute.shell.runtime import build_core
    from kvroute.shell.state import MonotonicClock

    config = parse_config({
        "listen": {"host": "127.0.0.1", "port": 0},
        "pools": {"p": {"model": "m", "block_size": 16, "hash_algo": "sha256",
                        "replicas": [{"name": f"e{i}", "url": f"http://127.0.0.1:{9 + i}"}
                                     for i in range(replicas)]}},
        "routes": {"m": {"pools": ["p"]}},
    }, env={})
    return build_core(config, clock=MonotonicClock())


def _run(batches: int, replicas: int, turns: bool) -> dict[str, float]:
    """One round of catch-ups against fresh publisher children."""
    children = [subprocess.Popen([sys.executable, "-c", _CHILD, str(batches)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                for _ in range(replicas)]
    try:
        engines: list[tuple[IO[str], str, str]] = []
        for child in children:
            assert child.stdin is not None and child.stdout is not None
            endpoint, replay_endpoint = child.stdout.readline().split()
            engines.append((child.stdin, endpoint, replay_endpoint))
        return asyncio.run(_catch_up(batches, engines, turns))
    finally:
        for child in children:
            if child.stdin is not None:
                child.stdin.close()
            child.wait(timeout=30)
            if child.stdout is not None:
                child.stdout.close()


async def _catch_up(batches: int, engines: Sequence[tuple[IO[str], str, str]],
                    turns: bool) -> dict[str, float]:
    from kvroute.core.types import ReplicaId
    from kvroute.shell.zmq_events import EventSubscriber

    core = _core(len(engines))
    applied = [0]
    total = len(engines) * (batches + 1)

    def on_batch(replica: ReplicaId, batch: Any) -> None:
        applied[0] += 1
        core.apply_events(replica, batch)

    def on_reset(replica: ReplicaId, reason: str) -> None:
        raise AssertionError(f"the catch-up reset the index of {replica}: {reason}")

    lock = asyncio.Lock() if turns else None
    extra = {"catch_up_turns": lock} if lock is not None else {}
    subs = [EventSubscriber(ReplicaId(f"e{i}"), endpoint, on_batch=on_batch, on_reset=on_reset,
                            replay_endpoint=replay_endpoint, topic="kv", token_ids=False,
                            replay_timeout=30.0, **extra)
            for i, (_, endpoint, replay_endpoint) in enumerate(engines)]
    for sub in subs:
        sub.start()
    for sub in subs:
        await sub.wait_connected()
    await asyncio.sleep(0.3)  # the subscriptions reach the publishers
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
    for go, _, _ in engines:
        go.write("go\n")
        go.flush()
    deadline = wall0 + 120.0
    while applied[0] < total:
        if time.perf_counter() > deadline:
            raise AssertionError(f"caught up {applied[0]} of {total} batches in 120 s")
        await asyncio.sleep(1e-3)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    done.set()
    await watch
    for sub in subs:
        await sub.stop()
        if sub.stats.replayed_batches != batches:
            raise AssertionError(f"{sub.replica} replayed {sub.stats.replayed_batches} of "
                                 f"{batches}")
    lags.sort()
    return {"cpu_us_per_batch": cpu * 1e6 / (total - len(engines)), "wall_s": wall,
            "timer_late_p99_ms": lags[int(0.99 * (len(lags) - 1))] * 1e3,
            "timer_late_max_ms": lags[-1] * 1e3}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--batches", type=int, default=10_000)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--no-turns", action="store_true",
                        help="let the subscribers catch up at once (no shared catch_up_turns)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if min(args.batches, args.replicas, args.repeats) < 1:
        parser.error("--batches, --replicas and --repeats must be >= 1")
    turns = args.replicas > 1 and not args.no_turns
    runs = [_run(args.batches, args.replicas, turns) for _ in range(args.repeats)]
    best = min(runs, key=lambda r: r["cpu_us_per_batch"])
    print(f"KV-event catch-up: {args.replicas} replica(s) x {args.batches} buffered batches, "
          f"{'taking turns' if turns else 'at once'} (best of {args.repeats} by CPU)")
    for key, value in best.items():
        print(f"  {key:22} {value:9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "best": best, "all": runs, "batches": args.batches, "replicas": args.replicas,
            "turns": turns, "python": sys.version.split()[0], "machine": platform.machine()},
            indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
