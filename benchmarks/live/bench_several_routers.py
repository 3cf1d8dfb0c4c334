"""One ``kvroute serve`` against three behind a round-robin front, same session workload.

    PYTHONPATH=src .venv/bin/python benchmarks/live/bench_several_routers.py --rounds 2

Starts three simulated engines, then per round: one router (Redis session state), three
routers sharing placements over NATS, and three routers without the bus (the control),
each on the same workload (``kvroute.bench.several_routers.Workload``) with its own Redis
namespace; prints one JSON line per run. ``--kill`` also runs three routers with one
SIGKILLed after a third of the requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import tempfile
from pathlib import Path

from kvroute.bench.several_routers import (
    Workload,
    kill_router,
    run_workload,
    start_routers,
)
from kvroute.sim.launcher import ReplicaSpec, start_fleet

TIMING = "0.001,0.0001,0.0002,0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--kill", action="store_true")
    parser.add_argument("--only", default="", help="run only the runs whose name contains this")
    parser.add_argument("--burst-gap-ms", type=float, default=200.0,
                        help="between siblings without the bus (the control); with the bus "
                        "they are paced on the routers' cluster stats")
    parser.add_argument("--burst-words", type=int, default=5000)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--nats", default="nats://127.0.0.1:4222")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvroute-routers-"))
    specs = [ReplicaSpec(name=f"e{i}", pool="sim", model="sim-model", replay=True,
                         extra_args=("--timing", TIMING)) for i in range(args.engines)]
    with start_fleet(specs, timeout_s=30.0, log_dir=work / "engines") as fleet:
        runs = [("1 router", 1, False, False), ("3 routers, NATS", 3, True, False),
                ("3 routers, no bus", 3, False, False)]
        if args.kill:
            runs.append(("3 routers, NATS, one killed", 3, True, True))
        for rnd in range(args.rounds):
            for name, n, bus, kill in runs:
                if args.only not in name:
                    continue
                ns = f"bench-{secrets.token_hex(4)}"
                routers = start_routers(n, fleet.replicas, work_dir=work / ns,
                                        redis_url=args.redis,
                                        nats_url=args.nats if bus else None, namespace=ns)
                try:
                    workload = Workload(sessions=args.sessions, turns=args.turns, seed=rnd,
                                        burst_gap_s=args.burst_gap_ms / 1000,
                                        burst_words=args.burst_words)
                    total = workload.num_requests
                    result = asyncio.run(run_workload(
                        [r.targets[0] for r in routers], fleet.replicas, workload,
                        kill_after=total // 3 if kill else None,
                        kill=(lambda victim=routers[1]: kill_router(victim)) if kill else None))
                finally:
                    for router in routers:
                        router.stop()
                print(json.dumps({"run": name, "round": rnd, **result.summary()}), flush=True)


if __name__ == "__main__":
    main()
