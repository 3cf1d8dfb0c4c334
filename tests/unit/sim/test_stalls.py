"""The simulated engine's own stalls on ``/metrics`` (``sim/stalls.py``)."""

from __future__ import annotations

import gc

from kvroute.sim.stalls import STALL_BOUNDS_S, EngineStalls
from kvroute.wire.prom import parse_exposition


def test_both_histograms_render_as_cumulative_prometheus_buckets() -> None:
    stalls = EngineStalls()
    for late in (0.0005, 0.002, 0.07, 3.0):
        stalls.step_lateness.observe(late)
    samples = parse_exposition(stalls.render(), names=("kvroute_sim_",)).samples
    late = {s.labels["le"]: s.value for s in samples
            if s.name == "kvroute_sim_step_lateness_seconds_bucket"}
    assert len(late) == len(STALL_BOUNDS_S) + 1
    assert (late["0.001"], late["0.005"], late["0.05"], late["0.1"], late["1.0"],
            late["+Inf"]) == (1, 2, 2, 3, 3, 4)
    sums = {s.name: s.value for s in samples if s.name.endswith(("_sum", "_count"))}
    assert sums["kvroute_sim_step_lateness_seconds_count"] == 4
    assert abs(sums["kvroute_sim_step_lateness_seconds_sum"] - 3.0725) < 1e-9
    assert sums["kvroute_sim_gc_pause_seconds_count"] == 0


def test_the_process_collections_are_timed_until_stopped() -> None:
    stalls = EngineStalls()
    stalls.watch_gc()
    try:
        gc.collect()
    finally:
        stalls.stop()
    counted = stalls.gc_pause.count
    assert counted >= 1
    gc.collect()
    assert stalls.gc_pause.count == counted
