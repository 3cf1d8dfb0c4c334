"""Micro-benchmark of the fleet prefix index (``kvroute.core.index.PrefixIndex``).

Three measurements, each against a target from the design:

* **apply**: block events per second applied from pre-built domain events (decoding is
  excluded; the wire codec has its own benchmark). Realistic shape: per replica, engine steps
  whose ``BlockStored`` events carry 1..32 new hashes and whose ``BlockRemoved`` events carry
  one hash each, balanced so the index size stays steady. Target: well above 1,000,000/s.
* **match**: one lookup of a 2,048-block request across 100 replicas that hold prefixes of it
  at different depths (hashing excluded). Target: < 1 ms.
* **memory**: tracemalloc growth per (block, replica) entry for 1M entries over 8 and 100
  replicas, with unique hashes per replica (worst case) and with shared prefixes.
  Target: <= 150 bytes.

Usage::

    .venv/bin/python benchmarks/micro/bench_index.py            # full run, prints a table
    .venv/bin/python benchmarks/micro/bench_index.py --quick    # CI smoke, tiny sizes
    .venv/bin/python benchmarks/micro/bench_index.py --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections import deque
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from kvroute.core.clock import ManualClock
from kvroute.core.events import BlockRemoved, BlockStored, EventBatch
from kvroute.core.index import PrefixIndex, TenantScope
from kvroute.core.types import ReplicaId, TenantName, WireHash

TENANT = TenantScope(TenantName("bench"))


@dataclass(frozen=True, slots=True)
class Timing:
    """Latency summary in microseconds."""

    avg_us: float
    p50_us: float
    p99_us: float
    max_us: float
    n: int


def _summarise(samples_s: list[float]) -> Timing:
    us = sorted(s * 1e6 for s in samples_s)
    p99 = us[min(len(us) - 1, round(0.99 * (len(us) - 1)))]
    return Timing(statistics.fmean(us), statistics.median(us), p99, us[-1], len(us))


def _hash(rng: random.Random) -> WireHash:
    return WireHash(rng.getrandbits(64))


# --- apply ---------------------------------------------------------------------------------


def _build_apply_workload(
    rng: random.Random, num_replicas: int, warm_blocks: int, num_block_events: int
) -> tuple[list[tuple[ReplicaId, EventBatch]], list[tuple[ReplicaId, EventBatch]], int, int]:
    """Return (warm-up batches, measured batches, measured block events, measured events)."""
    replicas = [ReplicaId(f"r{i}") for i in range(num_replicas)]
    resident: dict[ReplicaId, deque[WireHash]] = {r: deque() for r in replicas}
    warm: list[tuple[ReplicaId, EventBatch]] = []
    for r in replicas:
        hashes = tuple(_hash(rng) for _ in range(warm_blocks))
        resident[r].extend(hashes)
        warm.append((r, EventBatch(0, 0.0, (BlockStored(hashes, None, (), 16),))))
    measured: list[tuple[ReplicaId, EventBatch]] = []
    block_events = events = 0
    seq = 1
    while block_events < num_block_events:
        r = replicas[rng.randrange(num_replicas)]
        step: list[BlockStored | BlockRemoved] = []
        for _ in range(rng.randint(1, 4)):
            new = tuple(_hash(rng) for _ in range(rng.randint(1, 32)))
            # vLLM evicts (lazily) as many blocks as it allocates once the cache is full.
            for _ in range(len(new)):
                step.append(BlockRemoved((resident[r].popleft(),)))
            parent = resident[r][-1] if resident[r] else None
            step.append(BlockStored(new, parent, (), 16))
            resident[r].extend(new)
            block_events += 2 * len(new)
        events += len(step)
        measured.append((r, EventBatch(seq, 0.0, tuple(step))))
        seq += 1
    return warm, measured, block_events, events


def bench_apply(num_replicas: int, warm_blocks: int, num_block_events: int, runs: int) -> dict[str, Any]:
    rng = random.Random(1)
    warm, measured, num_blocks, num_events = _build_apply_workload(
        rng, num_replicas, warm_blocks, num_block_events
    )
    rates: list[float] = []
    cpu_rates: list[float] = []
    batch_times: list[float] = []
    for run in range(runs + 1):  # run 0 is a warm-up
        index = PrefixIndex(clock=ManualClock())
        for replica, batch in warm:
            index.apply_batch(replica, batch)
        gc.collect()
        perf = time.perf_counter
        apply_batch = index.apply_batch
        times = []
        t_start = perf()
        for replica, batch in measured:
            t0 = perf()
            apply_batch(replica, batch)
            times.append(perf() - t0)
        elapsed = perf() - t_start
        # Outer loop without per-batch timers, for the headline rate.
        index = PrefixIndex(clock=ManualClock())
        for replica, batch in warm:
            index.apply_batch(replica, batch)
        gc.collect()
        apply_batch = index.apply_batch
        t0 = perf()
        c0 = time.process_time()
        for replica, batch in measured:
            apply_batch(replica, batch)
        bare = perf() - t0
        cpu = time.process_time() - c0
        stats = index.stats()
        assert stats.num_entries == num_replicas * warm_blocks, stats
        assert stats.num_removed_unknown == 0, stats
        if run:
            rates.append(num_blocks / bare)
            cpu_rates.append(num_blocks / cpu)
            batch_times.extend(times)
        del elapsed  # the timed loop's total includes timer overhead; ``bare`` is the rate
    return {
        "num_replicas": num_replicas,
        "warm_blocks_per_replica": warm_blocks,
        "num_block_events": num_blocks,
        "num_events": num_events,
        "num_batches": len(measured),
        "block_events_per_s_median": statistics.median(rates),
        "block_events_per_s_max": max(rates),
        "events_per_s_median": statistics.median(rates) * num_events / num_blocks,
        # CPU time of this process only: on a shared machine, closer to what one core does.
        "block_events_per_cpu_s_median": statistics.median(cpu_rates),
        "block_events_per_cpu_s_max": max(cpu_rates),
        "per_batch": asdict(_summarise(batch_times)),
    }


# --- match ---------------------------------------------------------------------------------


def _build_match_index(
    rng: random.Random, num_replicas: int, num_blocks: int, cpu_share: float, predicted: bool
) -> tuple[PrefixIndex, list[WireHash]]:
    request = [_hash(rng) for _ in range(num_blocks)]
    index = PrefixIndex(clock=ManualClock())
    for i in range(num_replicas):
        depth = rng.randint(1, num_blocks)
        replica = ReplicaId(f"r{i}")
        gpu_depth = int(depth * (1 - cpu_share))
        index.apply_event(replica, BlockStored(tuple(request[:gpu_depth]), None, (), 16))
        if depth > gpu_depth:
            index.apply_event(
                replica, BlockStored(tuple(request[gpu_depth:depth]), None, (), 16, medium="CPU")
            )
        # Unrelated cache content, so the dict is not tiny.
        index.apply_event(replica, BlockStored(tuple(_hash(rng) for _ in range(2000)), None, (), 16))
    if predicted:
        for i in range(0, num_replicas, 10):
            index.add_predicted(ReplicaId(f"r{i}"), request, TENANT)
    return index, request


def bench_match(
    num_replicas: int, num_blocks: int, cpu_share: float, predicted: bool, iters: int
) -> dict[str, Any]:
    rng = random.Random(2)
    index, request = _build_match_index(rng, num_replicas, num_blocks, cpu_share, predicted)
    result = index.match(request, TENANT)
    assert len(result) == num_replicas, len(result)
    for _ in range(20):
        index.match(request, TENANT)
    gc.collect()
    perf = time.perf_counter
    samples = []
    cpu_samples = []
    cpu = time.thread_time
    for _ in range(iters):
        c0 = cpu()
        t0 = perf()
        index.match(request, TENANT)
        samples.append(perf() - t0)
        cpu_samples.append(cpu() - c0)
    return {
        "cpu_p50_us": statistics.median(cpu_samples) * 1e6,
        "num_replicas": num_replicas,
        "num_blocks": num_blocks,
        "cpu_share": cpu_share,
        "predicted": predicted,
        **asdict(_summarise(samples)),
    }


# --- memory --------------------------------------------------------------------------------


def bench_memory(num_entries: int, num_replicas: int, sharing: int) -> dict[str, Any]:
    """Bytes per entry after storing ``num_entries`` entries; each hash is held by ``sharing``
    replicas (1 = unique hashes per replica, the worst case)."""
    rng = random.Random(3)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(clock=ManualClock())
    replicas = [ReplicaId(f"r{i}") for i in range(num_replicas)]
    stored = 0
    while stored < num_entries:
        hashes = tuple(_hash(rng) for _ in range(min(1024, (num_entries - stored) // sharing or 1)))
        event = BlockStored(hashes, None, (), 16)
        for k in rng.sample(range(num_replicas), sharing):
            index.apply_event(replicas[k], event)
        stored += len(hashes) * sharing
        del event, hashes
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    stats = index.stats()
    return {
        "num_entries": stats.num_entries,
        "num_hashes": stats.num_hashes,
        "num_replicas": num_replicas,
        "replicas_per_hash": sharing,
        "bytes_total": used,
        "bytes_per_entry": used / stats.num_entries,
    }


# --- driver --------------------------------------------------------------------------------


def _git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc.__class__.__name__})"
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CI smoke run)")
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    args = parser.parse_args(argv)
    quick = args.quick

    config = {
        "quick": quick,
        "apply": {"num_block_events": 20_000 if quick else 2_000_000, "runs": 1 if quick else 5},
        "match_iters": 20 if quick else 300,
        "memory_entries": 20_000 if quick else 1_000_000,
    }
    apply_results = [
        bench_apply(n, 200 if quick else 20_000, config["apply"]["num_block_events"],
                    config["apply"]["runs"])
        for n in (8, 100)
    ]
    match_results = [
        bench_match(r, b, cpu, pred, config["match_iters"])
        for r, b, cpu, pred in (
            (8, 2048, 0.0, False),
            (100, 512, 0.0, False),
            (100, 2048, 0.0, False),
            (100, 2048, 0.25, False),
            (100, 2048, 0.25, True),
        )
    ]
    memory_results = [
        bench_memory(config["memory_entries"], r, s) for r, s in ((8, 1), (100, 1), (8, 8), (100, 10))
    ]

    print("apply (pre-built domain events; block events = stored + removed hashes)")
    print(f"{'replicas':>8} {'Mblk/s med':>10} {'Mblk/s max':>10} {'Mev/s':>7} "
          f"{'cpu Mblk/s med':>14} {'max':>6} "
          f"{'batch avg us':>12} {'p50':>7} {'p99':>7} {'max':>8}")
    for a in apply_results:
        pb = a["per_batch"]
        print(f"{a['num_replicas']:>8} {a['block_events_per_s_median'] / 1e6:>10.2f} "
              f"{a['block_events_per_s_max'] / 1e6:>10.2f} {a['events_per_s_median'] / 1e6:>7.2f} "
              f"{a['block_events_per_cpu_s_median'] / 1e6:>14.2f} "
              f"{a['block_events_per_cpu_s_max'] / 1e6:>6.2f} "
              f"{pb['avg_us']:>12.1f} {pb['p50_us']:>7.1f} {pb['p99_us']:>7.1f} {pb['max_us']:>8.1f}")
    print("\nmatch (one lookup; hashing excluded)")
    print(f"{'replicas':>8} {'blocks':>6} {'cpu':>5} {'pred':>5} "
          f"{'avg us':>8} {'p50':>8} {'p99':>8} {'max':>8} {'cpu p50':>8}")
    for m in match_results:
        print(f"{m['num_replicas']:>8} {m['num_blocks']:>6} {m['cpu_share']:>5} "
              f"{m['predicted']!s:>5} {m['avg_us']:>8.1f} {m['p50_us']:>8.1f} "
              f"{m['p99_us']:>8.1f} {m['max_us']:>8.1f} {m['cpu_p50_us']:>8.1f}")
    print("\nmemory (tracemalloc growth, index only; hash keys included)")
    print(f"{'replicas':>8} {'per hash':>8} {'entries':>9} {'hashes':>9} {'B/entry':>8}")
    for mem in memory_results:
        print(f"{mem['num_replicas']:>8} {mem['replicas_per_hash']:>8} {mem['num_entries']:>9} "
              f"{mem['num_hashes']:>9} {mem['bytes_per_entry']:>8.1f}")

    report = {
        "benchmark": "bench_index",
        "config": config,
        "git_sha": _git_sha(),
        "python": sys.version,
        "platform": platform.platform(),
        "versions": {pkg: version(pkg) for pkg in ("kvroute", "msgspec")},
        "apply": apply_results,
        "match": match_results,
        "memory": memory_results,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
