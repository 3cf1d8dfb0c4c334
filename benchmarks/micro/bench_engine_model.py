"""Micro benchmark: scheduler steps/s and requests/s of ``EngineModel`` with the zero profile.

Usage::

    .venv/bin/python benchmarks/micro/bench_engine_model.py [--requests N] [--json OUT]

Workload (synthetic, seeded): closed loop at a fixed concurrency; every prompt is one of 16
shared prefixes followed by a unique suffix; fixed output length (``ignore_eos`` style). The
engine shape is the ``zero`` profile's (block size 16, 24,800 blocks, budget 8,192 tokens,
256 sequences). Prompt hashes are precomputed outside the timed region by default, as the
router hands them to the engine (``prompt_block_hashes``); ``--engine-hashes`` times the
engine hashing the prompts itself. A ``gc.collect`` and a warm-up run precede each case.
Per-step times (µs, wall clock) are reported as mean/p50/p99/max; the rates are per second
of *process CPU time*, which a machine shared with other jobs distorts far less than wall time.

The figure that matters for the fleet benchmark: the Mooncake conversation trace (12,031
requests, mean 12,035 prompt / 343 output tokens) on 8 engines for ~10 policies must run in
10 minutes on one core; the ``mooncake-like`` row shows the engine's share of that budget.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from kvroute.bench.provenance import git_sha
from kvroute.core.hashing import BlockHasher
from kvroute.core.types import BlockHash
from kvroute.engine.model import EngineModel, EngineRequest
from kvroute.sim.profiles import get_profile

VOCAB = 32_000


@dataclass(frozen=True)
class Case:
    name: str
    prefix_tokens: int
    suffix_tokens: int
    output_tokens: int
    concurrency: int


CASES = (
    Case("short-chat", 512, 256, 64, 64),
    Case("rag-2k", 1536, 512, 128, 64),
    Case("mooncake-like", 6000, 6000, 343, 32),
)


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def _workload(
    case: Case, num_requests: int, hasher: BlockHasher, precompute: bool
) -> list[EngineRequest]:
    rng = random.Random(1234)
    prefixes = [[rng.randrange(VOCAB) for _ in range(case.prefix_tokens)] for _ in range(16)]
    out = []
    for i in range(num_requests):
        prompt = prefixes[rng.randrange(16)] + [
            rng.randrange(VOCAB) for _ in range(case.suffix_tokens)
        ]
        hashes: list[BlockHash] | None = hasher.hash_blocks(prompt) if precompute else None
        out.append(EngineRequest(
            f"{case.name}-{i}", prompt, max_tokens=case.output_tokens,
            output_length=case.output_tokens, prompt_block_hashes=hashes,
        ))
    return out


def _run(case: Case, requests: list[EngineRequest], hasher: BlockHasher) -> dict[str, float]:
    engine = EngineModel(get_profile("zero").engine_config(), hasher=hasher)
    pending = list(reversed(requests))
    in_flight = 0
    step_us: list[float] = []
    generated = prefill = 0
    start = time.perf_counter()
    cpu_start = time.process_time()
    while pending or engine.has_work():
        while pending and in_flight < case.concurrency:
            engine.add_request(pending.pop())
            in_flight += 1
        t0 = time.perf_counter_ns()
        result = engine.step()
        step_us.append((time.perf_counter_ns() - t0) / 1000)
        prefill += result.num_prefill_tokens
        for o in result.outputs:
            generated += 1
            if o.finished:
                in_flight -= 1
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    step_us.sort()
    m = engine.metrics()
    return {
        "requests": len(requests),
        "steps": len(step_us),
        "wall_s": wall,
        "cpu_s": cpu,
        "steps_per_s": len(step_us) / cpu,
        "requests_per_s": len(requests) / cpu,
        "output_tokens_per_s": generated / cpu,
        "prefill_tokens_per_s": prefill / cpu,
        "step_mean_us": statistics.fmean(step_us),
        "step_p50_us": _percentile(step_us, 0.5),
        "step_p99_us": _percentile(step_us, 0.99),
        "step_max_us": step_us[-1],
        "hit_rate": m.prefix_cache_hits_total / max(1, m.prefix_cache_queries_total),
        "preemptions": m.num_preemptions_total,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="requests per case")
    parser.add_argument("--engine-hashes", action="store_true",
                        help="let the engine hash prompts inside the timed region")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)

    hasher = BlockHasher(block_size=16)
    rows = []
    print(f"{'case':<14} {'req':>5} {'steps':>6} {'cpu s':>7} {'steps/s':>8} {'req/s':>7} "
          f"{'out tok/s':>9} {'step p50 us':>11} {'p99 us':>8} {'max us':>8} {'hit':>5}")
    for case in CASES:
        warm = _workload(case, max(8, args.requests // 20), hasher, not args.engine_hashes)
        gc.collect()
        _run(case, warm, hasher)
        requests = _workload(case, args.requests, hasher, not args.engine_hashes)
        gc.collect()
        r = _run(case, requests, hasher)
        rows.append({"case": case.__dict__, **r})
        print(f"{case.name:<14} {r['requests']:>5} {r['steps']:>6} {r['cpu_s']:>7.2f} "
              f"{r['steps_per_s']:>8.0f} {r['requests_per_s']:>7.1f} "
              f"{r['output_tokens_per_s']:>9.0f} {r['step_p50_us']:>11.1f} "
              f"{r['step_p99_us']:>8.0f} {r['step_max_us']:>8.0f} {r['hit_rate']:>5.2f}")
    if args.json:
        args.json.write_text(json.dumps({
            "benchmark": "engine_model",
            "engine_hashes": args.engine_hashes,
            "git_sha": git_sha(short=True, cwd=Path(__file__).parent,
                               timeout_s=None) or "unknown",
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "msgspec": metadata.version("msgspec"),
            "results": rows,
        }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
