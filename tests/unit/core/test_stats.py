"""Mean and nearest-rank percentiles (``core/stats.py``), as every benchmark report quotes them."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.core.stats import mean, percentile


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 90) == 90.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile(values, 0) == 1.0  # rank at least 1
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0], 50) == 1.0  # a value of the sample, not 1.5


def test_percentile_sorts_its_input() -> None:
    values = [float(v) for v in range(1, 11)]
    random.Random(0).shuffle(values)
    assert percentile(values, 90) == 9.0
    assert percentile(iter(values), 10) == 1.0  # any iterable


def test_percentile_rank_is_exact_where_pct_over_100_times_n_is_not() -> None:
    # 7 / 100 * 100 is 7.000000000000001 in floating point: rank 8 by that formula.
    assert percentile([float(v) for v in range(1, 101)], 7) == 7.0


def test_empty_sample_gives_the_default() -> None:
    assert percentile([], 50) is None
    assert percentile([], 99, 0.0) == 0.0
    assert mean([]) is None
    assert mean([], 0.0) == 0.0


def test_mean_is_sum_over_len() -> None:
    assert mean([1.0, 2.0, 6.0]) == 3.0
    assert mean([0.1, 0.2, 0.3]) == (0.1 + 0.2 + 0.3) / 3


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=300),
       st.sampled_from([1, 7, 25, 50, 90, 95, 99, 100]))
def test_percentile_picks_rank_ceil_n_pct_over_100(values: list[float], pct: int) -> None:
    n = len(values)
    rank = max(1, (n * pct + 99) // 100)  # integer ceil(n * pct / 100)
    assert percentile(values, pct) == sorted(values)[rank - 1]


@pytest.mark.parametrize("pct", [50, 90, 99])
def test_quoted_percentiles_match_the_live_clients_former_float_rank(pct: int) -> None:
    """The live client ranked by ``ceil(pct / 100.0 * n)``, the fleet and tier benchmarks by
    ``-(-n * pct // 100)``: for the percentiles the reports quote both give the same rank, so
    folding them into one helper leaves every figure as it was."""
    for n in range(1, 2_001):
        assert percentile(range(n), pct) == max(1, math.ceil(pct / 100.0 * n)) - 1
