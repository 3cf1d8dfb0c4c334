"""Spread-ahead in the simulated fleet (``core/spread.py`` decided by the walk, carried out
by ``sim/fleet.py``): copies are sent, their prefill runs on the target engine in virtual
time, and the bill is in the run's summary."""

from __future__ import annotations

from kvroute.bench import workloads as W
from kvroute.sim.fleet import SHADOW_PREFIX, FleetConfig, FleetResult, simulate
from kvroute.sim.profiles import get_profile

H100 = get_profile("llama-3.1-8b-h100")


def run(**params: float | bool) -> FleetResult:
    workload = W.growing_sessions(num_sessions=12, window_tokens=12_000,
                                  system_prompt_tokens=512, user_tokens=1_024,
                                  output_tokens=256, think_time_s=4.0, session_interval_s=0.3)
    return simulate(workload, FleetConfig(num_replicas=4, profile=H100, policy="kvroute",
                                          policy_params=params, seed=1))


def test_copies_are_sent_run_on_their_target_and_are_billed() -> None:
    result = run(spread_ahead=True, spread_min_tokens=1_000, spread_overlap=0.0,
                 spread_per_s=10.0)
    copies = [r for r in result.warm_records
              if r.request_id.startswith(f"{SHADOW_PREFIX}spread")]
    assert copies, "no spread-ahead copy was sent"
    assert result.counters["shadow_warms_spread"] == len(copies)
    summary = result.summary()
    assert summary["spread_copies"] == len(copies)
    assert summary["spread_copy_tokens"] == sum(r.num_prompt_tokens for r in copies) > 0
    homes: dict[str, str] = {}
    for r in sorted(result.records + copies, key=lambda r: r.arrival_s):
        if r in copies:
            assert r.replica != homes[r.session_id or ""]  # never to where it rests
            assert r.requested_max_tokens == 1
            # its prefill ran on the target's engine, in virtual time
            assert r.first_token_s is not None and r.first_token_s > r.arrival_s
            assert r.num_cached_tokens < r.num_prompt_tokens
        elif r.session_id is not None and r.replica:
            homes[r.session_id] = r.replica
    assert all(r.finish_s is not None for r in result.records)


def test_no_copy_when_spread_ahead_is_off() -> None:
    result = run(spread_ahead=False)
    assert not any(r.request_id.startswith(f"{SHADOW_PREFIX}spread")
                   for r in result.warm_records)
    assert result.summary()["spread_copies"] == 0
