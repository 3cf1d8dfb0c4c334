"""``kvroute bench overhead``: what each router adds in front of fast engines (its own module so
the option list of this one command stays apart from the other benchmarks')."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from kvroute.commands.results import exit_on_router_error, write_json_report
from kvroute.commands.tables import rows_table, wide_console

HELP = ("Router overhead side by side: direct, a bare relay, kvroute (engine /tokenize and "
        "local tokenizer) and the peer routers, same engines, fixed rates and a closed loop, "
        "two passes in opposite order.")

_HEADS = ["router", "phase", "req/s", "p50 ms", "p99 ms", "added p50", "added p99",
          "same-window added p50", "same-window added p99", "own p50", "own p99", "router CPU ms/req", "engine CPU ms/req", "errors"]


def bench_overhead(
    routers: Annotated[str, typer.Option(help="Comma-separated: direct, passthrough, kvroute, "
                                         "kvroute-local, kvroute-auto, sglang-router, "
                                         "vllm-router; a kvroute one may name another of "
                                         "its policies: kvroute-auto:round_robin.")] = "direct,passthrough,kvroute,kvroute-local,sglang-router,vllm-router",
    phases: Annotated[str, typer.Option(help="r<rate> fixed-rate whole responses, s<rate> "
                                        "streamed, c<workers> closed loop, u<workers> closed "
                                        "loop of short (~600-token) prompts nobody sent "
                                        "before, g<sessions> growing "
                                        "agentic sessions to 128K tokens at once (streamed, "
                                        "one turn a second each).")] = "r100,r200,r400,s100,c32",
    engines: Annotated[int, typer.Option(help="Simulated engines (zero timing profile).")] = 8,
    phase_seconds: Annotated[float, typer.Option(help="Seconds per phase.")] = 10.0,
    passes: Annotated[int, typer.Option(help="Passes; even ones run the routers in reverse.")] = 2,
    seed: Annotated[int, typer.Option(help="Workload and policy seed.")] = 0,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report here.")] = None,
    log_dir: Annotated[Path | None, typer.Option(help="Keep configs and logs here.")] = None,
    router_cpus: Annotated[str | None, typer.Option(
        help="Run every router on these CPUs (e.g. 1) and the engines and the load generator "
             "on the others, as a router on a host of its own would be. Default: all share "
             "every CPU.")] = None,
    same_window: Annotated[int, typer.Option(
        help="Per K requests to a router in a fixed-rate phase, send one more straight to "
             "the engines in the same stream, and report the router's added latency against "
             "those too (steadier than direct's own phase on a noisy machine). 0: off.")] = 0,
    long_sweep: Annotated[bool, typer.Option(
        help="After the passes, each router once more with one growing session at a time "
             "(several growth sizes), its CPU read per turn from /proc.")] = False,
    long_target_tokens: Annotated[int, typer.Option(
        help="Where the g phases' and the sweep's sessions stop growing.")] = 131_072,
    plot: Annotated[Path | None, typer.Option(
        help="Draw the sweep here (PNG): router CPU per turn against new and against total "
             "tokens. Needs --long-sweep.")] = None,
) -> None:
    """Router overhead side by side (see ``kvroute.bench.overhead``)."""
    from kvroute.bench.overhead import (
        OverheadSpec,
        format_rows,
        parse_cpus,
        parse_overhead_routers,
        parse_phases,
        run_overhead_bench,
    )

    console = Console(stderr=True)

    def on_phase(router: str, pass_no: int, phase: str, row: Any) -> None:
        same = ""
        if "same_window_direct_p99_ms" in row:
            same = (f" (direct in the same window: p50 {row['same_window_direct_p50_ms']} ms, "
                    f"p99 {row['same_window_direct_p99_ms']} ms)")
        if "long_p50_ms" in row:
            same += (f"; turns near the target: p50 {row['long_p50_ms']} ms, "
                     f"p99 {row['long_p99_ms']} ms")
        console.print(f"pass {pass_no} {router:>14} {phase:>5}: {row['achieved_rps']} req/s, "
                      f"p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms{same}, router CPU "
                      f"{row['router_cpu_ms_per_req']} ms/req, errors {row['errors']}")

    with exit_on_router_error(console):
        spec = OverheadSpec(routers=parse_overhead_routers(routers), phases=parse_phases(phases),
                            engines=engines, phase_s=phase_seconds, passes=passes, seed=seed,
                            log_dir=log_dir,
                            router_cpus=parse_cpus(router_cpus) if router_cpus else None,
                            same_window=same_window, long_sweep=long_sweep,
                            long_target_tokens=long_target_tokens, plot=plot)
        report = run_overhead_bench(spec, on_phase=on_phase)
    wide_console(230).print(rows_table(
        f"router overhead: {engines} engines, cells are pass 1 / pass 2 ...",
        [_HEADS, *format_rows(report)], left=("router", "phase")))
    for router, reason in report["skipped"].items():
        console.print(f"[yellow]skipped {router}:[/yellow] {reason}")
    if json_out is not None:
        write_json_report(json_out, report, console)
    sys.stdout.flush()
