"""``kvroute bench tiers``: the three tier modes on the same sessions, report and CLI."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvroute.bench.tiers_bench import MODES, TiersBenchSpec, format_table, run_tiers_bench
from kvroute.cli import app
from kvroute.core.errors import ConfigError

QUICK = TiersBenchSpec(sessions=4, small_window=2048, large_window=8192,
                       system_prompt_tokens=256, user_tokens=128, output_tokens=128,
                       replicas_small=2, replicas_large=1, seeds=(0, 1))


def without_wall(report: dict[str, Any]) -> dict[str, Any]:
    return {**report, "runs": [{k: v for k, v in r.items() if k != "wall_s"}
                               for r in report["runs"]]}


def test_report_compares_the_three_modes_on_the_same_sessions() -> None:
    report, results = run_tiers_bench(QUICK)
    assert list(report["modes"]) == list(MODES)
    assert [(r["mode"], r["seed"]) for r in report["runs"]] == [
        (m, s) for s in (0, 1) for m in MODES]
    sessions = QUICK.sessions * len(QUICK.seeds)
    requests = {m["requests"] for m in report["modes"].values()}
    assert len(requests) == 1  # same sessions in every mode
    reactive = report["modes"]["reactive"]
    assert reactive["doomed_attempts"] == sessions  # one per crossing
    assert reactive["failed"] == 0 and reactive["escalated_turns"] == sessions
    for mode in ("proactive", "proactive+warm"):
        m = report["modes"][mode]
        assert m["failed"] == 0 and m["doomed_attempts"] == 0
        assert m["completed"] == m["requests"]
        assert m["escalated_turns"] == sessions
    warm, cold = report["modes"]["proactive+warm"], report["modes"]["proactive"]
    # default cooldown: one warm-up per session per growth stage (0.6..1.0 in tenths)
    assert sessions <= warm["warms_fired"] <= 4 * sessions
    assert cold["warms_fired"] == 0 and cold["warm_skips"] == {"disabled": cold["requests"]}
    assert warm["escalated_cached_fraction_mean"] > cold["escalated_cached_fraction_mean"] + 0.3
    assert warm["escalated_ttft_mean_s"] < cold["escalated_ttft_mean_s"]
    assert warm["small_ttft_p99_s"] == cold["small_ttft_p99_s"]
    targets = report["targets"]
    assert targets["zero_failed_proactive"]["met"] is True
    assert targets["small_p99_with_warm"]["measured_change"] == 0.0
    assert targets["escalated_ttft_vs_cold"]["measured_mean"] == warm["escalated_to_cold_mean"]
    assert report["config"]["seeds"] == [0, 1] and report["config"]["small_window"] == 2048
    rows = format_table(report)
    assert [r[0] for r in rows] == ["mode", *MODES]
    assert len({len(r) for r in rows}) == 1
    assert len(results) == len(MODES) * 2


def test_runs_are_reproducible() -> None:
    first, _ = run_tiers_bench(QUICK)
    again, _ = run_tiers_bench(QUICK)
    assert without_wall(first) == without_wall(again)


def test_growth_stages_rewarm_the_growing_prefix() -> None:
    once, _ = run_tiers_bench(replace(QUICK, warm_rewarm_fraction=1.0))
    often, _ = run_tiers_bench(QUICK)
    w1, w0 = once["modes"]["proactive+warm"], often["modes"]["proactive+warm"]
    assert w0["warms_fired"] > w1["warms_fired"]
    assert w0["escalated_cached_fraction_mean"] > w1["escalated_cached_fraction_mean"]


@pytest.mark.parametrize(("change", "message"), [
    ({"large_window": 2048}, "must be larger than small_window"),
    ({"modes": ("sideways",)}, "modes must be some of"),
    ({"policy": "nope"}, "unknown policy 'nope'"),
    ({"small_profile": "nope"}, "unknown timing profile 'nope'"),
    ({"seeds": ()}, "at least one seed"),
])
def test_bad_specs_are_refused(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        run_tiers_bench(replace(QUICK, **change))


def test_cli_prints_the_table_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "tiers.json"
    result = CliRunner().invoke(app, [
        "bench", "tiers", "--sessions", "3", "--small-window", "2048", "--large-window", "8192",
        "--system-tokens", "256", "--user-tokens", "128", "--output-tokens", "128",
        "--replicas-small", "2", "--replicas-large", "1", "--think-time", "2",
        "--seed", "0", "--seed", "1,2", "--json", str(out),
    ])
    assert result.exit_code == 0, result.output
    assert "proactive+warm" in result.output and "target zero_failed_proactive" in result.output
    report = json.loads(out.read_text())
    assert report["config"]["seeds"] == [0, 1, 2]
    assert report["config"]["think_time_s"] == 2.0
    assert report["modes"]["reactive"]["doomed_attempts"] == 9


def test_cli_refuses_a_large_pool_that_is_not_larger() -> None:
    result = CliRunner().invoke(app, ["bench", "tiers", "--small-window", "4096",
                                      "--large-window", "4096"])
    assert result.exit_code == 2
    assert "must be larger than small_window" in result.output
