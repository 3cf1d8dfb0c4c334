"""``kvroute plan`` equals the block count a real vLLM 0.32.0 CPU engine reports.

The session engines (``conftest.py``) run with ``VLLM_CPU_KVCACHE_SPACE=1`` (1 GiB of KV per
worker, ``tests/realvllm.engine_env``) and the CPU backend's 128-token blocks. The engine
reports ``num_gpu_blocks`` in ``vllm:cache_config_info`` on ``/metrics`` (and logs ``CPU KV
cache size: <num_gpu_blocks x block_size> tokens``); the planner reads the same model
directory's ``config.json`` and must give exactly that count.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from realvllm import RealVllmEngine, engine_env, http_text, metric_samples
from typer.testing import CliRunner

from kvroute.cli import app

pytestmark = pytest.mark.realvllm


def test_plan_equals_the_engines_num_gpu_blocks(
    real_vllm_engine: RealVllmEngine, tmp_path: Path
) -> None:
    metrics = http_text(real_vllm_engine.url + "/metrics")
    (info,) = [labels for labels, _ in metric_samples(metrics, "vllm:cache_config_info")]
    reported = int(info["num_gpu_blocks"])
    block_size = int(info["block_size"])
    space_gib = engine_env()["VLLM_CPU_KVCACHE_SPACE"]
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, [
        "plan", "--model", str(real_vllm_engine.model_dir), "--kv-cache-gib", space_gib,
        "--block-size", str(block_size), "--context", str(real_vllm_engine.max_model_len),
        "--json", str(out)])
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    assert plan["num_gpu_blocks"] == reported, (plan, info)
    assert f"num_gpu_blocks   {reported:,}" in result.output
    # vLLM's own concurrency figure counts the null block too: blocks x size / window.
    assert plan["sessions"][str(real_vllm_engine.max_model_len)] == (
        (reported - 1) * block_size // real_vllm_engine.max_model_len)
