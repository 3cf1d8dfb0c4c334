"""The simulated fleet with hit reports: a router that forgot its index learns reused blocks
back only from hit reports."""

from __future__ import annotations

from kvroute.bench.workloads import generated_shared_prefix
from kvroute.sim.fleet import FleetConfig, FleetResult, FleetSimulation
from kvroute.sim.profiles import get_profile

H100 = get_profile("llama-3.1-8b-h100")


def run(report_hits: bool) -> tuple[FleetResult, float]:
    # One request a second over four groups: a group's requests are further apart than the
    # router's predicted entries live (2 s), so only events can tell the router what stays.
    workload = generated_shared_prefix(num_groups=4, prompts_per_group=12, system_prompt_len=512,
                                       question_len=32, output_len=8, rate=1.0, seed=1)
    reset_at = max(r.arrival_s for r in workload) / 2
    config = FleetConfig(num_replicas=2, profile=H100, report_hits=report_hits,
                         track_recency=True, index_reset_at_s=reset_at)
    return FleetSimulation(config, workload).run(), reset_at


def _after_reset(result: FleetResult, reset_at: float) -> tuple[int, int]:
    """(requests after the reset, those whose predicted cached tokens equal the engine's)."""
    after = [r for r in result.records if r.arrival_s >= reset_at]
    return len(after), sum(1 for r in after if r.expected_cached_tokens == r.num_cached_tokens)


def test_hit_reports_cost_events_and_restore_the_forgotten_prefixes() -> None:
    off, reset_at = run(False)
    on, _ = run(True)
    assert on.event_counts["hashes_stored"] > off.event_counts["hashes_stored"]
    n_off, agree_off = _after_reset(off, reset_at)
    n_on, agree_on = _after_reset(on, reset_at)
    assert n_off == n_on > 0
    # Incremental events never re-announce the shared system prompts once forgotten: the
    # router predicts misses the engines turn into hits. Hit reports bring them back at the
    # first hit on each replica.
    assert agree_off < n_off
    assert agree_on > agree_off
