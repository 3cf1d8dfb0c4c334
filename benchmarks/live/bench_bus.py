"""Which bus carries the routers' fresh placements: NATS or Redis, measured on loopback.

Each transport sends ``--messages`` payloads of ``--bytes`` bytes (about a placement of
~120 block hashes), one every ``--gap-ms``, from a publisher to a subscriber in this process,
and reports publish-to-receive latency (p50, p99, max) and the CPU per message of this
process (client side: encode-free, the client libraries only) and of the server, read from
``/proc/<pid>/stat`` when the server runs on this machine.

    PYTHONPATH=src .venv/bin/python benchmarks/live/bench_bus.py --messages 3000

Transports: NATS core publish/subscribe (what ``shell/cluster_bus.py`` uses), NATS JetStream
(publish acknowledged by the stream, push consumer), Redis pub/sub, Redis streams
(``XADD`` + blocking ``XREAD``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import struct
import subprocess
import time
from collections.abc import Awaitable, Callable

import nats
import redis.asyncio as aioredis
from nats.js.api import StreamConfig

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _server_cpu_s(name: str) -> float | None:
    try:
        pid = subprocess.run(["pgrep", "-x", name], capture_output=True, text=True,
                             check=True).stdout.split()[0]
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (subprocess.CalledProcessError, IndexError, OSError):
        return None


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


Sender = Callable[[bytes], Awaitable[None]]


async def _run(name: str, server: str, send: Sender, received: asyncio.Queue[float],
               args: argparse.Namespace) -> None:
    latencies: list[float] = []
    pad = b"x" * max(0, args.bytes - 8)
    for _ in range(50):  # warm up
        await send(struct.pack("<d", time.perf_counter()) + pad)
        await received.get()
    cpu0, srv0 = _own_cpu_s(), _server_cpu_s(server)
    for _ in range(args.messages):
        await send(struct.pack("<d", time.perf_counter()) + pad)
        latencies.append(await asyncio.wait_for(received.get(), 5.0))
        await asyncio.sleep(args.gap_ms / 1000)
    cpu1, srv1 = _own_cpu_s(), _server_cpu_s(server)
    latencies.sort()
    p = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e6
    srv = "n/a" if srv0 is None or srv1 is None else f"{(srv1 - srv0) / args.messages * 1e6:.0f}"
    print(f"{name:22s} p50 {p(0.5):6.0f} µs  p99 {p(0.99):6.0f} µs  max {latencies[-1]*1e6:7.0f} µs"
          f"  mean {statistics.fmean(latencies)*1e6:6.0f} µs  client CPU "
          f"{(cpu1 - cpu0) / args.messages * 1e6:5.0f} µs/msg  server CPU {srv} µs/msg")


async def nats_core(args: argparse.Namespace) -> None:
    nc = await nats.connect(args.nats)
    received: asyncio.Queue[float] = asyncio.Queue()

    async def on_msg(msg: nats.aio.msg.Msg) -> None:
        received.put_nowait(time.perf_counter() - struct.unpack_from("<d", msg.data)[0])

    await nc.subscribe("kvroute.benchbus", cb=on_msg)
    await _run("NATS core pub/sub", "nats-server",
               lambda data: nc.publish("kvroute.benchbus", data), received, args)
    await nc.close()


async def nats_jetstream(args: argparse.Namespace) -> None:
    nc = await nats.connect(args.nats)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="KVROUTE_BENCHBUS", subjects=["kvroute.benchjs"],
                                     max_msgs=10_000, storage="memory"))
    received: asyncio.Queue[float] = asyncio.Queue()

    async def on_msg(msg: nats.aio.msg.Msg) -> None:
        received.put_nowait(time.perf_counter() - struct.unpack_from("<d", msg.data)[0])

    await js.subscribe("kvroute.benchjs", cb=on_msg, manual_ack=False, ordered_consumer=True)

    async def send(data: bytes) -> None:
        await js.publish("kvroute.benchjs", data)

    try:
        await _run("NATS JetStream (memory)", "nats-server", send, received, args)
    finally:
        await js.delete_stream("KVROUTE_BENCHBUS")
        await nc.close()


async def redis_pubsub(args: argparse.Namespace) -> None:
    pub = aioredis.Redis.from_url(args.redis)
    sub = aioredis.Redis.from_url(args.redis)
    ps = sub.pubsub()
    await ps.subscribe("kvroute:benchbus")
    received: asyncio.Queue[float] = asyncio.Queue()

    async def reader() -> None:
        async for msg in ps.listen():
            if msg["type"] == "message":
                received.put_nowait(time.perf_counter() - struct.unpack_from("<d", msg["data"])[0])

    task = asyncio.create_task(reader())

    async def send(data: bytes) -> None:
        await pub.publish("kvroute:benchbus", data)

    await _run("Redis pub/sub", "redis-server", send, received, args)
    task.cancel()
    await ps.aclose()
    await pub.aclose()
    await sub.aclose()


async def redis_streams(args: argparse.Namespace) -> None:
    pub = aioredis.Redis.from_url(args.redis)
    sub = aioredis.Redis.from_url(args.redis)
    key = "kvroute:benchbus:stream"
    await pub.delete(key)
    received: asyncio.Queue[float] = asyncio.Queue()

    async def reader() -> None:
        last = "$"
        while True:
            got = await sub.xread({key: last}, block=1000, count=100)
            for _, entries in got:
                for entry_id, fields in entries:
                    last = entry_id
                    received.put_nowait(
                        time.perf_counter() - struct.unpack_from("<d", fields[b"d"])[0])

    task = asyncio.create_task(reader())
    await asyncio.sleep(0.05)

    async def send(data: bytes) -> None:
        await pub.xadd(key, {"d": data}, maxlen=10_000, approximate=True)

    await _run("Redis streams", "redis-server", send, received, args)
    task.cancel()
    await pub.delete(key)
    await pub.aclose()
    await sub.aclose()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--bytes", type=int, default=1024)
    parser.add_argument("--gap-ms", type=float, default=1.0)
    parser.add_argument("--nats", default="nats://127.0.0.1:4222")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    print(f"{args.messages} messages of {args.bytes} B, one every {args.gap_ms} ms; "
          f"load average {os.getloadavg()[0]:.2f}")
    for bench in (nats_core, nats_jetstream, redis_pubsub, redis_streams):
        await bench(args)


if __name__ == "__main__":
    asyncio.run(main())
