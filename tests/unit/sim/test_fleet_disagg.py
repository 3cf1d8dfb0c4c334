"""Disaggregated prefill/decode in the virtual-time fleet: the prefill half on P, the KV
pulled by D at the link's rate, D's first token after both, a failed prefill colocated."""

from __future__ import annotations

from kvroute.core.disagg import DisaggSpec
from kvroute.core.types import ReplicaId
from kvroute.sim.fleet import FleetConfig, FleetSimulation, Outage
from kvroute.sim.profiles import get_profile
from kvroute.sim.workload import WorkloadRequest

H100 = get_profile("llama-3.1-8b-h100")
PROMPT = tuple(range(1000, 3000))  # 2,000 tokens: 124 full blocks + 16 computed on D
LINK = 1e-4  # 0.1 ms a token: 0.2 s for the prompt, long enough to see in the timings


def run(mode: str, outages: tuple[Outage, ...] = ()) -> FleetSimulation:
    config = FleetConfig(num_replicas=2, profile=H100, roles=("prefill", "decode"),
                         disagg=DisaggSpec(mode, LINK), outages=outages)  # type: ignore[arg-type]
    sim = FleetSimulation(config, [WorkloadRequest(0.0, "a", PROMPT, 8)])
    sim.result = sim.run()  # type: ignore[attr-defined]
    return sim


def test_a_split_prefills_on_p_and_decodes_on_d_after_the_transfer() -> None:
    split = run("always")
    record = split.result.records[0]  # type: ignore[attr-defined]
    assert record.prefill_replica == "r0" and record.replica == "r1"
    assert record.num_output_tokens == 8 and record.finish_reason == "length"
    p, d = split.engines[ReplicaId("r0")].metrics(), split.engines[ReplicaId("r1")].metrics()
    assert p.prompt_tokens_total == 2_000  # P computed the prompt
    assert d.external_prefix_cache_hits_total == 1_984  # D pulled all but the last 16
    colocated = run("never").result.records[0]  # type: ignore[attr-defined]
    assert colocated.prefill_replica is None and colocated.replica == "r1"
    # the split's first token waits for P's prefill and the 0.2 s transfer
    assert record.ttft_s is not None and colocated.ttft_s is not None
    assert record.ttft_s > colocated.ttft_s + 0.19
    assert split.router.load.snapshot(ReplicaId("r0"), 1e9).num_in_flight == 0


def test_a_prefill_replica_that_is_down_leaves_the_request_colocated_on_d() -> None:
    sim = run("always", outages=(Outage("r0", 0.0, 10.0),))
    record = sim.result.records[0]  # type: ignore[attr-defined]
    assert record.prefill_replica is None and record.replica == "r1"
    assert record.finish_reason == "length"
    assert sim.result.counters["prefill_failures"] == 1  # type: ignore[attr-defined]
