"""``kvroute bench sim --routers N``: one router, N on the bus and N without, side by side."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from kvroute.bench.sim_bench import SimBenchSpec, format_table, run_sim_bench
from kvroute.cli import app


def test_each_policy_runs_as_one_router_and_as_several_with_and_without_the_bus() -> None:
    spec = SimBenchSpec(workload="sibling_fanout", policies=("kvroute",), replicas=4,
                        workload_params={"num_prompts": 2, "fanout": 3, "prompt_tokens": 256},
                        routers=3, bus_delay_s=0.002)
    report, results = run_sim_bench(spec)
    labels = ["kvroute", "kvroute/3 routers, bus 2 ms", "kvroute/3 routers, no bus"]
    assert list(report["policies"]) == labels
    assert report["config"]["routers"] == {"count": 3, "bus_delay_s": 0.002,
                                           "bus_batch_s": 0.0, "front": "round_robin"}
    assert results[(labels[1], 1.0, 0)].counters["bus_announcements"] > 0
    assert "bus_announcements" not in results[(labels[2], 1.0, 0)].counters
    table = format_table(report)
    assert "replicas/group" in table[0] and [row[0] for row in table[1:]] == labels
    assert all(1.0 <= m["group_replicas_mean"] <= 3 for m in report["policies"].values())


def test_bench_sim_takes_the_routers_options(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, [
        "bench", "sim", "--workload", "sibling_fanout", "--param", "num_prompts=2",
        "--param", "fanout=2", "--param", "prompt_tokens=128", "--replicas", "2",
        "--policies", "least_loaded", "--routers", "2", "--bus-delay-ms", "0.5",
        "--bus-batch-ms", "2", "--front", "session", "--quiet", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "session front" in result.output
    report = json.loads(out.read_text())
    assert list(report["policies"]) == ["least_loaded",
                                        "least_loaded/2 routers, bus 0.5 ms + batch 2 ms",
                                        "least_loaded/2 routers, no bus"]
    bad = CliRunner().invoke(app, ["bench", "sim", "--workload", "sibling_fanout",
                                   "--routers", "2", "--front", "nearest", "--quiet"])
    assert bad.exit_code != 0 and "front" in bad.output
