"""``kvroute demo``: the README's first command.

Owns the demo's choice of workload, fleet and report, and nothing else: the live run is
``bench/live.py`` (engines from ``sim/launcher.py``, routers from ``bench/live_routers.py``,
the load from ``bench/live_client.py``), the virtual run is ``bench/sim_bench.py``.

Live (the default): four ``kvroute sim serve`` engines with the ``llama-3.1-8b-h100`` timing
profile, real HTTP and ZMQ on loopback, and one ``kvroute serve`` process in front of them per
policy (kvroute, round robin, least-loaded: the same router program, only the policy
differs). Before each policy the engines' prefix caches are reset, so each starts cold; the
same requests are replayed open loop; the engines' own counters give the hit rate.

What is replayed, and why not simply "the first N requests": the Mooncake conversation trace
(FAST'25, 12k-token prompts on average) reuses a prefix when a conversation comes back for
its next turn, a median ~2 minutes later. The first 200 requests span ~70 s and reuse almost
nothing (4% of prompt tokens), so no policy could show anything. The demo therefore takes
*whole conversations* from a longer stretch: every request of the first ``trace_minutes``
minutes whose conversation (its second hash id: block 0 is the system prompt every request
shares) falls in 1 of ``every`` residue classes, then compresses the arrivals ``rate_scale``
times. Defaults: 5 minutes, 1 in 5, x10: ~200 requests in 30 s, about 80% of four H100s'
modelled prefill capacity, so queues form and a returning conversation can hit its cache.
Outputs are capped (``max_tokens``, default 32): every streamed token costs real CPU in three
processes on this machine, and the prefill is where routing matters. All of this is printed
with the table.

Bounds: the slice is finite; every request has a timeout and each policy's run a deadline
(``bench/live_client.py``); Ctrl-C stops the router and every engine (context managers in
``bench/live.py``) and exits 130.

``--virtual`` keeps the earlier virtual-time comparison (``sim.fleet``): the first 600
requests of the trace at their real rate, no processes, finished in seconds of CPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvroute.bench.workloads import mooncake
from kvroute.commands.results import write_json_report
from kvroute.commands.tables import rows_table
from kvroute.core.errors import ConfigError, RouterError
from kvroute.sim.workload import WorkloadRequest

__all__ = [
    "DEMO_POLICIES",
    "HELP",
    "DemoSlice",
    "conversation_slice",
    "demo",
    "demo_table",
]

HELP = "Run kvroute on the embedded default (a simulated fleet) and print what it shows."

DEMO_POLICIES: Final = ("kvroute", "round_robin", "least_loaded")
"""The policies compared, in run order (kvroute first: its cold start is not hidden)."""

_TRACE: Final = "mooncake_conversation"
_PROFILE: Final = "llama-3.1-8b-h100"
_JITTER_S: Final = 3.0
"""The conversation trace quantises arrivals to 3-s buckets (up to 28 requests at once);
spreading each uniformly over its bucket replays a plausible arrival process instead of
synchronised bursts the trace's recording never had."""


@dataclass(frozen=True, slots=True)
class DemoSlice:
    """The requests the live demo replays and how they were chosen.

    Invariants: ``requests`` are sorted by arrival, the first arrives at 0, and every
    request of a kept conversation within the first ``trace_minutes`` is present (unless
    ``limit`` cut the tail).
    """

    requests: tuple[WorkloadRequest, ...]
    trace_minutes: float
    every: int
    conversations: int
    source_requests: int

    @property
    def mean_prompt_tokens(self) -> float:
        return sum(r.num_prompt_tokens for r in self.requests) / len(self.requests)

    @property
    def span_s(self) -> float:
        """Trace seconds from the first to the last kept arrival (before any rate scale)."""
        return self.requests[-1].arrival_s


def _conversation_key(request: WorkloadRequest, position: int) -> tuple[bool, int]:
    """``(alone, value)``: a conversation's identity; ``value`` is what is sampled.

    Block 0 is the system prompt every request shares; block 1 starts the conversation, and
    every later turn repeats it (its prompt extends the previous turn's). A one-block request
    has no conversation: it is alone, keyed by its position in the trace.
    """
    ids = getattr(request.prompt_token_ids, "block_token_ids", None)
    if ids is None or len(ids) < 2:
        return True, position
    return False, int(ids[1])


def conversation_slice(
    *,
    trace_minutes: float = 5.0,
    every: int = 5,
    limit: int | None = None,
    seed: int = 0,
) -> DemoSlice:
    """Whole conversations of the start of the bundled Mooncake conversation trace.

    Args:
        trace_minutes: how much of the trace to take conversations from.
        every: keep the conversations whose key is 0 modulo ``every`` (1 keeps all).
        limit: at most this many requests (the earliest).
        seed: seeds the arrival jitter within the trace's 3-s buckets.

    Returns:
        The slice, arrivals shifted so the first is 0 (in trace seconds: the replay's
        ``rate_scale`` divides them).

    Raises:
        ConfigError: a non-positive bound, or a slice with no request.
    """
    if not trace_minutes > 0:
        raise ConfigError(f"trace_minutes={trace_minutes!r} must be > 0 (try 5)")
    if every < 1:
        raise ConfigError(f"every={every} must be >= 1 (1 keeps every conversation)")
    if limit is not None and limit < 1:
        raise ConfigError(f"limit={limit} must be >= 1 (or None for the whole slice)")
    span_s = trace_minutes * 60.0
    source = [r for r in mooncake(_TRACE, jitter_s=_JITTER_S, seed=seed) if r.arrival_s < span_s]
    kept: list[tuple[tuple[bool, int], WorkloadRequest]] = []
    for position, request in enumerate(source):
        key = _conversation_key(request, position)
        if key[1] % every == 0:
            kept.append((key, request))
    if limit is not None:
        kept = kept[:limit]
    if not kept:
        raise ConfigError(f"no request of the first {trace_minutes:g} trace minutes is kept "
                          f"with 1 conversation in {every}; take more minutes or a smaller "
                          "--every")
    start = kept[0][1].arrival_s
    shifted = tuple(dataclasses.replace(r, arrival_s=r.arrival_s - start) for _, r in kept)
    return DemoSlice(shifted, trace_minutes, every, len({k for k, _ in kept}), len(source))


def demo_table(report: dict[str, Any]) -> list[list[str]]:
    """Rows (header first) of the live demo's table, one per policy of ``report``."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value / 1e3:.2f}s"

    rows = [["policy", "done", "hit rate", "TTFT p50", "TTFT p99", "E2E p50", "req/s",
             "per engine"]]
    for name, m in report["routers"].items():
        rate = m.get("token_hit_rate")
        rps = m.get("achieved_rps")
        rows.append([
            name, f"{m['completed']}/{m['requests']}", "-" if rate is None else f"{rate:.3f}",
            ms(m.get("ttft_p50_ms")), ms(m.get("ttft_p99_ms")), ms(m.get("e2e_p50_ms")),
            "-" if rps is None else f"{rps:.2f}",
            "/".join(str(v) for v in m["requests_per_replica"].values()),
        ])
    return rows


def _print_rows(console: Console, rows: Sequence[Sequence[str]], title: str) -> None:
    console.print(rows_table(title, rows, left=("policy",)))


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console)


def _run_virtual(console: Console, out: Console, *, requests: int, replicas: int,
                 rate_scale: float, json_out: Path | None) -> None:
    from kvroute.bench.sim_bench import SimBenchSpec, run_sim_bench
    from kvroute.commands.bench import print_report_table

    spec = SimBenchSpec(workload="trace", trace=_TRACE, replicas=replicas, profile=_PROFILE,
                        rate_scales=(rate_scale,), policies=DEMO_POLICIES, limit=requests)
    progress = _progress(console)
    task: list[Any] = []

    def on_start(policy: str, rate: float, seed: int, total: int) -> None:
        task.append(progress.add_task(f"{policy:>12}", total=total))

    def on_progress(n: int) -> None:
        progress.advance(task[-1], n)

    console.print(f"Replaying the first {requests} requests of the Mooncake conversation trace "
                  f"(rate x{rate_scale:g}) through {replicas} simulated Llama-3.1-8B/H100 "
                  "engines in virtual time (no processes, no network)...")
    with progress:
        report, _ = run_sim_bench(spec, on_run_start=on_start, on_progress=on_progress)
    print_report_table(out, report, f"kvroute vs baselines, virtual time: {requests} Mooncake "
                                    f"requests, {replicas} replicas", compact=True)
    console.print("Hit rate = prompt tokens the engines served from their own prefix caches. "
                  "Times are virtual seconds of the modelled H100s. Run `kvroute bench sim "
                  "--help` for every policy and workload.")
    if json_out is not None:
        write_json_report(json_out, report)


def _run_live(console: Console, out: Console, *, chosen: DemoSlice, replicas: int,
              rate_scale: float, max_tokens: int, duration_s: float, request_timeout_s: float,
              seed: int, log_dir: Path | None, json_out: Path | None) -> None:
    from kvroute.bench.live import LiveBenchSpec, run_live_bench
    from kvroute.bench.live_routers import RouterSpec

    spec = LiveBenchSpec(
        routers=tuple(RouterSpec(p, "kvroute", p) for p in DEMO_POLICIES),
        workload="mooncake", engines=replicas, profile=_PROFILE, seed=seed,
        rate_scale=rate_scale, max_tokens=max_tokens, request_timeout_s=request_timeout_s,
        duration_s=duration_s, log_dir=log_dir, requests=chosen.requests)
    n = len(chosen.requests)
    replay_s = chosen.span_s / rate_scale
    console.print(
        f"Replaying {n} requests ({chosen.conversations} whole conversations: 1 in "
        f"{chosen.every} of those in the first {chosen.trace_minutes:g} minutes of the Mooncake "
        f"conversation trace, {chosen.source_requests} requests there), mean prompt "
        f"{chosen.mean_prompt_tokens:,.0f} tokens, output capped at {max_tokens} tokens, "
        f"arrivals {rate_scale:g}x faster ({chosen.span_s:.0f} trace seconds in "
        f"{replay_s:.0f} s), through `kvroute serve` in front of {replicas} `kvroute sim` "
        f"engines (Llama-3.1-8B/H100 timing, real HTTP and ZMQ on loopback), once per policy, "
        "caches reset in between...")
    progress = _progress(console)
    task: list[Any] = []

    def on_start(name: str, total: int) -> None:
        task.append(progress.add_task(f"{name:>12}", total=total))

    def on_progress(k: int) -> None:
        if task:
            progress.advance(task[-1], k)

    with progress:
        report = run_live_bench(spec, on_router_start=on_start, on_progress=on_progress)
    _print_rows(out, demo_table(report),
                f"kvroute vs baselines, live: {n} Mooncake requests, {replicas} engines")
    errors = {name: m["errors"] for name, m in report["routers"].items() if m["errors"]}
    if errors:
        console.print(f"[yellow]requests that failed, by kind:[/yellow] {errors}")
    console.print(
        "hit rate: prompt tokens the engines served from their prefix caches over prompt tokens "
        "they were asked for (the engines' vllm:prefix_cache_* counters over each run). "
        "TTFT: client-measured wall time from sending the request to its first streamed token; "
        "E2E: to its last byte (engine time is the modelled H100's, the rest is real router, "
        "HTTP and sim CPU time on this machine, shared by every process). req/s: completed "
        "requests over the run's wall time; the load is open loop, so it stays near the "
        "arrival rate unless a policy falls behind. per engine: requests each engine served. "
        "One run per policy on a shared machine: expect some noise between runs. "
        "`kvroute demo --virtual` runs the virtual-time comparison; `kvroute bench live --help` "
        "has every option.")
    if json_out is not None:
        report["demo"] = {"trace": _TRACE, "trace_minutes": chosen.trace_minutes,
                          "every": chosen.every, "conversations": chosen.conversations,
                          "requests": n, "mean_prompt_tokens": round(chosen.mean_prompt_tokens),
                          "trace_span_s": chosen.span_s, "jitter_s": _JITTER_S}
        write_json_report(json_out, report, console)


def demo(
    virtual: Annotated[bool, typer.Option(help="The instant virtual-time comparison instead "
                                          "of live processes.")] = False,
    requests: Annotated[int | None, typer.Option(help="At most this many requests (live: "
                                                 "default the whole slice; virtual: 600).")] = None,
    replicas: Annotated[int, typer.Option(help="Simulated engines.")] = 4,
    rate_scale: Annotated[float | None, typer.Option(help="Arrival-rate multiplier (live: "
                                                     "default 10; virtual: 1).")] = None,
    trace_minutes: Annotated[float, typer.Option(help="Live: minutes of the trace to take "
                                                 "conversations from.")] = 5.0,
    every: Annotated[int, typer.Option(help="Live: keep 1 conversation in this many.")] = 5,
    max_tokens: Annotated[int, typer.Option(help="Live: cap on each request's output "
                                            "tokens.")] = 32,
    duration: Annotated[float, typer.Option(help="Live: seconds one policy's run may "
                                            "take.")] = 120.0,
    request_timeout: Annotated[float, typer.Option(help="Live: seconds one request may "
                                                   "take.")] = 60.0,
    seed: Annotated[int, typer.Option(help="Arrival jitter and policy seed.")] = 0,
    log_dir: Annotated[Path | None, typer.Option(help="Live: keep configs and router/engine "
                                                 "logs here.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report here.")] = None,
) -> None:
    """Compare kvroute with round robin and least-loaded on a slice of a real trace."""
    console = Console(stderr=True)
    out = Console(width=max(Console().width, 110))
    try:
        if replicas < 1:
            raise ConfigError(f"--replicas {replicas} must be >= 1")
        if rate_scale is not None and not rate_scale > 0:
            raise ConfigError(f"--rate-scale {rate_scale} must be > 0")
        if virtual:
            _run_virtual(console, out, requests=requests or 600, replicas=replicas,
                         rate_scale=rate_scale or 1.0, json_out=json_out)
            return
        if max_tokens < 1:
            raise ConfigError(f"--max-tokens {max_tokens} must be >= 1")
        chosen = conversation_slice(trace_minutes=trace_minutes, every=every, limit=requests,
                                    seed=seed)
        _run_live(console, out, chosen=chosen, replicas=replicas,
                  rate_scale=rate_scale or 10.0, max_tokens=max_tokens, duration_s=duration,
                  request_timeout_s=request_timeout, seed=seed, log_dir=log_dir,
                  json_out=json_out)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted:[/yellow] the router and every engine were stopped.")
        raise typer.Exit(130) from None
    except RouterError as exc:  # ConfigError included
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
