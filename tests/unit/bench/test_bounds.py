"""What no router can beat (``kvroute.bench.bounds``), on traces small enough to do by hand."""

from __future__ import annotations

import dataclasses

import pytest
from typer.testing import CliRunner

from kvroute.bench.bounds import (
    compute_bounds,
    decode_floor_s,
    lru_hits,
    opt_hit_total,
    prompt_blocks,
    ttft_floor_s,
    unbounded_hits,
)
from kvroute.bench.traces import mooncake_tokens
from kvroute.bench.workloads import mooncake
from kvroute.cli import app
from kvroute.core.errors import ConfigError
from kvroute.core.hashing import BlockHasher
from kvroute.engine.model import EngineModel, EngineRequest, StepTiming
from kvroute.sim.fleet import FleetConfig, simulate
from kvroute.sim.profiles import get_profile
from kvroute.sim.workload import WorkloadRequest

H100 = get_profile("llama-3.1-8b-h100")


def trace_request(i: int, hash_ids: list[int], length: int) -> WorkloadRequest:
    """A Mooncake-style request: 8 tokens per hash id (two engine blocks of 4)."""
    return WorkloadRequest(float(i), f"r{i}", mooncake_tokens(hash_ids, length, 8), 1)


# Engine blocks of 4 tokens, trace blocks of 8. By hand (cap = (n - 1) // 4 blocks):
#   r0 [1,2] 16 tokens: 4 blocks, nothing seen before                  -> 0
#   r1 [1,3] 12 tokens: blocks of 1 seen, then 3 is new; cap 2          -> 8
#   r2 [1,2] 13 tokens: 3 full blocks, all seen (r0); cap 3             -> 12
#   r3 [1,2] 16 tokens: 4 blocks, all seen, but the cap is 3 blocks      -> 12
HAND = [trace_request(0, [1, 2], 16), trace_request(1, [1, 3], 12),
        trace_request(2, [1, 2], 13), trace_request(3, [1, 2], 16)]


def test_unbounded_hits_of_a_hand_made_trace() -> None:
    blocks = prompt_blocks(HAND, 4)
    assert list(unbounded_hits(blocks)) == [0, 8, 12, 12]
    # The same prompts as plain token tuples walk the generic path and agree.
    plain = [dataclasses.replace(r, prompt_token_ids=tuple(r.prompt_token_ids)) for r in HAND]
    assert list(unbounded_hits(prompt_blocks(plain, 4))) == [0, 8, 12, 12]


def test_block_ids_follow_prefix_identity_not_content() -> None:
    # Same trace block 5 after different parents: different engine blocks (chained hashes).
    a = trace_request(0, [1, 5], 16)
    b = trace_request(1, [2, 5], 16)
    blocks = prompt_blocks([a, b], 4)
    assert set(blocks.blocks(0)).isdisjoint(blocks.blocks(1))
    assert list(unbounded_hits(blocks)) == [0, 0]


def cyclic() -> list[WorkloadRequest]:
    # Three one-block prompts (block size 2, plus one token so the block can hit), A B C A B C.
    prompts = {"A": (10, 11, 1), "B": (20, 21, 1), "C": (30, 31, 1)}
    return [WorkloadRequest(float(i), f"q{i}", prompts[name], 1)
            for i, name in enumerate("ABCABC")]


def test_lru_and_belady_on_a_cycle_larger_than_the_cache() -> None:
    blocks = prompt_blocks(cyclic(), 2)
    # Unbounded: the second A, B and C hit one block each.
    assert sum(unbounded_hits(blocks)) == 6
    # LRU with room for two: each block is evicted just before it comes back.
    assert list(lru_hits(blocks, 2)) == [0] * 6
    # MIN keeps A for its return (evicts B), then keeps C (evicts A, never used again).
    assert opt_hit_total(blocks, 2) == 4
    # With room for all three, both keep everything.
    assert sum(lru_hits(blocks, 3)) == opt_hit_total(blocks, 3) == 6


def test_lru_evicts_the_tail_of_a_prompt_first() -> None:
    blocks = prompt_blocks(HAND, 4)
    # Capacity 3: r2 finds blocks 0 and 1 of [1,2] but its third block was evicted for r1's.
    assert list(lru_hits(blocks, 3)) == [0, 8, 8, 12]
    assert list(lru_hits(blocks, 100)) == list(unbounded_hits(blocks))


def test_ttft_floor_by_hand() -> None:
    timing = StepTiming(fixed_s=1.0, prefill_token_s=0.1, decode_seq_s=5.0, context_token_s=0.01)
    # u = 10 in chunks of 4: 3 steps; context after each (short chunk first): 2, 6, 10.
    assert ttft_floor_s(10, 0, timing, 4) == pytest.approx(3 * 1.0 + 10 * 0.1 + 18 * 0.01)
    assert ttft_floor_s(10, 8, timing, 4) == pytest.approx(1.0 + 2 * 0.1 + 10 * 0.01)
    # A full hit still computes the last token.
    assert ttft_floor_s(5, 5, timing, 4) == pytest.approx(1.0 + 0.1 + 5 * 0.01)
    with pytest.raises(ConfigError, match="chunk_tokens"):
        ttft_floor_s(5, 0, timing, 0)


def test_decode_floor_by_hand() -> None:
    timing = StepTiming(fixed_s=1.0, prefill_token_s=3.0, decode_seq_s=5.0, context_token_s=0.01)
    # 4 output tokens: the first comes with the prefill, then 3 lone decode steps whose
    # attention reads 11, 12 and 13 tokens.
    assert decode_floor_s(10, 4, timing) == pytest.approx(3 * (1.0 + 5.0) + 0.01 * 36)
    # The engine stops at its window: 12 - 10 = 2 output tokens, one decode step.
    assert decode_floor_s(10, 4, timing, max_model_len=12) == pytest.approx(6.0 + 0.01 * 11)
    # Two prefill tokens cost less than one decode here (2a = 0.2 < b = 5): a recompute after
    # a preemption could give the token at that price, so the floor takes it.
    cheap = dataclasses.replace(timing, prefill_token_s=0.1)
    assert decode_floor_s(10, 4, cheap) == pytest.approx(3 * (1.0 + 0.2) + 0.01 * 36)
    assert decode_floor_s(10, 1, timing) == decode_floor_s(10, 0, timing) == 0.0
    with pytest.raises(ConfigError, match="output_tokens >= 0"):
        decode_floor_s(10, -1, timing)


ONE = [WorkloadRequest(0.0, "only", tuple(range(100, 1100)), 5)]


def test_e2e_floor_of_a_one_request_workload_by_hand() -> None:
    report = compute_bounds(ONE, H100, replicas=1)
    rows = {r.name.split(" (")[0]: r for r in report.rows}
    # llama-3.1-8b-h100: 6 ms, 40 us, 20 us, 50 ns. Prefill: one step of 1,000 tokens.
    ttft = 6e-3 + 40e-6 * 1000 + 50e-9 * 1000  # 46.05 ms
    # Then 4 decode steps reading 1,001..1,004 tokens: 4 x 6.02 ms + 50 ns x 4,010.
    decode = 4 * (6e-3 + 20e-6) + 50e-9 * 4010  # 24.2805 ms
    floors = rows["floors: unbounded KV hits"]
    assert floors.ttft_mean_s == pytest.approx(ttft) and floors.ttft_p99_s == pytest.approx(ttft)
    assert floors.e2e_mean_s == pytest.approx(ttft + decode)
    assert floors.e2e_p99_s == pytest.approx(ttft + decode)
    assert rows["floors: fleet KV hits"].e2e_mean_s == pytest.approx(ttft + decode)
    assert rows["floors: fleet KV hits"].e2e_p99_s is None


def test_a_lone_request_in_the_simulator_takes_exactly_its_e2e_floor() -> None:
    (only,) = simulate(ONE, FleetConfig(num_replicas=1, profile=H100)).records
    floors = {r.name: r for r in compute_bounds(ONE, H100, replicas=1).rows}
    assert only.e2e_s == pytest.approx(floors["floors: unbounded KV hits"].e2e_mean_s)


def test_ttft_floor_is_below_an_idle_engine_and_close_to_it() -> None:
    config = H100.engine_config()
    for n, cached in ((20_000, 0), (12_035, 4_096), (600, 0)):
        engine = EngineModel(config, hasher=BlockHasher("sha256", config.block_size))
        if cached:
            engine.add_request(EngineRequest("warm", list(range(cached + 1)), max_tokens=1))
            while engine.has_work():
                engine.step()
        engine.add_request(EngineRequest("x", list(range(n)), max_tokens=1))
        elapsed = 0.0
        while True:
            step = engine.step()
            elapsed += step.duration_s
            if any(out.first_token for out in step.outputs):
                break
        floor = ttft_floor_s(n, cached, H100.timing, H100.max_num_batched_tokens)
        assert floor <= elapsed <= floor * 1.01


def test_compute_bounds_rows_on_the_hand_trace() -> None:
    profile = dataclasses.replace(H100, block_size=4, num_gpu_blocks=2,
                                  max_num_batched_tokens=8)
    report = compute_bounds(HAND, profile, replicas=2)
    rows = {r.name.split(" (")[0]: r for r in report.rows}
    assert report.prompt_tokens == 57 and report.requests == 4
    assert rows["hits: unbounded KV"].token_hit_rate == pytest.approx(32 / 57)
    floor = rows["floors: unbounded KV hits"].ttft_mean_s
    t = profile.timing
    expected = sum(ttft_floor_s(n, h, t, 8) for n, h in ((16, 0), (12, 8), (13, 12), (16, 12)))
    assert floor == pytest.approx(expected / 4)
    # Four blocks pooled: MIN and LRU both below the unbounded hits, MIN at least LRU.
    opt = rows["hits: fleet KV, Belady"].token_hit_rate
    lru = rows["hits: fleet KV, LRU"].token_hit_rate
    assert lru <= opt <= rows["hits: unbounded KV"].token_hit_rate
    fleet_floor = rows["floors: fleet KV hits"].ttft_mean_s
    assert fleet_floor is not None and floor is not None and fleet_floor >= floor


def test_compute_bounds_rejects_empty_input() -> None:
    with pytest.raises(ConfigError, match="at least one request"):
        compute_bounds([], H100, 8)
    with pytest.raises(ConfigError, match="replicas"):
        compute_bounds(HAND, H100, 0)


def test_belady_never_beats_unbounded_on_a_trace_slice() -> None:
    wl = mooncake(limit=300)
    blocks = prompt_blocks(wl, 16)
    unbounded = sum(unbounded_hits(blocks))
    for capacity in (500, 5_000):
        opt = opt_hit_total(blocks, capacity)
        lru = sum(lru_hits(blocks, capacity))
        assert lru <= opt
        # Raw MIN hits skip the last-token cap: allow one block per request above it.
        assert opt <= unbounded + 16 * len(wl)


def test_cli_prints_the_bounds() -> None:
    result = CliRunner().invoke(app, ["bench", "sim", "--bounds", "--limit", "40",
                                      "--rate-scale", "2.75"])
    assert result.exit_code == 0, result.output
    assert "hits: unbounded KV" in result.output
    assert "floors: fleet KV hits" in result.output
    assert "E2E mean floor" in result.output and "E2E p99 floor" in result.output


def test_run_bounds_bounds_a_trace_once_unless_jittered() -> None:
    from kvroute.bench.sim_bench import SimBenchSpec, run_bounds

    assert list(run_bounds(SimBenchSpec(limit=30, seeds=(0, 1)))) == [0]
    jittered = run_bounds(SimBenchSpec(limit=30, seeds=(0, 1), jitter_s=3.0))
    assert list(jittered) == [0, 1]
    with pytest.raises(ConfigError, match="trace replays only"):
        run_bounds(SimBenchSpec(workload="unique_prompts", jitter_s=1.0))
