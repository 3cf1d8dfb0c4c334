"""Properties of the engine model under random workloads (hypothesis).

* Block accounting: free + used = capacity, ref counts >= 0, free iff unused, hash map and
  block hashes agree, waiting requests hold nothing (``EngineModel.check_invariants``).
* The event stream, applied to a naive multiset of hashes, always equals the engine's cached
  hashes counted by copies.
* Every cached hash is the hash of exactly the tokens the events say the block holds: the
  prefix rebuilt from the events re-hashes to it.
* Every admitted request ends, with exactly its effective number of tokens, each streamed
  once; the same workload replays identically.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvroute.core.hashing import BlockHasher
from kvroute.core.types import to_wire_hash
from kvroute.engine.model import (
    Accepted,
    EngineConfig,
    EngineModel,
    EngineRequest,
    StepResult,
)

BS = 4
HASHER = BlockHasher(block_size=BS)
SALTS = (None, "s1")


@dataclass(frozen=True)
class Add:
    prompt: tuple[int, ...]
    max_tokens: int | None
    output_length: int | None
    salt: str | None


@dataclass(frozen=True)
class Step:
    count: int


@dataclass(frozen=True)
class Abort:
    index: int


@dataclass(frozen=True)
class Reset:
    pass


Op = Add | Step | Abort | Reset

# Prompts share prefixes: a few stems from a tiny vocabulary, plus a short random tail.
_stems = st.sampled_from([(), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8), (9, 9, 9, 9, 1, 2)])
_prompts = st.builds(
    lambda stem, tail: stem + tuple(tail),
    _stems,
    st.lists(st.integers(0, 6), min_size=0, max_size=14),
)
_ops: st.SearchStrategy[Op] = st.one_of(
    st.builds(Add, _prompts, st.one_of(st.none(), st.integers(-1, 20)),
              st.one_of(st.none(), st.integers(1, 8)), st.sampled_from(SALTS)),
    st.builds(Step, st.integers(1, 4)),
    st.builds(Abort, st.integers(0, 30)),
    st.just(Reset()),
)
_configs = st.builds(
    lambda blocks, window, seqs, budget, reserve: EngineConfig(
        num_gpu_blocks=blocks, max_model_len=window, block_size=BS, max_num_seqs=seqs,
        max_num_batched_tokens=max(budget, seqs), scheduler_reserve_full_isl=reserve,
    ),
    st.integers(9, 18),  # small caches, so eviction and preemption happen often
    st.sampled_from([16, 24, 32]),
    st.integers(1, 4),
    st.integers(1, 40),
    st.booleans(),
)


class NaiveCache:
    """The consumer's view: hash -> number of copies, plus each hash's full token prefix."""

    def __init__(self) -> None:
        self.copies: Counter[int] = Counter()
        self.prefix: dict[int, tuple[tuple[int, ...], str | None]] = {}

    def apply(self, events: list[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                if event.parent_block_hash is None:
                    tokens: tuple[int, ...] = ()
                    first_keys = (event.extra_keys or (None,))[0]
                    salt = first_keys[0] if isinstance(first_keys, tuple) else None
                    assert salt is None or isinstance(salt, str)
                else:
                    assert self.copies[event.parent_block_hash] > 0, "parent not cached"
                    tokens, salt = self.prefix[event.parent_block_hash]
                assert len(event.token_ids) == BS * len(event.block_hashes)
                for i, h in enumerate(event.block_hashes):
                    tokens = tokens + event.token_ids[i * BS : (i + 1) * BS]
                    self.copies[h] += 1
                    self.prefix[h] = (tokens, salt)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    assert self.copies[h] > 0, f"removal of uncached hash {h}"
                    self.copies[h] -= 1
                    if not self.copies[h]:
                        del self.copies[h]
            else:
                assert isinstance(event, AllBlocksCleared)
                self.copies.clear()


def _run(config: EngineConfig, ops: list[Op]) -> tuple[list[object], EngineModel]:
    engine = EngineModel(config, hasher=HASHER)
    naive = NaiveCache()
    accepted: dict[str, Accepted] = {}
    streamed: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    aborted: set[str] = set()
    trace: list[object] = []

    def check(events: list[KVEvent]) -> None:
        naive.apply(events)
        engine.check_invariants()
        expected = {to_wire_hash(h): n for h, n in engine.pool.cached_copies().items()}
        assert dict(naive.copies) == expected
        for h in naive.copies:
            tokens, salt = naive.prefix[h]
            assert HASHER.wire_hashes(list(tokens), cache_salt=salt)[-1] == h
        m = engine.metrics()
        assert 0.0 <= m.kv_cache_usage_perc <= 1.0
        assert m.num_requests_running <= config.max_num_seqs

    def record(result: StepResult) -> None:
        trace.append((result.events, [(o.request_id, o.new_token_ids, o.finish_reason)
                                      for o in result.outputs]))
        for o in result.outputs:
            assert o.request_id not in finished
            streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
            assert o.first_token == (len(streamed[o.request_id]) == 1)
            if o.finished:
                assert o.finish_reason is not None
                finished[o.request_id] = o.finish_reason
        check(result.events)

    for n, op in enumerate(ops):
        if isinstance(op, Add):
            rid = f"r{n}"
            admission = engine.add_request(EngineRequest(
                rid, list(op.prompt), max_tokens=op.max_tokens,
                output_length=op.output_length, cache_salt=op.salt,
            ))
            trace.append(admission)
            if isinstance(admission, Accepted):
                accepted[rid] = admission
        elif isinstance(op, Step):
            for _ in range(op.count):
                record(engine.step())
        elif isinstance(op, Abort):
            live = sorted(set(accepted) - set(finished) - aborted)
            if live:
                rid = live[op.index % len(live)]
                engine.abort_request(rid)
                aborted.add(rid)
                check([])
        else:
            ok = engine.reset_prefix_cache()
            assert ok == (engine.pool.num_free_blocks == engine.pool.capacity)
            check(engine.take_events())

    for _ in range(2000):
        if not engine.has_work():
            break
        record(engine.step())
    assert not engine.has_work(), "the engine did not drain"

    for rid, admission in accepted.items():
        if rid in aborted:
            continue
        out = streamed[rid]
        reason = finished[rid]
        if reason == "length":
            assert len(out) == admission.max_tokens
        else:
            assert reason == "stop" and len(out) < admission.max_tokens
    m = engine.metrics()
    assert m.generation_tokens_total == sum(len(v) for v in streamed.values())
    assert sum(m.request_success_total.values()) == len(accepted)
    assert m.kv_cache_usage_perc == 0.0
    return trace, engine


@settings(max_examples=150, deadline=None)
@given(_configs, st.lists(_ops, max_size=30))
def test_engine_invariants_and_event_stream_under_random_workloads(
    config: EngineConfig, ops: list[Op]
) -> None:
    _run(config, ops)


@settings(max_examples=40, deadline=None)
@given(_configs, st.lists(_ops, max_size=20))
def test_the_same_workload_replays_identically(config: EngineConfig, ops: list[Op]) -> None:
    first, _ = _run(config, ops)
    second, _ = _run(config, ops)
    assert first == second


@settings(max_examples=60, deadline=None)
@given(st.lists(_prompts, min_size=1, max_size=6), st.integers(9, 16))
def test_hits_are_whole_blocks_below_the_last_token(
    prompts: list[tuple[int, ...]], blocks: int
) -> None:
    engine = EngineModel(
        EngineConfig(num_gpu_blocks=blocks, max_model_len=32, block_size=BS), hasher=HASHER
    )
    for i, prompt in enumerate(prompts):
        admission = engine.add_request(EngineRequest(f"r{i}", list(prompt), max_tokens=1))
        if not isinstance(admission, Accepted):
            continue
        while engine.has_work():
            for o in engine.step().outputs:
                assert o.num_cached_tokens % BS == 0
                assert o.num_cached_tokens <= len(prompt) - 1
        engine.check_invariants()
