"""A decode engine's remote prefills (``EngineRequest.kv_transfer_s_per_token``) against a
naive model (hypothesis).

Under random mixes of local and remote requests arriving between steps:

* the engine's invariants hold after every step, and every request finishes;
* a remote request's first token comes no earlier than its transfer allows: its arrival
  plus (the prompt's full blocks below its last token, less the blocks the engine held when
  it arrived) × block size × seconds a token, the naive model's arithmetic;
* it computes no prompt token but its last beyond what it pulled: its ``num_cached_tokens``
  is every full block below its last token;
* the engine's external-hit counter is the sum of what the remote requests pulled.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.core.hashing import BlockHasher
from kvroute.engine.model import EngineConfig, EngineModel, EngineRequest, StepTiming

BS = 4
S_PER_TOKEN = 0.002
TIMING = StepTiming(fixed_s=0.001, prefill_token_s=0.0005, decode_seq_s=0.0001)

request = st.tuples(
    st.integers(0, 3),  # which of four shared prefixes
    st.integers(1, 30),  # its own suffix length
    st.booleans(),  # remote (its KV comes from a prefill elsewhere)
    st.integers(0, 3),  # engine steps before the next arrival
)


def engine() -> EngineModel:
    config = EngineConfig(num_gpu_blocks=256, max_model_len=256, block_size=BS, max_num_seqs=6,
                          max_num_batched_tokens=32, timing=TIMING)
    return EngineModel(config, hasher=BlockHasher(block_size=BS))


@settings(max_examples=60, deadline=None)
@given(st.lists(request, min_size=1, max_size=12))
def test_remote_prefills_wait_for_their_blocks_and_compute_one_token(
        script: list[tuple[int, int, bool, int]]) -> None:
    e = engine()
    now = 0.0
    earliest: dict[str, float] = {}
    full_blocks: dict[str, int] = {}
    first: dict[str, float] = {}
    cached: dict[str, int] = {}
    finished: set[str] = set()
    pulled_total = 0

    def step() -> None:
        nonlocal now
        result = e.step()
        now += result.duration_s
        e.check_invariants()
        for out in result.outputs:
            if out.first_token:
                first[out.request_id] = now
                cached[out.request_id] = out.num_cached_tokens
            if out.finished:
                finished.add(out.request_id)

    for i, (prefix, suffix, remote, gap) in enumerate(script):
        rid = f"r{i}"
        prompt = [1000 * (prefix + 1) + k for k in range(24)] + [50_000 + 100 * i + k
                                                                 for k in range(suffix)]
        blocks = (len(prompt) - 1) // BS
        if remote:
            # the naive model: the blocks the engine holds now are not pulled
            held = 0
            for h in BlockHasher(block_size=BS).hash_blocks(prompt)[:blocks]:
                if e.pool.get_cached_block(h) is None:
                    break
                held += 1
            pulled = (blocks - held) * BS
            pulled_total += pulled
            earliest[rid] = now + pulled * S_PER_TOKEN
            full_blocks[rid] = blocks * BS
        e.add_request(EngineRequest(rid, prompt, max_tokens=3,
                                    kv_transfer_s_per_token=S_PER_TOKEN if remote else None))
        for _ in range(gap):
            step()
    for _ in range(500):
        if not e.has_work():
            break
        step()
    assert not e.has_work() and finished == {f"r{i}" for i in range(len(script))}
    for rid, at in earliest.items():
        assert first[rid] >= at - 1e-9, f"{rid} answered before its blocks arrived"
        assert cached[rid] == full_blocks[rid]
    assert e.metrics().external_prefix_cache_hits_total == pulled_total
