"""``kvroute bench sim``: the figures a user waits for, policy overrides, the agentic trace."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from kvroute.bench.sim_bench import (
    COMPACT_COLUMNS,
    SimBenchSpec,
    build_workload,
    format_table,
    run_sim_bench,
)
from kvroute.bench.traces import BlockTokens
from kvroute.cli import app

NEW_FIGURES = ("e2e_mean_s", "e2e_p99_s", "itl_request_mean_s", "itl_request_p99_s",
               "slo_goodput_rps", "slo_goodput_fraction")


def test_policy_params_reach_only_the_policy_they_name() -> None:
    spec = SimBenchSpec(workload="unique_prompts", policies=("kvroute", "least_loaded"),
                        replicas=2, limit=6, workload_params={"num_requests": 6},
                        policy_params={"kvroute": {"work_weight": 0.25}})
    report, results = run_sim_bench(spec)
    assert results[("kvroute", 1.0, 0)].config.policy_params == {"work_weight": 0.25}
    assert results[("least_loaded", 1.0, 0)].config.policy_params == {}
    assert report["config"]["policy_params"] == {"kvroute": {"work_weight": 0.25},
                                                 "least_loaded": {}}
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
        "--policies", "kvroute,least_loaded", "--policy-param", "kvroute.work_weight=0.4",
        "--itl-slo", "0.05", "--json", str(out), "--quiet",
    ])
    assert result.exit_code == 0, result.output
    assert "SLO TTFT <= 2 s and ITL/req <= 50 ms" in result.output
    for column in ("E2E mean", "E2E p99", "ITL/req mean", "ITL/req p99", "SLO good/s",
                   "least_loaded", "per replica"):
        assert column in result.output
    report = json.loads(out.read_text())
    config = report["config"]
    assert (config["block_tokens"], config["trace_sessions"], config["itl_slo_s"]) == (64, True,
                                                                                       0.05)
    assert config["policy_params"]["kvroute"] == {"work_weight": 0.4}
    kvroute = report["policies"]["kvroute"]
    assert kvroute["completed"] == kvroute["requests"] == 12
    assert kvroute["e2e_mean_s"] > kvroute["ttft_mean_s"] > 0
    assert 0.0 <= kvroute["slo_goodput_fraction"] <= 1.0


def test_bench_sim_names_a_policy_parameter_that_does_not_exist() -> None:
    result = CliRunner().invoke(app, [
        "bench", "sim", "--policies", "kvroute", "--policy-param", "work_wieght=0.3", "--quiet",
    ])
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "policy 'kvroute' has no parameter 'work_wieght'" in text
    assert "work_weight" in text


def test_the_agentic_trace_replays_with_its_own_block_size_and_optional_sessions() -> None:
    marked = SimBenchSpec(trace="claude_code_agentic_64", limit=3)
    unmarked = SimBenchSpec(trace="claude_code_agentic_64", limit=3, trace_sessions=False)
    with_sessions = build_workload(marked, rate_scale=1.0, seed=0)
    assert [r.session_id for r in with_sessions] == ["claude_code_agentic_64-s77"] * 2 + [
        "claude_code_agentic_64-s37"]
    assert all(r.session_id is None for r in build_workload(unmarked, rate_scale=1.0, seed=0))
    first = with_sessions[0].prompt_token_ids
    assert isinstance(first, BlockTokens) and first.block_tokens == 64 and len(first) == 11_745
