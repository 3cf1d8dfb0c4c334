"""Router CPU per turn of growing sessions, two kvroute trees side by side on the same engines.

Usage::

    git archive <base commit> src | tar -x -C /tmp/before
    PYTHONPATH=src .venv/bin/python benchmarks/long_sweep_ab.py --before /tmp/before/src \
        [--rounds 2] [--growth 1000,7800] [--json OUT]

Two simulated engines (``zero`` profile, the bundled tokenizer, a 262,144-token window) run
once; then, ``rounds`` times, a ``kvroute serve`` (local tokenizer) from ``--before`` and one
from this tree (whatever ``PYTHONPATH`` names) each run ``bench/overhead_long.run_long_sweep``
in turn, after their KV-event catch-up: one session per growth size, turn by turn, each
turn's router CPU from ``/proc/<pid>/task/*/schedstat``. The router processes take their
code from ``PYTHONPATH``, which is set for each start; this driver's own code is this
tree's. Prints the median CPU per turn by growth size, for prompts up to 32K tokens and from
96K tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from kvroute.bench.live_routers import start_router
from kvroute.bench.overhead import parse_overhead_routers
from kvroute.bench.overhead_long import LONG_MAX_MODEL_LEN, run_long_sweep
from kvroute.bench.settle import settle_kvroute
from kvroute.sim.launcher import ReplicaSpec, start_fleet
from kvroute.tokenize.hf import bundled_tokenizer_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the other tree's src directory")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--growth", default="1000,7800")
    parser.add_argument("--target-tokens", type=int, default=131_072)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    mine = os.environ.get("PYTHONPATH", "")
    growth = tuple(int(g) for g in args.growth.split(","))
    tok = str(bundled_tokenizer_dir())
    specs = [ReplicaSpec(name=f"e{i}", model="sim-model", profile="zero",
                         max_model_len=LONG_MAX_MODEL_LEN, extra_args=("--tokenizer", tok))
             for i in range(2)]
    out: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvroute-ab-") as tmp, \
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
                        out.setdefault(label, []).extend(run_long_sweep(
                            router.targets[0], router.pid, model="sim-model", seed=rnd,
                            growth_chars=growth, target_tokens=args.target_tokens))
                finally:
                    os.environ["PYTHONPATH"] = mine
    for label, rows in out.items():
        for g in growth:
            for lo, hi in ((0, 32_000), (96_000, 10**9)):
                cpu = [r["router_cpu_ms"] for r in rows if r["growth_chars"] == g
                       and lo <= r["total_tokens"] < hi and r["new_tokens"] < r["total_tokens"]]
                if cpu:
                    print(f"{label:6} growth {g:6} tokens {lo}-{hi}: {len(cpu)} turns, "
                          f"median {statistics.median(cpu):.2f} CPU-ms")
    if args.json is not None:
        args.json.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
