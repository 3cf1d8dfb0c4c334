"""Per-stage thread CPU of a live ``kvroute serve`` over the long-session sweep or short
unique prompts (docs/long-contexts.md, "Where a live turn's CPU goes").

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/live/stage_cpu/profile_live.py long \
        --growth 1000 --out stages.txt
    PYTHONPATH=src .venv/bin/python benchmarks/live/stage_cpu/profile_live.py short \
        --requests 1000 --out stages.txt
    PYTHONPATH=src .venv/bin/python benchmarks/live/stage_cpu/profile_live.py unique \
        --requests 3000 --workers 32 --out stages.txt

Two simulated engines (``zero`` profile, bundled tokenizer) and one ``kvroute serve`` (local
tokenizer) with this directory's ``sitecustomize`` first on its ``PYTHONPATH``; after the
KV-event catch-up the router is signalled to start timing, the workload runs (``long``:
``run_long_sweep``, one session per growth size to 131K tokens; ``short``: ~750-token chat
prompts nobody sent before, one connection then eight; ``unique``: the overhead benchmark's
``u`` phase, ~600-token prompts nobody sent before from a closed loop of ``workers``
connections after 300 warm-up ones), and the router writes its totals.
Also prints the router's user and system CPU over the workload (``/proc/<pid>/stat``).
Bounded: the sweep's turns or ``requests`` per batch, 60 s a request; loopback only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import tempfile
import time
from pathlib import Path

from kvroute.bench.live_client import replay
from kvroute.bench.live_routers import start_router
from kvroute.bench.overhead import parse_overhead_routers
from kvroute.bench.overhead_long import LONG_MAX_MODEL_LEN, run_long_sweep
from kvroute.bench.overhead_short import short_unique_requests
from kvroute.bench.settle import settle_kvroute
from kvroute.sim.launcher import ReplicaSpec, start_fleet
from kvroute.tokenize.hf import bundled_tokenizer_dir

HERE = Path(__file__).resolve().parent


def _ticks(pid: int) -> tuple[int, int]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


def _short(base: str, n: int, clients: int, seed: int) -> None:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(3000)]
    bodies = [json.dumps({"model": "sim-model", "max_tokens": 8, "messages": [
        {"role": "system", "content": "You are a helpful assistant. " * 4},
        {"role": "user", "content": f"q{seed}-{i} " + " ".join(rng.choices(words, k=120))},
    ]}).encode() for i in range(n)]
    host, port = base.split("//")[1].split(":")
    conns = [http.client.HTTPConnection(host, int(port), timeout=60) for _ in range(clients)]
    try:
        for i, body in enumerate(bodies):  # round robin, one at a time: bounded and simple
            conn = conns[i % clients]
            conn.request("POST", "/v1/chat/completions", body,
                         {"content-type": "application/json"})
            answer = conn.getresponse()
            answer.read()
            if answer.status != 200:
                raise RuntimeError(f"HTTP {answer.status}")
    finally:
        for conn in conns:
            conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workload", choices=("long", "short", "unique"))
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--growth", default="1000")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    mine = os.environ.get("PYTHONPATH", "")
    tok = str(bundled_tokenizer_dir())
    specs = [ReplicaSpec(name=f"e{i}", model="sim-model", profile="zero",
                         max_model_len=LONG_MAX_MODEL_LEN, extra_args=("--tokenizer", tok))
             for i in range(2)]
    with tempfile.TemporaryDirectory(prefix="kvroute-stages-") as tmp, \
            start_fleet(specs, log_dir=Path(tmp) / "engines") as fleet:
        os.environ["PYTHONPATH"] = f"{HERE}{os.pathsep}{mine}"
        os.environ["KVROUTE_STAGE_CPU"] = str(args.out.resolve())
        try:
            spec = parse_overhead_routers("kvroute-local")[-1]
            router_cm = start_router(spec, fleet.replicas, work_dir=Path(tmp), model="sim-model")
        finally:
            os.environ["PYTHONPATH"] = mine
            del os.environ["KVROUTE_STAGE_CPU"]
        with router_cm as router:
            base = router.targets[0]
            settle_kvroute(base + "/metrics", fleet.replicas, "stages", model="sim-model",
                           request_timeout_s=60)
            os.kill(router.pid, signal.SIGUSR1)
            time.sleep(0.5)
            u0, s0 = _ticks(router.pid)
            if args.workload == "long":
                rows = run_long_sweep(base, router.pid, model="sim-model",
                                      growth_chars=tuple(int(g) for g in args.growth.split(",")))
                count = len(rows)
            elif args.workload == "unique":
                count = 0
                for label, n in (("warm-up", 300), ("measured", args.requests)):
                    run = replay([base], short_unique_requests(n, model="sim-model",
                                                               label=label),
                                 concurrency=args.workers, request_timeout_s=60,
                                 duration_s=600)
                    failed = [r.error for r in run.results if r.error is not None]
                    if failed:
                        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0]}")
                    count += n
            else:
                _short(base, 50, 1, seed=10_000)
                for clients in (1, 8):
                    _short(base, args.requests, clients, seed=clients)
                count = 2 * args.requests + 50
            u1, s1 = _ticks(router.pid)
            os.kill(router.pid, signal.SIGUSR2)
            time.sleep(1.0)
    tick_ms = 1000 / os.sysconf("SC_CLK_TCK")
    print(f"{count} requests; router user {(u1 - u0) * tick_ms / count:.2f} + system "
          f"{(s1 - s0) * tick_ms / count:.2f} CPU-ms a request; stages in {args.out}")


if __name__ == "__main__":
    main()
