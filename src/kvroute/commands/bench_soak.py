"""``kvroute bench soak``: the router over a long steady run, watched window by window (its
own module so this command's options stay apart from the other benchmarks')."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from kvroute.commands.results import exit_on_router_error, write_json_report
from kvroute.commands.tables import rows_table, wide_console

HELP = ("A long steady run of kvroute in front of simulated engines, with sessions, shared "
        "and unique prompts: the router's memory, CPU, index and latency, window by window, "
        "and a verdict (worst window p99 over the median window's, RSS slope).")

_HEADS = ["t s", "finished", "req/s", "p50 ms", "p99 ms", "max ms", "own p99 ms", "errors",
          "RSS MB", "CPU ms/decision", "router cores", "router run-queue ms", "load 1 min",
          "client lag max ms", "engines' cores", "index entries", "piece-cache tokens",
          "GC ms", "full GC ms", "GCs > 50 ms", "KV gaps", "KV resets",
          "p99 from intended send ms", "client stall max ms", "client GC max ms",
          "client run-queue ms", "engines' run-queue ms", "engine step late max <= ms",
          "engine steps > 50 ms late", "engines' GC ms", "router loop late max <= ms",
          "steal ms by CPU", "iowait ms by CPU"]
_KEYS = ["t_s", "finished", "rps", "p50_ms", "p99_ms", "max_ms", "own_p99_ms", "errors",
         "rss_mb", "cpu_ms_per_decision", "router_cores", "router_runq_ms", "load_1m",
         "start_lag_max_ms", "engines_cores", "index_entries", "piece_cache_tokens",
         "gc_ms", "gc_full_ms", "gc_over_50ms", "kv_gaps", "kv_resets", "p99_intended_ms",
         "client_stall_max_ms", "client_gc_max_ms", "client_runq_ms", "engines_runq_ms",
         "engine_late_max_le_ms", "engine_steps_late_over_50ms", "engine_gc_ms",
         "router_loop_late_max_le_ms", "steal_ms", "iowait_ms"]


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):  # per CPU: "cpu0/cpu1/..."
        return "/".join(f"{value[k]:g}" for k in sorted(value, key=int))
    return str(value)


def bench_soak(
    minutes: Annotated[float, typer.Option(help="Length of the run.")] = 5.0,
    rate: Annotated[float, typer.Option(help="Requests a second (open loop).")] = 200.0,
    engines: Annotated[int, typer.Option(help="Simulated engines (zero timing profile).")] = 4,
    sample_seconds: Annotated[float, typer.Option(help="Seconds per window.")] = 10.0,
    max_pins: Annotated[int, typer.Option(
        help="The router's state.max_pins: low, so the session maps reach their bound "
             "within the run.")] = 2000,
    num_gpu_blocks: Annotated[int, typer.Option(
        help="KV blocks per engine: small, so the engines evict (and the index with them) "
             "within the run.")] = 4096,
    seed: Annotated[int, typer.Option(help="Workload and policy seed.")] = 0,
    policy: Annotated[str, typer.Option(help="The router's policy (kvroute, round_robin, ...).")] = "kvroute",
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report here.")] = None,
    log_dir: Annotated[Path | None, typer.Option(help="Keep configs and logs here.")] = None,
    check: Annotated[bool, typer.Option(
        help="Exit 1 when the verdict fails (a window's p99 over 3x the median window's, or "
             "RSS still growing over the second half).")] = False,
    long_sessions: Annotated[int, typer.Option(
        help="Growing agentic sessions (to 128K tokens) at once beside the mix; needs "
             "--num-gpu-blocks above 16384.")] = 0,
    long_rate: Annotated[float, typer.Option(
        help="Turns a second of the long sessions, together.")] = 1.0,
    router_cpus: Annotated[str | None, typer.Option(
        help="Run the router on these CPUs (e.g. 1) and the engines and the load generator "
             "on the others, as a router deployed on a core of its own would be; the report "
             "records the CPUs each side had. Default: all share every CPU.")] = None,
    engine_nice: Annotated[int, typer.Option(
        help="Nice value of the simulated engines (0..19): above 0 the load generator is "
             "served first when both want the same core.")] = 0,
    client_gc: Annotated[str, typer.Option(
        help="The load generator's collector during the run: freeze (its stream out of the "
             "collector's walks), python (as it is) or off.")] = "freeze",
    client_loop: Annotated[str, typer.Option(
        help="The load generator's event loop: asyncio or uvloop.")] = "asyncio",
) -> None:
    """A long steady run (see ``kvroute.bench.soak``)."""
    from kvroute.bench.procfs import parse_cpus
    from kvroute.bench.soak import SoakSpec, run_soak, verdict_line

    console = Console(stderr=True)

    def on_sample(row: Any) -> None:
        console.print(f"t={row['t_s']:>7.2f} s  RSS {row['rss_mb']} MB  index "
                      f"{row.get('index_entries')}  decisions {row.get('decisions')}")

    with exit_on_router_error(console):
        spec = SoakSpec(seconds=minutes * 60.0, rate=rate, engines=engines,
                        sample_s=sample_seconds, max_pins=max_pins,
                        num_gpu_blocks=num_gpu_blocks, seed=seed, log_dir=log_dir,
                        policy=policy, long_sessions=long_sessions, long_rate=long_rate,
                        router_cpus=parse_cpus(router_cpus) if router_cpus else None,
                        engine_nice=engine_nice, client_gc=client_gc, client_loop=client_loop)
        report = run_soak(spec, on_sample=on_sample)
    rows = [[_cell(w.get(k)) for k in _KEYS] for w in report["windows"]]
    wide_console(200).print(rows_table(
        f"soak: {rate:g} req/s for {minutes:g} min, {engines} engines, policy {policy}", [_HEADS, *rows]))
    console.print(json.dumps(report["summary"]))
    cpus = report["config"]["cpus"]
    console.print(f"CPUs: router {cpus['router_cpus']}, engines {cpus['engine_cpus']}, load "
                  f"generator {cpus['apparatus_cpus']}" + ("" if cpus["pinned"] else " (shared)"),
                  markup=False, highlight=False)
    console.print(verdict_line(report["verdict"]), markup=False, highlight=False)
    if json_out is not None:
        write_json_report(json_out, report, console)
    sys.stdout.flush()
    if check and not report["verdict"]["ok"]:
        raise typer.Exit(1)
