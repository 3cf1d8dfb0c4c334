"""The drift alarm: predicted vs reported cached tokens (core/cache_drift.py)."""

from __future__ import annotations

import pytest

from kvroute.core.cache_drift import (
    ERROR_BOUNDS,
    CacheDriftMonitor,
    CacheDriftSettings,
    DriftSample,
    DriftTransition,
)
from kvroute.core.errors import ConfigError

SETTINGS = CacheDriftSettings(threshold=0.5, window=8, min_samples=4)


def sample(predicted: int, measured: int, prompt: int = 1000) -> DriftSample:
    return DriftSample(predicted, measured, prompt, block_size=16)


def test_agreeing_predictions_never_alarm_and_land_in_the_middle_buckets() -> None:
    m = CacheDriftMonitor(SETTINGS)
    for _ in range(50):
        assert m.observe(sample(800, 816)) is None  # one block apart: within tolerance
    assert not m.alarm and m.agree == 50 and m.drift_ratio == 0.0
    middle = ERROR_BOUNDS.index(0.02)
    assert m.error_counts[middle] == 50 and sum(m.error_counts) == 50


def test_a_drifting_index_alarms_then_recovers_with_hysteresis() -> None:
    m = CacheDriftMonitor(SETTINGS)
    transitions = [m.observe(sample(0, 800)) for _ in range(4)]
    assert transitions == [None, None, None, DriftTransition.ENTERED]
    assert m.alarm and m.under == 4 and m.window_samples == 0
    # Leaving needs min_samples fresh samples under half the threshold.
    assert [m.observe(sample(800, 800)) for _ in range(3)] == [None, None, None]
    assert m.observe(sample(800, 800)) is DriftTransition.LEFT
    assert not m.alarm


def test_unique_prompts_do_not_dilute_the_window() -> None:
    m = CacheDriftMonitor(SETTINGS)
    for _ in range(3):
        m.observe(sample(0, 800))
        for _ in range(20):
            m.observe(sample(0, 0))  # nothing cached, nothing predicted: says nothing
    assert m.observe(sample(0, 800)) is DriftTransition.ENTERED


def test_over_prediction_counts_and_its_error_is_negative() -> None:
    m = CacheDriftMonitor(SETTINGS)
    m.observe(sample(900, 0))
    assert m.over == 1 and m.error_sum == pytest.approx(-0.9)
    assert m.error_counts[ERROR_BOUNDS.index(-0.5)] == 1


def test_below_the_threshold_no_alarm() -> None:
    m = CacheDriftMonitor(SETTINGS)
    for i in range(40):
        m.observe(sample(0, 800) if i % 3 == 0 else sample(800, 800))  # a third disagree
    assert not m.alarm and 0.2 < m.drift_ratio < 0.5


@pytest.mark.parametrize("kwargs", [{"threshold": 0.0}, {"threshold": 1.5},
                                    {"min_samples": 10, "window": 5}, {"tolerance_blocks": -1},
                                    {"tolerance_fraction": 2.0}])
def test_bad_settings_say_what_is_wrong(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="cache_drift"):
        CacheDriftSettings(**kwargs)  # type: ignore[arg-type]
