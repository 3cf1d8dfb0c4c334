"""``kvroute demo``: the README's first command.

Replays a slice of the bundled Mooncake conversation trace (real arrival times and prefix
structure, FAST'25) through a simulated fleet of vLLM-faithful engines, once with kvroute's
policy and once with each baseline, on the same requests, and prints a table. Everything runs
in virtual time on this machine: no GPU, no network.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvroute.bench.sim_bench import SimBenchSpec, run_sim_bench
from kvroute.commands.bench import print_report_table

HELP = "Run kvroute on the embedded default (a simulated fleet) and print what it shows."


def demo(
    requests: Annotated[int, typer.Option(help="Requests of the trace to replay.")] = 600,
    replicas: Annotated[int, typer.Option(help="Simulated engines.")] = 4,
    rate_scale: Annotated[float, typer.Option(help="Arrival-rate multiplier.")] = 1.0,
) -> None:
    """Compare kvroute with round robin and least-loaded on a slice of a real trace."""
    console = Console(stderr=True)
    spec = SimBenchSpec(workload="trace", trace="mooncake_conversation", replicas=replicas,
                        profile="llama-3.1-8b-h100", rate_scales=(rate_scale,),
                        policies=("kvroute", "round_robin", "least_loaded"), limit=requests)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console)
    task: list[Any] = []

    def on_start(policy: str, rate: float, seed: int, total: int) -> None:
        task.append(progress.add_task(f"{policy:>12}", total=total))

    def on_progress(n: int) -> None:
        progress.advance(task[-1], n)

    console.print(f"Replaying the first {requests} requests of the Mooncake conversation trace "
                  f"through {replicas} simulated Llama-3.1-8B/H100 engines (virtual time)...")
    with progress:
        report, _ = run_sim_bench(spec, on_run_start=on_start, on_progress=on_progress)
    print_report_table(Console(width=150), report,
                       f"kvroute vs baselines: {requests} Mooncake requests, {replicas} replicas")
    console.print("Hit rate = prompt tokens the engines served from their own prefix caches. "
                  "Run `kvroute bench sim --help` for every policy and workload.")
