"""``kvroute bench scenarios``: the recompute bills of model-bound cache scenarios, in virtual time.

One trace with sessions (the bundled ``claude_code_agentic_64``, Mooncake format, by default)
is replayed through the simulated fleet (``sim/fleet.py``, the production walk) once per
scenario variant, side by side:

* ``upgrade cold`` / ``upgrade warm``: half of the pool restarts on new weights at
  ``switch_s`` (drained, cache dropped, back ``down_s`` later); the route's upgrade setting
  moves sessions to the new version at their next turn, at once (cold) or after warming the new
  replicas in shadow with the hottest sessions' prompts within ``warm_budget_tokens``;
* ``ab sticky`` / ``ab per-request``: the fleet split into two pools of equal size, 1:1, each
  session on one arm for good, or every request drawn anew;
* ``failover cold`` / ``failover warm``: a primary and a backup pool of equal size; every
  primary replica refuses connections from ``switch_s`` for ``outage_s``; the backup takes
  the route, and the route comes back ``back_after_s`` after the primary is usable; warm:
  the backup is also warmed in shadow every ``warm_interval_s`` with the sessions active since
  the last warm-up, within ``warm_budget_tokens``.

Figures per variant: the recompute bill (``recompute_tokens``: prompt tokens sessions had
cached and prefilled again because the scenario moved them, ``core/scenarios.recompute_bill``)
and the moves; the shadow warm-ups' prompt tokens sent and the tokens the engines actually
prefilled for them (the rest was already cached there); the engines' token hit rate; TTFT mean and p99
over the run and p99 in the ``window_s`` after ``switch_s`` (the switch, when the bill is paid);
E2E p99; failed requests. Every variant runs the same requests on the same engines.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvroute.bench.provenance import git_sha
from kvroute.bench.workloads import mooncake
from kvroute.core.errors import ConfigError
from kvroute.core.hashing import BlockHasher
from kvroute.core.scenarios import (
    AbArm,
    AbSplitSettings,
    FailoverSettings,
    RouteScenarios,
    UpgradeSettings,
)
from kvroute.core.stats import mean, percentile
from kvroute.core.types import PoolName
from kvroute.sim.fleet import (
    SHADOW_PREFIX,
    DigestCache,
    FleetConfig,
    FleetResult,
    FleetSimulation,
    Outage,
    Restart,
    SimPool,
)
from kvroute.sim.profiles import get_profile
from kvroute.sim.workload import WorkloadRequest

__all__ = ["VARIANTS", "ScenariosBenchSpec", "format_table", "run_scenarios_bench"]

VARIANTS = ("upgrade cold", "upgrade warm", "ab sticky", "ab per-request", "failover cold",
            "failover warm")


@dataclass(frozen=True, slots=True)
class ScenariosBenchSpec:
    """What to run (module docstring). ``replicas`` is the whole fleet (even: A/B and
    failover split it in two pools)."""

    trace: str = "claude_code_agentic_64"
    limit: int | None = None
    rate_scale: float = 1.0
    replicas: int = 8
    profile: str = "llama-3.1-8b-h100"
    switch_s: float = 600.0
    window_s: float = 120.0
    down_s: float = 30.0
    outage_s: float = 300.0
    back_after_s: float = 30.0
    warm_budget_tokens: int = 300_000
    warm_interval_s: float = 30.0
    variants: tuple[str, ...] = VARIANTS
    seed: int = 0

    def validate(self) -> None:
        if self.replicas < 2 or self.replicas % 2:
            raise ConfigError(f"--replicas must be an even number >= 2, got {self.replicas}")
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown:
            raise ConfigError(f"unknown variants {unknown}; choose from: {', '.join(VARIANTS)}")
        if self.switch_s < 0 or self.window_s <= 0 or self.outage_s <= 0:
            raise ConfigError("--switch must be >= 0, --window and --outage > 0 seconds")
        get_profile(self.profile)


def _fleet(spec: ScenariosBenchSpec, variant: str) -> FleetConfig:
    profile = get_profile(spec.profile)
    half = spec.replicas // 2
    if variant.startswith("upgrade"):
        budget = spec.warm_budget_tokens if variant.endswith("warm") else 0
        restarts = tuple(Restart(f"r{i}", spec.switch_s, "v2", down_s=spec.down_s)
                         for i in range(half))
        return FleetConfig(num_replicas=spec.replicas, profile=profile, seed=spec.seed,
                           restarts=restarts, scenarios=RouteScenarios(
                               upgrade=UpgradeSettings(warm_budget_tokens=budget)))
    if variant.startswith("ab"):
        pools = (SimPool("a", profile, half), SimPool("b", profile, half))
        split = AbSplitSettings((AbArm(PoolName("a"), 1.0), AbArm(PoolName("b"), 1.0)),
                                sticky=variant == "ab sticky")
        return FleetConfig.tiered(pools, tier_mode="none", seed=spec.seed,
                                  scenarios=RouteScenarios(ab_split=split))
    pools = (SimPool("primary", profile, half), SimPool("backup", profile, half))
    budget = spec.warm_budget_tokens if variant.endswith("warm") else 0
    outages = tuple(Outage(f"primary-r{i}", spec.switch_s, spec.switch_s + spec.outage_s)
                    for i in range(half))
    failover = FailoverSettings(PoolName("primary"), PoolName("backup"),
                                back_after_s=spec.back_after_s, warm_budget_tokens=budget,
                                warm_interval_s=spec.warm_interval_s)
    return FleetConfig.tiered(pools, tier_mode="none", seed=spec.seed, outages=outages,
                              scenarios=RouteScenarios(failover=failover))


def _row(spec: ScenariosBenchSpec, variant: str, result: FleetResult) -> dict[str, Any]:
    counters = result.counters
    scenario = variant.split()[0]
    done = [r for r in result.records if r.finish_s is not None and not r.rejected]
    ttfts = sorted(t for r in done if (t := r.ttft_s) is not None)
    window = sorted(t for r in done if (t := r.ttft_s) is not None
                    and spec.switch_s <= r.arrival_s < spec.switch_s + spec.window_s)
    e2e = sorted(t for r in done if (t := r.e2e_s) is not None)
    summary = result.summary()
    shadow = [r for r in result.warm_records if r.request_id.startswith(SHADOW_PREFIX)]
    by_arm: dict[str, dict[str, float]] = {}
    for arm in sorted({r.arm for r in done if r.arm is not None}):
        mine = [r for r in done if r.arm == arm]
        arm_ttft = sorted(t for r in mine if (t := r.ttft_s) is not None)
        by_arm[arm] = {
            "requests": len(mine),
            "hit_rate": sum(r.num_cached_tokens for r in mine)
            / max(1, sum(r.num_prompt_tokens for r in mine)),
            "ttft_mean_s": mean(arm_ttft, 0.0), "ttft_p99_s": percentile(arm_ttft, 99, 0.0),
            "recompute_tokens": sum(r.recompute_tokens for r in mine),
        }
    return {
        "variant": variant,
        "requests": len(result.records),
        "failed": sum(1 for r in result.records if r.rejected),
        "unfinished": sum(1 for r in result.records if r.finish_s is None and not r.rejected),
        "recompute_tokens": counters.get(f"recompute_tokens_{scenario}", 0)
        + counters.get("recompute_tokens_version", 0),
        "moves": counters.get(f"moves_{scenario}", 0) + counters.get("moves_version", 0),
        "shadow_warm_tokens": counters.get(f"shadow_warm_tokens_{scenario}", 0),
        "shadow_prefill_tokens": sum(max(0, r.num_prompt_tokens - r.num_cached_tokens)
                                     for r in shadow if r.first_token_s is not None),
        "token_hit_rate": summary["token_hit_rate"],
        "ttft_mean_s": mean(ttfts, 0.0),
        "ttft_p99_s": percentile(ttfts, 99, 0.0),
        "switch_ttft_p99_s": percentile(window, 99, 0.0),
        "switch_requests": len(window),
        "e2e_p99_s": percentile(e2e, 99, 0.0),
        "by_arm": by_arm,
    }


def run_scenarios_bench(spec: ScenariosBenchSpec, *,
                        on_start: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """Run every variant on the same requests; the JSON report."""
    spec.validate()
    profile = get_profile(spec.profile)
    workload: list[WorkloadRequest] = mooncake(spec.trace, limit=spec.limit,
                                               rate_scale=spec.rate_scale)
    if not any(r.session_id for r in workload):
        raise ConfigError(f"trace {spec.trace!r} carries no sessions; the scenarios move "
                          "sessions: use claude_code_agentic_64 or a trace with session_id")
    digests = DigestCache(BlockHasher("sha256", profile.block_size))
    rows = []
    for variant in spec.variants:
        if on_start is not None:
            on_start(variant, len(workload))
        result = FleetSimulation(_fleet(spec, variant), workload, digests=digests).run()
        rows.append(_row(spec, variant, result))
    return {"variants": rows, "config": {
        "trace": spec.trace, "limit": spec.limit, "rate_scale": spec.rate_scale,
        "replicas": spec.replicas, "profile": spec.profile, "switch_s": spec.switch_s,
        "window_s": spec.window_s, "down_s": spec.down_s, "outage_s": spec.outage_s,
        "back_after_s": spec.back_after_s, "warm_budget_tokens": spec.warm_budget_tokens,
        "warm_interval_s": spec.warm_interval_s, "seed": spec.seed, "git": git_sha()}}


def format_table(report: dict[str, Any]) -> list[list[str]]:
    """The report as table rows (the first row is the header)."""
    rows = [["variant", "requests", "failed", "moves", "recompute tok", "shadow warm tok",
             "warm prefill tok", "hit rate", "TTFT mean", "TTFT p99", "switch TTFT p99",
             "E2E p99"]]
    for v in report["variants"]:
        rows.append([v["variant"], str(v["requests"]), str(v["failed"] + v["unfinished"]),
                     str(v["moves"]), f"{v['recompute_tokens']:,}",
                     f"{v['shadow_warm_tokens']:,}", f"{v['shadow_prefill_tokens']:,}",
                     f"{v['token_hit_rate']:.3f}",
                     f"{v['ttft_mean_s']:.3f}s", f"{v['ttft_p99_s']:.3f}s",
                     f"{v['switch_ttft_p99_s']:.3f}s", f"{v['e2e_p99_s']:.2f}s"])
    return rows
