"""Micro benchmark: how long a router takes to rebuild an engine's index from the durable stream.

Usage::

    .venv/bin/python benchmarks/micro/bench_kv_stream_catchup.py [--batches N,N,...]
        [--snapshot-every S] [--nats nats://127.0.0.1:4222] [--json OUT]

For each ``N``: a fresh JetStream stream (``shell/kv_stream.py``), a relay fed ``N`` batches
(each one ``BlockStored`` of 8 new blocks, and every third batch a ``BlockRemoved`` of 4
older ones: a cache that churns), timed until JetStream acknowledged the last; then a fresh
``RouterCore``'s index rebuilt from the stream twice: from the whole stream (no snapshot),
and from the latest snapshot plus the tail (snapshots every ``S`` batches). Reported: relay
batches per second, rebuild wall time and CPU µs per batch read, and that each rebuilt
index holds exactly the blocks the batches leave (checked, not assumed). The stream and its
bucket are deleted after each ``N``. One process, loopback NATS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
import uuid
from typing import Any

import nats

from kvroute.config import KvStreamConfig
from kvroute.core.block_census import BlockCensus
from kvroute.core.clock import ManualClock
from kvroute.core.events import BlockRemoved, BlockStored, EventBatch, KVEvent
from kvroute.core.index import PrefixIndex
from kvroute.core.types import ReplicaId
from kvroute.shell.kv_stream import KvStream
from kvroute.shell.kv_stream_reader import StreamPosition, rebuild
from kvroute.shell.kv_stream_relay import KvStreamRelay

REPLICA = ReplicaId("bench-0")


def batch(i: int) -> EventBatch:
    events: list[KVEvent] = [BlockStored(tuple(range(i * 8 + 1, i * 8 + 9)), i * 8 or None,
                                         (), 16)]
    if i % 3 == 2:
        events.append(BlockRemoved(tuple(range((i - 2) * 8 + 1, (i - 2) * 8 + 5))))
    return EventBatch(i, time.time(), tuple(events), 0)


async def one(n: int, snapshot_every: int, url: str) -> dict[str, Any]:
    name = f"KVBENCH_{uuid.uuid4().hex[:8]}"
    results: dict[str, Any] = {"batches": n, "snapshot_every": snapshot_every}
    truth = BlockCensus()
    cfg = KvStreamConfig(url=url, name=name, subject_prefix=f"kvbench.{name}",
                         snapshot_every=snapshot_every, max_bytes=1 << 30)
    stream = await KvStream.open(cfg)
    if stream is None:
        raise SystemExit(f"NATS at {url} is not reachable")
    try:
        relay = KvStreamRelay(stream, queue_size=n + 1)
        relay.start()
        batches = [batch(i) for i in range(n)]
        for b in batches:
            truth.apply(b)
        began, cpu_began = time.perf_counter(), time.process_time()
        for b in batches:
            relay.on_batch(REPLICA, b)
        await relay.idle()
        await stream._js.publish_async_completed()  # every ack in
        relay_s = time.perf_counter() - began
        relay_cpu = time.process_time() - cpu_began
        await relay.stop()
        results["relay_s"] = round(relay_s, 3)
        results["relay_batches_per_s"] = round(n / relay_s)
        results["relay_cpu_us_per_batch"] = round(relay_cpu * 1e6 / n, 1)
        results["snapshots"] = relay.stats.snapshots
        results["failed"] = relay.stats.failed
        idle: list[float] = []  # the same timer with nothing else on the loop: the machine
        ticking = asyncio.get_running_loop().create_task(_tick(idle))
        await asyncio.sleep(2.0)
        ticking.cancel()
        idle.sort()
        results["idle_timer_late_p99_ms"] = round(idle[int(len(idle) * 0.99)] * 1e3, 2)
        results["idle_timer_late_max_ms"] = round(idle[-1] * 1e3, 2)
        for label, use_snapshot in (("whole_stream", False), ("snapshot_plus_tail", True)):
            index = PrefixIndex(clock=ManualClock())
            reader = _WithSnapshot(stream) if use_snapshot else _NoSnapshot(stream)
            late: list[float] = []
            ticking = asyncio.get_running_loop().create_task(_tick(late))
            cpu0, wall0 = time.process_time(), time.perf_counter()
            pos = await reader.rebuild(REPLICA, index.apply_batch,
                                       lambda r, why, index=index: index.clear_replica(r))
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            ticking.cancel()
            late.sort()
            entries = index.stats().num_entries
            results[label] = {
                "wall_s": round(wall, 3),
                "cpu_s": round(cpu, 3),
                "timer_late_p99_ms": round(late[int(len(late) * 0.99)] * 1e3, 2) if late else None,
                "timer_late_max_ms": round(late[-1] * 1e3, 2) if late else None,
                "batches_read": pos.batches, "snapshot_seq": pos.snapshot_seq,
                "last_seq": pos.last_seq, "entries": entries,
                "equals_truth": entries == len(truth) and pos.last_seq == n - 1,
            }
    finally:
        nc = await nats.connect(url)
        js = nc.jetstream()
        for drop in (js.delete_stream(name), js.delete_object_store(f"{name}_SNAPSHOTS")):
            try:
                await drop
            except nats.js.errors.NotFoundError:
                pass
        await nc.close()
        await stream.close()
    return results


async def _tick(late: list[float]) -> None:
    """A 1 ms timer on the rebuild's loop: how late each tick runs is what a request's next
    step would wait for meanwhile."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + 0.001
        await asyncio.sleep(0.001)
        late.append(max(0.0, loop.time() - due))


class _WithSnapshot:
    """The rebuild a router runs: from the snapshot and the stream's tail."""

    def __init__(self, stream: KvStream) -> None:
        self._stream = stream

    async def rebuild(self, *args: Any) -> StreamPosition:
        return await rebuild(self._stream, *args)


class _NoSnapshot(_WithSnapshot):
    """The rebuild with the snapshot bucket hidden: it reads the whole stream."""

    async def rebuild(self, *args: Any) -> StreamPosition:
        original = self._stream.read_snapshot

        async def none(replica: ReplicaId) -> None:
            return None

        self._stream.read_snapshot = none  # type: ignore[method-assign]
        try:
            return await rebuild(self._stream, *args)
        finally:
            self._stream.read_snapshot = original  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="12000,52000,102000")
    parser.add_argument("--snapshot-every", type=int, default=5_000)
    parser.add_argument("--nats", default="nats://127.0.0.1:4222")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for n in (int(x) for x in args.batches.split(",")):
        row = asyncio.run(one(n, args.snapshot_every, args.nats))
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {"machine": platform.processor() or platform.machine(), "python": sys.version.split()[0],
            "loadavg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(meta))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
