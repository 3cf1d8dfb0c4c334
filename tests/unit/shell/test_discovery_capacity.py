"""Discovery reads an engine's KV capacity from its ``vllm:cache_config_info``."""

from __future__ import annotations

from kvroute.shell.discovery import _kv_capacity_tokens
from kvroute.wire.prom import parse_vllm_metrics


def metrics(labels: str) -> str:
    return (
        "# TYPE vllm:cache_config_info gauge\n"
        f"vllm:cache_config_info{{{labels}}} 1.0\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m"} 0.0\n'
    )


def test_capacity_is_the_gpu_blocks_less_the_null_block_times_the_block_size() -> None:
    parsed = parse_vllm_metrics(metrics('block_size="16",num_gpu_blocks="24800"'), "m")
    assert _kv_capacity_tokens(parsed) == 24_799 * 16


def test_no_capacity_when_the_engine_does_not_say() -> None:
    for labels in ('block_size="16"', 'num_gpu_blocks="24800"',
                   'block_size="16",num_gpu_blocks="None"', 'block_size="16",num_gpu_blocks="1"'):
        assert _kv_capacity_tokens(parse_vllm_metrics(metrics(labels), "m")) is None
