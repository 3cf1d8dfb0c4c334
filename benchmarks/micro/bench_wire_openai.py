"""Micro-benchmark: parse + validate + re-encode of an OpenAI chat body (wire/openai.py).

Measures what the router does to every request body before routing: ``parse_request``
(msgspec decode + field checks) and ``encode_request`` (clamp ``max_tokens`` and inject a
``cache_salt``), for bodies of about 1, 4 and 16 KB. Prints avg/p50/p99/max in µs per request
and writes JSON next to the command's working directory if ``--json`` is given.

    .venv/bin/python benchmarks/micro/bench_wire_openai.py [--iterations N] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time

import msgspec

from kvroute.wire.openai import encode_request, parse_request


def make_body(target_bytes: int) -> bytes:
    """A chat body of roughly ``target_bytes``: system prompt, a few turns, one tool."""
    turn = "The quick brown fox jumps over the lazy dog; " * 4
    messages = [{"role": "system", "content": "You are a helpful assistant. " * 10}]
    body = {
        "model": "qwen-small",
        "messages": messages,
        "max_tokens": 4096,
        "temperature": 0.7,
        "top_p": 0.95,
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {
            "type": "object", "properties": {"q": {"type": "string"}}}}}],
        "user": "alice",
    }  # fmt: skip
    i = 0
    while len(msgspec.json.encode(body)) < target_bytes:
        role = "user" if i % 2 == 0 else "assistant"
        messages.append({"role": role, "content": f"turn {i}: {turn}"})
        i += 1
    return msgspec.json.encode(body)


def run(raw: bytes, iterations: int) -> dict[str, float]:
    for _ in range(200):  # warmup
        encode_request(parse_request(raw, "chat"), max_tokens=512, cache_salt="tenant-a")
    gc.collect()
    samples: list[float] = []
    clock = time.perf_counter_ns
    for _ in range(iterations):
        t0 = clock()
        req = parse_request(raw, "chat")
        encode_request(req, max_tokens=512, cache_salt="tenant-a")
        samples.append((clock() - t0) / 1000.0)
    samples.sort()
    return {
        "body_bytes": len(raw),
        "num_messages": len(msgspec.json.decode(raw)["messages"]),
        "avg_us": statistics.fmean(samples),
        "p50_us": samples[len(samples) // 2],
        "p99_us": samples[int(len(samples) * 0.99) - 1],
        "max_us": samples[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=5000)
    parser.add_argument("--json", default=None, help="write results to this file")
    args = parser.parse_args()
    rows = [run(make_body(size), args.iterations) for size in (1024, 4096, 16384)]
    print(f"{'bytes':>7} {'msgs':>5} {'avg µs':>8} {'p50 µs':>8} {'p99 µs':>8} {'max µs':>8}")
    for r in rows:
        print(f"{r['body_bytes']:>7} {r['num_messages']:>5} {r['avg_us']:>8.1f} {r['p50_us']:>8.1f}"
              f" {r['p99_us']:>8.1f} {r['max_us']:>8.1f}")  # fmt: skip
    if args.json:
        meta = {"python": platform.python_version(), "msgspec": msgspec.__version__,
                "iterations": args.iterations}  # fmt: skip
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "results": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
