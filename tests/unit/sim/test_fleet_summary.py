"""The fleet's per-request figures: each request's own ITL, E2E, and goodput at an SLO."""

from __future__ import annotations

from array import array

import pytest

from kvroute.core.errors import ConfigError
from kvroute.sim.fleet import FleetConfig, FleetResult, RequestRecord, simulate
from kvroute.sim.profiles import get_profile
from kvroute.sim.workload import WorkloadRequest

H100 = get_profile("llama-3.1-8b-h100")


def record(rid: str, arrival: float, first: float | None = None, finish: float | None = None,
           itl: tuple[float, int] = (0.0, 0), rejected: str | None = None) -> RequestRecord:
    return RequestRecord(rid, arrival, replica="r0", first_token_s=first, finish_s=finish,
                         itl_sum_s=itl[0], num_itl_tokens=itl[1], rejected=rejected)


def result(records: list[RequestRecord], **config: float) -> FleetResult:
    return FleetResult(
        config=FleetConfig(num_replicas=1, profile=H100, **config),  # type: ignore[arg-type]
        records=records, itl_s=array("d"), load_samples=[], replica_names=("r0",),
        prefix_cache_queries=0, prefix_cache_hits=0, preemptions=0, end_s=10.0,
    )


HAND_MADE = [
    record("fast", 0.0, first=1.0, finish=3.0, itl=(2.0, 100)),  # TTFT 1 s, ITL 20 ms: good
    record("slow-tokens", 0.0, first=0.5, finish=5.5, itl=(5.0, 100)),  # ITL 50 ms: not good
    record("late", 1.0, first=4.0, finish=4.5, itl=(0.5, 50)),  # TTFT 3 s: not good
    record("one-token", 2.0, first=2.1, finish=2.1),  # no gap: judged on its TTFT, good
    record("refused", 3.0, rejected="no_fit"),
    record("unfinished", 4.0, first=4.5),  # a first token but no end: not good
]


def test_a_request_meets_the_slo_only_finished_within_both_objectives() -> None:
    verdicts = {r.request_id: r.meets_slo(2.0, 0.030) for r in HAND_MADE}
    assert verdicts == {"fast": True, "slow-tokens": False, "late": False, "one-token": True,
                        "refused": False, "unfinished": False}
    assert HAND_MADE[0].itl_mean_s == pytest.approx(0.020)
    assert HAND_MADE[3].itl_mean_s is None and HAND_MADE[3].e2e_s == pytest.approx(0.1)


def test_summary_reports_per_request_itl_e2e_and_slo_goodput_of_hand_made_records() -> None:
    s = result(HAND_MADE, ttft_slo_s=2.0, itl_slo_s=0.030).summary()
    # Each finished request's own mean gap: 20, 50 and 10 ms (the one-token answer has none).
    assert s["itl_request_mean_s"] == pytest.approx((0.020 + 0.050 + 0.010) / 3)
    assert s["itl_request_p99_s"] == pytest.approx(0.050)
    assert s["e2e_mean_s"] == pytest.approx((3.0 + 5.5 + 3.5 + 0.1) / 4)
    assert s["e2e_p99_s"] == pytest.approx(5.5)
    # 2 of 6 requests within both objectives, over a 10 s run.
    assert s["slo_goodput_rps"] == pytest.approx(0.2)
    assert s["slo_goodput_fraction"] == pytest.approx(2 / 6)
    # The TTFT-only goodput still counts every first token within 2 s (4 of them).
    assert s["goodput_rps"] == pytest.approx(0.4)


def test_the_itl_objective_moves_the_slo_goodput() -> None:
    loose = result(HAND_MADE, ttft_slo_s=2.0, itl_slo_s=0.060).summary()
    strict = result(HAND_MADE, ttft_slo_s=2.0, itl_slo_s=0.015).summary()
    assert loose["slo_goodput_fraction"] == pytest.approx(3 / 6)  # slow-tokens now counts
    assert strict["slo_goodput_fraction"] == pytest.approx(1 / 6)  # only the one-token answer


def test_a_lone_request_records_its_own_decode_steps_as_its_itl() -> None:
    n, out = 1000, 5
    workload = [WorkloadRequest(0.0, "only", tuple(range(100, 100 + n)), out)]
    res = simulate(workload, FleetConfig(num_replicas=1, profile=H100, policy="round_robin"))
    (only,) = res.records
    t = H100.timing
    # Decode step j (j = 1..out-1) runs one sequence whose attention reads n + j tokens.
    steps = [t.fixed_s + t.decode_seq_s + t.context_token_s * (n + j) for j in range(1, out)]
    assert only.num_itl_tokens == out - 1
    assert only.itl_sum_s == pytest.approx(sum(steps))
    assert res.summary()["itl_request_mean_s"] == pytest.approx(sum(steps) / (out - 1))


def test_an_itl_objective_below_zero_is_refused() -> None:
    with pytest.raises(ConfigError, match="itl_slo_s"):
        FleetConfig(num_replicas=1, profile=H100, itl_slo_s=-0.001)


def test_idle_while_overloaded_counts_samples_with_an_idle_replica_beside_a_hot_one() -> None:
    res = result([])
    res.load_samples = [
        (0.0, (0, 9, 1, 2)),  # mean 3: an idle replica while one runs 9 > 6 — counted
        (1.0, (0, 5, 3, 4)),  # mean 3: idle, but nobody above 6
        (2.0, (1, 9, 1, 1)),  # hot, but nobody idle
        (3.0, (0, 0, 0, 0)),  # an idle fleet
    ]
    assert res.summary()["idle_while_overloaded"] == pytest.approx(1 / 4)
