"""Micro benchmark: the memory of the router's two token caches at their default bounds.

Usage::

    .venv/bin/python benchmarks/micro/bench_cache_memory.py [--piece-tokens N]
        [--memo-entries M] [--json OUT]

Fills, in this process, the bundled tokenizer's piece cache (``tokenize.segments``, bound
``DEFAULT_MAX_CACHED_TOKENS`` tokens) with chat pieces of ~1,000 tokens nobody sent before,
and a ``BlockHashMemo`` (``core/hash_memo``, bound ``DEFAULT_MEMO_BLOCKS`` entries) with
1,500-token prompts of random ids, as a router under varied traffic does within minutes
(``kvroute bench soak``). Prints what ``tracemalloc`` counts for each, per token or entry,
and how long a full garbage collection then takes (the piece cache's key tuples are untracked
by the first one and its ordered dict is still walked; the memo holds only bytes, never
tracked).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
import tracemalloc
from array import array
from pathlib import Path

from kvroute.core.hash_memo import DEFAULT_MEMO_BLOCKS, BlockHashMemo
from kvroute.core.hashing import BlockHasher
from kvroute.tokenize.hf import HFTokenizer, bundled_tokenizer_dir
from kvroute.tokenize.segments import DEFAULT_MAX_CACHED_TOKENS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--piece-tokens", type=int, default=DEFAULT_MAX_CACHED_TOKENS,
                        help="fill the piece cache up to this many tokens (default: its bound)")
    parser.add_argument("--memo-entries", type=int, default=DEFAULT_MEMO_BLOCKS,
                        help="the memo's bound (default: the router's)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.piece_tokens < 1 or args.memo_entries < 1:
        parser.error("--piece-tokens and --memo-entries must be >= 1")
    report: dict[str, float] = {}
    rng = random.Random(0)
    tok = HFTokenizer.from_dir(bundled_tokenizer_dir())
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    pieces = tok.pieces
    prompts = 0
    target = 0.999 * min(args.piece_tokens, DEFAULT_MAX_CACHED_TOKENS)
    while pieces.cached_tokens < target and prompts < 100_000:
        words = " ".join(f"w{rng.getrandbits(24):06x}" for _ in range(150))
        pieces.encode(f"<|im_start|>user\n{words}<|im_end|>\n<|im_start|>assistant\n")
        prompts += 1
    used = tracemalloc.get_traced_memory()[0] - base
    print(f"piece cache: {pieces.cached_tokens:,} tokens from {prompts:,} prompts: "
          f"{used / 2**20:.1f} MB ({used / pieces.cached_tokens:.1f} bytes a token)")
    report.update(piece_tokens=pieces.cached_tokens, piece_mb=used / 2**20)
    base = tracemalloc.get_traced_memory()[0]
    memo = BlockHashMemo(BlockHasher("sha256", 16, None), max_entries=args.memo_entries)
    prompts = 0
    while memo.hits + memo.misses < 2 * args.memo_entries and prompts < 100_000:
        memo.wire_hashes(array("I", (rng.randrange(1024) for _ in range(1500))))
        prompts += 1
    entries = len(memo._memo)  # the bound is what is measured
    used = tracemalloc.get_traced_memory()[0] - base
    print(f"block-hash memo: {entries:,} entries from {prompts:,} prompts: "
          f"{used / 2**20:.1f} MB ({used / entries:.0f} bytes an entry)")
    report.update(memo_entries=entries, memo_mb=used / 2**20)
    tracemalloc.stop()
    for i in range(3):
        started = time.perf_counter()
        gc.collect()
        took_ms = 1e3 * (time.perf_counter() - started)
        print(f"full collection {i + 1}: {took_ms:.1f} ms, "
              f"{len(gc.get_objects()):,} tracked objects")
        report[f"full_gc_{i + 1}_ms"] = took_ms
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
