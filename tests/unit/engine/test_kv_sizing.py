"""KV sizing against published per-token figures and vLLM's block arithmetic.

The model shapes are the bundled ``kvroute/data/models`` files (their README says where each
fact comes from). The real engine's block count is checked in
tests/conformance/test_plan_real_vllm.py.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import pytest

from kvroute.core.errors import ConfigError
from kvroute.engine.kv_sizing import (
    GIB,
    KvShape,
    kv_dtype_bytes,
    plan_replica,
    plan_tiers,
    safetensors_header_bytes,
)

KIB = 1024


def _config(name: str) -> dict[str, Any]:
    path = resources.files("kvroute") / "data" / "models" / f"{name}.json"
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def _shape(name: str) -> KvShape:
    return KvShape.from_config(_config(name))


def test_llama_3_1_8b_is_128_kib_per_token_in_bf16() -> None:
    shape = _shape("llama-3.1-8b")
    assert shape.bytes_per_token(kv_dtype_bytes("auto", shape.model_dtype)) == 128 * KIB
    assert shape.bytes_per_token(kv_dtype_bytes("fp8", shape.model_dtype)) == 64 * KIB


def test_llama_3_1_70b_is_320_kib_per_token_in_bf16_whatever_the_tp() -> None:
    shape = _shape("llama-3.1-70b")
    for tp in (1, 2, 4, 8):
        assert shape.bytes_per_token(2, tp) == 320 * KIB
    # past the 8 KV heads every rank keeps a whole head: TP16 stores each head twice
    assert shape.bytes_per_token(2, 16) == 640 * KIB


def test_deepseek_v3_mla_keeps_576_values_per_layer_replicated_on_every_rank() -> None:
    shape = _shape("deepseek-v3")
    assert shape.mla and shape.values_per_token_layer(tp=8) == 576
    assert shape.bytes_per_token(2) == 61 * 576 * 2 == 70_272
    assert shape.bytes_per_token(2, tp=8) == 8 * 70_272
    assert shape.bytes_per_token(kv_dtype_bytes("fp8", shape.model_dtype)) == 61 * 576


def test_sliding_window_and_hybrid_layers() -> None:
    mistral = _shape("mistral-7b-v0.1")
    assert (mistral.full_layers, mistral.sliding_layers, mistral.sliding_window) == (0, 32, 4096)
    gemma2 = _shape("gemma-2-9b")
    assert (gemma2.full_layers, gemma2.sliding_layers) == (21, 21)
    assert kv_dtype_bytes("auto", gemma2.model_dtype) == 2  # float32 checkpoint served in BF16
    gemma3 = _shape("gemma-3-27b")  # text_config, 5 sliding : 1 full
    assert (gemma3.full_layers, gemma3.sliding_layers, gemma3.sliding_window) == (10, 52, 1024)
    # vLLM's hybrid groups: 1 full group and 6 sliding groups of 10 layers (8 padded).
    assert gemma3.groups() == (10, 1, 6)
    assert gemma3.block_bytes_per_rank(16, 2) == 10 * gemma3.page_bytes(16, 2)
    assert gemma3.session_blocks(512, 16) == 7 * 32
    assert gemma3.session_blocks(32_768, 16) == 2048 + 6 * 65
    assert gemma2.groups() == (21, 1, 1)
    # Mistral past its window takes no more than at its window (plus the straddled block).
    assert mistral.groups() == (32, 0, 1)
    assert mistral.session_blocks(32_000, 16) == mistral.session_blocks(4096 + 16, 16) == 257
    plan = plan_replica(gemma3, block_size=16, kv_cache_gib=10)
    assert plan.sessions_at(32_768) == (plan.num_gpu_blocks - 1) // (2048 + 390)
    assert plan.tokens == (plan.num_gpu_blocks - 1) * 16 // 7


def test_layer_types_count_state_layers_and_reject_unknown_ones() -> None:
    base = {"num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 256,
            "sliding_window": 128}
    shape = KvShape.from_config({**base, "layer_types": [
        "linear_attention", "linear_attention", "sliding_attention", "full_attention"]})
    assert (shape.full_layers, shape.sliding_layers, shape.state_layers) == (1, 1, 2)
    with pytest.raises(ConfigError, match="layer_types has 'cross'"):
        KvShape.from_config({**base, "layer_types": ["cross"] * 4})
    with pytest.raises(ConfigError, match="lists 3 layers"):
        KvShape.from_config({**base, "layer_types": ["full_attention"] * 3})
    no_window = KvShape.from_config({**base, "sliding_window": 4096, "use_sliding_window": False})
    assert (no_window.full_layers, no_window.sliding_layers) == (4, 0)


def test_missing_or_bad_fields_say_which() -> None:
    with pytest.raises(ConfigError, match="no 'num_hidden_layers'"):
        KvShape.from_config({"num_attention_heads": 4})
    with pytest.raises(ConfigError, match="'num_key_value_heads' must be a positive integer"):
        KvShape.from_config({"num_hidden_layers": 2, "num_attention_heads": 4,
                             "num_key_value_heads": 0, "head_dim": 64})
    with pytest.raises(ConfigError, match="unknown KV dtype 'int3'"):
        kv_dtype_bytes("int3", "bfloat16")


def test_tiny_model_on_the_cpu_backend_is_8192_blocks_per_gib() -> None:
    """2 layers x (2 heads x 2 x 64 values) x 2 B x 128 tokens = 128 KiB a block."""
    plan = plan_replica(_shape("tiny-llama"), block_size=128, kv_cache_gib=1)
    assert plan.block_bytes_per_rank == 128 * KIB
    assert plan.num_gpu_blocks == 8192
    assert plan.tokens == 8191 * 128
    assert plan.sessions_at(2048) == 8191 // 16


def test_llama_8b_on_an_h100_left_after_weights() -> None:
    shape = _shape("llama-3.1-8b")
    weights = int(8.03e9 * 2)
    plan = plan_replica(shape, block_size=16, gpu_memory_gib=80, gpu_memory_utilization=0.9,
                        weights_bytes=weights, reserve_gib=4)
    kv = int(80 * GIB * 0.9 - weights - 4 * GIB)
    assert plan.kv_bytes_per_rank == kv
    assert plan.num_gpu_blocks == kv // (2 * KIB * KIB)  # 16 tokens x 128 KiB
    assert plan.sessions_at(8192) == (plan.num_gpu_blocks - 1) // 512
    assert plan.survival_s(10_000) == pytest.approx(plan.tokens / 10_000)
    # TP halves the weights and the heads per rank: more than twice the blocks per rank
    tp2 = plan_replica(shape, block_size=16, gpu_memory_gib=80, weights_bytes=weights,
                       reserve_gib=4, tp=2)
    assert tp2.num_gpu_blocks > 2 * plan.num_gpu_blocks


def test_no_memory_left_is_an_error_that_says_what_to_change() -> None:
    with pytest.raises(ConfigError, match="no memory left for KV.*raise tensor parallelism"):
        plan_replica(_shape("llama-3.1-70b"), block_size=16, gpu_memory_gib=80,
                     weights_bytes=int(70.6e9 * 2))
    with pytest.raises(ConfigError, match="give the KV memory per rank"):
        plan_replica(_shape("llama-3.1-8b"), block_size=16)


def test_tiers_hold_whole_replica_blocks_and_survive_by_their_writers() -> None:
    plan = plan_replica(_shape("llama-3.1-70b"), block_size=16, kv_cache_gib=30, tp=4)
    assert plan.block_bytes == 16 * 320 * KIB
    cpu, shared = plan_tiers(plan, [("cpu", 200, 1, 25.0), ("shared", 1000, 8, 12.5)])
    assert cpu.blocks == 200 * GIB // (5 * KIB * KIB) == 40_960
    assert cpu.load_s_per_block() == pytest.approx(16 * 320 * KIB / 25e9)
    assert shared.survival_s(1000) == pytest.approx(shared.tokens / 8000)
    with pytest.raises(ConfigError, match="tier 'disk'"):
        plan_tiers(plan, [("disk", 0, 1, None)])


def test_safetensors_header_sums_its_tensors() -> None:
    header = {"__metadata__": {"format": "pt"},
              "a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
              "b": {"dtype": "F32", "shape": [4], "data_offsets": [12, 28]}}
    assert safetensors_header_bytes(header) == 28
    with pytest.raises(ConfigError, match="'c' has no"):
        safetensors_header_bytes({"c": {"dtype": "F32"}})
