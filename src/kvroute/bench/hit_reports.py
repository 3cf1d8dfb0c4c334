"""What ``kv_cache_report_mode: "full"`` costs and buys, measured on the simulator.

Owns ``kvroute bench hit-reports``: one trace replayed twice on the same virtual-time fleet,
hit reports off (vLLM's default, ``incremental``) and on (``FleetConfig.report_hits``), with
the router keeping each replica's LRU order in both runs (``core/recency.py``), and the
router's index reset once mid-run (``index_reset_at_s``: a restarted router, or event streams
with unrecoverable gaps). Per run:

* **cost**: KV events and block hashes delivered to the router per virtual second, and the
  router's thread CPU spent applying them (machine-dependent, the only such figure);
* **index accuracy after the reset**: the share of requests whose predicted cached tokens
  equal the engine's, and the share of the engine's cached tokens the index did not predict
  (blocks the engine keeps reusing but never stores again are invisible to an incremental
  index once it forgot them);
* **LRU order**: where each block the engine removed stood in the router's order (0 = the
  oldest block the replica held, 1 = the newest); a router that sees hits ranks evictions
  near 0;
* **hit rate**: the engines' token hit rate (the routing policy does not read recency, so it
  moves only through the index's better knowledge after the reset).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvroute.bench.sim_bench import SimBenchSpec, build_workload
from kvroute.core.errors import ConfigError
from kvroute.core.hashing import BlockHasher
from kvroute.sim.fleet import DigestCache, FleetConfig, FleetResult, FleetSimulation
from kvroute.sim.profiles import get_profile

__all__ = ["HitReportSpec", "run_hit_reports"]


@dataclass(frozen=True, slots=True)
class HitReportSpec:
    """What to replay.

    Attributes:
        trace: a bundled trace (``mooncake_conversation``, ``claude_code_agentic_64``...).
        limit: its first N requests.
        replicas: engines in the fleet.
        profile: timing profile name.
        num_gpu_blocks: KV blocks per engine (None: the profile's); smaller means more
            evictions, which the LRU score needs.
        reset_fraction: when the router's index is reset, as a fraction of the last arrival
            time (None: never).
        seed: the policy's seed.
    """

    trace: str = "mooncake_conversation"
    limit: int | None = 2000
    replicas: int = 4
    profile: str = "llama-3.1-8b-h100"
    num_gpu_blocks: int | None = None
    reset_fraction: float | None = 0.5
    seed: int = 0

    def validate(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"--replicas must be >= 1, got {self.replicas}")
        if self.reset_fraction is not None and not 0 < self.reset_fraction < 1:
            raise ConfigError(f"--reset-at must be in (0, 1), got {self.reset_fraction}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 2:
            raise ConfigError(f"--num-gpu-blocks must be >= 2, got {self.num_gpu_blocks}")
        get_profile(self.profile)


def run_hit_reports(spec: HitReportSpec) -> dict[str, Any]:
    """Both runs of ``spec``; the JSON report (``runs``: ``off`` then ``on``)."""
    spec.validate()
    profile = get_profile(spec.profile)
    if spec.num_gpu_blocks is not None:
        profile = dataclasses.replace(profile, num_gpu_blocks=spec.num_gpu_blocks)
    workload = build_workload(SimBenchSpec(trace=spec.trace, limit=spec.limit), rate_scale=1.0,
                              seed=spec.seed)
    if not workload:
        raise ConfigError(f"trace {spec.trace!r} gave no requests")
    last = max(r.arrival_s for r in workload)
    reset_at = None if spec.reset_fraction is None else last * spec.reset_fraction
    digests = DigestCache(BlockHasher("sha256", profile.block_size))
    runs: dict[str, Any] = {}
    for name, report in (("off", False), ("on", True)):
        config = FleetConfig(num_replicas=spec.replicas, profile=profile, seed=spec.seed,
                             report_hits=report, track_recency=True, index_reset_at_s=reset_at)
        sim = FleetSimulation(config, workload, digests=digests)
        result = sim.run()
        recency = sim.router.recency
        assert recency is not None, "track_recency=True builds the order"
        runs[name] = _summary(result, reset_at, recency.stats().mean_position)
    return {"config": {"trace": spec.trace, "requests": len(workload), "replicas": spec.replicas,
                       "profile": profile.name, "num_gpu_blocks": profile.num_gpu_blocks,
                       "block_size": profile.block_size, "reset_at_s": reset_at,
                       "seed": spec.seed},
            "runs": runs}


def _summary(result: FleetResult, reset_at: float | None,
             eviction_position: float | None) -> dict[str, Any]:
    counts = result.event_counts
    span = max(result.end_s, 1e-9)
    after = [r for r in result.records
             if r.first_token_s is not None and (reset_at is None or r.arrival_s >= reset_at)]
    agree = sum(1 for r in after if r.expected_cached_tokens == r.num_cached_tokens)
    cached = sum(r.num_cached_tokens for r in after)
    missed = sum(max(0, r.num_cached_tokens - r.expected_cached_tokens) for r in after)
    hashes = counts.get("hashes_stored", 0) + counts.get("hashes_removed", 0)
    cpu_s = counts.get("event_apply_ns", 0) / 1e9
    queries = result.prefix_cache_queries
    return {
        "events_per_s": round((counts.get("events_stored", 0)
                               + counts.get("events_removed", 0)) / span, 1),
        "hashes_per_s": round(hashes / span, 1),
        "hashes_stored": counts.get("hashes_stored", 0),
        "router_event_cpu_s": round(cpu_s, 3),
        "router_cpu_us_per_hash": round(cpu_s * 1e6 / hashes, 3) if hashes else None,
        "requests_after_reset": len(after),
        "predicted_equals_engine": round(agree / len(after), 4) if after else None,
        "cached_tokens_unpredicted": round(missed / cached, 4) if cached else None,
        "eviction_position_mean": (None if eviction_position is None
                                   else round(eviction_position, 4)),
        "token_hit_rate": round(result.prefix_cache_hits / queries, 4) if queries else None,
        "virtual_s": round(result.end_s, 1),
    }
