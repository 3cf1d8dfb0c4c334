"""``kvroute bench tiers``: context-window tiers, reactive vs proactive vs warm-ahead.

The same growing sessions (``bench.workloads.growing_sessions``: closed-loop turns whose
prompt grows across the small pool's window) are replayed, per seed, through a virtual-time
fleet of two pools (``sim.fleet``: a fast small-window pool and a slow large-window pool)
once per mode:

* ``reactive`` — every request goes to the small pool first; an overflow rejection is parsed
  and recovered from (one doomed round trip per crossing);
* ``proactive`` — ``plan_tier`` chooses the pool before sending;
* ``proactive+warm`` — as proactive, plus warm-ahead of the large pool at ``warm_fraction``.

Metrics per mode (records of every seed pooled): failed requests, doomed attempts,
escalations, the *escalated turns* (the first turn of each session that lands on the large
pool) — their TTFT against a cold prefill of the same prompt on an idle large engine measured
in the same run, and their cached-token fraction from the large engine's own per-request
counter — the small pool's TTFT percentiles, warm-ups fired and skipped by reason, and
answers cut short. ``targets`` checks the issue's goals and reports the measured numbers
whatever they are. JSON shape::

    {"modes": {MODE: {...}}, "targets": {...}, "config": {...}, "runs": [{mode, seed, ...}]}
"""

from __future__ import annotations

import platform
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

from kvroute.bench.provenance import git_sha
from kvroute.bench.workloads import growing_sessions
from kvroute.core.errors import ConfigError
from kvroute.core.hashing import BlockHasher
from kvroute.core.peer_policies import POLICY_NAMES
from kvroute.core.stats import mean, percentile
from kvroute.sim.fleet import (
    DigestCache,
    FleetConfig,
    FleetResult,
    FleetSimulation,
    RequestRecord,
    SimPool,
    TierMode,
)
from kvroute.sim.profiles import get_profile

__all__ = [
    "MODES",
    "TiersBenchSpec",
    "format_table",
    "mode_metrics",
    "run_tiers_bench",
    "targets",
]

MODES: Final = (TierMode.REACTIVE.value, TierMode.PROACTIVE.value, TierMode.PROACTIVE_WARM.value)
SMALL, LARGE = "small", "large"
ESCALATED_TTFT_TARGET: Final = 0.25
"""The escalated turn's TTFT should be at most this fraction of a cold large-pool prefill."""
SMALL_P99_TOLERANCE: Final = 0.05
"""Warm-ahead may worsen the small pool's p99 TTFT by at most 5 %."""


@dataclass(frozen=True, slots=True)
class TiersBenchSpec:
    """What to run (defaults: the issue's 16k/128k pools with the Llama 8B / 70B profiles).

    Attributes:
        sessions: growing sessions (each ends with its first turn over ``small_window``).
        small_window / large_window: the pools' ``max_model_len``.
        small_profile / large_profile: timing profiles (``sim.profiles``).
        replicas_small / replicas_large: engines per pool.
        think_time_s: pause between a turn's last token and the next turn.
        seeds: one run per seed and mode (seeds the workload and the policy).
        system_prompt_tokens / user_tokens / output_tokens: the sessions' shape.
        session_interval_s: gap between session starts.
        policy: the replica-selection policy in both pools.
        warm_fraction / warm_cooldown_s / warm_rewarm_fraction: the warm-ahead planner's
            settings (``warm_rewarm_fraction`` 1.0 = one warm-up per session per cooldown).
        modes: which of ``MODES`` to run.
        with_messages: give requests chat ``messages`` so the estimator reads text (else the
            prompt is token ids and every estimate is exact).
    """

    sessions: int = 16
    small_window: int = 16_384
    large_window: int = 131_072
    small_profile: str = "llama-3.1-8b-h100"
    large_profile: str = "llama-3.1-70b-h100-tp4"
    replicas_small: int = 4
    replicas_large: int = 2
    think_time_s: float = 5.0
    seeds: tuple[int, ...] = (0,)
    system_prompt_tokens: int = 2048
    user_tokens: int = 512
    output_tokens: int = 256
    session_interval_s: float = 2.0
    policy: str = "kvroute"
    warm_fraction: float = 0.6
    warm_cooldown_s: float = 300.0
    warm_rewarm_fraction: float = 0.1
    modes: tuple[str, ...] = MODES
    with_messages: bool = True

    def validate(self) -> None:
        """Raises ``ConfigError`` naming the bad field and the fix."""
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ConfigError(f"modes must be some of {', '.join(MODES)}, got {list(self.modes)}")
        if self.policy not in POLICY_NAMES:
            raise ConfigError(f"unknown policy {self.policy!r}; choose from: "
                              f"{', '.join(POLICY_NAMES)}")  # fmt: skip
        if not self.seeds:
            raise ConfigError("give at least one seed")
        if self.large_window <= self.small_window:
            raise ConfigError(
                f"large_window ({self.large_window}) must be larger than small_window "
                f"({self.small_window}): the large pool is where sessions escalate to"
            )
        get_profile(self.small_profile)
        get_profile(self.large_profile)

    def pools(self) -> tuple[SimPool, SimPool]:
        """The two pools, small first (KV capacity raised to hold one full window if the
        profile's is smaller)."""
        return (_pool(SMALL, self.small_profile, self.replicas_small, self.small_window),
                _pool(LARGE, self.large_profile, self.replicas_large, self.large_window))


def _pool(name: str, profile_name: str, replicas: int, window: int) -> SimPool:
    profile = get_profile(profile_name)
    needed = -(-window // profile.block_size) + 1
    blocks = max(profile.num_gpu_blocks, needed)
    return SimPool(name, profile, replicas, max_model_len=window, num_gpu_blocks=blocks)


def run_tiers_bench(
    spec: TiersBenchSpec,
    *,
    on_run_start: Callable[[str, int, int], None] | None = None,
) -> tuple[dict[str, Any], dict[tuple[str, int], FleetResult]]:
    """Run every (seed, mode) cell; return the JSON report and the raw results.

    Raises:
        ConfigError: an invalid spec.
    """
    spec.validate()
    pools = spec.pools()
    results: dict[tuple[str, int], FleetResult] = {}
    runs: list[dict[str, Any]] = []
    for seed in spec.seeds:
        workload = growing_sessions(
            num_sessions=spec.sessions, window_tokens=spec.small_window,
            system_prompt_tokens=spec.system_prompt_tokens, user_tokens=spec.user_tokens,
            output_tokens=spec.output_tokens, think_time_s=spec.think_time_s,
            session_interval_s=spec.session_interval_s, seed=seed,
            with_messages=spec.with_messages,
        )
        digests = DigestCache(BlockHasher("sha256", pools[0].profile.block_size))
        for mode in spec.modes:
            if on_run_start is not None:
                on_run_start(mode, seed, len(workload))
            config = FleetConfig.tiered(
                pools, tier_mode=mode, policy=spec.policy, seed=seed,
                warm_fraction=spec.warm_fraction, warm_cooldown_s=spec.warm_cooldown_s,
                warm_rewarm_fraction=spec.warm_rewarm_fraction,
            )
            started = time.perf_counter()
            result = FleetSimulation(config, workload, digests=digests).run()
            wall = time.perf_counter() - started
            results[(mode, seed)] = result
            runs.append({"mode": mode, "seed": seed, "wall_s": round(wall, 3),
                         **mode_metrics([result])})
    modes = {mode: mode_metrics([results[(mode, s)] for s in spec.seeds]) for mode in spec.modes}
    report = {"modes": modes, "targets": targets(modes), "config": _config_block(spec),
              "runs": runs}
    return report, results


def mode_metrics(results: Sequence[FleetResult]) -> dict[str, Any]:
    """One mode's metrics over the pooled records of ``results`` (one result per seed)."""
    records = [r for res in results for r in res.records]
    counters: Counter[str] = Counter()
    skips: Counter[str] = Counter()
    queries = hits = 0
    for res in results:
        counters.update(res.counters)
        skips.update(res.warm_skips)
        q, h = res.pool_prefix_cache.get(LARGE, (0, 0))
        queries, hits = queries + q, hits + h
    escalated = [r for r in records if r.first_on_larger and r.ttft_s is not None]
    ratios = [r.ttft_s / r.cold_ttft_s for r in escalated  # type: ignore[operator]
              if r.cold_ttft_s]
    cached = [r.num_cached_tokens / r.num_prompt_tokens for r in escalated if r.num_prompt_tokens]
    small = _ttfts(r for r in records if r.pool == SMALL)
    large = _ttfts(r for r in records if r.pool == LARGE)
    every = _ttfts(records)
    return {
        "requests": len(records),
        "completed": sum(1 for r in records if r.finish_s is not None),
        "failed": sum(1 for r in records if r.rejected),
        "unfinished": sum(1 for r in records if r.finish_s is None and not r.rejected),
        "doomed_attempts": counters["doomed_attempts"],
        "escalations": counters["escalations"],
        "clamp_retries": counters["clamp_retries"],
        "give_ups": counters["give_ups"],
        "no_fit": counters["no_fit"],
        "exact_counts": counters["exact_counts"],
        "escalated_turns": len(escalated),
        "escalated_ttft_mean_s": mean([r.ttft_s for r in escalated], 0.0),  # type: ignore[misc]
        "escalated_ttft_max_s": max((r.ttft_s for r in escalated), default=0.0),  # type: ignore[type-var]
        "cold_ttft_mean_s": mean([r.cold_ttft_s for r in escalated], 0.0),  # type: ignore[misc]
        "escalated_to_cold_mean": mean(ratios, 0.0),
        "escalated_to_cold_max": max(ratios, default=0.0),
        "escalated_cached_fraction_mean": mean(cached, 0.0),
        "escalated_cached_fraction_min": min(cached, default=0.0),
        "large_pool_hit_rate": hits / queries if queries else 0.0,
        "small_ttft_p50_s": percentile(small, 50, 0.0),
        "small_ttft_p99_s": percentile(small, 99, 0.0),
        "large_ttft_p50_s": percentile(large, 50, 0.0),
        "large_ttft_p99_s": percentile(large, 99, 0.0),
        "ttft_p99_s": percentile(every, 99, 0.0),
        "requests_small": sum(1 for r in records if r.pool == SMALL),
        "requests_large": sum(1 for r in records if r.pool == LARGE),
        "warms_fired": counters["warms_fired"],
        "warms_rejected": counters["warms_rejected"],
        "warm_skips": dict(sorted(skips.items())),
        "cut_short": {"router_clamp": counters["cut_short_router_clamp"],
                      "engine_clamp": counters["cut_short_engine_clamp"]},
    }


def targets(modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's goals against the measured figures (``met`` is ``None`` when a mode the
    goal needs was not run)."""
    out: dict[str, Any] = {}
    proactive = [m for m in (TierMode.PROACTIVE.value, TierMode.PROACTIVE_WARM.value) if m in modes]
    out["zero_failed_proactive"] = {
        "failed": {m: modes[m]["failed"] for m in proactive},
        "doomed_attempts": {m: modes[m]["doomed_attempts"] for m in proactive},
        "met": all(modes[m]["failed"] == 0 and modes[m]["doomed_attempts"] == 0
                   for m in proactive) if proactive else None,
    }
    warm = modes.get(TierMode.PROACTIVE_WARM.value)
    out["escalated_ttft_vs_cold"] = {
        "target": ESCALATED_TTFT_TARGET,
        "measured_mean": warm["escalated_to_cold_mean"] if warm else None,
        "measured_max": warm["escalated_to_cold_max"] if warm else None,
        "met": (warm["escalated_turns"] > 0
                and warm["escalated_to_cold_max"] <= ESCALATED_TTFT_TARGET) if warm else None,
    }
    cold = modes.get(TierMode.PROACTIVE.value)
    if warm and cold and cold["small_ttft_p99_s"] > 0:
        change = warm["small_ttft_p99_s"] / cold["small_ttft_p99_s"] - 1.0
        out["small_p99_with_warm"] = {"target_max_change": SMALL_P99_TOLERANCE,
                                      "measured_change": change,
                                      "met": change <= SMALL_P99_TOLERANCE}
    else:
        out["small_p99_with_warm"] = {"target_max_change": SMALL_P99_TOLERANCE,
                                      "measured_change": None, "met": None}
    return out


def format_table(report: dict[str, Any]) -> list[list[str]]:
    """Rows of the printed table: one per mode."""
    rows = [["mode", "failed", "doomed", "escal.", "esc. TTFT", "cold TTFT", "esc/cold mean/max",
             "esc. cached", "small p50", "small p99", "warms", "cut short", "done"]]
    for mode, m in report["modes"].items():
        cut = m["cut_short"]
        rows.append([
            mode, str(m["failed"]), str(m["doomed_attempts"]), str(m["escalations"]),
            f"{m['escalated_ttft_mean_s']:.3f}s", f"{m['cold_ttft_mean_s']:.3f}s",
            f"{m['escalated_to_cold_mean']:.2f}/{m['escalated_to_cold_max']:.2f}",
            f"{m['escalated_cached_fraction_mean']:.2f}", f"{m['small_ttft_p50_s']:.3f}s",
            f"{m['small_ttft_p99_s']:.3f}s", str(m["warms_fired"]),
            str(cut["router_clamp"] + cut["engine_clamp"]),
            f"{m['completed']}/{m['requests']}",
        ])
    return rows


def _ttfts(records: Iterable[RequestRecord]) -> list[float]:
    return [t for t in (r.ttft_s for r in records) if t is not None]


def _config_block(spec: TiersBenchSpec) -> dict[str, Any]:
    config = asdict(spec)
    config.update(
        seeds=list(spec.seeds), modes=list(spec.modes),
        small_profile_source=get_profile(spec.small_profile).source,
        large_profile_source=get_profile(spec.large_profile).source,
        tokenize_rtt_s=FleetConfig.__dataclass_fields__["tokenize_rtt_s"].default,
        overflow_rtt_s=FleetConfig.__dataclass_fields__["overflow_rtt_s"].default,
        git_sha=git_sha(), python=sys.version.split()[0], machine=platform.machine(),
    )
    return config
