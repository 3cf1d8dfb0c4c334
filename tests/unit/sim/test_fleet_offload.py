"""Offload tiers in the virtual-time fleet: CPU tiers per engine and a shared store, their
events in the router's index, loads counted apart from device hits."""

from __future__ import annotations

import dataclasses

from kvroute.core.hashing import BlockHasher
from kvroute.core.index import TenantScope
from kvroute.core.types import ReplicaId, TenantName
from kvroute.sim.fleet import FleetConfig, FleetSimulation
from kvroute.sim.profiles import get_profile
from kvroute.sim.workload import WorkloadRequest

H100 = get_profile("llama-3.1-8b-h100")
# 40 usable blocks of 16 tokens: two 480-token prompts plus their answers evict each other.
SMALL = dataclasses.replace(H100, num_gpu_blocks=41, max_model_len=640)
A = tuple(range(1000, 1480))
B = tuple(range(5000, 5480))
C = tuple(range(9000, 9480))


def _run(config: FleetConfig, workload: list[WorkloadRequest]) -> FleetSimulation:
    sim = FleetSimulation(config, workload)
    sim.run()
    return sim


def test_a_prompt_evicted_from_the_gpu_comes_back_from_the_cpu_tier() -> None:
    tiered = dataclasses.replace(SMALL, cpu_offload_blocks=200, cpu_load_s_per_block=84e-6)
    workload = [WorkloadRequest(0.0, "a1", A, 8), WorkloadRequest(1.0, "b", B, 8),
                WorkloadRequest(2.0, "c", C, 8), WorkloadRequest(3.0, "a2", A, 8)]
    sim = _run(FleetConfig(num_replicas=1, profile=tiered, policy="round_robin"), workload)
    engine = sim.engines[ReplicaId("r0")]
    m = engine.metrics()
    assert m.external_prefix_cache_hits_total == 29 * 16  # (480 - 1) // 16 blocks, all loaded
    assert m.prefix_cache_hits_total == 0
    # the router's index holds the prompt on the replica's CPU tier (medium "CPU")
    hashes = BlockHasher("sha256", 16).wire_hashes(list(A))
    match = sim.router.index.match(hashes, TenantScope(TenantName("default")))
    assert match[ReplicaId("r0")].num_cpu_blocks + match[ReplicaId("r0")].num_gpu_blocks == 30


def test_without_a_tier_the_same_prompt_is_recomputed() -> None:
    workload = [WorkloadRequest(0.0, "a1", A, 8), WorkloadRequest(1.0, "b", B, 8),
                WorkloadRequest(2.0, "c", C, 8), WorkloadRequest(3.0, "a2", A, 8)]
    sim = _run(FleetConfig(num_replicas=1, profile=SMALL, policy="round_robin"), workload)
    m = sim.engines[ReplicaId("r0")].metrics()
    assert m.external_prefix_cache_hits_total == 0 and m.prefix_cache_hits_total == 0


def test_a_shared_store_serves_another_replica_and_every_replica_indexes_it() -> None:
    workload = [WorkloadRequest(0.0, "a1", A, 8), WorkloadRequest(1.0, "a2", A, 8)]
    config = FleetConfig(num_replicas=2, profile=SMALL, policy="round_robin",
                         shared_store_blocks=500, shared_load_s_per_block=2e-4)
    sim = _run(config, workload)
    loaded = {name: e.metrics().external_prefix_cache_hits_total
              for name, e in sim.engines.items()}
    assert sorted(loaded.values()) == [0, 29 * 16]
    hashes = BlockHasher("sha256", 16).wire_hashes(list(A))
    match = sim.router.index.match(hashes, TenantScope(TenantName("default")))
    for name in sim.engines:  # both replicas can load the whole prompt from the store
        assert match[name].num_storage_blocks + match[name].num_gpu_blocks == 30
