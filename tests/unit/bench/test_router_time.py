"""The router's own time in a benchmark phase: buckets from a real exposition, their
difference over a phase, and quantiles of it."""

from __future__ import annotations

import math
import random

import pytest

from kvroute.bench.router_time import bucket_counts, phase_counts, quantile_ms
from kvroute.shell.metrics import ROUTER_TIME_BUCKETS, RouterMetrics


def scrape(metrics: RouterMetrics) -> str:
    body, _ = metrics.render()
    return body.decode()


def test_buckets_come_from_the_routers_own_exposition() -> None:
    metrics = RouterMetrics()
    empty = bucket_counts(scrape(metrics))
    assert list(empty) == [*ROUTER_TIME_BUCKETS, math.inf] and not any(empty.values())
    metrics.router_time(0.0004, 0.0001)  # total 0.5 ms: bucket le=0.0005
    metrics.router_time(0.0015, 0.0010)  # total 2.5 ms: bucket le=0.0025
    total = bucket_counts(scrape(metrics))
    assert total[0.00025] == 0 and total[0.0005] == 1 and total[0.002] == 1
    assert total[0.0025] == 2 and total[math.inf] == 2
    before = bucket_counts(scrape(metrics), "before_engine")
    assert before[0.0005] == 1 and before[0.0015] == 2
    assert bucket_counts("no such metric here\n") == {}


def test_a_phase_counts_only_what_it_added() -> None:
    metrics = RouterMetrics()
    metrics.router_time(0.010, 0.010)  # before the phase: 20 ms, must not count
    start = bucket_counts(scrape(metrics))
    for _ in range(99):
        metrics.router_time(0.0003, 0.0001)  # 0.4 ms
    metrics.router_time(0.004, 0.001)  # 5 ms
    phase = phase_counts(start, bucket_counts(scrape(metrics)))
    assert phase[math.inf] == 100
    p50 = quantile_ms(phase, 0.5)
    assert p50 is not None and 0.25 < p50 <= 0.5
    p99 = quantile_ms(phase, 0.99)
    assert p99 is not None and p99 <= 0.5  # the 99th of 100 is still a 0.4 ms one
    p999 = quantile_ms(phase, 0.999)
    assert p999 is not None and 4.0 < p999 <= 5.0  # the slow one, not the 20 ms before


def test_quantiles_interpolate_inside_the_bucket() -> None:
    buckets = {0.001: 0.0, 0.002: 100.0, math.inf: 100.0}  # 100 between 1 and 2 ms
    assert quantile_ms(buckets, 0.5) == pytest.approx(1.5)
    assert quantile_ms(buckets, 0.99) == pytest.approx(1.99)
    assert quantile_ms({0.001: 0.0, math.inf: 3.0}, 0.5) == pytest.approx(1.0)  # +Inf only
    assert quantile_ms({}, 0.5) is None
    assert quantile_ms({0.001: 0.0, math.inf: 0.0}, 0.5) is None
    with pytest.raises(ValueError, match="between 0 and 1"):
        quantile_ms(buckets, 1.0)


def test_quantiles_agree_with_the_samples_to_a_bucket() -> None:
    rng = random.Random(3)
    metrics = RouterMetrics()
    values = [rng.lognormvariate(math.log(0.0008), 0.6) for _ in range(2000)]
    for v in values:
        metrics.router_time(v * 0.7, v * 0.3)
    phase = bucket_counts(scrape(metrics))
    ordered = sorted(values)
    bounds = [0.0, *ROUTER_TIME_BUCKETS]
    for q in (0.5, 0.9, 0.99):
        got = quantile_ms(phase, q)
        assert got is not None
        exact = ordered[int(q * len(ordered)) - 1]
        # the bucket holding the exact quantile (its edges, in ms)
        i = next(k for k, b in enumerate(bounds[1:], 1) if exact <= b)
        assert 1e3 * bounds[i - 1] - 1e-9 <= got <= 1e3 * bounds[i] + 1e-9, (q, got, exact)


def test_a_restarted_router_is_an_error_not_a_negative_count() -> None:
    with pytest.raises(ValueError, match="restarted"):
        phase_counts({0.001: 5.0, math.inf: 9.0}, {0.001: 1.0, math.inf: 2.0})
