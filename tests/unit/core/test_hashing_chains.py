"""Per-session block-hash chains (``core.hashing_chains``): a prompt that extends its session's
last prompt hashes only its new blocks, and every case where the stored chain must not be used
(an edited turn, another tenant, salt, system prompt, tokenizer, adapter or hashing) is hashed
from scratch; incremental == from scratch on random edits."""

from __future__ import annotations

import random
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.config import parse_config
from kvroute.core.clock import ManualClock
from kvroute.core.errors import ConfigError
from kvroute.core.hash_memo import BlockHashMemo
from kvroute.core.hashing import BlockHasher, LoraKey
from kvroute.core.hashing_chains import SessionChains
from kvroute.core.index import TenantScope
from kvroute.core.peer_policies import make_policy
from kvroute.core.router import PoolSpec, ReplicaSpec, RouterCore, RouteRequest
from kvroute.core.types import PoolName, ReplicaId, RequestId, TenantName

BS = 4
A = TenantScope(TenantName("a"))
B = TenantScope(TenantName("b"))


def memo(algo: str = "sha256", block_size: int = BS, seed: str | None = None) -> BlockHashMemo:
    return BlockHashMemo(BlockHasher(algo, block_size, seed))


def truth(ids: list[int], *, algo: str = "sha256", block_size: int = BS,
          salt: str | None = None, lora: LoraKey | None = None) -> list[int]:
    return list(BlockHasher(algo, block_size, None).wire_hashes(ids, cache_salt=salt, lora=lora))


def ids_of(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def test_an_extended_prompt_hashes_only_its_new_blocks() -> None:
    chains, m = SessionChains(), memo()
    first = ids_of(41)  # 10 full blocks and a partial one
    assert chains.wire_hashes((A, "p", "s"), m, first) == truth(first)
    second = first + ids_of(30, start=900)
    assert chains.wire_hashes((A, "p", "s"), m, second) == truth(second)
    assert chains.stats.extended == 1 and chains.stats.rebuilt == 1
    assert chains.stats.blocks_reused == 10  # the partial block 10 is hashed with the new ids
    assert chains.stats.blocks_hashed == 10 + (71 // BS - 10)


def test_array_and_list_prompts_give_the_same_chain() -> None:
    chains, m = SessionChains(), memo()
    base = ids_of(64)
    assert chains.wire_hashes((A, "p", "s"), m, array("I", base)) == truth(base)
    longer = base + ids_of(16, start=5000)
    assert chains.wire_hashes((A, "p", "s"), m, longer) == truth(longer)
    assert chains.stats.extended == 1


def test_the_same_prompt_again_reuses_every_block() -> None:
    chains, m = SessionChains(), memo()
    prompt = ids_of(40)
    chains.wire_hashes((A, "p", "s"), m, prompt)
    assert chains.wire_hashes((A, "p", "s"), m, prompt) == truth(prompt)
    assert chains.stats.extended == 1 and chains.stats.blocks_reused == 10


@pytest.mark.parametrize("case", ["edited turn", "system prompt", "tokenizer", "shorter"])
def test_a_prompt_that_does_not_extend_the_last_one_is_hashed_from_scratch(case: str) -> None:
    chains, m = SessionChains(), memo()
    system, turn1, turn2 = ids_of(20), ids_of(24, start=300), ids_of(16, start=600)
    chains.wire_hashes((A, "p", "s"), m, system + turn1)
    if case == "edited turn":
        edited = list(turn1)
        edited[5] += 1
        nxt = system + edited + turn2
    elif case == "system prompt":
        nxt = [system[0] + 7, *system[1:]] + turn1 + turn2
    elif case == "tokenizer":  # the same text read by another vocabulary: other ids
        nxt = [t + 50_000 for t in system + turn1] + turn2
    else:
        nxt = system + turn1[:8]
    assert chains.wire_hashes((A, "p", "s"), m, nxt) == truth(nxt)
    assert chains.stats.extended == 0 and chains.stats.rebuilt == 2


@pytest.mark.parametrize("change", ["salt", "lora", "algorithm", "block size", "seed"])
def test_another_hashing_basis_is_hashed_from_scratch(change: str) -> None:
    chains = SessionChains()
    prompt = ids_of(32)
    longer = prompt + ids_of(16, start=700)
    lora = LoraKey("adapter", "/models/adapter")
    chains.wire_hashes((A, "p", "s"), memo(), prompt)
    m, salt, key_lora, algo, bs = memo(), None, None, "sha256", BS
    if change == "salt":
        salt = "tenant-salt"
    elif change == "lora":
        key_lora = lora
    elif change == "algorithm":
        algo, m = "sha256_cbor", memo("sha256_cbor")
    elif change == "block size":
        bs, m = 8, memo(block_size=8)
    else:
        m = memo(seed="42")
    got = chains.wire_hashes((A, "p", "s"), m, longer, cache_salt=salt, lora=key_lora)
    if change == "seed":
        assert got == list(BlockHasher("sha256", BS, "42").wire_hashes(longer))
    else:
        assert got == truth(longer, algo=algo, block_size=bs, salt=salt, lora=key_lora)
    assert chains.stats.extended == 0 and chains.stats.rebuilt == 2


def test_tenants_and_sessions_keep_chains_apart() -> None:
    chains, m = SessionChains(), memo()
    prompt = ids_of(32)
    chains.wire_hashes((A, "p", "s"), m, prompt, cache_salt="salt-a")
    # Tenant b's session of the same id, with its own salt: not tenant a's chain.
    longer = prompt + ids_of(8, start=800)
    assert chains.wire_hashes((B, "p", "s"), m, longer, cache_salt="salt-b") == truth(
        longer, salt="salt-b")
    assert chains.stats.extended == 0 and len(chains) == 2


def test_lora_chains_extend_under_the_same_adapter() -> None:
    chains, m = SessionChains(), memo()
    lora = LoraKey("adapter", "/models/adapter")
    prompt, longer = ids_of(32), ids_of(32) + ids_of(12, start=999)
    chains.wire_hashes((A, "p", "s"), m, prompt, lora=lora)
    assert chains.wire_hashes((A, "p", "s"), m, longer, lora=lora) == truth(longer, lora=lora)
    assert chains.stats.extended == 1


def test_the_bound_holds_and_evicts_least_recent_sessions() -> None:
    chains, m = SessionChains(max_tokens=100), memo()
    for s in range(4):
        chains.wire_hashes((A, "p", f"s{s}"), m, ids_of(40, start=1000 * s))
        assert chains.held_tokens <= 100
    assert len(chains) == 2  # 40 tokens each
    chains.wire_hashes((A, "p", "huge"), m, ids_of(200))  # over the whole bound: not kept
    assert len(chains) == 2 and chains.held_tokens == 80


def test_off_and_ids_beyond_32_bits_go_to_the_memo() -> None:
    off, m = SessionChains(max_tokens=0), memo()
    prompt = ids_of(32)
    assert off.wire_hashes((A, "p", "s"), m, prompt) == truth(prompt)
    assert len(off) == 0
    chains = SessionChains()
    big = [2**33 + i for i in range(16)]
    assert chains.wire_hashes((A, "p", "s"), m, big) == truth(big)
    assert len(chains) == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10"])
def test_a_bad_bound_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SessionChains(bad)  # type: ignore[arg-type]


def test_the_bound_is_configured_and_validated() -> None:
    base = {"pools": {"p": {"model": "m", "replicas": [{"name": "r", "url": "http://h:1"}]}},
            "routes": {"m": {"pools": ["p"]}}}
    assert parse_config({**base, "state": {"max_chain_tokens": 1234}}).state \
        .max_chain_tokens == 1234
    with pytest.raises(ConfigError, match="state.max_chain_tokens"):
        parse_config({**base, "state": {"max_chain_tokens": -5}})


def test_the_router_hashes_a_session_incrementally_and_exactly() -> None:
    core = RouterCore([PoolSpec(PoolName("p"), (ReplicaSpec(ReplicaId("r0")),), block_size=BS)],
                      lambda: make_policy("kvroute", random.Random(0)), clock=ManualClock())

    def hashes(ids: list[int], session: str | None) -> tuple[int, ...]:
        request = RouteRequest(RequestId("q"), PoolName("p"), A, len(ids),
                               prompt_token_ids=ids, session_id=session)
        return core.block_hashes(request)[0]

    turns = [ids_of(30), ids_of(30) + ids_of(50, start=400)]
    for ids in turns:
        assert hashes(ids, "s") == hashes(ids, None) == tuple(truth(ids))
    assert core.chains.stats.extended == 1


_TOKENS = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=40)


@settings(max_examples=150, deadline=None)
@given(
    start=_TOKENS,
    steps=st.lists(st.tuples(
        st.sampled_from(["append", "edit", "truncate", "salt", "lora", "session"]),
        _TOKENS, st.integers(min_value=0, max_value=200)), max_size=8),
)
def test_incremental_equals_from_scratch_on_random_edits(
        start: list[int], steps: list[tuple[str, list[int], int]]) -> None:
    chains, m = SessionChains(max_tokens=150), memo()
    lora = LoraKey("x", "/x")
    ids, salt, adapter, session = list(start), None, None, "s"
    for op, more, at in steps:
        if op == "append":
            ids = ids + more
        elif op == "edit" and ids:
            ids[at % len(ids)] = (ids[at % len(ids)] + 1) % 2**32
        elif op == "truncate":
            ids = ids[: at % (len(ids) + 1)]
        elif op == "salt":
            salt = None if salt else f"s{at}"
        elif op == "lora":
            adapter = None if adapter else lora
        else:
            session = f"s{at % 3}"
        got = chains.wire_hashes((A, "p", session), m, ids, cache_salt=salt, lora=adapter)
        assert got == truth(ids, salt=salt, lora=adapter)
        assert chains.held_tokens <= 150


def test_no_session_goes_to_the_memo_and_keeps_nothing() -> None:
    chains, m = SessionChains(), memo()
    prompt = ids_of(48)
    assert chains.wire_hashes(None, m, prompt) == truth(prompt)
    assert len(chains) == 0 and chains.stats.rebuilt == 0
