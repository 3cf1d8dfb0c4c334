"""``kvroute bench``: benchmarks that compare routing policies on the same requests."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvroute.bench.sim_bench import SimBenchSpec, format_table, run_sim_bench, write_plots
from kvroute.core.errors import RouterError

bench_app = typer.Typer(help="Benchmarks: every policy side by side on the same requests.",
                        no_args_is_help=True)


def _floats(text: str, what: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise typer.BadParameter(f"{what} must be comma-separated numbers, got {text!r}") from exc


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise typer.BadParameter(f"{what} must be comma-separated integers, got {text!r}") from exc


def print_report_table(console: Console, report: dict[str, Any], title: str) -> None:
    rows = format_table(report)
    table = Table(title=title)
    for head in rows[0]:
        table.add_column(head, justify="right" if head != "policy" else "left")
    for row in rows[1:]:
        table.add_row(*row)
    console.print(table)


@bench_app.command("sim")
def bench_sim(
    trace: Annotated[str, typer.Option(help="Trace name (mooncake_conversation, "
                                       "mooncake_synthetic) or a JSONL path.")] = "mooncake_conversation",
    workload: Annotated[str, typer.Option(help="'trace', or a generated workload: "
                                          "generated_shared_prefix, unique_prompts, "
                                          "hot_prefix_bursts, sibling_fanout, growing_sessions.")] = "trace",
    block_tokens: Annotated[int, typer.Option(help="Tokens per trace hash id.")] = 512,
    replicas: Annotated[int, typer.Option(help="Engines in the simulated fleet.")] = 8,
    profile: Annotated[str, typer.Option(help="Timing profile of every engine.")] = "llama-3.1-8b-h100",
    rate_scale: Annotated[str, typer.Option(help="Arrival-rate multiplier(s), comma-separated.")] = "1",
    policies: Annotated[str, typer.Option(help="Comma-separated policies.")] = "kvroute,dynamo,cache_aware,least_loaded,round_robin",
    seed: Annotated[str, typer.Option(help="Seed(s), comma-separated.")] = "0",
    limit: Annotated[Optional[int], typer.Option(help="Only the first N requests.")] = None,
    ttft_slo: Annotated[float, typer.Option(help="TTFT objective (s) for goodput.")] = 2.0,
    param: Annotated[Optional[list[str]], typer.Option(help="Workload parameter KEY=VALUE (repeatable).")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the report here.")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="Write PNG plots into this directory.")] = None,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Replay a workload through a simulated fleet once per policy, in virtual time."""
    params: dict[str, Any] = {}
    for item in param or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"--param takes KEY=VALUE, got {item!r}")
        params[key] = json.loads(value) if value[:1] in "0123456789-[{tf" else value
    spec = SimBenchSpec(
        workload=workload, trace=trace, block_tokens=block_tokens, replicas=replicas,
        profile=profile, rate_scales=_floats(rate_scale, "--rate-scale"),
        policies=tuple(p.strip() for p in policies.split(",") if p.strip()),
        seeds=_ints(seed, "--seed"), limit=limit, ttft_slo_s=ttft_slo, workload_params=params,
    )
    console = Console(stderr=True)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, disable=quiet)
    task: list[Any] = []

    def on_start(policy: str, rate: float, run_seed: int, total: int) -> None:
        if task:
            progress.remove_task(task.pop())
        task.append(progress.add_task(f"{policy} x{rate:g} seed {run_seed}", total=total))

    def on_progress(n: int) -> None:
        if task:
            progress.advance(task[0], n)

    try:
        with progress:
            report, results = run_sim_bench(spec, on_run_start=on_start, on_progress=on_progress)
    except RouterError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    out = Console(width=max(Console().width, 150))
    print_report_table(out, report, f"{workload if workload != 'trace' else trace}: "
                       f"{replicas} replicas, {profile}, rate x{spec.rate_scales[0]:g}")
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"wrote {json_out}")
    if plot is not None:
        for path in write_plots(report, results, plot):
            console.print(f"wrote {path}")
    sys.stdout.flush()
