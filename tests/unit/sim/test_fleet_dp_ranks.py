"""Data-parallel ranks in the virtual-time fleet: every replica is several engines, each
with its own batch and KV; a rank-aware router sends a returning session to the rank that
holds its prefix, a rank-blind one leaves the rank to vLLM's load balancer
(docs/data-parallel.md)."""

from __future__ import annotations

import dataclasses

import pytest

from kvroute.core.errors import ConfigError
from kvroute.core.types import ReplicaId
from kvroute.sim.fleet import FleetConfig, FleetSimulation, Outage
from kvroute.sim.profiles import get_profile
from kvroute.sim.workload import WorkloadRequest

SMALL = dataclasses.replace(get_profile("llama-3.1-8b-h100"), num_gpu_blocks=200,
                            max_model_len=1024)
A = tuple(range(1000, 1480))  # 30 blocks of 16
B = tuple(range(5000, 5480))
PREFIX_HIT = 30 * 16  # a return holds all of its first prompt's 30 blocks

# Two sessions start together (one per rank); B returns first, to an idle engine, then A.
WORKLOAD = [
    WorkloadRequest(0.0, "a1", A, 8, session_id="a"),
    WorkloadRequest(0.0001, "b1", B, 8, session_id="b"),
    WorkloadRequest(5.0, "b2", (*B, *range(7000, 7040)), 8, session_id="b"),
    WorkloadRequest(6.0, "a2", (*A, *range(8000, 8040)), 8, session_id="a"),
]


def _run(*, blind: bool) -> FleetSimulation:
    sim = FleetSimulation(FleetConfig(num_replicas=1, profile=SMALL, policy="kvroute",
                                      data_parallel_size=2, rank_blind=blind), WORKLOAD)
    sim.result = sim.run()  # type: ignore[attr-defined]
    return sim


def test_a_dp_replica_is_one_engine_per_rank() -> None:
    sim = _run(blind=False)
    assert sim.names == (ReplicaId("r0.dp0"), ReplicaId("r0.dp1"))
    assert sim.router_names == sim.names  # rank-aware: each rank is a target
    assert _run(blind=True).router_names == (ReplicaId("r0"),)


def test_a_rank_aware_router_returns_each_session_to_its_rank() -> None:
    sim = _run(blind=False)
    ran = {r.request_id: r.replica for r in sim.result.records}  # type: ignore[attr-defined]
    assert ran["a1"] != ran["b1"]  # both ranks used: one session each
    assert ran["a2"] == ran["a1"] and ran["b2"] == ran["b1"]
    hits = sum(e.metrics().prefix_cache_hits_total for e in sim.engines.values())
    assert hits == 2 * PREFIX_HIT


def test_a_rank_blind_router_leaves_the_rank_to_the_engines_load_balancer() -> None:
    """vLLM's balancer puts b1 on rank 1 (rank 0 is busy with a1), then b2 on rank 0 (all
    idle: the first rank): b's prefix is on the other rank, recomputed."""
    sim = _run(blind=True)
    ran = {r.request_id: r.replica for r in sim.result.records}  # type: ignore[attr-defined]
    assert ran == {"a1": "r0.dp0", "b1": "r0.dp1", "b2": "r0.dp0", "a2": "r0.dp0"}
    hits = sum(e.metrics().prefix_cache_hits_total for e in sim.engines.values())
    assert hits == PREFIX_HIT  # a2 only


def test_a_rank_blind_fleet_refuses_what_names_engines() -> None:
    with pytest.raises(ConfigError, match="rank_blind"):
        FleetConfig(num_replicas=1, profile=SMALL, data_parallel_size=2, rank_blind=True,
                    outages=(Outage("r0.dp1", 1.0, 2.0),))
