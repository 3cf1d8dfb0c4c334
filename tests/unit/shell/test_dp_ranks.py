"""Data-parallel ranks in the router: a YAML replica with ``data_parallel_size`` is one
routing target per rank (its own index entries, load and cost), and the walk picks the rank
that holds the prefix (docs/data-parallel.md)."""

from __future__ import annotations

from typing import Any

import pytest

from kvroute.config import RouterConfig, parse_config
from kvroute.core.clock import ManualClock
from kvroute.core.errors import ConfigError
from kvroute.core.events import BlockStored, EventBatch
from kvroute.core.hashing import BlockHasher
from kvroute.core.index import TenantScope
from kvroute.core.router import RouteRequest
from kvroute.core.types import PoolName, ReplicaId, RequestId, TenantName, to_wire_hash
from kvroute.shell.dp_headers import DpRankHeaders
from kvroute.shell.runtime import build_core
from kvroute.wire.prom import parse_vllm_metrics

POOL = PoolName("main")
SCOPE = TenantScope(TenantName("default"))
PROMPT = list(range(100, 420))  # 20 blocks of 16


def config(replicas: list[dict[str, Any]]) -> RouterConfig:
    return parse_config({
        "pools": {"main": {"model": "m", "replicas": replicas, "block_size": 16,
                           "hash_algo": "sha256"}},
        "routes": {"assistant": {"pools": ["main"]}},
    }, env={})


DP_FLEET = [
    {"name": "e0", "url": "http://10.0.0.5:8000", "data_parallel_size": 2,
     "kv_events": "tcp://10.0.0.5:5557", "kv_replay": "tcp://10.0.0.5:5657"},
    {"name": "s1", "url": "http://10.0.0.6:8000", "kv_events": "tcp://10.0.0.6:5557"},
]


def stored(tokens: list[int]) -> EventBatch:
    hashes = BlockHasher("sha256", 16).hash_blocks(tokens)
    return EventBatch(seq=0, ts=0.0, events=(BlockStored(
        block_hashes=tuple(to_wire_hash(h) for h in hashes), parent_block_hash=None,
        token_ids=tuple(tokens[: 16 * len(hashes)]), block_size=16),), data_parallel_rank=1)


def request(rid: str, tokens: list[int]) -> RouteRequest:
    return RouteRequest(RequestId(rid), POOL, SCOPE, num_prompt_tokens=len(tokens),
                        prompt_token_ids=tokens, expected_output_tokens=16)


def test_a_dp_replica_is_one_target_per_rank_with_vllms_per_rank_endpoints() -> None:
    reps = config(DP_FLEET).pools[POOL].replicas
    assert [(r.name, r.dp_rank, r.engine, r.kv_events, r.kv_replay, r.url) for r in reps] == [
        ("e0.dp0", 0, "e0", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5657", "http://10.0.0.5:8000"),
        ("e0.dp1", 1, "e0", "tcp://10.0.0.5:5558", "tcp://10.0.0.5:5658", "http://10.0.0.5:8000"),
        ("s1", None, None, "tcp://10.0.0.6:5557", None, "http://10.0.0.6:8000"),
    ]


def test_bad_data_parallel_settings_say_what_to_write() -> None:
    with pytest.raises(ConfigError, match="data_parallel_size"):
        config([{"name": "e0", "url": "http://h:1", "data_parallel_size": 0}])
    with pytest.raises(ConfigError, match="port \\+ r"):
        config([{"name": "e0", "url": "http://h:1", "data_parallel_size": 2,
                 "kv_events": "ipc:///tmp/kv"}])
    with pytest.raises(ConfigError, match="port \\+ 2"):  # rank 1's events on rank 0's replay
        config([{"name": "e0", "url": "http://h:1", "data_parallel_size": 2,
                 "kv_events": "tcp://h:5557", "kv_replay": "tcp://h:5558"}])
    with pytest.raises(ConfigError, match="e0.dp1"):  # a name the ranks already take
        config([{"name": "e0", "url": "http://h:1", "data_parallel_size": 2},
                {"name": "e0.dp1", "url": "http://h:2"}])


def test_the_walk_picks_the_rank_holding_the_prefix_and_the_header_names_it() -> None:
    cfg = config(DP_FLEET)
    core = build_core(cfg, clock=ManualClock())
    core.apply_events(ReplicaId("e0.dp1"), stored(PROMPT))
    decision = core.route(request("a", [*PROMPT, 1, 2, 3]))
    assert decision.replica == "e0.dp1"
    assert decision.expected_cached_tokens == 320
    # rank 0 of the same engine holds nothing: each rank's cache is its own
    assert core.index.match(decision.block_hashes, SCOPE).get(ReplicaId("e0.dp0")) is None
    assert DpRankHeaders(cfg).of(decision.replica) == {"X-data-parallel-rank": "1"}
    assert DpRankHeaders(cfg).of(ReplicaId("s1")) == {}


def test_each_rank_has_its_own_load_so_a_busy_rank_loses_to_its_idle_sibling() -> None:
    """Both ranks hold the prefix; rank 1 has a long prefill queue of its own: the cost
    model prices each rank's queue apart and sends the request to rank 0."""
    cfg = config(DP_FLEET)
    core = build_core(cfg, clock=ManualClock())
    for rank in ("e0.dp0", "e0.dp1"):
        core.apply_events(ReplicaId(rank), stored(PROMPT))
    for i in range(6):  # six long cold prompts queued on rank 1 alone
        core.load.on_dispatch(ReplicaId("e0.dp1"), RequestId(f"q{i}"), prefill_tokens=8000,
                              prompt_tokens=8000, expected_output_tokens=16, now_s=0.0)
    decision = core.route(request("b", [*PROMPT, 9]))
    assert decision.replica == "e0.dp0"
    assert core.load.snapshot(ReplicaId("e0.dp1")).num_in_flight == 6
    assert core.load.snapshot(ReplicaId("e0.dp0")).num_in_flight == 1


EXPOSITION = """\
vllm:num_requests_running{engine="0",model_name="m"} 3
vllm:num_requests_running{engine="1",model_name="m"} 1
vllm:num_requests_waiting{engine="0",model_name="m"} 5
vllm:num_requests_waiting{engine="1",model_name="m"} 0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1
"""


def test_a_rank_reads_its_own_engine_label_out_of_the_servers_metrics() -> None:
    one = parse_vllm_metrics(EXPOSITION, "m", engine="1")
    assert (one.num_requests_running, one.num_requests_waiting, one.kv_cache_usage_perc) == (
        1, 0, 0.25)
    assert one.block_size == 16  # series without an engine label still count
    both = parse_vllm_metrics(EXPOSITION, "m")
    assert (both.num_requests_running, both.num_requests_waiting) == (4, 5)
