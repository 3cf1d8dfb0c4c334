"""The vLLM engine model: exact events, hits, eviction, preemption, chunking, clamping, timing.

Scripts are small (block size 4) and every expectation is exact: hashes come from the real
``BlockHasher``, output tokens from ``output_token_id`` with an explicit seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from kvroute.core.errors import ConfigError
from kvroute.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvroute.core.hashing import BlockHasher, LoraKey
from kvroute.core.types import WireHash
from kvroute.engine.model import (
    Accepted,
    EngineConfig,
    EngineInputError,
    EngineModel,
    EngineRequest,
    Rejection,
    RejectionKind,
    StepResult,
    StepTiming,
    output_token_id,
)
from kvroute.sim.profiles import PROFILES, get_profile, profile_names

BS = 4
HASHER = BlockHasher(block_size=BS)
VOCAB = 32000


def make_engine(
    num_gpu_blocks: int = 64,
    *,
    max_model_len: int = 64,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    timing: StepTiming | None = None,
) -> EngineModel:
    config = EngineConfig(
        num_gpu_blocks=num_gpu_blocks,
        max_model_len=max_model_len,
        block_size=BS,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        timing=timing or StepTiming(),
    )
    return EngineModel(config, hasher=HASHER)


def make_request(
    request_id: str,
    prompt: Sequence[int],
    max_tokens: int | None = 4,
    *,
    seed: int | None = None,
    **kwargs: object,
) -> EngineRequest:
    return EngineRequest(
        request_id, list(prompt), max_tokens=max_tokens,
        seed=seed if seed is not None else sum(map(ord, request_id)), **kwargs,  # type: ignore[arg-type]
    )


def add(engine: EngineModel, req: EngineRequest) -> Accepted:
    admission = engine.add_request(req)
    assert isinstance(admission, Accepted), admission
    return admission


def stored(tokens: Sequence[int], first: int, last: int, *, salt: str | None = None,
           lora: LoraKey | None = None) -> BlockStored:
    """The BlockStored vLLM emits for blocks ``[first, last)`` of ``tokens``."""
    wire = HASHER.wire_hashes(tokens, cache_salt=salt, lora=lora)
    keys: list[tuple[object, ...] | None] = []
    for i in range(first, last):
        k: list[object] = [lora.name] if lora else []
        if i == 0 and salt:
            k.append(salt)
        keys.append(tuple(k) or None)
    return BlockStored(
        block_hashes=tuple(wire[first:last]),
        parent_block_hash=wire[first - 1] if first else None,
        token_ids=tuple(tokens[first * BS : last * BS]),
        block_size=BS, lora_id=None, medium="GPU", lora_name=lora.name if lora else None,
        extra_keys=tuple(keys), group_idx=0, kv_cache_spec_kind="full_attention",
    )


def removed(tokens: Sequence[int], index: int, *, salt: str | None = None) -> BlockRemoved:
    wire = HASHER.wire_hashes(tokens, cache_salt=salt)
    return BlockRemoved(block_hashes=(wire[index],), medium="GPU", group_idx=0)


def outputs_of(result: StepResult) -> list[tuple[str, int, bool, str | None]]:
    return [
        (o.request_id, o.new_token_ids[0], o.finished, o.finish_reason) for o in result.outputs
    ]


def out_tokens(seed: int, count: int) -> list[int]:
    return [output_token_id(seed, i, VOCAB) for i in range(count)]


def run_to_end(engine: EngineModel, limit: int = 1000) -> list[StepResult]:
    results: list[StepResult] = []
    for _ in range(limit):
        if not engine.has_work():
            return results
        results.append(engine.step())
        engine.check_invariants()
    raise AssertionError("engine did not drain")


# ------------------------------------------------------------------ events and hashing


def test_full_blocks_only_stored_with_chained_parents_including_decode_blocks() -> None:
    engine = make_engine()
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    add(engine, make_request("a", prompt, max_tokens=5, seed=7))
    out = out_tokens(7, 5)
    full = prompt + out

    s1 = engine.step()
    assert s1.events == [stored(prompt, 0, 2)]
    assert outputs_of(s1) == [("a", out[0], False, None)]
    assert s1.outputs[0].first_token is True
    assert s1.outputs[0].num_cached_tokens == 0

    s2 = engine.step()  # computes token 10; token 11 (out[1]) completes block 2 -> hashed
    assert s2.events == []
    s3 = engine.step()  # computes token 11: block 2 is now cached, parent = block 1
    assert s3.events == [stored(full, 2, 3)]
    assert outputs_of(s3) == [("a", out[2], False, None)]
    s4 = engine.step()
    s5 = engine.step()
    assert s4.events == s5.events == []
    assert outputs_of(s5) == [("a", out[4], True, "length")]
    assert s5.outputs[0].num_output_tokens == 5
    assert not engine.has_work()
    # 15 tokens: block 3 (tokens 12..15) is never full, and the last token is never computed.


def test_fifteen_token_prompt_with_block_16_stores_nothing() -> None:
    engine = EngineModel(
        EngineConfig(num_gpu_blocks=8, max_model_len=64, block_size=16),
        hasher=BlockHasher(block_size=16),
    )
    add(engine, make_request("a", range(15), max_tokens=1))
    result = engine.step()
    assert result.events == []
    assert outputs_of(result)[0][2:] == (True, "length")


def test_hit_never_covers_the_last_token_and_recompute_makes_a_copy() -> None:
    engine = make_engine()
    prompt = list(range(8))  # exactly 2 blocks
    add(engine, make_request("a", prompt, max_tokens=1))
    assert engine.step().events == [stored(prompt, 0, 2)]
    add(engine, make_request("b", prompt, max_tokens=1))
    result = engine.step()
    assert result.outputs[0].num_cached_tokens == 4  # 8 - 1 tokens cap -> 1 whole block
    assert result.num_prefill_tokens == 4
    # Block 1 was recomputed in a new physical block: a second copy under the same hash.
    assert result.events == [stored(prompt, 1, 2)]
    wire = HASHER.hash_blocks(prompt)
    assert engine.pool.num_cached_copies(wire[1]) == 2
    assert engine.pool.num_cached_copies(wire[0]) == 1
    m = engine.metrics()
    assert (m.prefix_cache_queries_total, m.prefix_cache_hits_total) == (16, 4)


def test_hit_covers_every_whole_block_when_a_token_remains() -> None:
    engine = make_engine()
    prompt = list(range(8))
    add(engine, make_request("a", prompt, max_tokens=1))
    engine.step()
    add(engine, make_request("b", [*prompt, 99], max_tokens=1))
    result = engine.step()
    assert result.outputs[0].num_cached_tokens == 8
    assert result.num_prefill_tokens == 1
    assert result.events == []


def test_eviction_is_lru_with_reverse_freed_tails_and_lazy_removes() -> None:
    engine = make_engine(num_gpu_blocks=5, max_model_len=16)  # 4 usable blocks
    a, b, c = list(range(8)), list(range(50, 58)), list(range(200, 212))
    add(engine, make_request("a", a, max_tokens=1))
    assert engine.step().events == [stored(a, 0, 2)]
    add(engine, make_request("b", b, max_tokens=1))
    assert engine.step().events == [stored(b, 0, 2)]  # free blocks, nothing evicted
    assert engine.pool.free_queue_order() == [2, 1, 4, 3]
    add(engine, make_request("c", c, max_tokens=1))
    assert engine.step().events == [
        removed(a, 1),  # a's tail was freed first, so it is evicted first
        removed(a, 0),
        removed(b, 1),
        stored(c, 0, 3),
    ]
    # b's first block survived and is still a hit.
    add(engine, make_request("b2", [*b[:4], 1, 2], max_tokens=1))
    assert engine.step().outputs[0].num_cached_tokens == 4


def test_salt_isolates_and_matches_only_its_own_cache() -> None:
    engine = make_engine()
    prompt = list(range(9))
    add(engine, make_request("plain", prompt, max_tokens=1))
    assert engine.step().events == [stored(prompt, 0, 2)]
    add(engine, make_request("salted", prompt, max_tokens=1, cache_salt="t1"))
    result = engine.step()
    assert result.outputs[0].num_cached_tokens == 0
    assert result.events == [stored(prompt, 0, 2, salt="t1")]
    assert result.events[0].extra_keys == (("t1",), None)  # type: ignore[union-attr]
    add(engine, make_request("salted2", prompt, max_tokens=1, cache_salt="t1"))
    assert engine.step().outputs[0].num_cached_tokens == 8
    add(engine, make_request("other", prompt, max_tokens=1, cache_salt="t2"))
    assert engine.step().outputs[0].num_cached_tokens == 0


def test_lora_keys_every_block_and_isolates() -> None:
    engine = make_engine()
    lora = LoraKey("ad", "/adapters/ad")
    prompt = list(range(9))
    add(engine, make_request("l", prompt, max_tokens=1, lora=lora, cache_salt="s"))
    result = engine.step()
    assert result.events == [stored(prompt, 0, 2, salt="s", lora=lora)]
    assert result.events[0].extra_keys == (("ad", "s"), ("ad",))  # type: ignore[union-attr]
    add(engine, make_request("base", prompt, max_tokens=1, cache_salt="s"))
    assert engine.step().outputs[0].num_cached_tokens == 0


def test_precomputed_prompt_hashes_give_identical_behaviour() -> None:
    prompt = list(range(30))
    runs = []
    for precomputed in (False, True):
        engine = make_engine()
        hashes = HASHER.hash_blocks(prompt) if precomputed else None
        add(engine, make_request("a", prompt, max_tokens=6, prompt_block_hashes=hashes))
        runs.append([(r.events, outputs_of(r)) for r in run_to_end(engine)])
    assert runs[0] == runs[1]


def test_same_request_sequence_is_deterministic_and_seed_defaults_to_request_id() -> None:
    def run() -> list[object]:
        engine = make_engine(num_gpu_blocks=12, max_model_len=40, max_num_batched_tokens=8)
        for i in range(4):
            engine.add_request(EngineRequest(f"r{i}", list(range(i, i + 13)), max_tokens=9))
        return [(r.events, outputs_of(r), r.duration_s) for r in run_to_end(engine)]

    assert run() == run()


# ------------------------------------------------------------------ scheduling


def test_chunked_prefill_respects_the_budget_running_first_then_fcfs() -> None:
    engine = make_engine(max_num_batched_tokens=8)
    p, q = list(range(10)), list(range(20, 26))
    add(engine, make_request("p", p, max_tokens=3, seed=1))
    add(engine, make_request("q", q, max_tokens=2, seed=2))

    s1 = engine.step()  # p: 8 of 10 tokens; q waits (budget spent)
    assert (s1.num_prefill_tokens, s1.num_decode_seqs, s1.num_scheduled_reqs) == (8, 0, 1)
    assert s1.outputs == []
    assert s1.events == [stored(p, 0, 2)]
    s2 = engine.step()  # p: last 2 prompt tokens (running first), q: 6 tokens
    assert (s2.num_prefill_tokens, s2.num_decode_seqs) == (8, 0)
    assert outputs_of(s2) == [("p", out_tokens(1, 1)[0], False, None),
                              ("q", out_tokens(2, 1)[0], False, None)]
    assert s2.events == [stored(q, 0, 1)]
    s3 = engine.step()
    assert (s3.num_prefill_tokens, s3.num_decode_seqs) == (0, 2)
    assert outputs_of(s3) == [("p", out_tokens(1, 2)[1], False, None),
                              ("q", out_tokens(2, 2)[1], True, "length")]
    s4 = engine.step()
    assert outputs_of(s4) == [("p", out_tokens(1, 3)[2], True, "length")]
    assert not engine.has_work()


def test_max_num_seqs_caps_the_running_batch() -> None:
    engine = make_engine(max_num_seqs=2)
    for name in "abc":
        add(engine, make_request(name, [ord(name)] * 5, max_tokens=2))
    s1 = engine.step()
    assert [o.request_id for o in s1.outputs] == ["a", "b"]
    assert (engine.metrics().num_requests_running, engine.metrics().num_requests_waiting) == (2, 1)
    s2 = engine.step()  # a and b finish; c still could not start this step
    assert [(o.request_id, o.finished) for o in s2.outputs] == [("a", True), ("b", True)]
    s3 = engine.step()
    assert [o.request_id for o in s3.outputs] == ["c"]


def test_preemption_by_recompute_under_a_tiny_cache() -> None:
    engine = make_engine(num_gpu_blocks=5, max_model_len=16, max_num_batched_tokens=16)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    add(engine, make_request("a", a, max_tokens=8, seed=11))
    add(engine, make_request("b", b, max_tokens=8, seed=12))
    full_a = a + out_tokens(11, 8)
    full_b = b + out_tokens(12, 8)

    steps = [engine.step() for _ in range(5)]
    assert steps[0].events == [stored(a, 0, 1), stored(b, 0, 1)]
    assert steps[4].events == [stored(full_a, 1, 2), stored(full_b, 1, 2)]
    assert engine.metrics().num_preemptions_total == 0

    s6 = engine.step()  # a needs a third block; none free -> b (newest) is preempted
    assert engine.metrics().num_preemptions_total == 1
    assert s6.events == [removed(full_b, 1)]  # the reused block was b's freed tail
    assert [o.request_id for o in s6.outputs] == ["a"]
    m = engine.metrics()
    assert (m.num_requests_running, m.num_requests_waiting) == (1, 1)

    s7 = engine.step()  # b needs 3 blocks with only its own cached block free: waits
    s8 = engine.step()  # a finishes and frees
    assert [o.request_id for o in s7.outputs] == ["a"]
    assert outputs_of(s8) == [("a", full_a[11], True, "length")]

    s9 = engine.step()  # b resumes: hits its block 0, recomputes 5 tokens, caches block 1
    assert s9.num_prefill_tokens == 5
    assert s9.events == [removed(full_a, 1), stored(full_b, 1, 2)]
    assert outputs_of(s9) == [("b", full_b[9], False, None)]
    assert s9.outputs[0].first_token is False
    assert s9.outputs[0].num_cached_tokens == 0  # what its first scheduling found

    rest = run_to_end(engine)
    b_tokens = [o.new_token_ids[0] for r in [*steps, s6, s7, s8, s9, *rest] for o in r.outputs
                if o.request_id == "b"]
    assert b_tokens == full_b[4:]  # every output token exactly once, in order
    m = engine.metrics()
    assert m.num_preemptions_total == 1
    assert (m.prefix_cache_queries_total, m.prefix_cache_hits_total) == (8, 0)
    assert m.request_success_total == {"length": 2}


def test_preempted_request_is_counted_in_queries_only_once() -> None:
    engine = make_engine(num_gpu_blocks=5, max_model_len=16)
    add(engine, make_request("a", [1, 2, 3, 4], max_tokens=8))
    add(engine, make_request("b", [5, 6, 7, 8], max_tokens=8))
    run_to_end(engine)
    assert engine.metrics().num_preemptions_total >= 1
    assert engine.metrics().prefix_cache_queries_total == 8


# ------------------------------------------------------------------ admission


@pytest.mark.parametrize(
    "prompt_len,max_tokens,kind,cited",
    [
        (17, None, RejectionKind.PROMPT_TOO_LONG, None),
        (17, 4, RejectionKind.PROMPT_TOO_LONG, 4),
        (4, 17, RejectionKind.MAX_TOKENS_TOO_LARGE, 17),
        (17, 17, RejectionKind.MAX_TOKENS_TOO_LARGE, 17),  # checked first, as vLLM
        (16, None, RejectionKind.MAX_TOKENS_TOO_SMALL, 0),
        (16, 5, RejectionKind.MAX_TOKENS_TOO_SMALL, 0),
        (4, 0, RejectionKind.MAX_TOKENS_TOO_SMALL, 0),
        (4, -3, RejectionKind.MAX_TOKENS_TOO_SMALL, -3),
        (0, None, RejectionKind.EMPTY_PROMPT, None),
    ],
)
def test_rejections_carry_the_numbers(
    prompt_len: int, max_tokens: int | None, kind: RejectionKind, cited: int | None
) -> None:
    engine = make_engine(max_model_len=16)
    result = engine.add_request(make_request("x", range(prompt_len), max_tokens=max_tokens))
    assert isinstance(result, Rejection)
    assert (result.kind, result.max_model_len, result.prompt_tokens, result.max_tokens) == (
        kind, 16, prompt_len, cited,
    )
    assert not engine.has_work()


def test_window_overflow_is_clamped_silently_and_finishes_with_length() -> None:
    engine = make_engine(max_model_len=16)
    admission = add(engine, make_request("x", range(10), max_tokens=10))
    assert (admission.max_tokens, admission.requested_max_tokens, admission.clamped) == (
        6, 10, True,
    )
    results = run_to_end(engine)
    final = results[-1].outputs[-1]
    assert (final.num_output_tokens, final.finish_reason) == (6, "length")


@pytest.mark.parametrize(
    "endpoint,expected", [("completions", 16), ("chat", 54)]
)
def test_default_max_tokens_by_endpoint(endpoint: str, expected: int) -> None:
    engine = make_engine(max_model_len=64)
    admission = add(engine, make_request("x", range(10), max_tokens=None, endpoint=endpoint))
    assert (admission.max_tokens, admission.clamped) == (expected, False)


def test_chat_default_is_the_rest_of_the_window_and_clamped_default_completion() -> None:
    engine = make_engine(max_model_len=20)
    admission = add(engine, make_request("x", range(10), max_tokens=None))
    assert (admission.max_tokens, admission.clamped) == (10, True)  # default 16 > 10 left


def test_output_length_stops_early_with_stop() -> None:
    engine = make_engine()
    add(engine, make_request("x", range(5), max_tokens=10, output_length=3))
    add(engine, make_request("y", range(5), max_tokens=2, output_length=3))
    finals = {o.request_id: (o.num_output_tokens, o.finish_reason)
              for r in run_to_end(engine) for o in r.outputs if o.finished}
    assert finals == {"x": (3, "stop"), "y": (2, "length")}
    assert engine.metrics().request_success_total == {"stop": 1, "length": 1}


def test_bad_caller_input_raises_engine_input_error() -> None:
    engine = make_engine()
    add(engine, make_request("x", range(5)))
    with pytest.raises(EngineInputError, match="already live"):
        engine.add_request(make_request("x", range(5)))
    with pytest.raises(EngineInputError, match="2 full blocks"):
        engine.add_request(make_request("y", range(9), prompt_block_hashes=[]))
    with pytest.raises(EngineInputError, match="output_length"):
        engine.add_request(make_request("z", range(9), output_length=0))
    with pytest.raises(EngineInputError, match="cache_salt"):
        engine.add_request(make_request("w", range(9), cache_salt="a/b"))
    with pytest.raises(EngineInputError, match="position 1"):
        engine.add_request(make_request("v", [1, -2, 3, 4]))
    assert engine.metrics().num_requests_waiting == 1


# ------------------------------------------------------------------ abort, reset, metrics


def test_abort_frees_blocks_keeps_them_cached_and_ignores_unknown_ids() -> None:
    engine = make_engine()
    prompt = list(range(9))
    add(engine, make_request("x", prompt, max_tokens=10))
    add(engine, make_request("w", [7] * 3, max_tokens=10))
    engine.step()
    assert engine.metrics().kv_cache_usage_perc > 0
    engine.abort_request("x")
    engine.abort_request("w")
    engine.abort_request("never-seen")
    m = engine.metrics()
    assert (m.num_requests_running, m.kv_cache_usage_perc) == (0, 0.0)
    assert m.request_success_total == {"abort": 2}
    assert not engine.has_work()
    add(engine, make_request("again", prompt, max_tokens=1))
    assert engine.step().outputs[0].num_cached_tokens == 8
    engine.check_invariants()


def test_abort_of_a_waiting_request() -> None:
    engine = make_engine(max_num_seqs=1)
    add(engine, make_request("a", range(5)))
    add(engine, make_request("b", range(5)))
    engine.step()
    engine.abort_request("b")
    assert engine.metrics().num_requests_waiting == 0
    engine.check_invariants()


def test_reset_prefix_cache_only_when_idle() -> None:
    engine = make_engine()
    prompt = list(range(9))
    add(engine, make_request("x", prompt, max_tokens=2))
    engine.step()
    assert engine.reset_prefix_cache() is False
    run_to_end(engine)
    assert engine.reset_prefix_cache() is True
    assert engine.take_events() == [AllBlocksCleared()]
    add(engine, make_request("y", prompt, max_tokens=1))
    result = engine.step()
    assert result.outputs[0].num_cached_tokens == 0
    # Blocks whose hashes the reset dropped are reused without a BlockRemoved.
    assert all(isinstance(e, BlockStored) for e in result.events)


def test_reset_event_rides_with_the_next_step() -> None:
    engine = make_engine()
    assert engine.reset_prefix_cache() is True
    add(engine, make_request("y", range(9), max_tokens=1))
    assert engine.step().events == [AllBlocksCleared(), stored(list(range(9)), 0, 2)]


def test_metrics_count_prompt_generation_and_usage() -> None:
    engine = make_engine(num_gpu_blocks=11, max_model_len=40)  # 10 usable blocks
    add(engine, make_request("x", range(9), max_tokens=3))
    engine.step()
    m = engine.metrics()
    assert m.kv_cache_usage_perc == pytest.approx(0.3)  # 10 tokens -> 3 blocks
    assert (m.prompt_tokens_total, m.generation_tokens_total) == (9, 1)
    run_to_end(engine)
    m = engine.metrics()
    assert (m.prompt_tokens_total, m.generation_tokens_total) == (9, 3)
    assert m.kv_cache_usage_perc == 0.0


# ------------------------------------------------------------------ timing


def test_step_duration_sums_the_timing_terms() -> None:
    timing = StepTiming(fixed_s=0.01, prefill_token_s=0.001, decode_seq_s=0.1, context_token_s=1e-5)
    engine = make_engine(timing=timing, max_num_batched_tokens=8)
    add(engine, make_request("x", range(10), max_tokens=2))
    s1 = engine.step()  # 8 prefill tokens, context 8
    assert s1.duration_s == pytest.approx(0.01 + 8 * 0.001 + 8 * 1e-5)
    add(engine, make_request("y", range(50, 53), max_tokens=2))
    s2 = engine.step()  # x: 2 prefill (context 10), y: 3 prefill (context 3)
    assert s2.duration_s == pytest.approx(0.01 + 5 * 0.001 + 13 * 1e-5)
    s3 = engine.step()  # two decodes, contexts 11 and 4
    assert (s3.num_prefill_tokens, s3.num_decode_seqs, s3.num_context_tokens) == (0, 2, 15)
    assert s3.duration_s == pytest.approx(0.01 + 2 * 0.1 + 15 * 1e-5)


def test_empty_step_takes_no_time() -> None:
    engine = make_engine(timing=StepTiming(fixed_s=1.0))
    result = engine.step()
    assert (result.duration_s, result.outputs, result.events) == (0.0, [], [])


def test_timing_example_in_the_docstring() -> None:
    timing = get_profile("llama-3.1-8b-h100").timing
    assert timing.step_time_s(2048, 32, 2048 + 32 * 1000) == pytest.approx(0.09026, rel=1e-3)


# ------------------------------------------------------------------ configuration


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_gpu_blocks": 0}, "num_gpu_blocks"),
        ({"max_model_len": 1000}, "cannot hold one request"),
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": 300, "max_num_batched_tokens": 256}, "max_num_batched_tokens"),
        ({"vocab_size": True}, "vocab_size"),
    ],
)
def test_bad_config_names_the_key(kwargs: dict[str, Any], match: str) -> None:
    base: dict[str, Any] = {"num_gpu_blocks": 64, "max_model_len": 64, "block_size": 4}
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**{**base, **kwargs})


@pytest.mark.parametrize("field", ["fixed_s", "prefill_token_s", "decode_seq_s",
                                   "context_token_s"])
@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_bad_timing_is_a_config_error(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field):
        StepTiming(**{field: value})


def test_hasher_must_match_the_engine() -> None:
    config = EngineConfig(num_gpu_blocks=64, max_model_len=64, block_size=4)
    with pytest.raises(ConfigError, match="block_size=4"):
        EngineModel(config, hasher=BlockHasher(block_size=16))
    with pytest.raises(ConfigError, match="lookahead"):
        EngineModel(config, hasher=BlockHasher(block_size=4, lookahead_tokens=1))


# ------------------------------------------------------------------ profiles


def test_profiles_are_named_sourced_and_build_valid_engines() -> None:
    assert {"zero", "vllm-cpu-tiny", "llama-3.1-8b-h100", "llama-3.1-70b-h100-tp4"} <= set(
        profile_names()
    )
    for name in profile_names():
        profile = get_profile(name)
        assert profile.name == name
        assert profile.source
        config = profile.engine_config()
        assert config.timing is profile.timing
        EngineModel(config, hasher=BlockHasher(block_size=config.block_size))
    assert get_profile("zero").timing.step_time_s(1000, 10, 10_000) == 0.0
    tiny = get_profile("vllm-cpu-tiny")
    assert tiny.calibrated is True and "CALIBRATED 2026-11-29" in tiny.source
    assert tiny.block_size == 128 and tiny.max_model_len == 2048


def test_profile_overrides_and_recalibration() -> None:
    profile = get_profile("llama-3.1-8b-h100")
    config = profile.engine_config(num_gpu_blocks=100, max_model_len=1024)
    assert (config.num_gpu_blocks, config.max_model_len, config.block_size) == (100, 1024, 16)
    new = profile.with_timing(StepTiming(fixed_s=1.0), source="fit", calibrated=True)
    assert new.timing.fixed_s == 1.0 and new.calibrated and PROFILES[profile.name] is profile


def test_unknown_profile_lists_the_names() -> None:
    with pytest.raises(ConfigError) as info:
        get_profile("h200")
    for name in profile_names():
        assert name in str(info.value)


def test_wire_hash_type_of_events() -> None:
    engine = make_engine()
    add(engine, make_request("x", range(9), max_tokens=1))
    (event,) = engine.step().events
    assert isinstance(event, BlockStored)
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in event.block_hashes)
    assert event.block_hashes == tuple(WireHash(h) for h in HASHER.wire_hashes(list(range(9))))


@pytest.mark.parametrize("reserve_full,b_starts", [(True, False), (False, True)])
def test_full_sequence_admission_gate(reserve_full: bool, b_starts: bool) -> None:
    config = EngineConfig(num_gpu_blocks=5, max_model_len=16, block_size=BS,
                          max_num_seqs=4, max_num_batched_tokens=16,
                          scheduler_reserve_full_isl=reserve_full)
    engine = EngineModel(config, hasher=HASHER)
    add(engine, make_request("a", range(8), max_tokens=2))
    add(engine, make_request("b", range(100, 112), max_tokens=2))
    # a takes 2 of the 4 blocks; b's first 8-token chunk would fit, its 12 tokens would not.
    result = engine.step()
    assert ("b" in {o.request_id for o in result.outputs} or
            engine.metrics().num_requests_running == 2) is b_starts
