"""Router CPU per turn of growing sessions against new and total tokens: one kvroute's sweep,
its plot and a least-squares fit (docs/benchmarks.md, "Long contexts: router CPU per turn").

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/long_sweep_fit.py \
        --plot docs/img/long-sessions-kvroute-cpu.png [--json OUT]

Two simulated engines (``zero`` profile, the bundled tokenizer, a 262,144-token window) and
one ``kvroute serve`` (local tokenizer, this tree) past its KV-event catch-up run
``bench/overhead_long.run_long_sweep`` at its default growth sizes (one session each, turn by
turn to 131,072 real tokens, each turn's router CPU from ``/proc``); ``plot_long_sweep``
draws CPU against new and against total tokens, and the turns past each session's first are
fitted as ``a + b * new + c * total`` (thousands of tokens). Prints the fit and the median
and p90 CPU by growth size for prompts up to 32K tokens and from 96K.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from kvroute.bench.live_routers import start_router
from kvroute.bench.overhead import parse_overhead_routers
from kvroute.bench.overhead_long import LONG_MAX_MODEL_LEN, plot_long_sweep, run_long_sweep
from kvroute.bench.settle import settle_kvroute
from kvroute.sim.launcher import ReplicaSpec, start_fleet
from kvroute.tokenize.hf import bundled_tokenizer_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plot", type=Path, required=True)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    tok = str(bundled_tokenizer_dir())
    specs = [ReplicaSpec(name=f"e{i}", model="sim-model", profile="zero",
                         max_model_len=LONG_MAX_MODEL_LEN, extra_args=("--tokenizer", tok))
             for i in range(2)]
    with tempfile.TemporaryDirectory(prefix="kvroute-fit-") as tmp, \
            start_fleet(specs, log_dir=Path(tmp) / "engines") as fleet, \
            start_router(parse_overhead_routers("kvroute-local")[-1], fleet.replicas,
                         work_dir=Path(tmp), model="sim-model") as router:
        settle_kvroute(router.targets[0] + "/metrics", fleet.replicas, "fit",
                       model="sim-model", request_timeout_s=60)
        rows = run_long_sweep(router.targets[0], router.pid, model="sim-model", seed=0)
    if args.json is not None:
        args.json.write_text(json.dumps(rows))
    plot_long_sweep({"kvroute-local": rows}, args.plot,
                    title="kvroute: router CPU per turn of growing sessions")
    pts = [r for r in rows if r["new_tokens"] < r["total_tokens"]
           and r["router_cpu_ms"] is not None]
    design = np.array([[1.0, r["new_tokens"] / 1000, r["total_tokens"] / 1000] for r in pts])
    cpu = np.array([r["router_cpu_ms"] for r in pts])
    (a, b, c), *_ = np.linalg.lstsq(design, cpu, rcond=None)
    print(f"fit over {len(pts)} turns: CPU ms = {a:.2f} + {b:.3f} x new/1K + {c:.4f} x total/1K")
    for growth in sorted({r["growth_chars"] for r in pts}):
        for lo, hi in ((0, 32_000), (96_000, 10**9)):
            sel = [r for r in pts if r["growth_chars"] == growth and lo <= r["total_tokens"] < hi]
            if sel:
                ms = sorted(r["router_cpu_ms"] for r in sel)
                new = statistics.median(r["new_tokens"] for r in sel)
                print(f"growth {growth:6} tokens {lo}-{hi}: {len(sel)} turns, ~{new:.0f} new, "
                      f"median {statistics.median(ms):.2f} p90 {ms[int(0.9 * (len(ms) - 1))]:.2f}")


if __name__ == "__main__":
    main()
