"""``bench tiers-live --repeats``: interleaved mode order, paired p99 ratios and their median,
and the targets judged on them (pure functions of the report; the live run is
``tests/integration/test_tiers_live_bench.py``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvroute.bench.tiers_live import (
    LiveTurn,
    TiersLiveSpec,
    format_repeats,
    live_mode_metrics,
    live_targets,
    mode_order,
    paired,
    router_yaml,
)
from kvroute.config import parse_config
from kvroute.core.errors import ConfigError
from kvroute.sim.launcher import ReplicaHandle

MODES = ("reactive", "proactive", "proactive+warm")


def test_modes_alternate_order_between_repeats() -> None:
    assert [mode_order(MODES, r) for r in range(3)] == [
        list(MODES), list(reversed(MODES)), list(MODES)]


def metrics(small_p99_s: float, esc_max: float = 0.1, *, router_cpu: float | None = 1.0,
            failed: int = 0) -> dict[str, Any]:
    return {"small_ttft_p99_s": small_p99_s, "escalated_to_cold_max": esc_max,
            "escalated_to_cold_mean": esc_max / 2, "escalated_turns": 4, "failed": failed,
            "doomed_attempts": 0, "cpu_s": {"router": router_cpu}}


def repeat(i: int, proactive_p99: float, warm_p99: float, esc_max: float) -> dict[str, Any]:
    return {"repeat": i, "order": mode_order(MODES[1:], i),
            "modes": {"proactive": metrics(proactive_p99),
                      "proactive+warm": metrics(warm_p99, esc_max, router_cpu=None)}}


REPEATS = [repeat(0, 0.050, 0.052, 0.20), repeat(1, 0.050, 0.150, 0.22),
           repeat(2, 0.060, 0.057, 0.18)]


def test_paired_ratios_and_their_median_ignore_one_outlier() -> None:
    pairs = paired(REPEATS)
    assert pairs["small_p99_ratio"] == pytest.approx([1.04, 3.0, 0.95])
    assert pairs["small_p99_ratio_median"] == pytest.approx(1.04)
    assert pairs["escalated_to_cold_max"] == [0.20, 0.22, 0.18]
    assert pairs["escalated_to_cold_max_max"] == 0.22


def test_a_repeat_without_both_modes_has_no_pair() -> None:
    only_warm = {"repeat": 0, "order": ["proactive+warm"],
                 "modes": {"proactive+warm": metrics(0.05, 0.3)}}
    pairs = paired([only_warm])
    assert pairs["small_p99_ratio"] == [] and pairs["small_p99_ratio_median"] is None
    assert pairs["escalated_to_cold_max_max"] == 0.3


def test_targets_use_the_median_paired_ratio_with_repeats() -> None:
    # Pooled p99s that alone would fail the goal (+50%); the paired median (+4%) meets it.
    pooled = {"proactive": metrics(0.060), "proactive+warm": metrics(0.090, 0.22)}
    out = live_targets(pooled, paired(REPEATS), repeats=3)
    goal = out["small_p99_with_warm"]
    assert goal["measured_change"] == pytest.approx(0.04)
    assert goal["pooled_change"] == pytest.approx(0.5)
    assert goal["per_repeat_change"] == pytest.approx([0.04, 2.0, -0.05])
    assert goal["met"] is True
    assert out["escalated_ttft_vs_cold"]["measured_max"] == 0.22
    assert out["escalated_ttft_vs_cold"]["met"] is True
    # One repeat: the single run's pooled figure decides, as before.
    single = live_targets(pooled, paired(REPEATS[:1]), repeats=1)
    assert single["small_p99_with_warm"]["measured_change"] == pytest.approx(0.5)
    assert single["small_p99_with_warm"]["met"] is False


def test_repeat_table_rows() -> None:
    report = {"config": {"modes": list(MODES[1:])}, "repeats": REPEATS,
              "paired": paired(REPEATS)}
    rows = format_repeats(report)
    assert rows[0][:2] == ["repeat", "order"]
    assert rows[2] == ["1", "proactive+warm,proactive", "50.0 ms", "150.0 ms", "3.000", "0.22",
                       "1.00 s", "-"]
    assert len(rows) == 1 + len(REPEATS)


def test_pooled_metrics_count_every_repeats_turns() -> None:
    turns = [LiveTurn(f"r{rep}-{i}", f"s{i}", 1, 100, pool="small", status=200,
                      ttft_s=0.01 * (i + 1), repeat=rep) for rep in range(2) for i in range(50)]
    m = live_mode_metrics(turns, {"warm_fired": 3.0})
    assert m["requests"] == m["requests_small"] == 100
    assert m["small_ttft_p99_s"] == pytest.approx(0.50)
    assert m["warms_fired"] == 3


@pytest.mark.parametrize(("chunk", "expected"), [(None, None), (0, 0), (512, 512)])
def test_the_router_config_carries_the_warm_chunk_size(chunk: int | None,
                                                       expected: int | None) -> None:
    """``--warm-chunk-tokens`` reaches ``warm_ahead.chunk_tokens`` of the warm mode's router
    (unset: the router's default), and the router accepts the config."""
    small = [ReplicaHandle("s0", "small", "sim-small", "http://127.0.0.1:1", None, None, 4096, 16)]
    large = [ReplicaHandle("l0", "large", "sim-large", "http://127.0.0.1:2", None, None, 16384, 16)]
    spec = TiersLiveSpec(warm_chunk_tokens=chunk)
    spec.validate()
    doc = json.loads(router_yaml(spec, "proactive+warm", small, large))  # JSON is YAML
    assert doc["warm_ahead"].get("chunk_tokens") == expected
    parsed = parse_config(doc, env={})
    assert parsed.warm_ahead.chunk_tokens == (512 if chunk is None else chunk)


def test_a_negative_warm_chunk_size_is_refused() -> None:
    with pytest.raises(ConfigError, match="warm_chunk_tokens must be >= 0"):
        TiersLiveSpec(warm_chunk_tokens=-1).validate()
