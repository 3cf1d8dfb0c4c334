"""Micro-benchmark: the router's per-request metric updates (``shell/metrics.py``).

What every routed request costs in ``RouterMetrics``: ``decision`` (four series),
``tokenize`` and ``warm``, called together as the request path calls them, and each alone;
plus ``upstream_error``, ``retry`` and ``events``, and a ``render`` with nothing pending.
Prints ns per call (best of ``--repeats`` runs of ``--calls`` calls) and writes JSON with
``--json``.

    .venv/bin/python benchmarks/micro/bench_metrics.py [--calls N] [--repeats R] [--json out.json]

For the code before a change, run the same script with ``PYTHONPATH`` set to a worktree's
``src`` (the methods' signatures have not changed).
"""

from __future__ import annotations

import argparse
import json
import platform
import timeit

from kvroute.shell.metrics import RouterMetrics

CASES = {
    "decision+tokenize+warm": "m.decision('p', 'r0', 'cost', 96, 128, 0.00003, False); "
                              "m.tokenize('p', 'ok'); m.warm('skipped', 'below_threshold')",
    "decision": "m.decision('p', 'r0', 'cost', 96, 128, 0.00003, False)",
    "tokenize": "m.tokenize('p', 'ok')",
    "warm": "m.warm('skipped', 'below_threshold')",
    "upstream_error": "m.upstream_error('r0', 'connect')",
    "retry": "m.retry('r0')",
    "events": "m.events('r0', applied=1)",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    metrics = RouterMetrics()
    ns: dict[str, float] = {}
    for name, stmt in CASES.items():
        best = min(timeit.repeat(stmt, globals={"m": metrics}, number=args.calls,
                                 repeat=args.repeats))
        ns[name] = best / args.calls * 1e9
    render = min(timeit.repeat("m.render()", globals={"m": metrics}, number=20,
                               repeat=args.repeats))
    ns["render"] = render / 20 * 1e9
    print(f"RouterMetrics, ns per call (best of {args.repeats} x {args.calls}):")
    for name, value in ns.items():
        print(f"  {name:24s} {value:10.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ns_per_call": ns, "calls": args.calls, "repeats": args.repeats,
                       "python": platform.python_version(), "machine": platform.machine()}, f,
                      indent=2)


if __name__ == "__main__":
    main()
