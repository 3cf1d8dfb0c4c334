"""``kvroute bench sim``: the figures a user waits for, on the agentic trace too."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from kvroute.bench.sim_bench import COMPACT_COLUMNS, SimBenchSpec, format_table, run_sim_bench
from kvroute.cli import app

NEW_FIGURES = ("e2e_mean_s", "e2e_p99_s", "itl_request_mean_s", "itl_request_p99_s",
               "slo_goodput_rps", "slo_goodput_fraction")


def test_every_policy_reports_the_figures_a_user_waits_for() -> None:
    spec = SimBenchSpec(workload="unique_prompts", policies=("kvroute", "least_loaded"),
                        replicas=2, limit=6, workload_params={"num_requests": 6})
    report, _ = run_sim_bench(spec)
    for name in ("kvroute", "least_loaded"):
        assert all(key in report["policies"][name] for key in NEW_FIGURES)
    full, compact = format_table(report), format_table(report, compact=True)
    assert "E2E p99" in full[0] and "ITL/req p99" in full[0]
    assert compact[0] == list(COMPACT_COLUMNS) and [r[0] for r in compact[1:]] == [
        "kvroute", "least_loaded"]


def test_the_itl_objective_is_passed_to_every_run() -> None:
    spec = SimBenchSpec(workload="unique_prompts", policies=("round_robin",), replicas=2,
                        limit=4, workload_params={"num_requests": 4}, itl_slo_s=0.0)
    report, results = run_sim_bench(spec)
    assert results[("round_robin", 1.0, 0)].config.itl_slo_s == 0.0
    # No decode step is instantaneous, so only one-token answers could meet a 0 s objective.
    assert report["policies"]["round_robin"]["slo_goodput_fraction"] == 0.0


def test_bench_sim_replays_the_agentic_trace_with_the_new_figures(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, [
        "bench", "sim", "--trace", "claude_code_agentic_64", "--limit", "12", "--replicas", "2",
        "--block-tokens", "64", "--policies", "kvroute,least_loaded", "--itl-slo", "0.05", "--json", str(out), "--quiet",
    ])
    assert result.exit_code == 0, result.output
    assert "SLO TTFT <= 2 s and ITL/req <= 50 ms" in result.output
    for column in ("E2E mean", "E2E p99", "ITL/req mean", "ITL/req p99", "SLO good/s",
                   "least_loaded", "per replica"):
        assert column in result.output
    report = json.loads(out.read_text())
    config = report["config"]
    assert (config["block_tokens"], config["itl_slo_s"]) == (64, 0.05)
    kvroute = report["policies"]["kvroute"]
    assert kvroute["completed"] == kvroute["requests"] == 12
    assert kvroute["e2e_mean_s"] > kvroute["ttft_mean_s"] > 0
    assert 0.0 <= kvroute["slo_goodput_fraction"] <= 1.0
