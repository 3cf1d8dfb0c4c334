"""Decode + apply: ZMQ frames of vLLM KV events into the fleet prefix index, per core.

The path a router runs for every event message: ``wire.vllm_events.decode_message`` (token ids
skipped, as the router subscribes) on the
three frames, then ``PrefixIndex.apply_batch``. Batches are vLLM 0.32's map form with int
hashes, block size 16, token ids included: ``BlockStored`` events of 1..32 new hashes, and
one-hash ``BlockRemoved`` events evicting earlier blocks (steady state: the cache is full, so
every block stored eventually evicts one). A *block event* is one hash stored or removed.
Replicas are spread over 8 engines. Timing is CPU time of this process (``process_time``), so
other load on the machine inflates it less than wall time.

    .venv/bin/python benchmarks/micro/bench_decode_apply.py [--batches 2000] [--repeat 5]
        [--replicas 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from collections import deque

from kvroute.core.clock import ManualClock
from kvroute.core.events import BlockRemoved, BlockStored, EventBatch, KVEvent
from kvroute.core.index import PrefixIndex
from kvroute.core.types import ReplicaId, WireHash
from kvroute.wire.vllm_events import decode_message, encode_message


def make_messages(rng: random.Random, batches: int, replicas: int,
                  capacity_blocks: int = 4096) -> tuple[list[tuple[ReplicaId, list[bytes]]], int]:
    """Encoded messages per replica and the number of block events they carry."""
    messages: list[tuple[ReplicaId, list[bytes]]] = []
    cached: dict[int, deque[int]] = {r: deque() for r in range(replicas)}
    seqs = [0] * replicas
    block_events = 0
    for _ in range(batches):
        r = rng.randrange(replicas)
        events: list[KVEvent] = []
        for _ in range(4):
            k = rng.randint(1, 32)
            hashes = tuple(WireHash(rng.getrandbits(64)) for _ in range(k))
            events.append(BlockStored(hashes, WireHash(rng.getrandbits(64)),
                                      tuple(rng.randrange(152_000) for _ in range(16 * k)), 16,
                                      None, "GPU", None, (None,) * k, 0, "full_attention"))
            cached[r].extend(hashes)
            block_events += k
            while len(cached[r]) > capacity_blocks:
                events.append(BlockRemoved((WireHash(cached[r].popleft()),), "GPU", 0))
                block_events += 1
        batch = EventBatch(seq=seqs[r], ts=1.0, events=tuple(events), data_parallel_rank=0)
        seqs[r] += 1
        messages.append((ReplicaId(f"r{r}"), encode_message(batch, "kv")))
    return messages, block_events


def run_once(messages: list[tuple[ReplicaId, list[bytes]]]) -> float:
    index = PrefixIndex(clock=ManualClock())
    gc.collect()
    start = time.process_time()
    for replica, frames in messages:
        index.apply_batch(replica, decode_message(frames, token_ids=False))
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    messages, block_events = make_messages(random.Random(0), args.batches, args.replicas)
    run_once(messages[: max(1, len(messages) // 10)])  # warm-up
    times = [run_once(messages) for _ in range(args.repeat)]
    rates = sorted(block_events / t for t in times)
    result = {
        "batches": args.batches, "replicas": args.replicas, "block_events": block_events,
        "cpu_s": times, "best_block_events_per_s": rates[-1],
        "median_block_events_per_s": statistics.median(rates),
        "ns_per_block_event_median": 1e9 / statistics.median(rates),
    }
    print(f"decode + apply: {block_events} block events in {args.batches} batches, "
          f"{args.replicas} replicas")
    print(f"  median {result['median_block_events_per_s'] / 1e6:.2f} M block events/s "
          f"({result['ns_per_block_event_median']:.0f} ns each), best "
          f"{result['best_block_events_per_s'] / 1e6:.2f} M/s (CPU time)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
