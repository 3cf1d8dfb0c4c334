"""``kvroute bench``: benchmarks that compare routing policies on the same requests."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvroute.bench.policy_params import parse_policy_params
from kvroute.bench.sim_bench import (
    SimBenchSpec,
    format_table,
    run_sim_bench,
    table_title,
    write_plots,
)
from kvroute.commands.results import exit_on_router_error, write_json_report
from kvroute.commands.tables import rows_table, wide_console

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


def print_report_table(console: Console, report: dict[str, Any], title: str, *,
                       compact: bool = False) -> None:
    console.print(rows_table(title, format_table(report, compact=compact), left=("policy",)))


def _print_targets(console: Console, report: dict[str, Any]) -> None:
    """One line per goal of a tiers report: met or not, and the figures it was judged on."""
    for name, goal in report["targets"].items():
        console.print(f"target {name}: met={goal['met']} "
                      + ", ".join(f"{k}={v}" for k, v in goal.items() if k != "met"))


@bench_app.command("sim")
def bench_sim(
    trace: Annotated[str, typer.Option(help="Trace name (mooncake_conversation, "
                                       "mooncake_synthetic, claude_code_agentic_64) or a "
                                       ".jsonl / .jsonl.xz path.")] = "mooncake_conversation",
    workload: Annotated[str, typer.Option(help="'trace', or a generated workload: "
                                          "generated_shared_prefix, unique_prompts, "
                                          "hot_prefix_bursts, sibling_fanout, growing_sessions.")] = "trace",
    block_tokens: Annotated[int | None, typer.Option(help="Tokens per trace hash id (default: "
                                                     "the trace's own: 64 for "
                                                     "claude_code_agentic_64, else 512).")] = None,
    replicas: Annotated[int, typer.Option(help="Engines in the simulated fleet.")] = 8,
    profile: Annotated[str, typer.Option(help="Timing profile of every engine.")] = "llama-3.1-8b-h100",
    rate_scale: Annotated[str, typer.Option(help="Arrival-rate multiplier(s), comma-separated.")] = "1",
    policies: Annotated[str, typer.Option(help="Comma-separated policies.")] = "kvroute,dynamo,cache_aware,least_loaded,round_robin",
    seed: Annotated[str, typer.Option(help="Seed(s), comma-separated.")] = "0",
    limit: Annotated[int | None, typer.Option(help="Only the first N requests.")] = None,
    ttft_slo: Annotated[float, typer.Option(help="TTFT objective (s) for goodput and SLO "
                                            "goodput.")] = 2.0,
    itl_slo: Annotated[float, typer.Option(help="Objective (s) for each request's mean "
                                           "inter-token latency, for SLO goodput.")] = 0.030,
    policy_param: Annotated[list[str] | None, typer.Option(
        help="Policy parameter KEY=VALUE for every policy run, or POLICY.KEY=VALUE for one "
             "(repeatable), e.g. kvroute.work_weight=0.3.")] = None,
    trace_sessions: Annotated[bool, typer.Option(
        help="Mark requests with the sessions a bundled trace's hash ids carry "
             "(claude_code_agentic_64 only).")] = True,
    param: Annotated[list[str] | None, typer.Option(help="Workload parameter KEY=VALUE (repeatable).")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report here.")] = None,
    plot: Annotated[Path | None, typer.Option(help="Write PNG plots into this directory.")] = None,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
    jitter: Annotated[float, typer.Option(help="Trace replays: add seeded uniform jitter in "
                                          "[0, JITTER) seconds to each arrival.")] = 0.0,
    bounds: Annotated[bool, typer.Option(help="Instead of running policies, print what no router "
                                         "can beat on this workload: oracle token hit rates and "
                                         "the zero-queue TTFT and E2E floors.")] = False,
    kv_plan: Annotated[str | None, typer.Option(help="KV capacity from `kvroute plan`: "
                                                "MODEL@GPU[,tp=N][,util=F][,reserve=GIB], e.g. "
                                                "llama-3.1-8b@h100-80gb,reserve=4 (blocks at the "
                                                "profile's block size; the tiers' bytes too).")] = None,
    cpu_tier: Annotated[float, typer.Option(help="Every engine's CPU tier, as a multiple of its "
                                            "GPU KV blocks (vLLM native offloading; 0: none).")] = 0.0,
    cpu_gbps: Annotated[float, typer.Option(help="CPU tier load bandwidth, GB/s.")] = 25.0,
    shared_store: Annotated[float, typer.Option(help="A store shared by the fleet, as a multiple "
                                                "of the fleet's GPU KV (LMCache-like; 0: none).")] = 0.0,
    shared_gbps: Annotated[float, typer.Option(help="Shared store load bandwidth, GB/s.")] = 10.0,
    data_parallel_size: Annotated[int, typer.Option(help="Engine ranks per replica (vLLM "
                                                    "--data-parallel-size): the fleet has "
                                                    "--replicas x this many engines.")] = 1,
    dp_routing: Annotated[str, typer.Option(help="Who picks the rank, comma-separated: "
                                            "'aware' (the router, X-data-parallel-rank), "
                                            "'blind' (the engine's load balancer; rows "
                                            "labelled POLICY/rank-blind).")] = "aware",
    pd: Annotated[str, typer.Option(help="Disaggregated prefill/decode layout: counts of P "
                                    "(prefill), D (decode), B (both), e.g. 2P6D or 8B; empty: "
                                    "colocated.")] = "",
    split: Annotated[str, typer.Option(help="With --pd: split each request by the cost "
                                       "model (auto), always, or never.")] = "auto",
    link_gbps: Annotated[float, typer.Option(help="With --pd: the P->D KV link, GB/s.")] = 12.5,
    routers: Annotated[int, typer.Option(help="Routers in front of the fleet; above 1, each "
                                         "policy runs as one router, as this many sharing "
                                         "placements on a bus, and as this many without "
                                         "(sim.routers).")] = 1,
    bus_delay_ms: Annotated[float, typer.Option(help="With --routers: a batch's delay from "
                                                "one router to the others, ms.")] = 1.0,
    bus_batch_ms: Annotated[float, typer.Option(help="With --routers: how long a router "
                                                "gathers announcements before sending them "
                                                "as one batch, ms (0: at once).")] = 0.0,
    front: Annotated[str, typer.Option(help="With --routers: 'round_robin' over requests, or "
                                       "'session' (a session's turns reach one router).")] = "round_robin",
) -> None:
    """Replay a workload through a simulated fleet once per policy, in virtual time."""
    params: dict[str, Any] = {}
    for item in param or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"--param takes KEY=VALUE, got {item!r}")
        params[key] = json.loads(value) if value[:1] in "0123456789-[{tf" else value
    console = Console(stderr=True)
    chosen = tuple(p.strip() for p in policies.split(",") if p.strip())
    with exit_on_router_error(console):
        kv = _kv_from_plan(kv_plan, profile)
        spec = SimBenchSpec(
            workload=workload, trace=trace, block_tokens=block_tokens, replicas=replicas,
            profile=profile, rate_scales=_floats(rate_scale, "--rate-scale"), policies=chosen,
            seeds=_ints(seed, "--seed"), limit=limit, ttft_slo_s=ttft_slo, itl_slo_s=itl_slo,
            policy_params=parse_policy_params(policy_param or [], chosen),
            trace_sessions=trace_sessions, workload_params=params, jitter_s=jitter,
            cpu_tier=cpu_tier, cpu_gbps=cpu_gbps, shared_store=shared_store,
            shared_gbps=shared_gbps, data_parallel_size=data_parallel_size,
            dp_routing=tuple(m.strip() for m in dp_routing.split(",") if m.strip()),
            pd=pd, split=split, link_gbps=link_gbps, routers=routers,
            bus_delay_s=bus_delay_ms / 1e3, bus_batch_s=bus_batch_ms / 1e3, front=front, **kv,
        )
        spec.validate()
    if bounds:
        _print_bounds(spec, console, json_out)
        return
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

    with exit_on_router_error(console), progress:
        report, results = run_sim_bench(spec, on_run_start=on_start, on_progress=on_progress)
    out = wide_console(200)
    print_report_table(out, report, table_title(report))
    if json_out is not None:
        write_json_report(json_out, report, console)
    if plot is not None:
        for path in write_plots(report, results, plot):
            console.print(f"wrote {path}")
    sys.stdout.flush()


def _kv_from_plan(kv_plan: str | None, profile: str) -> dict[str, Any]:
    """``SimBenchSpec`` KV fields from ``--kv-plan``: the plan's blocks at the profile's
    block size, and the bytes per token one rank loads (each GPU loads its share over its
    own link)."""
    if kv_plan is None:
        return {}
    from kvroute.commands.plan import replica_from_spec
    from kvroute.sim.profiles import get_profile

    plan = replica_from_spec(kv_plan, block_size=get_profile(profile).block_size)
    return {"num_gpu_blocks": plan.num_gpu_blocks,
            "kv_bytes_per_token": plan.bytes_per_token // plan.tp}


def _print_bounds(spec: SimBenchSpec, console: Console, json_out: Path | None) -> None:
    """``kvroute bench sim --bounds``: the bounds table per seed (and JSON if asked)."""
    from kvroute.bench.bounds import format_bounds_table, format_itl_table
    from kvroute.bench.sim_bench import run_bounds

    with exit_on_router_error(console):
        reports = run_bounds(spec)
    out = wide_console(200)
    name = spec.trace if spec.workload == "trace" else spec.workload
    for run_seed, report in reports.items():
        out.print(rows_table(f"{name}: what no router can beat, {report.requests} requests, "
                             f"{spec.replicas} x {spec.profile}, seed {run_seed}",
                             format_bounds_table(report), left=("bound", "kind", "how")))
        if report.itl_rows:
            out.print(rows_table(f"{name}: inter-token latency no router can beat, seed "
                                 f"{run_seed}", format_itl_table(report),
                                 left=("inter-token", "kind", "how")))
    if json_out is not None:
        payload = {"bounds": {str(k): v.as_dict() for k, v in reports.items()},
                   "config": {"workload": spec.workload, "trace": spec.trace,
                              "replicas": spec.replicas, "profile": spec.profile,
                              "limit": spec.limit, "jitter_s": spec.jitter_s,
                              "seeds": list(reports)}}
        write_json_report(json_out, payload, console)
    sys.stdout.flush()


def _workload_params(items: list[str] | None) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"--param takes KEY=VALUE, got {item!r}")
        try:
            params[key] = json.loads(value)
        except ValueError:
            params[key] = value
    return params


@bench_app.command("live")
def bench_live(
    routers: Annotated[str, typer.Option(help="Comma-separated: direct, kvroute, sglang-router, "
                                         "vllm-router (peers take :POLICY, default cache_aware).")] = "direct,kvroute,sglang-router,vllm-router",
    kvroute_policies: Annotated[str, typer.Option(help="Policies 'kvroute' expands to, comma-separated.")] = "kvroute,round_robin",
    workload: Annotated[str, typer.Option(help="generated_shared_prefix, unique_prompts, hot_prefix_bursts, "
                                          "sibling_fanout, growing_sessions, mooncake.")] = "hot_prefix_bursts",
    param: Annotated[list[str] | None, typer.Option(help="Workload parameter KEY=VALUE (repeatable).")] = None,
    engines: Annotated[int, typer.Option(help="Simulated engines (kvroute sim serve processes).")] = 4,
    profile: Annotated[str, typer.Option(help="Engine timing profile ('zero' isolates router overhead).")] = "zero",
    num_gpu_blocks: Annotated[int | None, typer.Option(help="KV blocks per engine (default: the profile's).")] = None,
    seed: Annotated[int, typer.Option(help="Workload and policy seed.")] = 0,
    limit: Annotated[int | None, typer.Option(help="Only the first N requests.")] = 400,
    rate_scale: Annotated[float, typer.Option(help="Open-loop arrival-rate multiplier.")] = 1.0,
    concurrency: Annotated[int | None, typer.Option(help="Closed loop with N workers instead of the arrivals.")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="Cap on each request's output tokens.")] = None,
    max_in_flight: Annotated[int, typer.Option(help="Open-loop cap on concurrent requests.")] = 512,
    request_timeout: Annotated[float, typer.Option(help="Seconds one request may take.")] = 60.0,
    duration: Annotated[float, typer.Option(help="Seconds one router's run may take.")] = 300.0,
    fidelity: Annotated[bool, typer.Option(help="Run the peer-fidelity scenarios (48 concurrent, shared "
                                           "vs distinct prefixes) instead of the workload.")] = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report here.")] = None,
    log_dir: Annotated[Path | None, typer.Option(help="Keep configs and router/engine logs here.")] = None,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Real routers on loopback in front of simulated engines, one at a time, same requests."""
    from kvroute.bench.live import LiveBenchSpec, run_fidelity, run_live_bench
    from kvroute.bench.live import format_table as live_table
    from kvroute.bench.live_routers import parse_router_specs

    console = Console(stderr=True)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, disable=quiet)
    task: list[Any] = []

    def on_start(name: str, total: int) -> None:
        if task:
            progress.remove_task(task.pop())
        task.append(progress.add_task(name, total=total))

    def on_progress(n: int) -> None:
        if task:
            progress.advance(task[0], n)

    out = wide_console()
    with exit_on_router_error(console):
        specs = parse_router_specs(routers, kvroute_policies)
        with progress:
            if fidelity:
                result = run_fidelity(routers=specs, engines=engines, log_dir=log_dir,
                                      on_router_start=on_start)
            else:
                spec = LiveBenchSpec(
                    routers=tuple(specs), workload=workload, workload_params=_workload_params(param),
                    engines=engines, profile=profile, num_gpu_blocks=num_gpu_blocks, seed=seed,
                    limit=limit, rate_scale=rate_scale, concurrency=concurrency,
                    max_tokens=max_tokens, max_in_flight=max_in_flight,
                    request_timeout_s=request_timeout, duration_s=duration, log_dir=log_dir)
                result = run_live_bench(spec, on_router_start=on_start, on_progress=on_progress)
    reports = result["reports"] if fidelity else {workload: result}
    for name, report in reports.items():
        out.print(rows_table(f"{name}: {engines} engines", live_table(report),
                             left=("router",)))
        for router, reason in report["skipped"].items():
            console.print(f"[yellow]skipped {router}:[/yellow] {reason}")
    if json_out is not None:
        write_json_report(json_out, result, console)
    sys.stdout.flush()


@bench_app.command("tiers")
def bench_tiers(
    sessions: Annotated[int, typer.Option(help="Growing sessions (each crosses the small window).")] = 16,
    small_window: Annotated[int, typer.Option(help="Small pool's max_model_len.")] = 16_384,
    large_window: Annotated[int, typer.Option(help="Large pool's max_model_len.")] = 131_072,
    small_profile: Annotated[str, typer.Option(help="Timing profile of the small pool.")] = "llama-3.1-8b-h100",
    large_profile: Annotated[str, typer.Option(help="Timing profile of the large pool.")] = "llama-3.1-70b-h100-tp4",
    replicas_small: Annotated[int, typer.Option(help="Engines in the small pool.")] = 4,
    replicas_large: Annotated[int, typer.Option(help="Engines in the large pool.")] = 2,
    think_time: Annotated[float, typer.Option(help="Seconds between a turn's end and the next turn.")] = 5.0,
    seed: Annotated[list[str] | None, typer.Option(help="Seed(s); repeat or comma-separate.")] = None,
    system_tokens: Annotated[int, typer.Option(help="System prompt tokens.")] = 2048,
    user_tokens: Annotated[int, typer.Option(help="Mean user-turn tokens.")] = 512,
    output_tokens: Annotated[int, typer.Option(help="Mean answer tokens (the client's max_tokens).")] = 256,
    warm_fraction: Annotated[float, typer.Option(help="Warm-ahead threshold (share of the small window).")] = 0.6,
    warm_cooldown: Annotated[float, typer.Option(help="Seconds between warm-ups of one session at one growth stage.")] = 300.0,
    rewarm_fraction: Annotated[float, typer.Option(help="Growth (share of the small window) that allows another warm-up; 1 = once per cooldown.")] = 0.1,
    policy: Annotated[str, typer.Option(help="Replica-selection policy in both pools.")] = "kvroute",
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report here.")] = None,
) -> None:
    """Context-window tiers: reactive vs proactive vs proactive+warm on the same sessions."""
    from kvroute.bench.tiers_bench import TiersBenchSpec, run_tiers_bench
    from kvroute.bench.tiers_bench import format_table as tiers_table

    seeds = tuple(s for item in (seed or ["0"]) for s in _ints(item, "--seed"))
    console = Console(stderr=True)
    with exit_on_router_error(console):
        spec = TiersBenchSpec(
            sessions=sessions, small_window=small_window, large_window=large_window,
            small_profile=small_profile, large_profile=large_profile,
            replicas_small=replicas_small, replicas_large=replicas_large,
            think_time_s=think_time, seeds=seeds, system_prompt_tokens=system_tokens,
            user_tokens=user_tokens, output_tokens=output_tokens, policy=policy,
            warm_fraction=warm_fraction, warm_cooldown_s=warm_cooldown,
            warm_rewarm_fraction=rewarm_fraction)
        report, _ = run_tiers_bench(spec)
    out = wide_console()
    out.print(rows_table(f"tiers: {sessions} sessions, small {small_window} ({small_profile} x"
                         f"{replicas_small}), large {large_window} ({large_profile} "
                         f"x{replicas_large})", tiers_table(report), left=("mode",)))
    _print_targets(out, report)
    sys.stdout.flush()
    if json_out is not None:
        write_json_report(json_out, report, console)
    sys.stdout.flush()


@bench_app.command("tiers-live")
def bench_tiers_live(
    sessions: Annotated[int, typer.Option(help="Growing sessions (each crosses the small window).")] = 8,
    small_window: Annotated[int, typer.Option(help="Small pool's max_model_len.")] = 4096,
    large_window: Annotated[int, typer.Option(help="Large pool's max_model_len.")] = 16_384,
    small_profile: Annotated[str, typer.Option(help="Timing profile of the small pool.")] = "llama-3.1-8b-h100",
    large_profile: Annotated[str, typer.Option(help="Timing profile of the large pool.")] = "llama-3.1-70b-h100-tp4",
    replicas_small: Annotated[int, typer.Option(help="Engines in the small pool.")] = 2,
    replicas_large: Annotated[int, typer.Option(help="Engines in the large pool (plus one cold probe).")] = 1,
    think_time: Annotated[float, typer.Option(help="Seconds between a turn's end and the next turn.")] = 1.0,
    session_interval: Annotated[float, typer.Option(help="Seconds between session starts.")] = 0.5,
    system_tokens: Annotated[int, typer.Option(help="System prompt tokens.")] = 512,
    user_tokens: Annotated[int, typer.Option(help="Mean user-turn tokens.")] = 256,
    output_tokens: Annotated[int, typer.Option(help="Mean answer tokens (the client's max_tokens).")] = 64,
    seed: Annotated[int, typer.Option(help="Workload and policy seed.")] = 0,
    warm_fraction: Annotated[float, typer.Option(help="Warm-ahead threshold (share of the small window).")] = 0.6,
    rewarm_fraction: Annotated[float, typer.Option(help="Growth (share of the small window) that allows another warm-up.")] = 0.1,
    warm_per_replica: Annotated[int | None, typer.Option(help="warm_ahead.max_in_flight_per_replica of the router (default: the router's).")] = None,
    warm_chunk_tokens: Annotated[int | None, typer.Option(help="warm_ahead.chunk_tokens of the router (default: the router's; 0 = one request per warm-up).")] = None,
    modes: Annotated[str, typer.Option(help="Comma-separated: reactive, proactive, proactive+warm.")] = "reactive,proactive,proactive+warm",
    repeats: Annotated[int, typer.Option(help="Runs of every mode, interleaved (ABC, CBA, ...); the small-p99 target is judged on the median paired ratio.")] = 1,
    request_timeout: Annotated[float, typer.Option(help="Seconds one request may take.")] = 60.0,
    duration: Annotated[float, typer.Option(help="Seconds one mode's run may take.")] = 300.0,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report here.")] = None,
    log_dir: Annotated[Path | None, typer.Option(help="Keep router configs and logs, engine logs here.")] = None,
) -> None:
    """Context-window tiers live: kvroute serve + simulated engines, reactive vs proactive vs warm."""
    from kvroute.bench.tiers_live import TiersLiveSpec, format_repeats, run_tiers_live
    from kvroute.bench.tiers_live import format_table as live_tiers_table

    console = Console(stderr=True)
    with exit_on_router_error(console):
        spec = TiersLiveSpec(
            sessions=sessions, small_window=small_window, large_window=large_window,
            small_profile=small_profile, large_profile=large_profile,
            replicas_small=replicas_small, replicas_large=replicas_large,
            think_time_s=think_time, session_interval_s=session_interval,
            system_prompt_tokens=system_tokens, user_tokens=user_tokens,
            output_tokens=output_tokens, seed=seed, warm_fraction=warm_fraction,
            warm_rewarm_fraction=rewarm_fraction, warm_per_replica=warm_per_replica,
            warm_chunk_tokens=warm_chunk_tokens, repeats=repeats,
            modes=tuple(m.strip() for m in modes.split(",") if m.strip()),
            request_timeout_s=request_timeout, duration_s=duration, log_dir=log_dir)
        report = run_tiers_live(spec, on_mode_start=lambda mode, n: console.print(
            f"mode {mode}: {n} turns of {sessions} sessions"))
    out = wide_console()
    out.print(rows_table(f"tiers live: {sessions} sessions, small {small_window} "
                         f"({small_profile} x{replicas_small}), large {large_window} "
                         f"({large_profile} x{replicas_large})", live_tiers_table(report),
                         left=("mode",)))
    if repeats > 1:
        out.print(rows_table(f"{repeats} repeats, modes interleaved", format_repeats(report)))
    _print_targets(out, report)
    if json_out is not None:
        write_json_report(json_out, report, console)
    sys.stdout.flush()


_HIT_REPORT_ROWS = (
    ("events_per_s", "KV events / virtual s"),
    ("hashes_per_s", "block hashes / virtual s"),
    ("router_event_cpu_s", "router CPU applying events (s)"),
    ("router_cpu_us_per_hash", "router CPU per hash (µs)"),
    ("predicted_equals_engine", "after reset: predicted = engine's cached"),
    ("cached_tokens_unpredicted", "after reset: engine-cached tokens not predicted"),
    ("eviction_position_mean", "evicted block's place in the LRU view (0 = oldest)"),
    ("token_hit_rate", "engines' token hit rate"),
)


@bench_app.command("hit-reports")
def bench_hit_reports(
    trace: Annotated[str, typer.Option(help="Bundled trace: mooncake_conversation, claude_code_agentic_64, ...")] = "mooncake_conversation",
    limit: Annotated[int, typer.Option(help="The trace's first N requests.")] = 2000,
    replicas: Annotated[int, typer.Option(help="Engines in the fleet.")] = 4,
    profile: Annotated[str, typer.Option(help="Timing profile.")] = "llama-3.1-8b-h100",
    num_gpu_blocks: Annotated[int | None, typer.Option(help="KV blocks per engine (default: the profile's).")] = None,
    reset_at: Annotated[float, typer.Option(help="Reset the router's index at this fraction of the trace (0 = never).")] = 0.5,
    seed: Annotated[int, typer.Option(help="The policy's seed.")] = 0,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report here.")] = None,
) -> None:
    """kv_cache_report_mode "full" off vs on: events and router CPU against index accuracy."""
    from kvroute.bench.hit_reports import HitReportSpec, run_hit_reports

    console = Console(stderr=True)
    with exit_on_router_error(console):
        spec = HitReportSpec(trace=trace, limit=limit, replicas=replicas, profile=profile,
                             num_gpu_blocks=num_gpu_blocks,
                             reset_fraction=reset_at if reset_at > 0 else None, seed=seed)
        report = run_hit_reports(spec)
    runs = report["runs"]
    rows = [[label, str(runs["off"][key]), str(runs["on"][key])]
            for key, label in _HIT_REPORT_ROWS]
    cfg = report["config"]
    out = wide_console()
    out.print(rows_table(f"hit reports: {cfg['trace']}, {cfg['requests']} requests, "
                         f"{cfg['replicas']} x {cfg['profile']} ({cfg['num_gpu_blocks']} blocks)",
                         [["", "incremental", "full"], *rows], left=("",)))
    sys.stdout.flush()
    if json_out is not None:
        write_json_report(json_out, report, console)
@bench_app.command("scenarios")
def bench_scenarios(
    trace: Annotated[str, typer.Option(help="A trace with sessions (Mooncake format).")] = "claude_code_agentic_64",
    limit: Annotated[int | None, typer.Option(help="Replay only the first N requests.")] = None,
    rate_scale: Annotated[float, typer.Option(help="Arrival-rate multiplier.")] = 1.0,
    replicas: Annotated[int, typer.Option(help="Engines in the fleet (even: A/B and failover split it in two pools).")] = 8,
    profile: Annotated[str, typer.Option(help="Timing profile of every engine.")] = "llama-3.1-8b-h100",
    switch: Annotated[float, typer.Option(help="Virtual second of the upgrade's restarts and the primary's outage.")] = 600.0,
    window: Annotated[float, typer.Option(help="Seconds after --switch whose TTFT p99 is reported.")] = 120.0,
    down: Annotated[float, typer.Option(help="Seconds an upgraded replica is down after its drain.")] = 30.0,
    outage: Annotated[float, typer.Option(help="Seconds the failover's primary refuses connections.")] = 300.0,
    back_after: Annotated[float, typer.Option(help="Failover hysteresis: seconds the primary must be usable.")] = 30.0,
    warm_budget: Annotated[int, typer.Option(help="Shadow warm-up budget in prompt tokens: per new replica (upgrade), per interval (failover).")] = 300_000,
    warm_interval: Annotated[float, typer.Option(help="Seconds between shadow warm-ups of a failover backup.")] = 30.0,
    variants: Annotated[str, typer.Option(help="Comma-separated subset of: upgrade cold, upgrade warm, ab sticky, ab per-request, failover cold, failover warm (default: all).")] = "",
    seed: Annotated[int, typer.Option(help="Policy seed.")] = 0,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report here.")] = None,
) -> None:
    """Model-bound caches: the recompute bill of an upgrade, an A/B split and a failover."""
    from kvroute.bench.scenarios_bench import VARIANTS, ScenariosBenchSpec, run_scenarios_bench
    from kvroute.bench.scenarios_bench import format_table as scenarios_table

    console = Console(stderr=True)
    chosen = tuple(v.strip() for v in variants.split(",") if v.strip()) or VARIANTS
    with exit_on_router_error(console):
        spec = ScenariosBenchSpec(
            trace=trace, limit=limit, rate_scale=rate_scale, replicas=replicas,
            profile=profile, switch_s=switch, window_s=window, down_s=down, outage_s=outage,
            back_after_s=back_after, warm_budget_tokens=warm_budget,
            warm_interval_s=warm_interval, variants=chosen, seed=seed)
        report = run_scenarios_bench(spec, on_start=lambda variant, n: console.print(
            f"{variant}: {n} requests"))
    out = wide_console()
    out.print(rows_table(f"model-bound cache scenarios: {trace}, {replicas} x {profile}",
                         scenarios_table(report), left=("variant",)))
    if json_out is not None:
        write_json_report(json_out, report, console)
    sys.stdout.flush()
