"""Micro benchmark: CPU per stage of a growing session's turns, the router's own functions in
process (docs/long-contexts.md, "Where a long turn's CPU goes").

Usage::

    .venv/bin/python benchmarks/micro/bench_long_turn.py [--turn-chars C] [--target-tokens N]
        [--last K] [--json OUT]

One session of ``bench/overhead_long.py`` (a system prompt, then a tool result of ``C``
characters a turn, to ``N`` real tokens of the bundled tokenizer) goes turn by turn through
what the live path runs: ``parse_request`` and the ``/tokenize`` body, the chat template,
the piece-cached encode, the block hashes through the session's chain
(``core/hashing_chains.py``) and, side by side on the same ids, through the memo alone (the
path before the chains), then ``PrefixIndex.match`` with the turn's blocks predicted and the
earlier ones confirmed, as an engine's events leave them. Each stage is timed with
``time.thread_time_ns`` (CPU of this thread: a loaded machine stretches it less than wall
time). The chain and the memo must agree on every turn (checked). Prints and writes the last
``K`` turns.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

from kvroute.bench.overhead_long import LONG_TARGET_TOKENS, TURN_CHARS, long_session_requests
from kvroute.bench.provenance import git_sha
from kvroute.core.clock import ManualClock
from kvroute.core.events import BlockStored
from kvroute.core.hash_memo import BlockHashMemo
from kvroute.core.hashing import BlockHasher
from kvroute.core.hashing_chains import SessionChains
from kvroute.core.index import PrefixIndex, TenantScope
from kvroute.core.types import ReplicaId, TenantName
from kvroute.tokenize.hf import HFTokenizer, bundled_tokenizer_dir
from kvroute.tokenize.prompt import tokenize_request_body
from kvroute.wire.openai import parse_request


def run(turn_chars: int, target_tokens: int) -> list[dict[str, Any]]:
    turns = long_session_requests(1, model="m", turn_chars=turn_chars,
                                  target_tokens=target_tokens)
    tok = HFTokenizer.from_dir(bundled_tokenizer_dir())
    chains, memo = SessionChains(), BlockHashMemo(BlockHasher("sha256", 16, None))
    memo_only = BlockHashMemo(BlockHasher("sha256", 16, None))
    index = PrefixIndex(clock=ManualClock())
    scope, replica = TenantScope(TenantName("t")), ReplicaId("r0")
    clock = time.thread_time_ns
    rows: list[dict[str, Any]] = []
    confirmed = previous = 0
    for turn in turns:
        t0 = clock()
        parsed = parse_request(turn.body, "chat", max_body_bytes=1 << 30)
        body = tokenize_request_body(parsed, None)
        assert body is not None
        t1 = clock()
        text = tok.render_chat(body["messages"])
        t2 = clock()
        ids = tok.encode(text, add_special_tokens=False)
        t3 = clock()
        hashes = chains.wire_hashes((scope, "p", "s"), memo, ids)
        t4 = clock()
        index.match(hashes, scope)
        t5 = clock()
        if memo_only.wire_hashes(ids) != hashes:
            raise AssertionError("the session chain and the memo disagree")
        t6 = clock()
        index.add_predicted(replica, hashes[confirmed:], scope)
        new = tuple(hashes[confirmed:])
        for i in range(0, len(new), 256):
            index.apply_event(replica, BlockStored(new[i : i + 256], None, (), 16))
        added, confirmed, previous = len(ids) - previous, len(hashes), len(ids)
        rows.append({"total_tokens": len(ids), "new_tokens": added,
                     "blocks": len(hashes),
                     **{name: round((b - a) / 1e6, 3) for name, a, b in (
                         ("parse_ms", t0, t1), ("render_ms", t1, t2), ("encode_ms", t2, t3),
                         ("chain_hash_ms", t3, t4), ("match_ms", t4, t5),
                         ("memo_hash_ms", t5, t6))}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turn-chars", type=int, default=TURN_CHARS)
    parser.add_argument("--target-tokens", type=int, default=LONG_TARGET_TOKENS)
    parser.add_argument("--last", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = run(args.turn_chars, args.target_tokens)[-args.last :]
    for row in rows:
        print("  ".join(f"{k} {v}" for k, v in row.items()))
    if args.json is not None:
        args.json.write_text(json.dumps({
            "rows": rows, "turn_chars": args.turn_chars, "target_tokens": args.target_tokens,
            "git": git_sha(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d")}, indent=2))


if __name__ == "__main__":
    main()
