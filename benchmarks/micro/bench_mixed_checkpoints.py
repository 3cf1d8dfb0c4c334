"""Micro benchmark: a growing session's encode among short unique prompts, the tokenizer's
checkpoints kept or pushed out (docs/long-contexts.md, "Checkpoints under mixed traffic").

Usage::

    .venv/bin/python benchmarks/micro/bench_mixed_checkpoints.py [--turn-chars C]
        [--target-tokens N] [--shorts-between K] [--last L] [--json OUT]

One session of ``bench/overhead_long.py`` (a tool result of ``C`` characters a turn, to ``N``
real tokens of the bundled tokenizer) is rendered and encoded turn by turn through
``HFTokenizer.encode`` (the piece cache and its checkpoints, as the router runs it), with
``K`` short chat prompts nobody sent before (a shared system prompt and ~120 random words,
~750 tokens) encoded between two turns, as a router serving both kinds of traffic sees them.
Prints the checkpoint hits and the median thread CPU of the last ``L`` long turns' encode.
Every id is checked against the whole encoding on the last long turn.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from kvroute.bench.overhead_long import LONG_TARGET_TOKENS, long_session_requests
from kvroute.bench.provenance import git_sha
from kvroute.tokenize.hf import HFTokenizer, bundled_tokenizer_dir


def _short_prompts(tok: HFTokenizer, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(3000)]
    system = "You are a helpful assistant. " * 4
    return [tok.render_chat([{"role": "system", "content": system},
                             {"role": "user", "content": f"q{i} " + " ".join(
                                 rng.choices(words, k=120))}]) for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turn-chars", type=int, default=1000)
    parser.add_argument("--target-tokens", type=int, default=LONG_TARGET_TOKENS)
    parser.add_argument("--shorts-between", type=int, default=100)
    parser.add_argument("--last", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    tok = HFTokenizer.from_dir(bundled_tokenizer_dir())
    turns = long_session_requests(1, model="m", turn_chars=args.turn_chars,
                                  target_tokens=args.target_tokens)
    longs = [tok.render_chat(json.loads(t.body)["messages"]) for t in turns]
    shorts = _short_prompts(tok, args.shorts_between * len(longs), seed=3)
    k = args.shorts_between
    cost_ms: list[float] = []
    ids = None
    for i, text in enumerate(longs):
        for short in shorts[i * k : (i + 1) * k]:
            tok.encode(short, add_special_tokens=False)
        t0 = time.thread_time_ns()
        ids = tok.encode(text, add_special_tokens=False)
        cost_ms.append((time.thread_time_ns() - t0) / 1e6)
    if ids is None or list(ids) != tok.encode_plain_unlocked(longs[-1]):
        raise AssertionError("the last long turn's ids differ from its whole encoding")
    tail = cost_ms[-args.last :]
    result = {"long_turns": len(longs), "shorts_between": k,
              "checkpoint_hits": tok.pieces.checkpoint_hits,
              "last_turns_encode_ms_median": round(statistics.median(tail), 3),
              "turn_chars": args.turn_chars, "target_tokens": args.target_tokens,
              "git": git_sha(), "python": platform.python_version(),
              "date": time.strftime("%Y-%m-%d")}
    print("  ".join(f"{key} {value}" for key, value in result.items()))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
