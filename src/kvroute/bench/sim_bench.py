"""``kvroute bench sim``: every policy side by side on the same workload, in virtual time.

For each arrival-rate scale and each seed, the same request stream is replayed through a
fresh simulated fleet once per policy (``sim.fleet``). Prompt digests are computed once and
shared by all runs. Results are aggregated per policy over seeds (mean, with min and max as
the spread) and written as JSON shaped::

    {"policies": {NAME: {"ttft_mean_s": ..., "ttft_p50_s": ..., "ttft_p99_s": ...,
                         "itl_p50_s": ..., "itl_p99_s": ..., "itl_request_mean_s": ...,
                         "itl_request_p99_s": ..., "e2e_mean_s": ..., "e2e_p99_s": ...,
                         "token_hit_rate": ..., "goodput_rps": ..., "slo_goodput_rps": ...,
                         "slo_goodput_fraction": ..., "preemptions": ..., "requests": ...,
                         "spread": {metric: [min, max]}, "by_rate": {scale: {...}}}},
     "config": {...}, "runs": [...]}

``policies`` holds the figures at the first (or only) rate scale; ``by_rate`` every scale.
What each figure means is ``sim.fleet.FleetResult.summary``'s docstring: ``itl_*`` pool every
token gap, ``itl_request_*`` summarise each request's own mean gap, ``slo_goodput_*`` count
requests within both the TTFT and the ITL objective. ``config.policy_params`` records the
overrides each policy ran with (``--policy-param``, ``bench.policy_params``).

Several routers (``routers`` > 1, ``sim/routers.py``): each policy runs three times side by
side on the same workload, as one router (row ``POLICY``), as ``routers`` routers sharing
their placements on a bus (``POLICY/N routers, bus D ms``) and as ``routers`` routers sharing
nothing but the engines' events and the session records (``POLICY/N routers, no bus``), all
behind the same front. ``group_replicas_mean`` is the mean number of replicas a workload
group's requests (siblings sharing a prefix by construction) ran on.
"""

from __future__ import annotations

import dataclasses
import math
import platform
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kvroute.bench.bounds import BoundsReport, compute_bounds
from kvroute.bench.policy_params import PolicyParams
from kvroute.bench.provenance import git_sha
from kvroute.bench.traces import trace_block_tokens
from kvroute.bench.workloads import WORKLOADS, mooncake
from kvroute.core.disagg import DisaggSpec, Role
from kvroute.core.errors import ConfigError
from kvroute.core.hashing import BlockHasher
from kvroute.core.peer_policies import POLICY_NAMES, make_policy
from kvroute.sim.fleet import DigestCache, FleetConfig, FleetResult, FleetSimulation
from kvroute.sim.profiles import TimingProfile, get_profile
from kvroute.sim.routers import (
    DEFAULT_BUS_DELAY_S,
    RoutersConfig,
    SeveralRoutersSimulation,
    group_replicas_mean,
)
from kvroute.sim.workload import WorkloadRequest

HEADLINE_METRICS = (
    "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_mean_s", "itl_p50_s",
    "itl_p90_s", "itl_p99_s", "itl_request_mean_s", "itl_request_p99_s", "e2e_mean_s",
    "e2e_p99_s", "token_hit_rate", "tier_hit_rate", "router_expected_hit_rate", "goodput_rps",
    "slo_goodput_rps", "slo_goodput_fraction", "throughput_rps", "output_tokens_per_s",
    "preemptions", "requests", "completed", "rejected", "unfinished", "load_imbalance_mean",
    "idle_while_overloaded", "split_fraction", "spread_copies", "spread_copy_tokens",
    "spread_copies_used", "prompt_tokens", "group_replicas_mean",
)


@dataclass(frozen=True, slots=True)
class SimBenchSpec:
    """What to run.

    Attributes:
        workload: a generated workload name (``WORKLOADS``) or ``trace`` for a trace replay.
        trace: trace name or path (when ``workload == "trace"``).
        block_tokens: tokens per trace hash id; ``None`` for the trace's own (64 for
            ``claude_code_agentic_64``, else Mooncake's 512).
        replicas: engines in the fleet.
        profile: timing profile name.
        rate_scales: arrival-rate multipliers (one run per scale).
        policies: policy names.
        seeds: seeds (each changes the policies' random choices and generated workloads).
        limit: the first N requests of the workload.
        ttft_slo_s: the TTFT objective (goodput, and with ``itl_slo_s`` SLO goodput).
        itl_slo_s: the objective for each request's mean inter-token latency.
        policy_params: each policy's parameter overrides (``bench.policy_params``).
        trace_sessions: trace replays: mark requests with the sessions a bundled trace's ids
            carry (``bench.trace_sessions``; only ``claude_code_agentic_64`` has them).
        workload_params: extra keyword arguments for a generated workload.
        jitter_s: trace replays only: seeded uniform jitter in ``[0, jitter_s)`` added to
            each arrival (the conversation trace quantises arrivals to 3-second buckets), so
            that seeds give different but equally plausible arrival orders.
        data_parallel_size: engine ranks per replica (``FleetConfig.data_parallel_size``);
            the fleet has ``replicas`` x this many engines.
        dp_routing: with ranks, who picks the rank, one run per mode and policy: ``aware``
            (the router, each rank its own target) and/or ``blind`` (the engine's API server,
            as vLLM's load balancer; the row is labelled ``<policy>/rank-blind``).
        pd: the fleet's prefill/decode layout (``2P6D``: two prefill-only replicas, then
            six decode replicas; ``8B``: eight of role ``both``; counts of ``P``, ``D``, ``B``
            summing to ``replicas``); empty: an ordinary colocated fleet.
        split: the split mode of a ``pd`` fleet (``auto``, ``always``, ``never``).
        link_gbps: the P→D KV link's bandwidth, GB/s (with ``kv_bytes_per_token``).
        routers: routers in front of the fleet; more than 1 runs each policy as one router,
            as that many with the bus and as that many without (module docstring).
        bus_delay_s / bus_batch_s / front: the several routers' bus and front
            (``sim.routers.RoutersConfig``).
    """

    workload: str = "trace"
    trace: str = "mooncake_conversation"
    block_tokens: int | None = None
    replicas: int = 8
    profile: str = "llama-3.1-8b-h100"
    rate_scales: tuple[float, ...] = (1.0,)
    policies: tuple[str, ...] = ("kvroute", "round_robin", "least_loaded")
    seeds: tuple[int, ...] = (0,)
    limit: int | None = None
    ttft_slo_s: float = 2.0
    itl_slo_s: float = 0.030
    policy_params: PolicyParams = field(default_factory=dict)
    trace_sessions: bool = True
    workload_params: dict[str, Any] = field(default_factory=dict)
    jitter_s: float = 0.0
    num_gpu_blocks: int | None = None
    cpu_tier: float = 0.0
    cpu_gbps: float = 25.0
    shared_store: float = 0.0
    shared_gbps: float = 10.0
    kv_bytes_per_token: int = 131_072
    data_parallel_size: int = 1
    dp_routing: tuple[str, ...] = ("aware",)
    pd: str = ""
    split: str = "auto"
    link_gbps: float = 12.5
    routers: int = 1
    bus_delay_s: float = DEFAULT_BUS_DELAY_S
    bus_batch_s: float = 0.0
    front: str = "round_robin"

    def router_arrangements(self) -> tuple[RoutersConfig | None, ...]:
        """What each policy runs behind: one router (None: the ordinary simulation), then
        with ``routers`` > 1 that many with the bus and that many without."""
        if self.routers == 1:
            return (None,)
        return tuple([None] + [
            RoutersConfig(self.routers, bus=bus, bus_delay_s=self.bus_delay_s,
                          batch_s=self.bus_batch_s, front=self.front)
            for bus in (True, False)])

    def roles(self) -> tuple[Role, ...]:
        """Each replica's role from ``pd`` (empty without one)."""
        if not self.pd:
            return ()
        parts = re.fullmatch(r"((\d+)[PDB])+", self.pd.upper())
        if parts is None:
            raise ConfigError(f"--pd {self.pd!r}: give counts of P (prefill), D (decode) and "
                              "B (both) in order, e.g. 2P6D or 8B")
        names: dict[str, Role] = {"P": "prefill", "D": "decode", "B": "both"}
        roles: list[Role] = []
        for count, letter in re.findall(r"(\d+)([PDB])", self.pd.upper()):
            roles += [names[letter]] * int(count)
        if len(roles) != self.replicas:
            raise ConfigError(f"--pd {self.pd!r} lays out {len(roles)} replicas; --replicas "
                              f"is {self.replicas}")
        if all(role == "prefill" for role in roles):
            raise ConfigError(f"--pd {self.pd!r} has no replica that can decode; add D or B")
        return tuple(roles)

    def disagg(self) -> DisaggSpec | None:
        """The fleet's ``DisaggSpec`` (None without ``pd``)."""
        if not self.pd:
            return None
        try:
            return DisaggSpec(self.split,  # type: ignore[arg-type]
                              self.kv_bytes_per_token / (self.link_gbps * 1e9))
        except ValueError as exc:
            raise ConfigError(f"--split/--link-gbps: {exc}") from exc

    def engine_profile(self) -> TimingProfile:
        """The profile every engine runs: ``profile`` with the KV capacity and CPU tier of
        this spec (a tier of ``cpu_tier`` x the engine's usable blocks, loading a block of
        ``kv_bytes_per_token`` x block size at ``cpu_gbps``)."""
        profile = get_profile(self.profile)
        blocks = self.num_gpu_blocks or profile.num_gpu_blocks
        cpu_blocks = int(self.cpu_tier * (blocks - 1))
        return dataclasses.replace(
            profile, num_gpu_blocks=blocks, cpu_offload_blocks=cpu_blocks,
            cpu_load_s_per_block=(self.block_bytes(profile) / (self.cpu_gbps * 1e9)
                                  if cpu_blocks else 0.0))

    def block_bytes(self, profile: TimingProfile) -> int:
        return self.kv_bytes_per_token * profile.block_size

    def shared_store_blocks(self) -> int:
        """The shared store: ``shared_store`` x the fleet's usable device blocks (every rank's)."""
        profile = self.engine_profile()
        return int(self.shared_store * self.replicas * self.data_parallel_size
                   * (profile.num_gpu_blocks - 1))

    def run_policy_params(self, policy: str) -> dict[str, float]:
        """A policy's parameters for a run: kvroute learns each tier's load time per token
        from the spec (bytes per token / bandwidth) unless it was given one."""
        params = dict(self.policy_params.get(policy, {}))
        if policy == "kvroute":
            if self.cpu_tier:
                params.setdefault("cpu_load_s_per_token",
                                  self.kv_bytes_per_token / (self.cpu_gbps * 1e9))
            if self.shared_store:
                params.setdefault("storage_load_s_per_token",
                                  self.kv_bytes_per_token / (self.shared_gbps * 1e9))
        return params

    def validate(self) -> None:
        unknown = [p for p in self.policies if p not in POLICY_NAMES]
        if unknown:
            raise ConfigError(
                f"unknown policies {unknown}; choose from: {', '.join(POLICY_NAMES)}"
            )
        if self.workload != "trace" and self.workload not in WORKLOADS:
            raise ConfigError(
                f"unknown workload {self.workload!r}; choose 'trace' or one of: "
                f"{', '.join(sorted(WORKLOADS))}"
            )
        if not self.policies or not self.seeds or not self.rate_scales:
            raise ConfigError("give at least one policy, one seed and one rate scale")
        if not (math.isfinite(self.jitter_s) and self.jitter_s >= 0):
            raise ConfigError(f"jitter must be a finite number of seconds >= 0, got "
                              f"{self.jitter_s}")
        if self.jitter_s and self.workload != "trace":
            raise ConfigError("--jitter applies to trace replays only; generated workloads "
                              "draw their own arrivals from --seed")
        if any(scale <= 0 for scale in self.rate_scales):
            raise ConfigError(f"rate scales must be > 0, got {self.rate_scales}")
        for name, value in (("--ttft-slo", self.ttft_slo_s), ("--itl-slo", self.itl_slo_s)):
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be a finite number of seconds >= 0, got {value}")
        stray = sorted(set(self.policy_params) - set(self.policies))
        if stray:
            raise ConfigError(f"policy parameters given for {stray}, which are not run")
        for name, value in (("--cpu-tier", self.cpu_tier), ("--shared-store", self.shared_store)):
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} is a multiple of the GPU KV >= 0, got {value}")
        for name, value in (("--cpu-gbps", self.cpu_gbps), ("--shared-gbps", self.shared_gbps),
                            ("KV bytes per token", self.kv_bytes_per_token)):
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be > 0, got {value}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 2:
            raise ConfigError(f"KV blocks per engine must be >= 2, got {self.num_gpu_blocks}")
        if self.data_parallel_size < 1:
            raise ConfigError(f"--data-parallel-size must be >= 1, got {self.data_parallel_size}")
        bad = [m for m in self.dp_routing if m not in DP_ROUTING_MODES]
        if bad or not self.dp_routing:
            raise ConfigError(f"--dp-routing takes {' and/or '.join(DP_ROUTING_MODES)}, "
                              f"comma-separated; got {list(self.dp_routing)}")
        if "blind" in self.dp_routing and self.data_parallel_size == 1:
            raise ConfigError("--dp-routing blind needs --data-parallel-size 2 or more: "
                              "with one rank there is no rank to pick")
        for policy in self.policies:
            make_policy(policy, random.Random(0), **self.run_policy_params(policy))
        self.engine_profile().engine_config()
        if not (math.isfinite(self.link_gbps) and self.link_gbps > 0):
            raise ConfigError(f"--link-gbps must be > 0, got {self.link_gbps}")
        self.roles()
        self.disagg()
        if self.routers < 1:
            raise ConfigError(f"--routers must be >= 1, got {self.routers}")
        if self.routers > 1 and len(self.dp_routing) > 1:
            raise ConfigError("--routers > 1 runs three arrangements per policy; give one "
                              "--dp-routing mode with it")
        self.router_arrangements()


DP_ROUTING_MODES: Final = ("aware", "blind")
"""Who picks a data-parallel rank: the router (``aware``) or the engine's API server."""


def build_workload(spec: SimBenchSpec, *, rate_scale: float, seed: int) -> list[WorkloadRequest]:
    """The request stream for one (rate, seed) cell."""
    if spec.workload == "trace":
        return mooncake(spec.trace, limit=spec.limit, rate_scale=rate_scale,
                        block_tokens=spec.block_tokens, jitter_s=spec.jitter_s, seed=seed,
                        sessions=spec.trace_sessions)
    params = dict(spec.workload_params)
    params.setdefault("seed", seed)
    requests = WORKLOADS[spec.workload](**params)
    if spec.limit is not None:
        requests = requests[: spec.limit]
    if rate_scale != 1.0:
        requests = [_rescaled(r, rate_scale) for r in requests]
    return requests


def _rescaled(request: WorkloadRequest, rate_scale: float) -> WorkloadRequest:
    from dataclasses import replace

    return replace(request, arrival_s=request.arrival_s / rate_scale)


def run_sim_bench(
    spec: SimBenchSpec,
    *,
    on_run_start: Callable[[str, float, int, int], None] | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> tuple[dict[str, Any], dict[tuple[str, float, int], FleetResult]]:
    """Run every (rate, seed, policy) cell; return the JSON report and the raw results."""
    spec.validate()
    profile = spec.engine_profile()
    shared_blocks = spec.shared_store_blocks()
    shared_load = spec.block_bytes(profile) / (spec.shared_gbps * 1e9)
    results: dict[tuple[str, float, int], FleetResult] = {}
    runs: list[dict[str, Any]] = []
    for rate in spec.rate_scales:
        for seed in spec.seeds:
            workload = build_workload(spec, rate_scale=rate, seed=seed)
            digests = DigestCache(BlockHasher("sha256", profile.block_size))
            for policy, mode, routers in ((p, m, r) for p in spec.policies
                                          for m in spec.dp_routing
                                          for r in spec.router_arrangements()):
                label = policy if mode == "aware" else f"{policy}/rank-blind"
                if routers is not None:
                    label = f"{label}/{routers.label()}"
                if on_run_start is not None:
                    on_run_start(label, rate, seed, len(workload))
                config = FleetConfig(num_replicas=spec.replicas, profile=profile, policy=policy,
                                     policy_params=spec.run_policy_params(policy),
                                     seed=seed, ttft_slo_s=spec.ttft_slo_s,
                                     itl_slo_s=spec.itl_slo_s,
                                     shared_store_blocks=shared_blocks,
                                     shared_load_s_per_block=shared_load,
                                     data_parallel_size=spec.data_parallel_size,
                                     rank_blind=mode == "blind",
                                     roles=spec.roles(), disagg=spec.disagg())
                started = time.perf_counter()
                simulation = (
                    FleetSimulation(config, workload, digests=digests, progress=on_progress)
                    if routers is None else
                    SeveralRoutersSimulation(config, workload, routers, digests=digests,
                                             progress=on_progress))
                result = simulation.run()
                wall = time.perf_counter() - started
                results[(label, rate, seed)] = result
                summary = {**result.summary(),
                           "group_replicas_mean": group_replicas_mean(workload, result.records)}
                runs.append({"policy": label, "rate_scale": rate, "seed": seed,
                             "wall_s": round(wall, 3), **summary})
    report = {
        "policies": _aggregate(runs, spec.rate_scales),
        "config": _config_block(spec, profile_source=profile.source),
        "runs": runs,
    }
    return report, results


def run_bounds(spec: SimBenchSpec) -> dict[int, BoundsReport]:
    """What no router can beat on the workload (``bench.bounds``), per seed.

    Bounds do not depend on the arrival rate (only on the arrival order), so they are
    computed at the first rate scale. A trace replayed without jitter is the same request
    stream for every seed: it is bounded once, under the first seed.
    """
    spec.validate()
    profile = spec.engine_profile()
    seeds = spec.seeds
    if spec.workload == "trace" and not spec.jitter_s:
        seeds = seeds[:1]
    return {
        seed: compute_bounds(build_workload(spec, rate_scale=spec.rate_scales[0], seed=seed),
                             profile, spec.replicas * spec.data_parallel_size,  # engines
                             shared_blocks=spec.shared_store_blocks())
        for seed in seeds
    }


def _aggregate(runs: Sequence[dict[str, Any]], scales: Sequence[float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    for policy in policies:
        by_rate: dict[str, Any] = {}
        for scale in scales:
            cell = [r for r in runs if r["policy"] == policy and r["rate_scale"] == scale]
            agg: dict[str, Any] = {}
            spread: dict[str, list[float]] = {}
            for metric in HEADLINE_METRICS:
                values = [float(r[metric]) for r in cell]
                agg[metric] = sum(values) / len(values)
                spread[metric] = [min(values), max(values)]
            agg["requests"] = int(agg["requests"])
            agg["preemptions"] = round(agg["preemptions"])
            agg["spread"] = spread
            agg["seeds"] = [r["seed"] for r in cell]
            agg["requests_per_replica"] = cell[0]["requests_per_replica"]
            by_rate[f"{scale:g}"] = agg
        first = dict(by_rate[f"{scales[0]:g}"])
        first["by_rate"] = by_rate
        out[policy] = first
    return out


def _config_block(spec: SimBenchSpec, *, profile_source: str) -> dict[str, Any]:
    trace = spec.workload == "trace"
    return {
        "workload": spec.workload, "trace": spec.trace if trace else None,
        "block_tokens": (spec.block_tokens or trace_block_tokens(spec.trace)) if trace else None,
        "trace_sessions": spec.trace_sessions if trace else None,
        "replicas": spec.replicas, "profile": spec.profile,
        "data_parallel_size": spec.data_parallel_size, "dp_routing": list(spec.dp_routing),
        "profile_source": profile_source, "rate_scales": list(spec.rate_scales),
        "policies": list(spec.policies), "seeds": list(spec.seeds), "limit": spec.limit,
        "ttft_slo_s": spec.ttft_slo_s, "itl_slo_s": spec.itl_slo_s,
        "policy_params": {p: spec.run_policy_params(p) for p in spec.policies},
        "workload_params": spec.workload_params,
        "jitter_s": spec.jitter_s,
        "kv": {"num_gpu_blocks": spec.engine_profile().num_gpu_blocks,
               "cpu_offload_blocks": spec.engine_profile().cpu_offload_blocks,
               "cpu_gbps": spec.cpu_gbps if spec.cpu_tier else None,
               "shared_store_blocks": spec.shared_store_blocks(),
               "shared_gbps": spec.shared_gbps if spec.shared_store else None,
               "kv_bytes_per_token": spec.kv_bytes_per_token},
        "routers": ({"count": spec.routers, "bus_delay_s": spec.bus_delay_s,
                     "bus_batch_s": spec.bus_batch_s, "front": spec.front}
                    if spec.routers > 1 else None),
        "pd": ({"layout": spec.pd.upper(), "split": spec.split, "link_gbps": spec.link_gbps}
               if spec.pd else None),
        "git_sha": git_sha(), "python": sys.version.split()[0], "machine": platform.machine(),
    }


COMPACT_COLUMNS = ("policy", "hit rate", "TTFT mean", "ITL/req mean", "E2E mean", "SLO good",
                   "done", "per replica")
"""The columns ``format_table(compact=True)`` keeps, for narrow terminals (``kvroute demo``)."""


def format_table(report: dict[str, Any], *, compact: bool = False) -> list[list[str]]:
    """Rows of the printed table: one per policy at the first rate scale.

    ITL columns: ``ITL`` pools every token gap, ``ITL/req`` is each request's own mean gap
    (mean and p99 over requests); ``SLO good`` counts requests within both objectives
    (``config.ttft_slo_s`` and ``config.itl_slo_s``, which :func:`table_title` states), per
    second and as a share of all; ``idle 2x`` is the share of the run's load samples in which
    a replica sat idle while another ran more than twice the fleet's mean load.
    """
    rows = [["policy", "hit rate", "TTFT mean", "TTFT p99", "ITL mean", "ITL p99",
             "ITL/req mean", "ITL/req p99", "E2E mean", "E2E p99", "SLO good/s", "SLO good",
             "preempt", "idle 2x", "done", "per replica"]]
    for name, m in report["policies"].items():
        per = m["requests_per_replica"]
        rows.append([
            name, f"{m['token_hit_rate']:.3f}", f"{m['ttft_mean_s']:.3f}s",
            f"{m['ttft_p99_s']:.3f}s", f"{m['itl_mean_s'] * 1e3:.1f}ms",
            f"{m['itl_p99_s'] * 1e3:.1f}ms", f"{m['itl_request_mean_s'] * 1e3:.1f}ms",
            f"{m['itl_request_p99_s'] * 1e3:.1f}ms", f"{m['e2e_mean_s']:.2f}s",
            f"{m['e2e_p99_s']:.2f}s", f"{m['slo_goodput_rps']:.2f}",
            f"{m['slo_goodput_fraction']:.1%}", str(m["preemptions"]),
            f"{m.get('idle_while_overloaded', 0.0):.1%}", f"{m['completed']:.0f}/{m['requests']}", "/".join(str(v) for v in per.values()),
        ])
    if any(m.get("tier_hit_rate", 0.0) for m in report["policies"].values()):
        # offload tiers: the share of prompt tokens loaded from them, beside the device hits
        rows[0].insert(2, "tier hits")
        for row, m in zip(rows[1:], report["policies"].values()):
            row.insert(2, f"{m['tier_hit_rate']:.3f}")
    if any(m.get("split_fraction", 0.0) for m in report["policies"].values()):
        rows[0].insert(-2, "split")  # prefill/decode: the share of requests split
        for row, m in zip(rows[1:], report["policies"].values()):
            row.insert(-2, f"{m['split_fraction']:.1%}")
    if any(m.get("spread_copies", 0) for m in report["policies"].values()):
        # spread-ahead's bill: copies sent, their prompt tokens against the workload's own
        rows[0].insert(-2, "spread copies")
        for row, m in zip(rows[1:], report["policies"].values()):
            copied = m.get("spread_copy_tokens", 0)
            share = copied / m["prompt_tokens"] if m.get("prompt_tokens") else 0.0
            row.insert(-2, f"{m.get('spread_copies', 0)} ({copied / 1e6:.1f}M tok, "
                           f"{share:.1%})")
    if report["config"].get("routers") and any(
            m.get("group_replicas_mean", 0.0) for m in report["policies"].values()):
        # several routers on a workload of sibling groups: how far each group scattered
        rows[0].insert(-2, "replicas/group")
        for row, m in zip(rows[1:], report["policies"].values()):
            row.insert(-2, f"{m.get('group_replicas_mean', 0.0):.2f}")
    if compact:
        keep = [i for i, head in enumerate(rows[0]) if head in COMPACT_COLUMNS]
        rows = [[row[i] for i in keep] for row in rows]
    return rows


def table_title(report: dict[str, Any]) -> str:
    """The printed table's title: the workload, the fleet, the rate and the SLO."""
    c = report["config"]
    name = c["trace"] if c["workload"] == "trace" else c["workload"]
    dp = c.get("data_parallel_size", 1)
    ranks = f" x {dp} DP ranks" if dp > 1 else ""
    routers = c.get("routers")
    front = f", {routers['front'].replace('_', '-')} front" if routers else ""
    return (f"{name}: {c['replicas']} replicas{ranks}{front}, {c['profile']}, "
            f"rate x{c['rate_scales'][0]:g}, "
            f"SLO TTFT <= {c['ttft_slo_s']:g} s and ITL/req <= {c['itl_slo_s'] * 1e3:g} ms")


def write_plots(report: dict[str, Any], results: dict[tuple[str, float, int], FleetResult],
                out_dir: Path) -> list[Path]:
    """TTFT CDF per policy, hit rate and p99 TTFT against rate, per-replica load over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig: Figure, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    scales = report["config"]["rate_scales"]
    seed0 = report["config"]["seeds"][0]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in report["policies"]:
        res = results[(policy, scales[0], seed0)]
        ttfts = sorted(r.ttft_s for r in res.records if r.ttft_s is not None)
        if ttfts:
            ax.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF (rate x{scales[0]:g}, seed {seed0})")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save(fig, "ttft_cdf.png")

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for policy, m in report["policies"].items():
        xs = [float(s) for s in m["by_rate"]]
        ax1.plot(xs, [m["by_rate"][s]["token_hit_rate"] for s in m["by_rate"]], "o-", label=policy)
        ax2.plot(xs, [m["by_rate"][s]["ttft_p99_s"] for s in m["by_rate"]], "o-", label=policy)
    ax1.set_xlabel("arrival rate scale")
    ax1.set_ylabel("token hit rate")
    ax2.set_xlabel("arrival rate scale")
    ax2.set_ylabel("TTFT p99 (s)")
    ax2.set_yscale("log")
    ax1.legend(fontsize=8)
    for a in (ax1, ax2):
        a.grid(alpha=0.3)
    save(fig, "vs_rate.png")

    policies = list(report["policies"])
    fig, axes = plt.subplots(len(policies), 1, figsize=(9, 1.8 * len(policies)), sharex=True,
                             squeeze=False)
    for ax, policy in zip(axes[:, 0], policies):
        res = results[(policy, scales[0], seed0)]
        if res.load_samples:
            times = [t for t, _ in res.load_samples]
            for i, name in enumerate(res.replica_names):
                ax.plot(times, [loads[i] for _, loads in res.load_samples], lw=0.8, label=name)
        ax.set_ylabel(policy, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("virtual time (s): running + waiting requests per replica")
    save(fig, "load_over_time.png")
    return written
