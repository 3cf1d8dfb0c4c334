"""``kvroute bench live``: real routers on loopback, one at a time, on the same requests.

Owns the run order and the report. A fleet of ``kvroute sim serve`` engines is started once;
then, for each router under test (``bench/live_routers.py``): the engines' prefix caches are
reset (``POST /reset_prefix_cache``, retried while the engine still holds requests), their
``/metrics`` counters are read, the router is started and waited for, the same bounded
request stream is replayed through it (``bench/live_client.py``), the counters are read
again, and the router is stopped. The ``direct`` baseline (the client round-robins over the
engines) runs in the same sequence, so "overhead vs direct" compares figures of one run.

What each router's entry holds (the JSON is shaped like ``bench sim``'s)::

    {"routers": {NAME: {"kind", "policy", "requests", "completed", "errors",
                        "ttft_{mean,p50,p90,p99}_ms", "itl_...", "e2e_...",
                        "token_hit_rate", "hit_tokens", "query_tokens",
                        "requests_per_replica": {engine: n}, "max_replica_share",
                        "router_cpu_s", "router_cpu_ms_per_req", "ready_s", "wall_s",
                        "achieved_rps", "start_lag_p99_ms", "tcp_nodelay",
                        "overhead_vs_direct": {"ttft_p50_ms", "ttft_p99_ms",
                                               "e2e_p50_ms", "e2e_p99_ms"} | None}},
     "skipped": {NAME: reason}, "config": {...}}

Engine-side figures are deltas of vLLM's counters over the router's run:
``vllm:prefix_cache_hits_total``/``queries_total`` (tokens) and the per-engine sum of
``vllm:request_success_total`` over finish reasons. The per-engine request counts are the
hot-spot signal: ``max_replica_share`` is the busiest engine's share.

NOTE: "overhead vs direct" is the router's own cost only with the ``zero`` engine profile.
With a timed profile the routers' choices change the engines' work (a cache hit shortens
prefill, a hot spot queues), and the difference mixes both.

The peer-fidelity check (``FIDELITY_SCENARIOS``, ``run_fidelity``) runs the measured
hot-spot scenario of ``docs/reference/peer-routers.md`` §9 (48 concurrent requests sharing a
~2.3k-character system prompt over 4 engines, and 48 with distinct prefixes) through the real
peers and through kvroute's reimplementations, and returns the per-engine distributions.
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kvroute.bench.live_client import build_live_requests, replay, summarize
from kvroute.bench.live_routers import (
    PEER_VERSIONS,
    PeerRouters,
    RouterSpec,
    find_peer_routers,
    start_router,
)
from kvroute.bench.provenance import git_sha
from kvroute.bench.workloads import WORKLOADS
from kvroute.core.errors import ConfigError, RouterError
from kvroute.sim.launcher import Fleet, ReplicaHandle, ReplicaSpec, start_fleet
from kvroute.sim.profiles import get_profile
from kvroute.sim.workload import WorkloadRequest
from kvroute.wire.prom import parse_exposition

__all__ = [
    "FIDELITY_SCENARIOS",
    "EngineCounters",
    "LiveBenchSpec",
    "build_workload",
    "dumps",
    "format_table",
    "read_engine_counters",
    "reset_engine_caches",
    "run_fidelity",
    "run_live_bench",
]

_SUCCESS: Final = "vllm:request_success_total"
_HITS: Final = "vllm:prefix_cache_hits_total"
_QUERIES: Final = "vllm:prefix_cache_queries_total"

FIDELITY_SCENARIOS: Final[dict[str, tuple[str, dict[str, Any]]]] = {
    # One shared system prompt of ~2.3k characters (345 words of to_text), 48 at once.
    "hot_prefix_48": ("hot_prefix_bursts", {"num_bursts": 1, "burst_size": 48,
                                            "system_prompt_tokens": 345, "suffix_tokens": 8,
                                            "output_tokens": 64}),
    # 48 distinct prefixes of the same length, 48 at once.
    "distinct_48": ("generated_shared_prefix", {"num_groups": 48, "prompts_per_group": 1,
                                                "system_prompt_len": 345, "question_len": 8,
                                                "output_len": 64}),
}
"""The peer-fidelity scenarios: name -> (workload, parameters)."""


@dataclass(frozen=True, slots=True)
class LiveBenchSpec:
    """What to run.

    Attributes:
        routers: the routers, run in this order.
        workload / workload_params: a generator of ``bench.workloads.WORKLOADS``.
        engines / profile: the simulated fleet (``zero`` isolates router overhead).
        num_gpu_blocks: KV blocks per engine (None: the profile's).
        seed: workload seed and kvroute's policy seed.
        limit: only the first N requests.
        rate_scale: open-loop arrival-rate multiplier.
        concurrency: closed loop with this many workers instead of the arrivals.
        max_tokens: cap on each request's output tokens.
        max_in_flight: open-loop cap on concurrent requests.
        request_timeout_s / duration_s: bounds on one request and on one router's run.
        router_start_timeout_s: bound on one router's start-up.
        model: the served model name.
        log_dir: where configs and logs go (a temporary directory when None).
        requests: a request stream prepared by the caller, replayed instead of generating
            ``workload`` (``workload`` then only names it in the report; ``limit`` still
            applies). ``kvroute demo`` passes its trace slice this way.
        engine_args: further ``kvroute sim serve`` options for every engine (``--timing``).
    """

    routers: tuple[RouterSpec, ...]
    workload: str = "hot_prefix_bursts"
    workload_params: Mapping[str, Any] = field(default_factory=dict)
    engines: int = 4
    profile: str = "zero"
    num_gpu_blocks: int | None = None
    seed: int = 0
    limit: int | None = None
    rate_scale: float = 1.0
    concurrency: int | None = None
    max_tokens: int | None = None
    max_in_flight: int = 512
    request_timeout_s: float = 60.0
    duration_s: float = 300.0
    router_start_timeout_s: float = 60.0
    model: str = "sim-model"
    log_dir: Path | None = None
    requests: tuple[WorkloadRequest, ...] | None = None
    engine_args: tuple[str, ...] = ()

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first bad field."""
        if not self.routers:
            raise ConfigError("give at least one router")
        if self.workload not in WORKLOADS:
            raise ConfigError(f"unknown workload {self.workload!r}; choose one of: "
                              f"{', '.join(sorted(WORKLOADS))}")
        if self.engines < 1:
            raise ConfigError(f"engines={self.engines} must be >= 1")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit={self.limit} must be >= 1")
        if self.requests is not None and not self.requests:
            raise ConfigError("LiveBenchSpec.requests is empty; give at least one request "
                              "(or None to generate the workload)")
        get_profile(self.profile)


def build_workload(spec: LiveBenchSpec) -> list[WorkloadRequest]:
    """The request stream (chat form where the generator has one), cut to ``limit``."""
    if spec.requests is not None:
        prepared = list(spec.requests)
        return prepared[: spec.limit] if spec.limit is not None else prepared
    params = dict(spec.workload_params)
    params.setdefault("seed", spec.seed)
    if spec.workload != "mooncake":
        params.setdefault("with_messages", True)
    try:
        requests = WORKLOADS[spec.workload](**params)
    except TypeError as exc:
        raise ConfigError(f"workload {spec.workload!r} does not take {sorted(params)}: {exc}") \
            from exc
    return requests[: spec.limit] if spec.limit is not None else requests


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """One engine's cumulative counters at one moment."""

    requests: float
    hit_tokens: float
    query_tokens: float


def read_engine_counters(url: str, timeout_s: float = 5.0) -> EngineCounters:
    """Read the request, hit and query counters from an engine's ``/metrics``.

    Raises:
        RouterError: the engine did not answer, or exposed none of the counters.
    """
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as resp:
            text = resp.read().decode("utf-8", "replace")
    except (OSError, urllib.error.URLError) as exc:
        raise RouterError(f"cannot read {url}/metrics: {exc}") from exc
    sums = {_SUCCESS: 0.0, _HITS: 0.0, _QUERIES: 0.0}
    seen: set[str] = set()
    for sample in parse_exposition(text, names=tuple(sums)).samples:
        if sample.name in sums:
            sums[sample.name] += sample.value
            seen.add(sample.name)
    if seen != set(sums):
        raise RouterError(f"{url}/metrics lacks {sorted(set(sums) - seen)}; is it a vLLM "
                          "engine (or kvroute sim)?")
    return EngineCounters(sums[_SUCCESS], sums[_HITS], sums[_QUERIES])


def reset_engine_caches(engines: Sequence[ReplicaHandle], timeout_s: float = 30.0) -> None:
    """``POST /reset_prefix_cache`` on every engine, retried while it still holds requests.

    Raises:
        RouterError: an engine kept refusing (or failing) until ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    for eng in engines:
        last = ""
        while True:
            req = urllib.request.Request(eng.url + "/reset_prefix_cache", data=b"",
                                         method="POST")
            try:
                with urllib.request.urlopen(req, timeout=5) as resp:
                    if resp.status == 200:
                        break
                    last = f"HTTP {resp.status}"
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}: {exc.read()[:200]!r}"
            except (OSError, urllib.error.URLError) as exc:
                last = repr(exc)
            if time.monotonic() > deadline:
                raise RouterError(f"{eng.name}: /reset_prefix_cache kept failing for "
                                  f"{timeout_s:g} s (last: {last})")
            time.sleep(0.1)


def _fleet_specs(spec: LiveBenchSpec) -> list[ReplicaSpec]:
    return [ReplicaSpec(name=f"e{i}", model=spec.model, profile=spec.profile,
                        num_gpu_blocks=spec.num_gpu_blocks, extra_args=spec.engine_args)
            for i in range(spec.engines)]


def _overhead(entry: dict[str, Any], direct: dict[str, Any] | None) -> dict[str, Any] | None:
    if direct is None:
        return None
    out: dict[str, Any] = {}
    for key in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms"):
        mine, base = entry.get(key), direct.get(key)
        out[key] = None if mine is None or base is None else round(mine - base, 3)
    return out


def _run_one(spec: LiveBenchSpec, router_spec: RouterSpec, fleet: Fleet,
             requests: Sequence[Any], peers: PeerRouters, work_dir: Path,
             on_progress: Callable[[int], None] | None) -> dict[str, Any]:
    engines = fleet.replicas
    reset_engine_caches(engines)
    router = start_router(router_spec, engines, work_dir=work_dir, peers=peers,
                          model=spec.model, seed=spec.seed,
                          timeout_s=spec.router_start_timeout_s)
    with router:
        before = [read_engine_counters(e.url) for e in engines]
        cpu0 = router.cpu_s()
        run = replay(
            router.targets, requests, rate_scale=spec.rate_scale,
            concurrency=spec.concurrency, max_in_flight=spec.max_in_flight,
            request_timeout_s=spec.request_timeout_s, duration_s=spec.duration_s,
            on_done=on_progress)
        cpu1 = router.cpu_s()
        after = [read_engine_counters(e.url) for e in engines]
        alive = router.process is None or router.process.poll() is None
        log_tail = "" if alive else router.log_tail()
    entry: dict[str, Any] = {"kind": router_spec.kind, "policy": router_spec.policy,
                             **summarize(run)}
    per = {e.name: round(a.requests - b.requests)
           for e, a, b in zip(engines, after, before, strict=True)}
    hits = sum(a.hit_tokens - b.hit_tokens for a, b in zip(after, before, strict=True))
    queries = sum(a.query_tokens - b.query_tokens for a, b in zip(after, before, strict=True))
    total = sum(per.values())
    entry.update({
        "requests_per_replica": per,
        "max_replica_share": round(max(per.values()) / total, 4) if total else None,
        "hit_tokens": int(hits), "query_tokens": int(queries),
        "token_hit_rate": round(hits / queries, 4) if queries else None,
        "router_cpu_s": None if cpu0 is None or cpu1 is None else round(cpu1 - cpu0, 3),
        "ready_s": round(router.ready_s, 3),
        "command": router.command or None,
    })
    done = entry["completed"]
    entry["router_cpu_ms_per_req"] = (round(1e3 * entry["router_cpu_s"] / done, 4)
                                      if entry["router_cpu_s"] is not None and done else None)
    if not alive:
        entry["router_exited"] = log_tail
    return entry


def run_live_bench(
    spec: LiveBenchSpec,
    *,
    peers: PeerRouters | None = None,
    on_router_start: Callable[[str, int], None] | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Run every router of ``spec`` in turn on the same requests; return the JSON report.

    Peer routers that are not installed are skipped and listed under ``skipped`` with the
    reason (``find_peer_routers``); every other failure raises.

    Raises:
        ConfigError: a bad spec.
        RouterError: the fleet or a router did not start, or an engine misbehaved.
    """
    spec.validate()
    peers = peers if peers is not None else find_peer_routers()
    workload = build_workload(spec)
    requests = build_live_requests(workload, model=spec.model, max_tokens_cap=spec.max_tokens)
    own_dir = spec.log_dir is None
    work_dir = Path(tempfile.mkdtemp(prefix="kvroute-live-")) if own_dir else Path(
        str(spec.log_dir))
    work_dir.mkdir(parents=True, exist_ok=True)
    routers: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    with start_fleet(_fleet_specs(spec), timeout_s=60.0, log_dir=work_dir / "engines") as fleet:
        for router_spec in spec.routers:
            if router_spec.kind in ("sglang", "vllm") and not peers.available:
                skipped[router_spec.name] = peers.reason
                continue
            if on_router_start is not None:
                on_router_start(router_spec.name, len(requests))
            routers[router_spec.name] = _run_one(spec, router_spec, fleet, requests, peers,
                                                 work_dir, on_progress)
    direct = routers.get("direct")
    for entry in routers.values():
        entry["overhead_vs_direct"] = _overhead(entry, direct) if entry is not direct else None
    return {"routers": routers, "skipped": skipped,
            "config": _config_block(spec, len(requests), peers, work_dir)}


def run_fidelity(
    *,
    routers: Sequence[RouterSpec],
    scenarios: Sequence[str] = tuple(FIDELITY_SCENARIOS),
    engines: int = 4,
    profile: str = "llama-3.1-8b-h100",
    peers: PeerRouters | None = None,
    log_dir: Path | None = None,
    on_router_start: Callable[[str, int], None] | None = None,
) -> dict[str, Any]:
    """The peer-fidelity check: each scenario through each router; per-engine distributions.

    The default profile gives every request a few hundred milliseconds of engine time, so the
    48 requests of a scenario are in flight together, as in the reference measurement (its
    mock workers took 1 s per request).

    Returns:
        ``{"scenarios": {SCENARIO: {ROUTER: [n_e0, n_e1, ...]}}, "reports": {SCENARIO:
        report}}`` with each scenario's full ``run_live_bench`` report.
    """
    out: dict[str, Any] = {"scenarios": {}, "reports": {}}
    for name in scenarios:
        if name not in FIDELITY_SCENARIOS:
            raise ConfigError(f"unknown fidelity scenario {name!r}; choose from: "
                              f"{', '.join(FIDELITY_SCENARIOS)}")
        workload, params = FIDELITY_SCENARIOS[name]
        spec = LiveBenchSpec(routers=tuple(routers), workload=workload, workload_params=params,
                             engines=engines, profile=profile, duration_s=120.0,
                             log_dir=None if log_dir is None else log_dir / name)
        report = run_live_bench(spec, peers=peers, on_router_start=on_router_start)
        out["reports"][name] = report
        out["scenarios"][name] = {
            r: list(entry["requests_per_replica"].values())
            for r, entry in report["routers"].items()
        }
    return out


def _config_block(spec: LiveBenchSpec, num_requests: int, peers: PeerRouters,
                  work_dir: Path) -> dict[str, Any]:
    return {
        "routers": [s.name for s in spec.routers], "workload": spec.workload,
        "workload_params": dict(spec.workload_params), "requests": num_requests,
        "engines": spec.engines, "profile": spec.profile, "num_gpu_blocks": spec.num_gpu_blocks,
        "seed": spec.seed, "limit": spec.limit, "rate_scale": spec.rate_scale,
        "concurrency": spec.concurrency, "max_tokens": spec.max_tokens,
        "max_in_flight": spec.max_in_flight, "request_timeout_s": spec.request_timeout_s,
        "duration_s": spec.duration_s, "model": spec.model,
        "prepared_requests": spec.requests is not None, "engine_args": list(spec.engine_args),
        "peer_versions": dict(PEER_VERSIONS) if peers.available else None,
        "log_dir": str(work_dir), "git_sha": git_sha(), "python": sys.version.split()[0],
        "machine": platform.machine(),
    }


def format_table(report: Mapping[str, Any]) -> list[list[str]]:
    """Rows of the printed table: one per router."""

    def f(value: Any, fmt: str = "{:.2f}") -> str:
        return "-" if value is None else fmt.format(value)

    rows = [["router", "done", "errors", "TTFT p50", "TTFT p99", "ITL p50", "E2E p50",
             "E2E p99", "SLO good/s", "+TTFT p50", "+E2E p50", "hit rate", "CPU ms/req", "per engine"]]
    for name, m in report["routers"].items():
        over = m.get("overhead_vs_direct") or {}
        rows.append([
            name, f"{m['completed']}/{m['requests']}", str(sum(m["errors"].values())),
            f(m["ttft_p50_ms"]), f(m["ttft_p99_ms"]), f(m["itl_p50_ms"]),
            f(m["e2e_p50_ms"]), f(m["e2e_p99_ms"]), f(m.get("slo_goodput_rps"), "{:.3f}"),
            f(over.get("ttft_p50_ms"), "{:+.2f}"),
            f(over.get("e2e_p50_ms"), "{:+.2f}"), f(m["token_hit_rate"], "{:.3f}"),
            f(m["router_cpu_ms_per_req"], "{:.3f}"),
            "/".join(str(v) for v in m["requests_per_replica"].values()),
        ])
    return rows


def dumps(report: Mapping[str, Any]) -> str:
    """The report as indented JSON text."""
    return json.dumps(report, indent=2) + "\n"
