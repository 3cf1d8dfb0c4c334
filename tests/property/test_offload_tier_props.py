"""Offload tiers (``engine/offload.py``) against naive models (hypothesis).

* The tier alone, under random stores, loads and lookups, holds exactly what a naive LRU list
  holds (same order), and its event stream applied to a naive set equals its content.
* An engine with a CPU tier, under random workloads: the engine's invariants hold, the GPU
  events still rebuild the device cache, the ``CPU`` events rebuild the tier, and every
  ``CPU`` block's tokens (from the events and their parents) re-hash to its hash.
* What a request loads: exactly the tier's run after its device hit, whole blocks below
  its last token; the external-hit counter is the sum of those.
* A shared tier: a prompt computed on one engine is a load on another that never saw it.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.core.events import BlockRemoved, BlockStored, KVEvent
from kvroute.core.hashing import BlockHasher
from kvroute.core.types import BlockHash, WireHash, to_wire_hash
from kvroute.engine.model import Accepted, EngineConfig, EngineModel, EngineRequest
from kvroute.engine.offload import MEDIUM_CPU, OffloadTier

BS = 4
HASHER = BlockHasher(block_size=BS)


class NaiveLru:
    """A list, least recent first: the obvious implementation of the tier's order."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: list[int] = []

    def touch(self, h: int) -> None:
        self.items.remove(h)
        self.items.append(h)

    def store(self, hashes: list[int]) -> None:
        for h in hashes:
            if h in self.items:
                self.touch(h)
                continue
            if len(self.items) >= self.capacity:
                self.items.pop(0)
            self.items.append(h)


def _apply(held: Counter[int], events: list[KVEvent], medium: str) -> None:
    for e in events:
        if e.medium != medium:  # type: ignore[union-attr]
            continue
        if isinstance(e, BlockStored):
            for h in e.block_hashes:
                held[h] += 1
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                assert held[h] > 0, f"removal of {h}, not held"
                held[h] -= 1
                if not held[h]:
                    del held[h]


_tier_ops = st.lists(st.tuples(st.sampled_from(["store", "load"]),
                               st.lists(st.integers(1, 12), min_size=1, max_size=6)),
                     max_size=40)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 8), _tier_ops)
def test_the_tier_is_a_naive_lru_and_its_events_rebuild_it(capacity: int,
                                                            ops: list[tuple[str, list[int]]]) -> None:
    tier = OffloadTier(capacity, BS, load_s_per_block=0.5)
    naive = NaiveLru(capacity)
    held: Counter[int] = Counter()
    for kind, raw in ops:
        hashes = [BlockHash(h.to_bytes(8, "big")) for h in dict.fromkeys(raw)]
        wire = [WireHash(h) for h in dict.fromkeys(raw)]
        if kind == "store":
            tier.store(hashes, wire, None, list(range(len(hashes) * BS)))
            naive.store(list(wire))
        else:
            n = tier.lookup(hashes)
            expect = 0
            for w in wire:
                if w not in naive.items:
                    break
                expect += 1
            assert n == expect
            assert tier.load(hashes[:n]) == 0.5 * n
            for w in wire[:n]:
                naive.touch(w)
        tier.check_invariants()
        assert [int.from_bytes(h, "big") for h in tier.held()] == naive.items
        _apply(held, tier.take_events(), MEDIUM_CPU)
        assert sorted(held) == sorted(naive.items) and all(v == 1 for v in held.values())


_stems = st.sampled_from([(), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8), (9, 9, 9, 9, 1, 2)])
_prompts = st.builds(lambda stem, tail: stem + tuple(tail), _stems,
                     st.lists(st.integers(0, 6), min_size=0, max_size=14))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(_prompts, st.integers(1, 6), st.integers(0, 3)), min_size=1,
                max_size=14),
       st.integers(9, 16), st.integers(1, 30), st.integers(1, 4))
def test_an_engine_with_a_cpu_tier_under_random_workloads(
    requests: list[tuple[tuple[int, ...], int, int]], gpu_blocks: int, cpu_blocks: int,
    max_seqs: int,
) -> None:
    config = EngineConfig(num_gpu_blocks=gpu_blocks, max_model_len=32, block_size=BS,
                          max_num_seqs=max_seqs, max_num_batched_tokens=16,
                          cpu_offload_blocks=cpu_blocks, cpu_load_s_per_block=0.01)
    engine = EngineModel(config, hasher=HASHER)
    tier = engine.cpu_tier
    assert tier is not None
    gpu: Counter[int] = Counter()
    cpu: Counter[int] = Counter()
    prefix: dict[int, tuple[int, ...]] = {}
    prompts: dict[str, tuple[int, ...]] = {}
    ever_held: set[int] = set()  # every hash cached on the device or in the tier so far

    def step() -> None:
        ever_held.update(to_wire_hash(h) for h in tier.held())
        ever_held.update(to_wire_hash(h) for h in engine.pool.cached_copies())
        result = engine.step()
        # vLLM caches blocks as scheduled: a hit may be on a block computed in this step
        ever_held.update(to_wire_hash(h) for h in tier.held())
        ever_held.update(to_wire_hash(h) for h in engine.pool.cached_copies())
        _apply(gpu, result.events, "GPU")
        _apply(cpu, result.events, MEDIUM_CPU)
        for e in result.events:
            if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU:
                tokens = () if e.parent_block_hash is None else prefix[e.parent_block_hash]
                for i, h in enumerate(e.block_hashes):
                    tokens = tokens + e.token_ids[i * BS:(i + 1) * BS]
                    prefix[h] = tokens
                    assert HASHER.wire_hashes(list(tokens))[-1] == h
        engine.check_invariants()
        tier.check_invariants()
        assert dict(gpu) == {to_wire_hash(h): n for h, n in engine.pool.cached_copies().items()}
        assert set(cpu) == {to_wire_hash(h) for h in tier.held()}
        for o in result.outputs:
            if o.first_token:
                prompt = prompts[o.request_id]
                assert o.num_cached_tokens % BS == 0
                assert o.num_cached_tokens <= len(prompt) - 1
                # a hit, device or loaded, is only ever blocks some cache held
                hit = HASHER.wire_hashes(list(prompt))[:o.num_cached_tokens // BS]
                assert set(hit) <= ever_held

    for i, (prompt, out, steps) in enumerate(requests):
        if not prompt:
            continue
        rid = f"r{i}"
        admission = engine.add_request(EngineRequest(rid, list(prompt), max_tokens=out,
                                                     output_length=out))
        if isinstance(admission, Accepted):
            prompts[rid] = prompt
        for _ in range(steps):
            step()
    for _ in range(500):
        if not engine.has_work():
            break
        step()
    assert not engine.has_work()
    m = engine.metrics()
    # a request re-admitted after a preemption loads again, uncounted (as vLLM's counters)
    assert m.external_prefix_cache_hits_total <= tier.loads * BS
    if not m.num_preemptions_total:
        assert m.external_prefix_cache_hits_total == tier.loads * BS
    assert (m.external_prefix_cache_hits_total + m.prefix_cache_hits_total
            <= m.prefix_cache_queries_total)


def test_a_load_takes_the_tiers_run_after_the_device_hit_and_costs_its_time() -> None:
    """A prompt evicted from the device (a tiny GPU cache) comes back from the CPU tier."""
    timing_free = EngineConfig(num_gpu_blocks=8, max_model_len=28, block_size=BS,
                               cpu_offload_blocks=64, cpu_load_s_per_block=0.25)
    engine = EngineModel(timing_free, hasher=HASHER)
    first = list(range(1, 26))          # 6 full blocks + 1 token
    other = list(range(100, 125))       # evicts the first prompt's blocks from the GPU

    def run(rid: str, prompt: list[int]) -> tuple[int, float]:
        engine.add_request(EngineRequest(rid, prompt, max_tokens=1, output_length=1))
        cached, duration = -1, 0.0
        while engine.has_work():
            result = engine.step()
            duration += result.duration_s
            for o in result.outputs:
                cached = o.num_cached_tokens
        return cached, duration

    assert run("a", first) == (0, 0.0)
    assert run("b", other) == (0, 0.0)
    assert engine.pool.get_cached_block(engine.hasher.hash_blocks(first)[0]) is None
    cached, duration = run("c", first)
    assert cached == 24 and duration == 6 * 0.25
    assert engine.metrics().external_prefix_cache_hits_total == 24


def test_a_shared_tier_serves_a_prompt_another_engine_computed() -> None:
    shared = OffloadTier(64, BS, load_s_per_block=0.1)
    config = EngineConfig(num_gpu_blocks=20, max_model_len=32, block_size=BS)
    a = EngineModel(config, hasher=HASHER, shared_tier=shared)
    b = EngineModel(config, hasher=HASHER, shared_tier=shared)
    prompt = list(range(1, 18))  # 4 full blocks + 1 token
    for engine, rid in ((a, "x"), (b, "y")):
        engine.add_request(EngineRequest(rid, prompt, max_tokens=1, output_length=1))
        while engine.has_work():
            result = engine.step()
            assert all(e.medium == "GPU" for e in result.events)  # type: ignore[union-attr]
    assert a.metrics().external_prefix_cache_hits_total == 0
    assert b.metrics().external_prefix_cache_hits_total == 16
    stored = [e for e in shared.take_events() if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [4] and stored[0].medium == MEDIUM_CPU
