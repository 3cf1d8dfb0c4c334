"""The soak's stream and its window arithmetic (``kvroute.bench.soak``), without processes."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest
from typer.testing import CliRunner

from kvroute.bench.live_client import ClientRun, RequestResult
from kvroute.bench.soak import SoakSpec, soak_requests, soak_verdict, soak_windows, verdict_line
from kvroute.cli import app
from kvroute.core.errors import ConfigError


def test_the_stream_mixes_kinds_exactly_and_sessions_grow_turn_by_turn() -> None:
    spec = SoakSpec(seconds=20, rate=50, seed=3)
    stream = soak_requests(spec)
    assert len(stream) == 1000
    assert [r.arrival_s for r in stream[:3]] == [0.0, 0.02, 0.04]
    kinds = Counter(("shared" if (r.group or "").startswith("shared-") else r.group)
                    for r in stream)
    assert kinds == {"shared": 500, "session": 300, "unique": 200}
    bodies = [json.loads(r.body) for r in stream]
    assert all(b["stream"] is False and b["model"] == "sim-model" for b in bodies)
    turns: dict[str, list[list[dict[str, str]]]] = {}
    for r, body in zip(stream, bodies, strict=True):
        if r.group == "session":
            turns.setdefault(body["user"], []).append(body["messages"])
        else:
            assert "user" not in body
    assert len(turns) > 64  # new sessions keep arriving (each under a new id)
    for history in turns.values():
        assert 1 <= len(history) <= 4
        for before, after in itertools.pairwise(history):
            assert after[: len(before)] == before and len(after) == len(before) + 2
    uniques = [json.dumps(b["messages"]) for r, b in zip(stream, bodies, strict=True)
               if r.group == "unique"]
    assert len(set(uniques)) == len(uniques)
    assert soak_requests(spec) == stream  # deterministic for a seed
    assert soak_requests(SoakSpec(seconds=20, rate=50, seed=4)) != stream


def test_windows_count_what_finished_in_each_and_the_cost_per_decision() -> None:
    def done(start: float, e2e: float, error: str | None = None) -> RequestResult:
        return RequestResult("r", start_s=start, e2e_s=e2e, error=error)

    # The last request ends at 4.01 s, past the last sample's 4.0 s (two clocks, one
    # rounding): it still counts, in the last window.
    run = ClientRun([done(0.5, 0.01), done(1.2, 0.02), done(1.5, 0.6, "http_503"),
                     done(2.5, 0.04), done(3.99, 0.02)], wall_s=4.0, tcp_nodelay=True)
    samples = [{"t_s": 0.0, "rss_mb": 80.0, "cpu_s": 1.0, "decisions": 0.0,
                "engines_cpu_s": 5.0, "runq_s": 0.5, "load_1m": 1.0},
               {"t_s": 2.0, "rss_mb": 82.5, "cpu_s": 1.3, "decisions": 3.0,
                "index_entries": 10.0, "engines_cpu_s": 6.0, "own_p99_ms": 1.5,
                "runq_s": 0.52, "load_1m": 2.5},
               # A scrape that failed: no gauges, the window still counts what finished.
               {"t_s": 4.0, "rss_mb": 83.0, "cpu_s": 1.4, "engines_cpu_s": 9.0,
                "runq_s": 0.9, "load_1m": 3.0, "scrape_error": "TimeoutError: "}]
    first, second = soak_windows(run, samples)
    assert (first["finished"], first["errors"], first["rps"]) == (2, 0, 1.0)
    assert first["p99_ms"] == 20.0 and first["rss_mb"] == 82.5
    assert first["cpu_ms_per_decision"] == 100.0 and first["index_entries"] == 10.0
    assert first["engines_cores"] == 0.5 and first["own_p99_ms"] == 1.5
    assert first["max_ms"] == 20.0
    # The router's CPU in cores, and the time its threads waited for one (the machine's share).
    assert first["router_cores"] == 0.15 and first["router_runq_ms"] == 20.0
    assert first["load_1m"] == 2.5 and second["router_runq_ms"] == 380.0
    # The failed request finished at 2.1 s: counted in the second window, not in its latency.
    assert (second["finished"], second["errors"]) == (3, 1)
    assert second["p50_ms"] == 20.0 and second["max_ms"] == 40.0
    assert second["cpu_ms_per_decision"] is None and second["own_p99_ms"] is None
    assert second["engines_cores"] == 1.5


@pytest.mark.parametrize("bad, says", [
    ({"seconds": 0}, "seconds=0"),
    ({"rate": -1}, "rate=-1"),
    ({"sample_s": 100, "seconds": 10}, "sample_s=100"),
    ({"num_gpu_blocks": 100}, "num_gpu_blocks=100 must be > 512"),
    ({"max_pins": 0}, "max_pins=0"),
    ({"warmup_s": -1}, "warmup_s=-1"),
    ({"router_cpus": frozenset({4096})}, "some, not all"),
])
def test_a_bad_spec_says_what_is_wrong(bad: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        soak_requests(SoakSpec(**bad))  # type: ignore[arg-type]


def test_long_sessions_join_the_mix_and_need_a_window_for_them() -> None:
    spec = SoakSpec(seconds=12, rate=10, sample_s=4, num_gpu_blocks=16_500, long_sessions=2,
                    long_rate=2.0, long_target_tokens=12_000)
    reqs = soak_requests(spec)
    long = [r for r in reqs if r.request_id.startswith("soak-long-")]
    short = [r for r in reqs if not r.request_id.startswith("soak-long-")]
    assert len(short) == 120 and len(long) == 24  # 2 turns a second for 12 s
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    assert max(r.prompt_tokens for r in long) >= 12_000
    # Sessions of a later batch start once the batch before has sent its last turn.
    assert len({r.request_id.rsplit("-t", 1)[0] for r in long}) > 2
    with pytest.raises(ConfigError, match="num_gpu_blocks=4096 must be > 16384"):
        soak_requests(SoakSpec(long_sessions=1))


def _window(t: float, p99: float | None, own: float | None = 5.0, **more: object) -> dict:
    return {"t_s": t, "p99_ms": p99, "own_p99_ms": own, "router_runq_ms": 1.0, "load_1m": 1.5,
            "start_lag_max_ms": 2.0, "gc_full_ms": 0.0, "router_cores": 0.3, **more}


def _samples(rss: list[float], every_s: float = 10.0) -> list[dict]:
    return [{"t_s": i * every_s, "rss_mb": mb} for i, mb in enumerate(rss)]


def test_the_verdict_is_the_worst_window_over_the_median_and_the_rss_slope() -> None:
    # Median of 10, 11, 12, 13, 36 is 12: the worst is 3.0x, on the bound (ok).
    windows = [_window(10, 11.0), _window(20, 36.0, own=20.0), _window(30, 12.0),
               _window(40, 10.0), _window(50, 13.0), _window(60, None, own=None)]
    flat = _samples([80, 200, 250, 260, 260.2, 260.1, 260.3])
    verdict = soak_verdict(windows, flat)
    assert verdict["median_window_p99_ms"] == 12.0 and verdict["worst_window_p99_ms"] == 36.0
    assert verdict["worst_window_t_s"] == 20 and verdict["p99_ratio"] == 3.0
    assert verdict["p99_ok"] and verdict["over_bound"] == []
    assert verdict["own_ratio"] == 4.0 and verdict["own_worst_window_t_s"] == 20
    # The second half (t >= 30 s) is flat although the first grew by 180 MB.
    assert verdict["rss_slope_mb_per_min"] is not None
    assert abs(verdict["rss_slope_mb_per_min"]) < 0.5 and verdict["rss_ok"] and verdict["ok"]
    assert verdict["rss_second_half_mb"] == [260.0, 260.3]
    line = verdict_line(verdict)
    assert "3.0x (bound 3x)" in line and "the others' worst 36.0 ms = 3.0x: ok" in line


def test_a_window_over_three_times_the_median_fails_and_is_listed_with_its_causes() -> None:
    windows = [_window(10, 11.0), _window(20, 37.0, own=30.0, router_runq_ms=850.0,
                                          load_1m=9.5), _window(30, 12.0), _window(40, 12.0)]
    verdict = soak_verdict(windows, _samples([100, 100, 100, 100, 100]))
    assert verdict["p99_ratio"] == round(37 / 12, 2) and not verdict["p99_ok"]
    assert not verdict["ok"] and verdict["rss_ok"]
    [over] = verdict["over_bound"]
    assert over["t_s"] == 20 and over["own_p99_ms"] == 30.0
    assert over["router_runq_ms"] == 850.0 and over["load_1m"] == 9.5
    assert verdict["median_window_runq_ms"] == 1.0  # what a window's run queue compares with
    line = verdict_line(verdict)
    assert "FAIL" in line and "run queue 850.0 ms, load 9.5" in line
    assert "median window's run queue 1.0 ms" in line


def test_memory_that_keeps_growing_in_the_second_half_fails() -> None:
    windows = [_window(10, 10.0), _window(20, 10.0)]
    growing = _samples([100 + 0.2 * i for i in range(61)])  # 0.2 MB / 10 s = 1.2 MB/min
    verdict = soak_verdict(windows, growing)
    assert verdict["rss_slope_mb_per_min"] == 1.2
    assert not verdict["rss_ok"] and not verdict["ok"] and verdict["p99_ok"]
    assert soak_verdict(windows, growing, rss_slope_bound=1.5)["rss_ok"]


def test_without_windows_or_samples_nothing_is_ok() -> None:
    verdict = soak_verdict([_window(10, None, own=None)], _samples([100]))
    assert verdict["p99_ratio"] is None and verdict["rss_slope_mb_per_min"] is None
    assert not verdict["p99_ok"] and not verdict["rss_ok"] and not verdict["ok"]
    verdict_line(verdict)  # renders without figures


def test_warm_up_windows_are_marked_reported_apart_and_not_judged() -> None:
    def done(start: float) -> RequestResult:
        return RequestResult("r", start_s=start, e2e_s=0.01)

    run = ClientRun([done(t + 0.5) for t in range(4)], wall_s=4.0, tcp_nodelay=True)
    samples = [{"t_s": float(t)} for t in range(5)]
    marks = [w["warmup"] for w in soak_windows(run, samples, warmup_s=1.5)]
    assert marks == [True, True, False, False]  # a window that starts in the warm-up is one
    assert not any(w["warmup"] for w in soak_windows(run, samples))

    windows = [_window(10, 300.0, warmup=True), _window(20, 40.0, warmup=True),
               _window(30, 11.0), _window(40, 12.0), _window(50, 13.0)]
    verdict = soak_verdict(windows, _samples([100, 100, 100, 100, 100, 100]))
    # Judged: the three steady windows only; the warm-up's 300 ms is shown against their median.
    assert verdict["median_window_p99_ms"] == 12.0 and verdict["worst_window_p99_ms"] == 13.0
    assert verdict["p99_ok"] and verdict["judged_windows"] == 3
    assert verdict["warmup_windows"] == 2 and verdict["warmup_worst_p99_ms"] == 300.0
    assert verdict["warmup_worst_t_s"] == 10 and verdict["warmup_ratio"] == 25.0
    assert [w["t_s"] for w in verdict["warmup_over_bound"]] == [10, 20]
    line = verdict_line(verdict)
    assert "warm-up (2 windows, not judged): worst 300.0 ms at 10 s = 25.0x" in line
    # The same windows with none marked: the warm-up fails the run.
    unmarked = [{**w, "warmup": False} for w in windows]
    assert not soak_verdict(unmarked, _samples([100] * 6))["p99_ok"]


def test_the_command_refuses_router_cpus_it_cannot_use_before_starting_anything() -> None:
    for bad, says in (("one", "not a CPU number"), ("4096", "some, not all")):
        result = CliRunner().invoke(app, ["bench", "soak", "--minutes", "1",
                                          "--router-cpus", bad])
        assert result.exit_code == 2, result.output
        assert says in " ".join((result.stdout + result.stderr).split())


def _judged(*over: dict, n: int = 5) -> list[dict]:
    """``n`` ordinary windows at 12 ms p99 (the median), then ``over``."""
    return [_window(10 * (i + 1), 12.0, client_stall_max_ms=3.0, steal_ms={"0": 0.0, "1": 0.0})
            for i in range(n)] + list(over)


def test_a_window_over_the_bound_by_the_generators_own_stall_is_the_machines_and_shown() -> None:
    # 120 ms against a 12 ms median (bound 36 ms); the load generator's loop stalled 100 ms
    # in that window, so at most 20 ms of it need be the router's or the engines'.
    stalled = _window(60, 120.0, client_stall_max_ms=100.0, steal_ms={"0": 0.0, "1": 0.0})
    verdict = soak_verdict(_judged(stalled), _samples([100] * 7))
    [over] = verdict["over_bound"]
    assert over["t_s"] == 60 and over["category"] == "machine"
    assert over["machine_stall_ms"] == 100.0
    assert verdict["machine_windows"] == 1 and verdict["machine_windows_allowed"] == 1
    # Not dropped: the raw ratio still counts it; the others' worst is the judged one.
    assert verdict["p99_ratio"] == 10.0 and verdict["system_p99_ratio"] == 1.0
    assert verdict["p99_result"] == "ok" and verdict["p99_ok"] and verdict["ok"]
    line = verdict_line(verdict)
    assert "the machine's windows 1 (allowed 1)" in line and "machine stall 100.0 ms" in line
    # The same window without the generator's figures is the system's, and fails.
    bare = {**stalled, "client_stall_max_ms": None, "steal_ms": None}
    verdict = soak_verdict(_judged(bare), _samples([100] * 7))
    assert verdict["over_bound"][0]["category"] == "system"
    assert verdict["p99_result"] == "fail" and not verdict["ok"]
    # A stall shorter than the excess explains part of it only: the system's, and fails.
    short = {**stalled, "client_stall_max_ms": 50.0}
    verdict = soak_verdict(_judged(short), _samples([100] * 7))
    assert verdict["over_bound"][0]["category"] == "system" and not verdict["p99_ok"]
    assert verdict["system_p99_ratio"] == 10.0


def test_steal_on_any_cpu_counts_as_the_machines_stall() -> None:
    stolen = _window(60, 60.0, client_stall_max_ms=5.0, steal_ms={"0": 10.0, "1": 40.0})
    verdict = soak_verdict(_judged(stolen), _samples([100] * 7))
    assert verdict["over_bound"][0]["machine_stall_ms"] == 40.0
    assert verdict["over_bound"][0]["category"] == "machine" and verdict["p99_ok"]


def test_the_engines_and_the_routers_stalls_are_never_set_apart() -> None:
    # The engines' steps ran 250 ms late and their collector ran 100 ms: what users of the
    # router would feel, so the window is the system's whatever the engines' reason.
    engines = _window(60, 120.0, client_stall_max_ms=5.0, steal_ms={"0": 0.0, "1": 0.0},
                      engine_late_max_le_ms=250.0, engine_gc_ms=100.0)
    verdict = soak_verdict(_judged(engines), _samples([100] * 7))
    [over] = verdict["over_bound"]
    assert over["category"] == "system" and over["engine_late_max_le_ms"] == 250.0
    assert verdict["p99_result"] == "fail" and not verdict["ok"]


def test_too_many_of_the_machines_windows_make_the_run_inconclusive() -> None:
    stalls = [_window(60 + 10 * i, 120.0, client_stall_max_ms=100.0, steal_ms={"0": 0.0})
              for i in range(2)]
    verdict = soak_verdict(_judged(*stalls), _samples([100] * 8))
    assert verdict["machine_windows"] == 2 and verdict["machine_windows_allowed"] == 1
    assert verdict["system_p99_ratio"] == 1.0
    assert verdict["p99_result"] == "inconclusive" and not verdict["p99_ok"]
    assert "INCONCLUSIVE" in verdict_line(verdict)
    # 5% of the judged windows may be the machine's: two of 40 are.
    verdict = soak_verdict(_judged(*stalls, n=40), _samples([100] * 43))
    assert verdict["machine_windows_allowed"] == 2 and verdict["p99_result"] == "ok"


def test_windows_carry_the_generators_the_machines_and_the_engines_stalls() -> None:
    def done(start: float, e2e: float, lag: float) -> RequestResult:
        return RequestResult("r", start_s=start, e2e_s=e2e, lag_s=lag)

    run = ClientRun([done(0.2, 0.010, 0.0), done(0.5, 0.020, 0.030), done(1.5, 0.010, 0.001)],
                    wall_s=2.0, tcp_nodelay=True)

    def stalls(late: dict[str, float], gc_sum: float) -> dict:
        return {"kvroute_sim_step_lateness_seconds": late,
                "kvroute_sim_gc_pause_seconds": {"0.05": 3.0, "+Inf": 3.0 + gc_sum * 10,
                                                 "sum": gc_sum}}

    samples = [
        {"t_s": 0.0, "client_runq_s": 1.0, "engines_runq_s": 2.0, "client_cpu_s": 1.0,
         "router_stalls": {"kvroute_event_loop_lag_seconds": {"0.05": 10.0, "0.1": 10.0,
                                                              "+Inf": 10.0}},
         "cpu_wait": {"0": {"steal": 1.0, "iowait": 5.0}, "1": {"steal": 2.0, "iowait": 5.0}},
         "engine_stalls": stalls({"0.01": 90.0, "0.05": 99.0, "0.1": 100.0, "+Inf": 100.0},
                                 0.0)},
        {"t_s": 1.0, "client_stall_max_s": 0.0421, "client_gc_s": 0.003,
         # The router's loop woke once between 50 and 100 ms late.
         "router_stalls": {"kvroute_event_loop_lag_seconds": {"0.05": 59.0, "0.1": 60.0,
                                                              "+Inf": 60.0}},
         "client_gc_max_s": 0.002, "client_runq_s": 1.25, "engines_runq_s": 2.5,
         "client_cpu_s": 1.1,
         "cpu_wait": {"0": {"steal": 1.04, "iowait": 5.0}, "1": {"steal": 2.0, "iowait": 5.01}},
         "engine_stalls": stalls({"0.01": 189.0, "0.05": 198.0, "0.1": 200.0, "+Inf": 200.0},
                                 0.1)},
        {"t_s": 2.0, "client_stall_max_s": 0.001, "client_gc_s": 0.0, "client_gc_max_s": 0.0,
         "client_runq_s": 1.25, "engines_runq_s": 2.5, "client_cpu_s": 1.2,
         "cpu_wait": {"0": {"steal": 1.04, "iowait": 5.0}, "1": {"steal": 2.0, "iowait": 5.01}},
         # An engine's step later than the last bound: the worst is past 1 s.
         "engine_stalls": stalls({"0.01": 189.0, "0.05": 198.0, "0.1": 200.0, "+Inf": 201.0},
                                 0.1)},
    ]
    first, second = soak_windows(run, samples)
    # From the actual send (what the verdict judges) and from the intended one (+ the lag).
    assert first["p99_ms"] == 20.0 and first["p99_intended_ms"] == 50.0
    assert first["start_lag_max_ms"] == 30.0 and first["lag_p99_ms"] == 30.0
    assert first["client_stall_max_ms"] == 42.1 and first["client_gc_max_ms"] == 2.0
    assert first["client_runq_ms"] == 250.0 and first["engines_runq_ms"] == 500.0
    assert first["client_cores"] == 0.1
    assert first["steal_ms"] == {"0": 40.0, "1": 0.0}
    assert first["iowait_ms"] == {"0": 0.0, "1": 10.0}
    # 100 steps, 1 later than 50 ms, none past 100 ms; 100 ms of the engines' collections.
    assert first["engine_steps_late_over_50ms"] == 1.0
    assert first["engine_late_max_le_ms"] == 100.0 and first["engine_gc_ms"] == 100.0
    assert first["router_loop_late_max_le_ms"] == 100.0
    assert first["router_loop_late_over_50ms"] == 1.0
    assert second["router_loop_late_max_le_ms"] is None  # not scraped: not made up
    assert second["engine_late_max_le_ms"] == float("inf")
    assert second["engine_steps_late_over_50ms"] == 1.0 and second["engine_gc_ms"] == 0.0
    assert second["p99_intended_ms"] == 11.0


def test_the_arrangement_options_are_checked() -> None:
    for bad, says in (({"engine_nice": 20}, "engine_nice=20"),
                      ({"client_gc": "sometimes"}, "client_gc='sometimes'"),
                      ({"client_loop": "trio"}, "client_loop='trio'")):
        with pytest.raises(ConfigError, match=says):
            SoakSpec(**bad).validate()  # type: ignore[arg-type]
