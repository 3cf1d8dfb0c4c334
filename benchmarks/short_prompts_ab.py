"""Router CPU per short unique chat request, two kvroute trees side by side on the same engines.

Usage::

    git archive <base commit> src | tar -x -C /tmp/before
    PYTHONPATH=src .venv/bin/python benchmarks/short_prompts_ab.py --before /tmp/before/src \
        [--rounds 2] [--requests 1000] [--clients 1,8] [--json OUT]

Two simulated engines (``zero`` profile, the bundled tokenizer) run once; then, ``rounds``
times, a ``kvroute serve`` (local tokenizer) from ``--before`` and one from this tree (whatever
``PYTHONPATH`` names) each get, after their KV-event catch-up and 50 warm-up requests,
``requests`` chat requests per client count: a ~120-character system prompt shared by all and
a user message of ~120 words nobody sent before (~750 tokens of the bundled tokenizer), 8
output tokens, not streamed, from ``clients`` keep-alive connections at once (1: one at a
time, the router idle between requests; 8: the router kept busy). The router's CPU over the
batch (``/proc/<pid>/task/*/schedstat``, every thread) divided by the requests is the figure.
Bounded: ``requests`` per batch, each with a 30 s timeout; loopback only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvroute.bench.live_routers import start_router
from kvroute.bench.overhead import parse_overhead_routers
from kvroute.bench.overhead_long import tree_cpu_ns
from kvroute.bench.settle import settle_kvroute
from kvroute.sim.launcher import ReplicaSpec, start_fleet
from kvroute.tokenize.hf import bundled_tokenizer_dir


def _bodies(n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(3000)]
    system = "You are a helpful assistant. " * 4
    return [json.dumps({"model": "sim-model", "max_tokens": 8, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": f"q{seed}-{i} " + " ".join(rng.choices(words, k=120))},
    ]}).encode() for i in range(n)]


def _send_all(base: str, bodies: list[bytes], clients: int) -> None:
    host, port = base.split("//")[1].split(":")
    errors: list[str] = []

    def worker(part: list[bytes]) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            for body in part:
                conn.request("POST", "/v1/chat/completions", body,
                             {"content-type": "application/json"})
                answer = conn.getresponse()
                answer.read()
                if answer.status != 200:
                    errors.append(f"HTTP {answer.status}")
        finally:
            conn.close()

    threads = [threading.Thread(target=worker, args=(bodies[k::clients],))
               for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the other tree's src directory")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--clients", default="1,8")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    mine = os.environ.get("PYTHONPATH", "")
    client_counts = [int(c) for c in args.clients.split(",")]
    tok = str(bundled_tokenizer_dir())
    specs = [ReplicaSpec(name=f"e{i}", model="sim-model", profile="zero",
                         extra_args=("--tokenizer", tok)) for i in range(2)]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvroute-short-ab-") as tmp, \
            start_fleet(specs, log_dir=Path(tmp) / "engines") as fleet:
        for rnd in range(args.rounds):
            for label, src in (("before", args.before), ("after", mine)):
                os.environ["PYTHONPATH"] = src
                try:
                    spec = parse_overhead_routers("kvroute-local")[-1]
                    with start_router(spec, fleet.replicas, work_dir=Path(tmp),
                                      model="sim-model") as router:
                        settle_kvroute(router.targets[0] + "/metrics", fleet.replicas,
                                       f"{label}-{rnd}", model="sim-model",
                                       request_timeout_s=60)
                        base = router.targets[0]
                        _send_all(base, _bodies(50, 10_000 + rnd), 1)
                        for clients in client_counts:
                            bodies = _bodies(args.requests, rnd * 100 + clients)
                            before = tree_cpu_ns(router.pid)
                            started = time.monotonic()
                            _send_all(base, bodies, clients)
                            wall = time.monotonic() - started
                            cpu = tree_cpu_ns(router.pid) - before
                            rows.append({"tree": label, "round": rnd, "clients": clients,
                                         "cpu_ms_per_request": cpu / 1e6 / len(bodies),
                                         "requests_per_s": len(bodies) / wall,
                                         "loadavg": os.getloadavg()[0]})
                            print(json.dumps(rows[-1]), flush=True)
                finally:
                    os.environ["PYTHONPATH"] = mine
    for label in ("before", "after"):
        for clients in client_counts:
            cpu = [r["cpu_ms_per_request"] for r in rows
                   if r["tree"] == label and r["clients"] == clients]
            print(f"{label:6} clients {clients}: CPU-ms a request {statistics.median(cpu):.3f} "
                  f"(rounds: {', '.join(f'{c:.3f}' for c in cpu)})")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
