"""``kvroute plan`` on the command line, and the ``MODEL@GPU`` spec sim and bench take."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvroute.cli import app
from kvroute.commands.plan import replica_from_spec, weights_bytes
from kvroute.core.errors import ConfigError
from kvroute.engine.kv_sizing import GIB, GPUS


def test_plan_prints_and_writes_the_llama_8b_h100_figures(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    result = CliRunner().invoke(app, [
        "plan", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--reserve-gib", "4",
        "--cpu-gib", "200", "--prefill-rate", "10000", "--context", "8192", "--link-gbps", "50",
        "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["bytes_per_token"] == 131_072
    kv = int(GPUS["h100-80gb"] * GIB * 0.9 - 8.03e9 * 2 - 4 * GIB)
    assert report["num_gpu_blocks"] == kv // (16 * 131_072)
    assert report["sessions"]["8192"] == (report["num_gpu_blocks"] - 1) // 512
    assert report["tiers"]["cpu"]["blocks"] == 200 * GIB // (16 * 131_072)
    assert report["survival_s"]["gpu"] == pytest.approx(report["tokens"] / 10_000)
    assert "per token        131,072 B (128.0 KiB)" in result.output
    assert "prefix survives" in result.output
    # moving an 8,192-token prompt's KV (1 GiB) over a 50 GB/s link
    assert report["transfer_s"]["8192"] == pytest.approx(8192 * 131_072 / 50e9)
    assert "transfer         21.5 ms for 8,192 tokens" in result.output


def test_plan_lists_and_refuses_clearly() -> None:
    runner = CliRunner()
    listed = runner.invoke(app, ["plan", "--list"])
    assert "deepseek-v3" in listed.output and "h100-80gb" in listed.output
    bad = runner.invoke(app, ["plan", "--model", "llama-3.1-8b", "--gpu", "tpu"])
    assert bad.exit_code == 2 and "unknown GPU 'tpu'" in bad.output
    missing = runner.invoke(app, ["plan", "--model", "no-such-model", "--kv-cache-gib", "1"])
    assert missing.exit_code == 2 and "no model 'no-such-model'" in missing.output


def test_the_spec_sim_and_bench_take() -> None:
    plan = replica_from_spec("llama-3.1-70b@h100-80gb,tp=4,reserve=4", block_size=16)
    assert plan.tp == 4 and plan.bytes_per_token == 320 * 1024
    assert replica_from_spec("tiny-llama@kvgib=1", block_size=128).num_gpu_blocks == 8192
    fp8 = replica_from_spec("llama-3.1-8b@h100-80gb,kv=fp8", block_size=16)
    assert fp8.dtype_bytes == 1
    for bad, why in (("llama-3.1-8b", "takes MODEL@GPU"), ("llama-3.1-8b@h100-80gb,x=1",
                                                          "option 'x=1'"),
                     ("llama-3.1-8b@h100-80gb,tp=two", "'two' is not a int")):
        with pytest.raises(ConfigError, match=why):
            replica_from_spec(bad, block_size=16)


def test_weights_from_a_safetensors_file_header(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "BF16", "shape": [8, 8], "data_offsets": [0, 128]}})
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(128))
    (tmp_path / "config.json").write_text("{}")
    assert weights_bytes({}, tmp_path) == (128, str(path))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 1234}, "weight_map": {}}))
    assert weights_bytes({}, tmp_path)[0] == 1234
    assert weights_bytes({"kvroute_params_b": 1}, None)[0] == 2 * 10**9


def test_bench_sim_takes_its_kv_and_tiers_from_the_plan(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    result = CliRunner().invoke(app, [
        "bench", "sim", "--limit", "40", "--policies", "kvroute", "--quiet",
        "--kv-plan", "llama-3.1-8b@h100-80gb,reserve=4", "--cpu-tier", "2",
        "--json", str(out)])
    assert result.exit_code == 0, result.output
    config = json.loads(out.read_text())["config"]
    blocks = replica_from_spec("llama-3.1-8b@h100-80gb,reserve=4", block_size=16).num_gpu_blocks
    assert config["kv"]["num_gpu_blocks"] == blocks
    assert config["kv"]["cpu_offload_blocks"] == 2 * (blocks - 1)
    assert config["policy_params"]["kvroute"]["cpu_load_s_per_token"] == pytest.approx(
        131_072 / 25e9)
    bounds = tmp_path / "bounds.json"
    result = CliRunner().invoke(app, [
        "bench", "sim", "--bounds", "--limit", "40", "--cpu-tier", "4", "--json", str(bounds)])
    assert result.exit_code == 0, result.output
    rows = [r["name"] for r in json.loads(bounds.read_text())["bounds"]["0"]["rows"]]
    assert any("tiers" in name and "Belady" in name for name in rows), rows
    assert any("LRU write-through" in name for name in rows), rows
