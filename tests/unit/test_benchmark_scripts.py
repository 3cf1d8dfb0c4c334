"""Every micro benchmark still runs, at tiny sizes (the figures are in docs/benchmarks.md).

These check that the scripts work and write their JSON, not how fast anything is: speed is
measured by running the scripts themselves, never asserted in a test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

MICRO = Path(__file__).resolve().parents[2] / "benchmarks" / "micro"

CASES = {
    "bench_cache_memory.py": ["--piece-tokens", "2000", "--memo-entries", "64"],
    "bench_cold.py": ["--gaps-ms", "0,0.2", "--calls", "3"],
    "bench_decode_apply.py": ["--batches", "20", "--repeat", "1"],
    "bench_engine_model.py": ["--requests", "8"],
    "bench_events_decode.py": ["--batches", "10", "--repeat", "1"],
    "bench_handler.py": ["--requests", "20", "--repeats", "1", "--gap-ms", "0.5"],
    "bench_hashing.py": ["--repeats", "2", "--blocks", "4"],
    "bench_index.py": ["--quick"],
    "bench_long_turn.py": ["--turn-chars", "2000", "--target-tokens", "9000", "--last", "2"],
    "bench_kv_catchup.py": ["--batches", "200", "--replicas", "2", "--repeats", "1"],
    "bench_kv_subscriber.py": ["--messages", "200", "--gap-ms", "0.5"],
    "bench_kv_stream_catchup.py": ["--batches", "300", "--snapshot-every", "100"],  # NATS
    "bench_memo_churn.py": ["--bound", "64", "--calls", "50"],
    "bench_mixed_checkpoints.py": ["--turn-chars", "2000", "--target-tokens", "9000",
                                   "--shorts-between", "3", "--last", "2"],
    "bench_metrics.py": ["--calls", "100", "--repeats", "1"],
    "bench_router_path.py": ["--requests", "20", "--repeats", "1", "--no-engine"],
    "bench_wire_openai.py": ["--iterations", "50"],
    "bench_soak_gc.py": ["--requests", "60", "--engine-blocks", "64"],
    "bench_sim_server.py": ["--requests", "20", "--concurrency", "4", "--max-tokens", "2",
                            "--max-seconds", "20"],
}


def test_every_script_is_covered() -> None:
    assert sorted(p.name for p in MICRO.glob("bench_*.py")) == sorted(CASES)


@pytest.mark.parametrize("script", sorted(CASES))
def test_micro_benchmark_runs(script: str, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    flag = "--out" if script == "bench_events_decode.py" else "--json"
    result = subprocess.run(
        [sys.executable, str(MICRO / script), *CASES[script], flag, str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(out.read_text())
