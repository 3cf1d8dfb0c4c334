"""Micro benchmark: the block-hash memo's slowest calls once it is full and every miss evicts.

Usage::

    .venv/bin/python benchmarks/micro/bench_memo_churn.py [--bound N] [--calls M] [--json OUT]

A ``BlockHashMemo`` of ``N`` entries (default: the router's ``DEFAULT_MEMO_BLOCKS``) is filled
with 1,500-token prompts nobody sent before (``array('I')``, as the local tokenizer gives
them), then ``M`` more such prompts are timed one by one: each misses, is hashed and evicts,
as under varied traffic (``kvroute bench soak``). Printed: the calls' p50, p99.9 and max in
ms, and how many took over 5 ms (with no GC during the timed calls, so what shows is the
memo's own work). Compare two versions with ``PYTHONPATH`` on each ``src``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from array import array
from pathlib import Path

from kvroute.core.hash_memo import DEFAULT_MEMO_BLOCKS, BlockHashMemo
from kvroute.core.hashing import BlockHasher


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--bound", type=int, default=DEFAULT_MEMO_BLOCKS)
    parser.add_argument("--calls", type=int, default=12_000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.bound < 1 or args.calls < 1:
        parser.error("--bound and --calls must be >= 1")
    rng = random.Random(0)

    def prompt() -> array[int]:
        return array("I", [rng.randrange(1024) for _ in range(1500)])

    memo = BlockHashMemo(BlockHasher("sha256", 16, None), max_entries=args.bound)
    while len(memo) < args.bound:
        memo.wire_hashes(prompt())
    prompts = [prompt() for _ in range(args.calls)]
    gc.collect()
    gc.disable()
    times = []
    for ids in prompts:
        started = time.perf_counter()
        memo.wire_hashes(ids)
        times.append(time.perf_counter() - started)
    gc.enable()
    times.sort()
    ms = [1e3 * t for t in times]
    print(f"memo of {args.bound:,} entries, full, {args.calls:,} prompts of 1,500 new tokens: "
          f"p50 {ms[len(ms) // 2]:.3f} ms, p99.9 {ms[int(0.999 * (len(ms) - 1))]:.3f} ms, "
          f"max {ms[-1]:.2f} ms, {sum(1 for t in ms if t > 5.0)} calls over 5 ms")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "bound": args.bound, "calls": args.calls, "p50_ms": ms[len(ms) // 2],
            "p999_ms": ms[int(0.999 * (len(ms) - 1))], "max_ms": ms[-1],
            "over_5ms": sum(1 for t in ms if t > 5.0)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
