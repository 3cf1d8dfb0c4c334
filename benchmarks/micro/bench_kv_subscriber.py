"""Micro benchmark: the KV-event subscriber's CPU per message when messages come one at a time.

Usage::

    .venv/bin/python benchmarks/micro/bench_kv_subscriber.py [--messages N] [--gap-ms G]
        [--json OUT]

A publisher in a child process sends ``N`` one-event batches (``BlockStored`` of 4 blocks,
the shape of a request's new blocks) over ZMQ on loopback, one every ``G`` ms, busy-waiting
between sends so that the pace holds. This process runs one ``EventSubscriber``
(``shell/zmq_events.py``) bound to that endpoint, as the router runs one per replica,
delivering to a callback that only counts. The figure is this process's CPU µs per message
received once the first 50 have arrived.

Why paced, one at a time: that is a live router's case (at 400 requests/s over 8 replicas,
about one message every 2.5 ms, rarely two queued), where the cost per message is what the
subscriber pays to be woken, not what it pays to drain a backlog (``bench_decode_apply.py``
measures that). To compare two versions, run this file with ``PYTHONPATH`` pointed at each
``src``; CPU time is noisy on a shared machine, so interleave the runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_WARM = 50


def publish(endpoint: str, count: int, gap_ms: float) -> None:
    """The child process: connect a PUB to ``endpoint`` and send ``count`` batches, paced."""
    import zmq

    from kvroute.core.events import BlockStored, EventBatch
    from kvroute.wire.vllm_events import encode_payload, encode_seq

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 1000)
    pub.connect(endpoint)
    time.sleep(0.3)  # the subscription reaches the publisher
    due = time.perf_counter()
    for seq in range(count):
        hashes = tuple(range(seq * 4, seq * 4 + 4))
        event = BlockStored(hashes, None, (), 16, None, "GPU", None, (None,) * 4, 0,
                            "full_attention")
        pub.send_multipart([b"", encode_seq(seq), encode_payload(EventBatch(seq, 1.0, (event,), 0))])
        due += gap_ms / 1e3
        while time.perf_counter() < due:
            pass
    pub.close()
    ctx.term()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def run(count: int, gap_ms: float) -> dict[str, Any]:
    from kvroute.core.types import ReplicaId
    from kvroute.shell.zmq_events import EventSubscriber

    received = [0]

    def on_batch(replica: object, batch: object) -> None:
        received[0] += 1

    def on_reset(replica: object, reason: str) -> None:
        raise AssertionError(f"the subscriber reset: {reason}")

    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    sub = EventSubscriber(ReplicaId("r"), endpoint, on_batch=on_batch, on_reset=on_reset,
                          bind=True, catch_up=False, token_ids=False)
    sub.start()
    await sub.wait_connected()
    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--publish", endpoint, "--messages", str(count),
        "--gap-ms", str(gap_ms))
    try:
        limit = time.perf_counter() + 30 + count * gap_ms / 1e3
        while received[0] < _WARM:
            if time.perf_counter() > limit or child.returncode not in (None, 0):
                raise RuntimeError(f"only {received[0]} messages arrived")
            await asyncio.sleep(0.005)
        cpu0, got0 = time.process_time(), received[0]
        while child.returncode is None and time.perf_counter() < limit:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)  # the last messages in flight
        cpu1, got1 = time.process_time(), received[0]
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()
        await sub.stop()
    if child.returncode != 0:
        raise RuntimeError(f"the publisher exited with {child.returncode}")
    if got1 < count:
        raise RuntimeError(f"{count - got1} of {count} messages were lost")
    return {"cpu_us_per_message": (cpu1 - cpu0) * 1e6 / (got1 - got0),
            "messages_timed": got1 - got0}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--gap-ms", type=float, default=1.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--publish", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.messages <= _WARM:
        parser.error(f"--messages {args.messages} must be over {_WARM} (the warm-up)")
    if args.gap_ms < 0:
        parser.error(f"--gap-ms {args.gap_ms:g} must be >= 0")
    if args.publish:
        publish(args.publish, args.messages, args.gap_ms)
        return 0
    report = asyncio.run(run(args.messages, args.gap_ms))
    print(f"KV-event subscriber, {args.messages} messages one every {args.gap_ms:g} ms")
    print(f"  cpu_us_per_message  {report['cpu_us_per_message']:9.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            **report, "messages": args.messages, "gap_ms": args.gap_ms,
            "python": sys.version.split()[0], "machine": platform.machine()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
