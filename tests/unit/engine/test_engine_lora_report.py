"""The engine model's LoRA slots (``max_loras``) and ``kv_cache_report_mode: "full"``."""

from __future__ import annotations

from kvroute.core.events import BlockStored
from kvroute.core.hashing import BlockHasher, LoraKey
from kvroute.core.types import to_wire_hash
from kvroute.engine.model import EngineConfig, EngineModel, EngineRequest, StepTiming

BS = 4
HASHER = BlockHasher(block_size=BS)
AD1 = LoraKey("ad1", "/a/ad1")
AD2 = LoraKey("ad2", "/a/ad2")


def engine(max_loras: int | None = None) -> EngineModel:
    return EngineModel(EngineConfig(num_gpu_blocks=64, max_model_len=64, block_size=BS,
                                    max_num_seqs=8, max_num_batched_tokens=64,
                                    timing=StepTiming(), max_loras=max_loras), hasher=HASHER)


def stored(events: object) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]  # type: ignore[attr-defined]


def run(e: EngineModel) -> list[BlockStored]:
    out: list[BlockStored] = []
    while e.has_work():
        out.extend(stored(e.step().events))
    return out


def test_full_report_re_announces_the_hit_blocks_from_block_zero() -> None:
    e = engine()
    prompt = list(range(1, 14))  # 3 full blocks
    e.add_request(EngineRequest("a", prompt, max_tokens=1, lora=AD1, lora_id=1))
    first = run(e)
    assert first[0].lora_name == "ad1" and first[0].lora_id == 1
    assert first[0].extra_keys == (("ad1",),) * 3
    e.add_request(EngineRequest("b", prompt, max_tokens=1, lora=AD1, lora_id=1))
    assert run(e) == []  # incremental (vLLM's default): a hit announces nothing
    e.add_request(EngineRequest("c", prompt, max_tokens=1, lora=AD1, lora_id=1,
                                report_full=True))
    again = run(e)
    expected = [to_wire_hash(h) for h in HASHER.hash_blocks(prompt, lora=AD1)]
    assert len(again) == 1
    assert list(again[0].block_hashes) == expected
    assert again[0].parent_block_hash is None
    assert list(again[0].token_ids) == prompt[:12]


def test_an_adapter_beyond_max_loras_waits_without_blocking_the_queue() -> None:
    e = engine(max_loras=1)
    e.add_request(EngineRequest("a", list(range(1, 9)), max_tokens=5, lora=AD1))
    e.add_request(EngineRequest("b", list(range(20, 28)), max_tokens=5, lora=AD2))
    e.add_request(EngineRequest("c", list(range(40, 48)), max_tokens=5))
    e.step()
    assert e.lora_adapters() == (["ad1"], ["ad2"])  # b skipped, c (base model) admitted
    assert e.metrics().num_requests_running == 2
    run(e)
    assert e.lora_adapters() == ([], [])
