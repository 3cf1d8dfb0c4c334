"""Micro benchmark: how much slower the same work runs after the CPU has idled, in µs.

Usage::

    .venv/bin/python benchmarks/micro/bench_cold.py [--gaps-ms 0,1,2.5,6.7,20] [--calls N]
        [--json OUT]

The work is what the router's local tokenizer does for a new chat turn: parse the request
body (JSON), render its chat template, and tokenize the prompt with the bundled Hugging Face
tokenizer through its piece cache, which holds the shared system prompts (warmed up first)
and never the question: every call takes a request not seen before, so every call encodes
the same kind of new text (~120 tokens) and looks up the same kind of cached prefix (~1,400
tokens). Each call is timed in thread CPU time, after an idle gap of ``G`` ms spent one of
two ways:

* ``sleep``: the thread sleeps, as a live router waits in ``epoll`` between requests (the
  vCPU may halt, and the host may run something else on the core);
* ``spin``: the thread spins on the clock, so the vCPU stays busy with other code.

Why: ``bench_handler.py`` runs requests back to back, with the handler's code and data hot in
the caches, while a router serving 150 or 400 requests/s idles for milliseconds between
them. On the 2-vCPU KVM machines of this project the gap multiplies the cost of the same
work several times over (``docs/benchmarks.md``, "Hot and cold"); this script measures that
property of a machine on its own, so two machines can be compared with it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvroute.bench.live_client import build_live_requests
from kvroute.bench.overhead import _WORKLOAD
from kvroute.bench.workloads import WORKLOADS
from kvroute.tokenize.hf import HFTokenizer, bundled_tokenizer_dir

IDLE_MODES = ("sleep", "spin")


def idle(mode: str, gap_s: float) -> None:
    if not gap_s:
        return
    if mode == "sleep":
        time.sleep(gap_s)
        return
    end = time.perf_counter() + gap_s
    while time.perf_counter() < end:
        pass


def make_work(num_requests: int) -> tuple[Callable[[bytes], int], list[bytes]]:
    """The work, and ``num_requests`` distinct request bodies (32 shared system prompts)."""
    tokenizer = HFTokenizer.from_dir(bundled_tokenizer_dir())
    per_group = -(-num_requests // _WORKLOAD["num_groups"])
    workload = WORKLOADS["generated_shared_prefix"](
        **{**_WORKLOAD, "prompts_per_group": per_group}, seed=0, with_messages=True)
    bodies = [r.body for r in build_live_requests(workload, model="sim-model")]
    if len(set(bodies)) < num_requests:
        raise AssertionError(f"the workload gave {len(set(bodies))} distinct bodies, "
                             f"{num_requests} needed")

    def work(body: bytes) -> int:
        messages = json.loads(body)["messages"]
        text = tokenizer.render_chat(messages)
        return len(tokenizer.encode(text, add_special_tokens=False))

    return work, bodies


def measure(work: Callable[[bytes], int], bodies: Sequence[bytes], *, mode: str,
            gap_ms: float) -> dict[str, float]:
    """One cell: ``work`` on each of ``bodies`` (none seen before), each after the gap."""
    gap_s = gap_ms / 1e3
    samples: list[int] = []
    for body in bodies:
        idle(mode, gap_s)
        t0 = time.thread_time_ns()
        work(body)
        samples.append(time.thread_time_ns() - t0)
    return {"mean_us": statistics.fmean(samples) / 1e3,
            "p50_us": statistics.median(samples) / 1e3}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--gaps-ms", default="0,1,2.5,6.7,20",
                        help="comma-separated idle gaps before each call, in ms")
    parser.add_argument("--calls", type=int, default=400, help="calls per gap and mode")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    try:
        gaps = [float(g) for g in args.gaps_ms.split(",") if g.strip()]
    except ValueError:
        parser.error(f"--gaps-ms {args.gaps_ms!r} must be comma-separated numbers, e.g. 0,1,6.7")
    if not gaps or min(gaps) < 0:
        parser.error(f"--gaps-ms {args.gaps_ms!r} needs at least one gap, each >= 0")
    if args.calls < 1:
        parser.error(f"--calls {args.calls} must be >= 1")
    num_groups = _WORKLOAD["num_groups"]
    cells = len(gaps) * len(IDLE_MODES)
    work, bodies = make_work(num_groups * 2 + cells * args.calls)
    for body in bodies[: num_groups * 2]:
        work(body)  # warm-up: the template compiled, every system prompt in the piece cache
    fresh = iter(range(num_groups * 2, len(bodies), args.calls))
    rows: list[dict[str, Any]] = []
    print(f"a new chat turn: parse, render, tokenize (~1,500 tokens, the new ~120 encoded), "
          f"thread CPU µs per call "
          f"({args.calls} calls per cell)")
    print(f"  {'gap ms':>7} " + " ".join(f"{m + ' mean':>11} {m + ' p50':>10}"
                                         for m in IDLE_MODES))
    for gap in gaps:
        cell: dict[str, dict[str, float]] = {}
        for mode in IDLE_MODES:
            start = next(fresh)
            cell[mode] = measure(work, bodies[start : start + args.calls], mode=mode, gap_ms=gap)
        rows.append({"gap_ms": gap, **cell})
        print(f"  {gap:7.2f} " + " ".join(f"{cell[m]['mean_us']:11.1f} {cell[m]['p50_us']:10.1f}"
                                          for m in IDLE_MODES))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "rows": rows, "calls": args.calls, "python": sys.version.split()[0],
            "machine": platform.machine()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
