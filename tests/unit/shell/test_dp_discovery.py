"""Data-parallel rank counts read from ``/metrics`` (docs/data-parallel.md, "Discovering the
rank count"): the count from the ``engine`` labels, a replica configured without
``data_parallel_size`` expanded into its ranks and folded back, a fixed count the engine
contradicts logged, never resized."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from kvroute.config import RouterConfig, parse_config
from kvroute.core.errors import ConfigError
from kvroute.core.types import PoolName, ReplicaId
from kvroute.shell.dp_discovery import DpRankWatch
from kvroute.shell.dp_headers import DpRankHeaders
from kvroute.shell.metrics import RouterMetrics
from kvroute.wire.dp_rank import DpRankError, rank_count
from kvroute.wire.prom import EngineStats, parse_vllm_metrics, render_vllm_metrics

REAL_DP2 = Path(__file__).parents[2] / "data" / "vllm-0.32-cpu-dp2-metrics.txt"
"""vLLM 0.32 CPU's own ``/metrics`` with ``--data-parallel-size 2`` (its ``vllm:`` series)."""
POOL = PoolName("main")
CACHE = {"block_size": "16", "prefix_caching_hash_algo": "sha256", "num_gpu_blocks": "400"}


def exposition(ranks: int) -> str:
    """The ``/metrics`` body the simulated engine serves with ``--data-parallel-size``
    ``ranks`` (vLLM 0.32's layout: every series labelled ``engine="r"``)."""
    return render_vllm_metrics([EngineStats(engine=r, num_requests_running=r)
                                for r in range(ranks)], model_name="m", cache_config=CACHE)


def config(replicas: list[dict[str, Any]]) -> RouterConfig:
    return parse_config({
        "pools": {"main": {"model": "m", "replicas": replicas}},
        "routes": {"assistant": {"pools": ["main"]}},
    }, env={})


def engines(text: str) -> tuple[str, ...]:
    return parse_vllm_metrics(text, "m").engines


# -- the rank count in the exposition ------------------------------------------------------


def test_the_rank_count_of_real_vllm_with_two_ranks_is_two() -> None:
    parsed = parse_vllm_metrics(REAL_DP2.read_text(), "tiny")
    assert parsed.found and parsed.engines == ("0", "1")
    assert rank_count(parsed.engines) == 2
    assert rank_count(parse_vllm_metrics(REAL_DP2.read_text(), "tiny", engine="1").engines) == 2


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_the_rank_count_is_read_from_the_engine_labels(ranks: int) -> None:
    assert rank_count(engines(exposition(ranks))) == ranks


def test_an_engine_without_engine_labels_says_nothing() -> None:
    unlabelled = "vllm:num_requests_running{model_name=\"m\"} 1.0\n"
    assert rank_count(engines(unlabelled)) is None


def test_one_rank_of_an_externally_balanced_deployment_is_one_engine() -> None:
    assert rank_count(["3"]) == 1  # a server started with --data-parallel-rank 3


def test_a_missing_rank_or_a_label_that_is_no_rank_is_refused() -> None:
    with pytest.raises(DpRankError, match="a rank is missing"):
        rank_count(["0", "2"])
    with pytest.raises(DpRankError, match="not data-parallel rank numbers"):
        rank_count(["0", "gpu1"])


# -- the config ----------------------------------------------------------------------------


def test_an_unset_or_auto_size_is_read_from_the_engine_and_a_number_is_fixed() -> None:
    reps = config([
        {"name": "a", "url": "http://h:1"},
        {"name": "b", "url": "http://h:2", "data_parallel_size": "auto"},
        {"name": "c", "url": "http://h:3", "data_parallel_size": 1},
        {"name": "d", "url": "http://h:4", "data_parallel_size": 2},
    ]).pools[POOL].replicas
    assert [(r.name, r.dp_auto, r.dp_size) for r in reps] == [
        ("a", True, 1), ("b", True, 1), ("c", False, 1), ("d.dp0", False, 2),
        ("d.dp1", False, 2)]
    with pytest.raises(ConfigError, match="data_parallel_size"):
        config([{"name": "a", "url": "http://h:1", "data_parallel_size": "many"}])


# -- expansion, folding, mismatch ----------------------------------------------------------


def test_an_auto_replica_becomes_its_ranks_and_folds_back_when_the_engine_changes() -> None:
    cfg = config([{"name": "e0", "url": "http://h:1", "kv_events": "tcp://h:5557",
                   "kv_replay": "tcp://h:5657"}])
    watch = DpRankWatch(cfg.pools.values(), RouterMetrics())
    (e0,) = cfg.pools[POOL].replicas
    watch.observe(e0, engines(exposition(1)))
    assert watch.take_resizes(frozenset({e0.name})) == []  # one rank: nothing to change
    watch.observe(e0, engines(exposition(2)))
    (grow,) = watch.take_resizes(frozenset({e0.name}))
    assert [r.name for r in grow.leaving] == ["e0"]
    assert [(r.name, r.dp_rank, r.kv_events, r.kv_replay, r.dp_auto) for r in grow.joining] == [
        ("e0.dp0", 0, "tcp://h:5557", "tcp://h:5657", True),
        ("e0.dp1", 1, "tcp://h:5558", "tcp://h:5658", True)]
    assert watch.size("e0") == 2
    # discovered ranks are not in the config; their header comes from their name
    assert DpRankHeaders(cfg).of(ReplicaId("e0.dp1")) == {"X-data-parallel-rank": "1"}
    # the engine restarted with three ranks: rank 1's reading says so
    watch.observe(grow.joining[1], engines(exposition(3)))
    (again,) = watch.take_resizes(frozenset(r.name for r in grow.joining))
    assert [r.name for r in again.leaving] == ["e0.dp0", "e0.dp1"]
    assert [r.name for r in again.joining] == ["e0.dp0", "e0.dp1", "e0.dp2"]
    # and with one: the ranks fold back into e0
    watch.observe(again.joining[0], engines(exposition(1)))
    (fold,) = watch.take_resizes(frozenset(r.name for r in again.joining))
    assert [r.name for r in fold.joining] == ["e0"] and fold.joining[0].dp_rank is None
    assert DpRankHeaders(cfg).of(ReplicaId("e0")) == {}


def test_rank_headers_are_read_from_the_config_once_and_unlisted_names_get_none() -> None:
    cfg = config([{"name": "e0", "url": "http://h:1"},
                  {"name": "f0", "url": "http://h:2", "data_parallel_size": 1}])
    headers = DpRankHeaders(cfg)
    first = headers.of(ReplicaId("e0.dp3"))
    assert first == {"X-data-parallel-rank": "3"} and headers.of(ReplicaId("e0.dp3")) is first
    for name in ("f0.dp1", "e0.dpx", "e0", "pod-7f9c", "x.dp1"):  # f0's count is fixed
        assert headers.of(ReplicaId(name)) == {}, name


def test_a_fixed_size_the_engine_contradicts_is_logged_once_and_kept(
        caplog: pytest.LogCaptureFixture) -> None:
    cfg = config([{"name": "e0", "url": "http://h:1", "data_parallel_size": 2,
                   "kv_events": "tcp://h:5557"}])
    watch = DpRankWatch(cfg.pools.values(), RouterMetrics())
    rank0, rank1 = cfg.pools[POOL].replicas
    with caplog.at_level(logging.ERROR, logger="kvroute.shell.dp_discovery"):
        watch.observe(rank0, engines(exposition(2)))
        assert caplog.records == []
        watch.observe(rank0, engines(exposition(4)))
        watch.observe(rank1, engines(exposition(4)))
    assert watch.take_resizes(frozenset({rank0.name, rank1.name})) == []
    (record,) = caplog.records
    assert "runs 4 data-parallel rank(s) but the config routes it as 2" in record.getMessage()
    assert "Set data_parallel_size: 4" in record.getMessage()


def test_ranks_that_cannot_be_followed_or_named_are_refused_and_the_replica_kept(
        caplog: pytest.LogCaptureFixture) -> None:
    cfg = config([{"name": "e0", "url": "http://h:1", "kv_events": "ipc:///tmp/e0"},
                  {"name": "e1", "url": "http://h:2"}])
    watch = DpRankWatch(cfg.pools.values(), RouterMetrics())
    e0, e1 = cfg.pools[POOL].replicas
    with caplog.at_level(logging.ERROR, logger="kvroute.shell.dp_discovery"):
        watch.observe(e0, engines(exposition(2)))
        watch.observe(e1, engines(exposition(2)))
        taken = frozenset({e0.name, e1.name, ReplicaId("e1.dp1")})  # a Kubernetes member
        assert watch.take_resizes(taken) == []
    assert watch.size("e0") == 1 and watch.size("e1") == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any("ipc:///tmp/e0" in m and "stays routed as 1" in m for m in messages), messages
    assert any("the name e1.dp1 is another replica's" in m for m in messages), messages
