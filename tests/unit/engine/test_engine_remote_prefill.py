"""The engine model as a decode replica of a disaggregated pool: a request whose prompt was
computed elsewhere (vLLM's ``do_remote_prefill``) waits for the blocks it lacks, without
holding up the others, then computes only its last prompt token."""

from __future__ import annotations

from kvroute.core.events import BlockStored
from kvroute.core.hashing import BlockHasher
from kvroute.engine.model import EngineConfig, EngineModel, EngineRequest, StepTiming

BS = 4
TIMING = StepTiming(fixed_s=0.01, prefill_token_s=0.001)
PROMPT = list(range(100, 141))  # 41 tokens: 10 full blocks, the last token computed here


def engine() -> EngineModel:
    config = EngineConfig(num_gpu_blocks=64, max_model_len=128, block_size=BS, max_num_seqs=8,
                          max_num_batched_tokens=64, timing=TIMING)
    return EngineModel(config, hasher=BlockHasher(block_size=BS))


def test_a_remote_prefill_waits_for_its_transfer_then_computes_one_token() -> None:
    e = engine()
    e.add_request(EngineRequest("d", PROMPT, max_tokens=2, kv_transfer_s_per_token=0.01))
    first = e.step()  # nothing runs: the step lasts until the 40 pulled tokens arrive
    assert first.num_scheduled_reqs == 0 and abs(first.duration_s - 0.4) < 1e-9
    second = e.step()
    assert second.num_prefill_tokens == 1  # every prompt token but the last came over the link
    out = second.outputs[0]
    assert out.first_token and out.num_cached_tokens == 40
    stored = [ev for ev in second.events if isinstance(ev, BlockStored)]
    assert sum(len(ev.block_hashes) for ev in stored) == 10  # the pulled blocks are cached
    assert e.metrics().external_prefix_cache_hits_total == 40


def test_only_the_blocks_the_engine_lacks_are_pulled_and_others_run_meanwhile() -> None:
    e = engine()
    e.add_request(EngineRequest("warm", PROMPT[:21], max_tokens=1))
    while e.has_work():
        e.step()  # 5 blocks of the prompt are now cached here
    e.add_request(EngineRequest("d", PROMPT, max_tokens=2, kv_transfer_s_per_token=0.01))
    e.add_request(EngineRequest("other", list(range(500, 508)), max_tokens=3))
    step = e.step()  # "other" runs while "d"'s 20 missing tokens are on the way (0.2 s)
    assert [o.request_id for o in step.outputs] == ["other"]
    elapsed = step.duration_s
    while True:
        step = e.step()
        elapsed += step.duration_s
        if any(o.request_id == "d" for o in step.outputs):
            break
    assert elapsed >= 0.2 - 1e-9
    assert next(o for o in step.outputs if o.request_id == "d").num_cached_tokens == 40
