"""Micro benchmark: µs per block of ``BlockHasher.hash_blocks`` for each vLLM hash algorithm.

Usage::

    .venv/bin/python benchmarks/micro/bench_hashing.py [--repeats N] [--blocks B] [--json OUT]

Each measurement hashes one ``B``-block prompt of seeded random token ids (vocabulary of
151 936, Qwen2-sized, so ids use every pickle int width) and divides by ``B``. A ``gc.collect``
and a warm-up run precede every series; mean/p50/p99/max are over the repeats. The ``+lora``
rows add a LoRA key to every block (the slower extra-keys path); ``floor`` is the bare
``sha256(pickle.dumps(...))`` loop with no validation, the best a pure-Python hasher can do.
The issue's target: sha256 at block size 16 <= 1.5 µs per block on one core.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import pickle
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from importlib import metadata
from pathlib import Path

from kvroute.bench.provenance import git_sha
from kvroute.core.hashing import HASH_ALGOS, BlockHasher, LoraKey

BLOCK_SIZES = (16, 32, 128)
VOCAB = 151_936


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def _measure(run: Callable[[], object], repeats: int, num_blocks: int) -> dict[str, float]:
    gc.collect()
    run()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        run()
        samples.append((time.perf_counter_ns() - start) / 1000 / num_blocks)
    samples.sort()
    return {
        "mean_us": statistics.fmean(samples),
        "p50_us": _percentile(samples, 0.50),
        "p99_us": _percentile(samples, 0.99),
        "max_us": samples[-1],
    }


def _floor(tokens: list[int], block_size: int) -> Callable[[], object]:
    root = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()

    def run() -> object:
        parent = root
        for start in range(0, len(tokens) - block_size + 1, block_size):
            block = tuple(tokens[start : start + block_size])
            parent = hashlib.sha256(pickle.dumps((parent, block, None), protocol=5)).digest()
        return parent

    return run


def run_benchmark(repeats: int, num_blocks: int, seed: int = 0) -> list[dict[str, object]]:
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    lora = LoraKey("my-lora", "/adapters/my-lora")
    for block_size in BLOCK_SIZES:
        tokens = [rng.randrange(VOCAB) for _ in range(block_size * num_blocks)]
        for algo in HASH_ALGOS:
            hasher = BlockHasher(algo, block_size, "0" if algo.startswith("xxhash") else None)
            stats = _measure(partial(hasher.hash_blocks, tokens), repeats, num_blocks)
            rows.append({"case": algo, "block_size": block_size, **stats})
        hasher = BlockHasher("sha256", block_size)
        stats = _measure(partial(hasher.hash_blocks, tokens, lora=lora), repeats, num_blocks)
        rows.append({"case": "sha256+lora", "block_size": block_size, **stats})
        stats = _measure(_floor(tokens, block_size), repeats, num_blocks)
        rows.append({"case": "floor(sha256)", "block_size": block_size, **stats})
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=300, help="timed runs per case")
    parser.add_argument("--blocks", type=int, default=64, help="blocks per hashed prompt")
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.blocks < 1:
        parser.error("--repeats and --blocks must be >= 1")

    rows = run_benchmark(args.repeats, args.blocks)
    print(f"µs per block; {args.blocks} blocks per prompt, {args.repeats} repeats")
    print(f"{'case':<15} {'bs':>4} {'mean':>8} {'p50':>8} {'p99':>8} {'max':>8}")
    for row in rows:
        print(
            f"{row['case']:<15} {row['block_size']:>4} {row['mean_us']:>8.3f} "
            f"{row['p50_us']:>8.3f} {row['p99_us']:>8.3f} {row['max_us']:>8.3f}"
        )
    if args.json is not None:
        report = {
            "benchmark": "bench_hashing",
            "config": {"repeats": args.repeats, "blocks": args.blocks, "vocab": VOCAB},
            "git_sha": git_sha(short=True, cwd=Path(__file__).resolve().parent,
                               timeout_s=10) or "unknown",
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "libs": {name: metadata.version(name) for name in ("cbor2", "xxhash", "kvroute")},
            "results": rows,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
