"""Inter-token latency floors and the spread estimate (``kvroute.bench.itl_floors``), on
workloads small enough to check by hand and against the simulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvroute.bench.bounds import compute_bounds, decode_floor_s
from kvroute.bench.itl_floors import (
    context_percentile,
    decode_steps,
    even_share,
    lone_itl_floors,
    lone_step_s,
    spread_itl_estimate,
)
from kvroute.cli import app
from kvroute.core.errors import ConfigError
from kvroute.core.stats import percentile
from kvroute.engine.model import StepTiming
from kvroute.sim.fleet import FleetConfig, simulate
from kvroute.sim.profiles import get_profile
from kvroute.sim.workload import WorkloadRequest

H100 = get_profile("llama-3.1-8b-h100")
T = H100.timing  # 6 ms, 40 us prefill, 20 us decode, 50 ns a context token


def prompt(first: int, length: int) -> tuple[int, ...]:
    return tuple(range(first, first + length))


def test_lone_floors_of_the_worked_example() -> None:
    # 1,000 prompt tokens, 5 output tokens: 4 gaps reading 1,001..1,004 tokens.
    one = lone_itl_floors([1000], [4], T)
    gaps = [6.02e-3 + 50e-9 * (1000 + j) for j in range(1, 5)]
    assert one.itl_mean_s == pytest.approx(sum(gaps) / 4) == pytest.approx(6.070125e-3)
    assert one.itl_p99_s == pytest.approx(gaps[-1]) == pytest.approx(6.0702e-3)
    assert one.itl_request_mean_s == one.itl_request_p99_s == pytest.approx(6.070125e-3)
    # With a 30,000-token prompt beside it, 8 gaps: the p99 (rank 8) is its last gap.
    two = lone_itl_floors([1000, 30_000], [4, 4], T)
    long = [6.02e-3 + 50e-9 * (30_000 + j) for j in range(1, 5)]
    assert two.itl_p99_s == pytest.approx(7.5202e-3)
    assert two.itl_mean_s == pytest.approx((sum(gaps) + sum(long)) / 8)
    assert two.itl_request_p99_s == pytest.approx(sum(long) / 4)
    assert two.itl_request_mean_s == pytest.approx((sum(gaps) + sum(long)) / 8)


def test_a_request_with_one_token_has_no_gap() -> None:
    # It counts in neither figure: the mean is over the other request's 2 gaps only.
    floors = lone_itl_floors([5000, 100], [0, 2], T)
    assert floors.itl_mean_s == pytest.approx(6.02e-3 + 50e-9 * 101.5)
    assert floors.itl_request_p99_s == pytest.approx(floors.itl_mean_s)
    with pytest.raises(ConfigError, match="at least one decode step"):
        lone_itl_floors([100], [0], T)


def test_decode_steps_stop_at_the_window() -> None:
    assert decode_steps(10, 5) == 4
    assert decode_steps(10, 5, max_model_len=12) == 1
    assert decode_steps(10, 0) == decode_steps(10, 1) == 0
    with pytest.raises(ConfigError):
        decode_steps(-1, 3)


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 6)), min_size=1, max_size=8),
       st.sampled_from([1, 50, 90, 99, 100]))
def test_context_percentile_is_the_nearest_rank_of_every_context(
        requests: list[tuple[int, int]], pct: int) -> None:
    expanded = [n + j for n, d in requests for j in range(1, d + 1)]
    prompts = [n for n, _ in requests]
    steps = [d for _, d in requests]
    if not expanded:
        with pytest.raises(ConfigError):
            context_percentile(prompts, steps, pct)
        return
    assert context_percentile(prompts, steps, pct) == percentile(expanded, pct)


def spaced_workload() -> list[WorkloadRequest]:
    """Five requests far enough apart that each runs alone on an idle engine."""
    shapes = [(1000, 5), (30_000, 40), (200, 2), (12_000, 120), (4000, 1)]
    return [WorkloadRequest(100.0 * i, f"s{i}", prompt(1000 * (i + 1) * 100, n), o)
            for i, (n, o) in enumerate(shapes)]


def test_requests_alone_in_the_simulator_take_exactly_their_itl_floors() -> None:
    workload = spaced_workload()
    summary = simulate(workload, FleetConfig(num_replicas=2, profile=H100)).summary()
    floors = lone_itl_floors([r.num_prompt_tokens for r in workload],
                             [r.output_tokens - 1 for r in workload], T)
    for key in ("itl_mean_s", "itl_p99_s", "itl_request_mean_s", "itl_request_p99_s"):
        assert summary[key] == pytest.approx(getattr(floors, key), rel=1e-9), key


def test_requests_sharing_one_engine_stay_above_their_itl_floors() -> None:
    workload = [WorkloadRequest(0.01 * i, f"c{i}", prompt(100_000 * (i + 1), 3000 + 2000 * i),
                                30 + 10 * i) for i in range(6)]
    summary = simulate(workload, FleetConfig(num_replicas=1, profile=H100)).summary()
    floors = lone_itl_floors([r.num_prompt_tokens for r in workload],
                             [r.output_tokens - 1 for r in workload], T)
    for key in ("itl_mean_s", "itl_p99_s", "itl_request_mean_s", "itl_request_p99_s"):
        assert summary[key] > getattr(floors, key), key


def test_the_lone_step_takes_two_prefill_tokens_when_cheaper_than_a_decode() -> None:
    assert lone_step_s(T) == pytest.approx(6.02e-3)
    cpu = StepTiming(fixed_s=1.0, prefill_token_s=0.1, decode_seq_s=5.0)
    assert lone_step_s(cpu) == pytest.approx(1.2)
    assert lone_itl_floors([10], [1], cpu).itl_mean_s == pytest.approx(1.2)


@pytest.mark.parametrize(("decoding", "replicas", "share"), [
    (0, 8, 0.0), (8, 8, 0.0), (9, 8, 2 / 9), (16, 8, 1.0), (10, 4, 1.6), (3, 1, 2.0)])
def test_even_share_by_hand(decoding: int, replicas: int, share: float) -> None:
    # (10, 4): two replicas of 3, two of 2: (2·3·2 + 2·2·1) / 10 = 1.6 others on average.
    assert even_share(decoding, replicas) == pytest.approx(share)


def test_spread_estimate_by_hand() -> None:
    timing = StepTiming(fixed_s=1.0, prefill_token_s=1.0, decode_seq_s=0.5,
                        context_token_s=0.01)
    # Two requests of 100 prompt tokens and 2 gaps each, decoding from t = 0 together.
    # Lone gaps: 1.5 + 1.01 = 2.51 and 1.5 + 1.02 = 2.52; each decodes over [0, 5.03).
    # Gap 1 at t = 0: the other reads 101 tokens; one other shares each step (R = 1).
    # Gap 2 at t = 2.51: the other's context, linear over its decode, is
    # 101 + 2 * 2.51 / 5.03 tokens.
    other_2 = 101 + 2 * 2.51 / 5.03
    g1 = 2.51 + 0.5 + 0.01 * 101
    g2 = 2.52 + 0.5 + 0.01 * other_2
    one = spread_itl_estimate([0.0, 0.0], [0.0, 0.0], [100, 100], [2, 2], timing, 1)
    assert one.itl_mean_s == pytest.approx((g1 + g2) / 2)
    assert one.itl_p99_s == pytest.approx(g2)
    assert one.itl_request_p99_s == pytest.approx((g1 + g2) / 2)
    assert one.e2e_mean_s == pytest.approx(g1 + g2)
    # On two replicas each decodes alone: the estimate is the lone floor.
    two = spread_itl_estimate([0.0, 0.0], [0.0, 0.0], [100, 100], [2, 2], timing, 2)
    lone = lone_itl_floors([100, 100], [2, 2], timing)
    assert two.itl_mean_s == pytest.approx(lone.itl_mean_s)
    assert two.itl_p99_s == pytest.approx(lone.itl_p99_s)
    # Decodes that do not overlap in time do not share either.
    apart = spread_itl_estimate([0.0, 10.0], [0.0, 0.0], [100, 100], [2, 2], timing, 1)
    assert apart.itl_mean_s == pytest.approx(lone.itl_mean_s)
    assert apart.e2e_p99_s == pytest.approx(decode_floor_s(100, 3, timing))


def test_spread_estimate_is_close_to_two_decodes_sharing_one_engine() -> None:
    # Two prompts of equal length arriving together, then decoding side by side. The second
    # prefills during the first's first gap (one long gap of 398, under the 1% the p99 and
    # beyond the median): every other step decodes both, as the estimate prices each gap.
    workload = [WorkloadRequest(0.0, f"p{i}", prompt(50_000 * (i + 1), 4000), 200)
                for i in range(2)]
    summary = simulate(workload, FleetConfig(num_replicas=1, profile=H100)).summary()
    estimate = spread_itl_estimate([0.0, 0.0], [0.0, 0.0], [4000, 4000], [199, 199], T, 1)
    lone = lone_itl_floors([4000, 4000], [199, 199], T)
    assert summary["itl_p50_s"] == pytest.approx(estimate.itl_mean_s, rel=2e-3)
    assert summary["itl_p99_s"] == pytest.approx(estimate.itl_p99_s, rel=1e-3)
    assert estimate.itl_mean_s > lone.itl_mean_s * 1.03


def test_a_closed_loop_turn_starts_after_its_predecessor_on_the_timeline() -> None:
    # Turn 2 depends on turn 1: released after it ends, so they never decode together, even
    # though its arrival_s (only a lower bound for a closed-loop turn) is the same.
    first = WorkloadRequest(0.0, "t1", prompt(1, 2000), 50)
    second = WorkloadRequest(0.0, "t2", prompt(1, 2100), 50, session_id="s", turn=1,
                             depends_on="t1", think_time_s=1.0)
    rows = {r.kind: r.figures for r in compute_bounds([first, second], H100, 1).itl_rows}
    assert rows["estimate"].itl_mean_s == pytest.approx(rows["bound"].itl_mean_s)
    # Open loop at the same arrival, they overlap on the one replica.
    free = WorkloadRequest(0.0, "t2", prompt(1, 2100), 50)
    rows = {r.kind: r.figures for r in compute_bounds([first, free], H100, 1).itl_rows}
    assert rows["estimate"].itl_mean_s > rows["bound"].itl_mean_s


def test_compute_bounds_reports_the_itl_rows(tmp_path: Path) -> None:
    only = [WorkloadRequest(0.0, "only", prompt(100, 1000), 5)]
    report = compute_bounds(only, H100, replicas=1)
    bound, estimate = report.itl_rows
    assert (bound.kind, estimate.kind) == ("bound", "estimate")
    assert bound.figures.itl_mean_s == pytest.approx(6.070125e-3)
    assert estimate.figures.itl_mean_s == pytest.approx(6.070125e-3)
    ttft = 6e-3 + 40e-6 * 1000 + 50e-9 * 1000
    assert estimate.figures.e2e_mean_s == pytest.approx(ttft + 4 * 6.070125e-3)
    row = report.as_dict()["itl_rows"][0]  # type: ignore[index]
    assert row["itl_p99_s"] == pytest.approx(6.0702e-3)
    # No gap anywhere: no ITL rows.
    assert compute_bounds([WorkloadRequest(0.0, "x", prompt(1, 10), 1)], H100, 1).itl_rows == ()
    out = tmp_path / "bounds.json"
    result = CliRunner().invoke(app, ["bench", "sim", "--bounds", "--limit", "40",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "inter-token latency no router can beat" in result.output
    assert "ITL/req p99" in result.output
    names = [r["name"] for r in json.loads(out.read_text())["bounds"]["0"]["itl_rows"]]
    assert names[0] == "itl: own decode alone"
