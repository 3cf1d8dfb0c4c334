"""``kvroute bench soak`` end to end, short: real engines and router processes on loopback."""

from __future__ import annotations

import os

import pytest

from kvroute.bench.soak import SoakSpec, run_soak

pytestmark = pytest.mark.integration


def test_a_short_soak_reports_every_window_with_the_routers_state() -> None:
    usable = sorted(os.sched_getaffinity(0))
    # The router on a CPU of its own where there are two (``--router-cpus``), as deployed.
    router_cpus = frozenset(usable[-1:]) if len(usable) >= 2 else None
    spec = SoakSpec(seconds=6.0, rate=40.0, engines=2, sample_s=2.0, max_pins=10,
                    num_gpu_blocks=1024, warmup_s=2.0, router_cpus=router_cpus)
    samples: list[dict[str, object]] = []
    report = run_soak(spec, on_sample=lambda row: samples.append(dict(row)))
    summary = report["summary"]
    assert summary["requests"] == 240 and summary["completed"] == 240, summary
    assert summary["errors"] == {}
    assert samples == report["samples"] and len(samples) >= 4
    windows = report["windows"]
    assert len(windows) == len(samples) - 1
    assert sum(w["finished"] for w in windows) == 240
    for w in windows[:-1]:  # the last one may be a short tail
        assert w["finished"] > 0 and w["p99_ms"] is not None
        assert w["rss_mb"] > 20 and w["cpu_ms_per_decision"] > 0
    # The router learned from the engines' events and tokenized in process.
    assert windows[-1]["index_entries"] > 0
    assert windows[-1]["piece_cache_tokens"] > 0
    assert summary["rss_last_mb"] >= summary["rss_first_mb"] > 20
    assert report["config"]["max_pins"] == 10
    # What tells the router's stalls from the machine's, in every window, and the verdict.
    assert all(w["router_runq_ms"] is not None and w["load_1m"] is not None for w in windows)
    verdict = report["verdict"]
    assert verdict["median_window_p99_ms"] > 0 and verdict["p99_ratio"] >= 1.0
    assert verdict["own_ratio"] is not None and verdict["rss_slope_mb_per_min"] is not None
    assert verdict["ok"] == (verdict["p99_ok"] and verdict["rss_ok"])
    # The fixed warm-up: the first window, reported apart from the judged ones.
    assert windows[0]["warmup"] and not any(w["warmup"] for w in windows[1:])
    assert verdict["warmup_windows"] == 1 and verdict["judged_windows"] == len(windows) - 1
    # Where each side ran, as the kernel had it during the run; this process has its CPUs back.
    cpus = report["config"]["cpus"]
    if router_cpus is None:
        assert cpus["router_cpus"] == cpus["apparatus_cpus"] == usable and not cpus["pinned"]
    else:  # every thread of the router on its CPU; the engines' and the client's on the rest
        assert cpus["router_cpus"] == usable[-1:] and cpus["apparatus_cpus"] == usable[:-1]
        assert cpus["engine_cpus"] == usable[:-1] and cpus["pinned"]
    assert sorted(os.sched_getaffinity(0)) == usable
