"""``BlockHashMemo`` answers exactly what ``BlockHasher`` computes, whatever it has memoised,
for lists and arrays mixed on one memo (keys: the ids' bytes as ``array('I')`` or, beyond 32
bits, ``array('Q')``), with salts of any length."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.core.hash_memo import BlockHashMemo
from kvroute.core.hashing import HASH_ALGOS, BlockHasher, LoraKey

_tokens = st.lists(st.one_of(st.integers(min_value=0, max_value=2**20), st.just(2**33 + 7)),
                   min_size=0, max_size=90)
_salts = st.one_of(st.none(), st.sampled_from(["tenant-a", "tenant-b", "t" * 64, "ténant 🙂"]))
"""Salts of several lengths: a salted root's code is as long as a digest's or a block's
tokens for some of them, which the keys must still tell apart."""
_forms = st.sampled_from(["list", "I", "Q"])
"""How a request's ids reach the memo: a list (copied into an ``array('I')``, or ``'Q'``), the
tokenizer's ``array('I')`` (sliced as it is), or an ``array('Q')`` (its own key form)."""


def _as(form: str, tokens: list[int]) -> Sequence[int]:
    if form == "I" and max(tokens, default=0) >= 2**32:
        form = "Q"
    return tokens if form == "list" else array(form, tokens)


@settings(max_examples=150, deadline=None)
@given(
    prefix=_tokens,
    suffixes=st.lists(st.tuples(_tokens, _salts, _forms), min_size=1, max_size=6),
    block_size=st.sampled_from([1, 4, 16]),
    algo=st.sampled_from(sorted(HASH_ALGOS)),
    max_entries=st.sampled_from([0, 3, 1000]),
    per_block=st.booleans(),
)
def test_memo_equals_hasher_on_shared_prefixes(
        prefix: list[int], suffixes: list[tuple[list[int], str | None, str]], block_size: int,
        algo: str, max_entries: int, per_block: bool) -> None:
    hasher = BlockHasher(algo, block_size, seed="0" if algo.startswith("xxhash") else None)
    memo = BlockHashMemo(hasher, max_entries=max_entries, per_block=per_block)
    for suffix, salt, form in suffixes * 2:  # the second round runs on a warm memo
        tokens = prefix + suffix
        ids = _as(form, tokens)
        assert memo.wire_hashes(ids, cache_salt=salt) == hasher.wire_hashes(
            tokens, cache_salt=salt)
        assert memo.hash_blocks(ids, cache_salt=salt) == hasher.hash_blocks(
            tokens, cache_salt=salt)
        assert len(memo) <= max_entries


def test_array_and_list_of_one_prompt_share_entries_and_wide_ids_are_keyed_apart() -> None:
    hasher = BlockHasher("sha256", 16)
    memo = BlockHashMemo(hasher, per_block=True)
    tokens = list(range(16 * 20 + 5))  # 20 blocks (2 spans, 4 blocks) and a partial block
    expected = hasher.wire_hashes(tokens, cache_salt="acme")
    assert memo.wire_hashes(array("I", tokens), cache_salt="acme") == expected
    entries = len(memo)
    assert entries == 20 + 2 and memo.misses == 20
    assert memo.wire_hashes(tokens, cache_salt="acme") == expected  # the same bytes: hits
    assert len(memo) == entries and memo.misses == 20 and memo.hits == 20
    assert memo.wire_hashes(array("Q", tokens), cache_salt="acme") == expected  # 8-byte ids
    assert len(memo) == 2 * entries and memo.misses == 40
    wide = [2**40 + t for t in tokens]
    assert memo.wire_hashes(wide) == hasher.wire_hashes(wide)
    assert memo.wire_hashes(array("Q", wide)) == hasher.wire_hashes(wide)  # hits the list's
    assert memo.misses == 60 and memo.hits == 40
    assert memo.wire_hashes(array("I", tokens)) == hasher.wire_hashes(tokens)  # salt: a miss
    assert memo.misses == 80


@pytest.mark.parametrize("bad", [[1.0] * 16, [-1] * 16, [2**64] * 16, "x" * 16, b"\0" * 64])
def test_what_is_not_ids_is_refused_as_the_hasher_refuses_it(bad: Sequence[int]) -> None:
    memo = BlockHashMemo(BlockHasher("sha256", 16), per_block=True)
    with pytest.raises(ValueError, match="token"):
        memo.wire_hashes(bad)
    assert len(memo) == 0


def test_memo_hits_the_shared_prefix_and_stays_bounded() -> None:
    hasher = BlockHasher("sha256", 16)
    memo = BlockHashMemo(hasher, max_entries=100, per_block=True)
    system = list(range(320))  # 20 blocks shared by every request
    for question in range(5):
        memo.wire_hashes(system + [1000 + question] * 32)
    assert memo.misses == 20 + 5 * 2
    assert memo.hits == 4 * 20
    for question in range(200):
        memo.wire_hashes([5000 + question] * 64)
    assert len(memo) == 100


def test_spans_only_hashes_from_the_first_span_that_misses() -> None:
    """With the C hasher the memo keeps spans only: the blocks after the last full span hit
    are hashed again, the same hashes."""
    hasher = BlockHasher("sha256", 16)
    memo = BlockHashMemo(hasher, max_entries=100, per_block=False)
    system = list(range(320))  # 20 blocks: 2 spans of 8, then 4 blocks
    for question in range(5):
        tokens = system + [1000 + question] * 32
        assert memo.wire_hashes(array("I", tokens)) == hasher.wire_hashes(tokens)
    assert memo.misses == 22 + 4 * 6 and memo.hits == 4 * 16
    assert len(memo) == 2  # the two shared spans; no block entries


def test_salt_separates_and_lora_bypasses() -> None:
    hasher = BlockHasher("sha256", 4)
    memo = BlockHashMemo(hasher)
    tokens = list(range(12))
    plain = memo.wire_hashes(tokens)
    salted = memo.wire_hashes(tokens, cache_salt="acme")
    assert plain != salted and salted == hasher.wire_hashes(tokens, cache_salt="acme")
    lora = LoraKey("adapter", "/adapters/a")
    assert memo.wire_hashes(tokens, lora=lora) == hasher.wire_hashes(tokens, lora=lora)
    with pytest.raises(ValueError, match="cache_salt"):
        memo.wire_hashes(tokens, cache_salt="bad/salt")
    with pytest.raises(ValueError, match="max_entries"):
        BlockHashMemo(hasher, max_entries=-1)
