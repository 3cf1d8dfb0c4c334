"""Unit and property tests of ``kvroute.core.hashing`` beyond the vLLM vectors.

The properties compare :class:`BlockHasher` with a deliberately naive reference written from
the contract (one ``pickle.dumps``/``cbor2.dumps`` per block, multimodal keys by overlap), so
the fast paths, incremental hashing and key plumbing are each checked against plain code.
"""

from __future__ import annotations

import hashlib
import pickle
import runpy
from array import array
from pathlib import Path

import cbor2
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.core.errors import HashConfigError
from kvroute.core.hashing import (
    HASH_ALGOS,
    BlockHasher,
    LoraKey,
    MultiModalItem,
    coarser_view,
    digest_size,
    extra_keys_for_block,
    get_hash_fn_by_name,
    hash_block_tokens,
    none_hash,
    to_event_extra_keys,
    validate_cache_salt,
)
from kvroute.core.types import BlockHash

TOKENS_1_40 = list(range(1, 41))
BLOCK0_PLAIN = "7b255da405e1d722823892e4fef187b4d8ac78215d7f0dd2137bb037547f4caf"

# ------------------------------------------------------------------ naive reference model


def _copy(text: str) -> str:
    """An equal string that is a distinct object (as vLLM's parsed inputs are)."""
    return (text + "#")[:-1]


def _ref_hash(algo: str, obj: object) -> bytes:
    data = pickle.dumps(obj, protocol=5) if "cbor" not in algo else cbor2.dumps(obj, canonical=True)
    return hashlib.sha256(data).digest() if algo.startswith("sha") else xxhash.xxh3_128_digest(data)


def reference_hashes(
    algo: str,
    seed: str | None,
    block_size: int,
    tokens: list[int],
    *,
    salt: str | None = None,
    lora: LoraKey | None = None,
    items: tuple[MultiModalItem, ...] = (),
    embeds: list[bytes] | None = None,
    lookahead: int = 0,
) -> list[bytes]:
    parent = _ref_hash(algo, seed if seed is not None else "vllm-none-hash")
    out = []
    for i in range((len(tokens) - lookahead) // block_size):
        start, end = i * block_size, (i + 1) * block_size
        keys: list[tuple[object, ...]] = []
        if lora:
            keys.append(("lora", _copy(lora.name), _copy(lora.path)))
        for item in items:  # overlap rule: equal to vLLM's scan for disjoint items, L == 0
            if item.offset < end and item.offset + item.length > start:
                keys.append(("mm", _copy(item.identifier), item.offset - start))
        if start == 0 and salt:
            keys.append(("cache_salt", _copy(salt)))
        if embeds is not None:
            keys.append(("prompt_embeds", hashlib.sha256(b"".join(embeds[start:end])).digest()))
        extra: object = tuple(keys) or None
        if lookahead:
            extra = (extra, *tokens[end : end + lookahead])
        parent = _ref_hash(algo, (parent, tuple(tokens[start:end]), extra))
        out.append(parent)
    return out


# ------------------------------------------------------------------------- strategies

token_ids = st.lists(
    st.one_of(
        st.integers(0, 300),
        st.integers(0, 2**31),
        st.integers(2**31, 2**64 - 1),  # pickled as LONG1, CBOR uint64
    ),
    max_size=70,
)
safe_text = st.text(
    alphabet=st.characters(codec="utf-8", exclude_characters="@/\\\x00"),
    min_size=1,
    max_size=12,
)
algos = st.sampled_from(HASH_ALGOS)
loras = st.none() | st.builds(LoraKey, safe_text, safe_text)


@st.composite
def disjoint_items(draw: st.DrawFn) -> tuple[MultiModalItem, ...]:
    items = []
    position = 0
    for _ in range(draw(st.integers(0, 3))):
        position += draw(st.integers(0, 12))
        length = draw(st.integers(1, 20))
        items.append(MultiModalItem(draw(safe_text), position, length))
        position += length
    return tuple(items)


def _seed_for(algo: str) -> str | None:
    return "0" if algo.startswith("xxhash") else None


# ------------------------------------------------------------------------- properties


@settings(max_examples=150, deadline=None)
@given(
    algo=algos,
    block_size=st.integers(1, 9),
    tokens=token_ids,
    salt=st.none() | safe_text,
    lora=loras,
    items=disjoint_items(),
    with_embeds=st.booleans(),
)
def test_matches_naive_reference(
    algo: str,
    block_size: int,
    tokens: list[int],
    salt: str | None,
    lora: LoraKey | None,
    items: tuple[MultiModalItem, ...],
    with_embeds: bool,
) -> None:
    embeds = [bytes([t % 251]) * 3 for t in tokens[: len(tokens) // 2]] if with_embeds else None
    hasher = BlockHasher(algo, block_size, _seed_for(algo))
    got = hasher.hash_blocks(
        tokens, cache_salt=salt, lora=lora, mm_items=items, prompt_embeds=embeds
    )
    want = reference_hashes(
        algo, _seed_for(algo), block_size, tokens, salt=salt, lora=lora, items=items, embeds=embeds
    )
    assert got == want
    assert all(len(h) == digest_size(algo) for h in got)


@settings(max_examples=100, deadline=None)
@given(
    algo=algos,
    block_size=st.integers(1, 9),
    lookahead=st.integers(0, 4),
    tokens=token_ids,
    salt=st.none() | safe_text,
    lora=loras,
)
def test_lookahead_matches_naive_reference(
    algo: str,
    block_size: int,
    lookahead: int,
    tokens: list[int],
    salt: str | None,
    lora: LoraKey | None,
) -> None:
    hasher = BlockHasher(algo, block_size, _seed_for(algo), lookahead_tokens=lookahead)
    got = hasher.hash_blocks(tokens, cache_salt=salt, lora=lora)
    want = reference_hashes(
        algo, _seed_for(algo), block_size, tokens, salt=salt, lora=lora, lookahead=lookahead
    )
    assert got == want


@settings(max_examples=150, deadline=None)
@given(
    algo=algos,
    block_size=st.integers(1, 9),
    lookahead=st.integers(0, 3),
    tokens=token_ids,
    salt=st.none() | safe_text,
    lora=loras,
    items=disjoint_items(),
    cuts=st.lists(st.integers(0, 80), max_size=4),
)
def test_incremental_equals_whole(
    algo: str,
    block_size: int,
    lookahead: int,
    tokens: list[int],
    salt: str | None,
    lora: LoraKey | None,
    items: tuple[MultiModalItem, ...],
    cuts: list[int],
) -> None:
    """Hashing while tokens arrive (as an engine decodes) gives the whole-sequence hashes."""
    hasher = BlockHasher(algo, block_size, _seed_for(algo), lookahead_tokens=lookahead)
    kwargs = {"cache_salt": salt, "lora": lora, "mm_items": items}
    whole = hasher.hash_blocks(tokens, **kwargs)  # type: ignore[arg-type]
    grown: list[BlockHash] = []
    for length in [*sorted(c for c in cuts if c <= len(tokens)), len(tokens)]:
        parent = grown[-1] if grown else None
        grown += hasher.hash_blocks(
            tokens[:length],
            start_block=len(grown),
            parent=parent,
            **kwargs,  # type: ignore[arg-type]
        )
    assert grown == whole
    # Any suffix from a known parent.
    for k in range(1, len(whole)):
        assert hasher.hash_blocks(tokens, start_block=k, parent=whole[k - 1], **kwargs) == whole[k:]  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(algo=algos, block_size=st.integers(1, 9), tokens=token_ids, extra=token_ids)
def test_prefix_hashes_do_not_depend_on_later_tokens(
    algo: str, block_size: int, tokens: list[int], extra: list[int]
) -> None:
    hasher = BlockHasher(algo, block_size, _seed_for(algo))
    short = hasher.hash_blocks(tokens)
    assert hasher.hash_blocks(tokens + extra)[: len(short)] == short
    assert len(short) == len(tokens) // block_size


@settings(max_examples=100, deadline=None)
@given(algo=algos, tokens=token_ids)
def test_wire_form_is_last_eight_bytes(algo: str, tokens: list[int]) -> None:
    hasher = BlockHasher(algo, 4, _seed_for(algo))
    digests = hasher.hash_blocks(tokens)
    wires = hasher.wire_hashes(tokens)
    assert wires == [int.from_bytes(d[-8:], "big") for d in digests]
    assert all(0 <= w < 2**64 for w in wires)


# --------------------------------------------------------------------------- examples


def test_partial_blocks_have_no_hash() -> None:
    hasher = BlockHasher("sha256", 16)
    assert hasher.hash_blocks(list(range(15))) == []
    assert len(hasher.hash_blocks(list(range(31)))) == 1
    assert len(hasher.hash_blocks(list(range(32)))) == 2
    assert hasher.hash_blocks([]) == []
    assert hasher.hash_blocks(TOKENS_1_40)[0].hex() == BLOCK0_PLAIN


def test_lookahead_delays_a_block_until_its_next_tokens_exist() -> None:
    hasher = BlockHasher("sha256", 16, lookahead_tokens=2)
    assert hasher.hash_blocks(list(range(17))) == []
    assert len(hasher.hash_blocks(list(range(18)))) == 1
    assert hasher.num_hashable_blocks(33) == 1
    assert hasher.num_hashable_blocks(34) == 2


def test_salt_enters_block_zero_only() -> None:
    assert extra_keys_for_block(0, 16, cache_salt="s1") == (("cache_salt", "s1"),)
    assert extra_keys_for_block(1, 16, cache_salt="s1") is None
    hasher = BlockHasher("sha256", 16)
    plain = hasher.hash_blocks(TOKENS_1_40)
    salted = hasher.hash_blocks(TOKENS_1_40, cache_salt="s1")
    # Block 1 has no salt key, but its parent (block 0) differs, so the chain differs.
    assert salted[0] != plain[0] and salted[1] != plain[1]
    fn = get_hash_fn_by_name("sha256")
    assert salted[1] == hash_block_tokens(fn, salted[0], TOKENS_1_40[16:32], None, root=hasher.root)


def test_extra_key_order_is_lora_mm_salt_embeds() -> None:
    keys = extra_keys_for_block(
        0,
        16,
        cache_salt="s",
        lora=LoraKey("a", "/p"),
        mm_items=[MultiModalItem("img", 3, 4)],
        prompt_embeds=[b"\x01\x02"] * 16,
    )
    assert keys == (
        ("lora", "a", "/p"),
        ("mm", "img", 3),
        ("cache_salt", "s"),
        ("prompt_embeds", hashlib.sha256(b"\x01\x02" * 16).digest()),
    )
    assert to_event_extra_keys(keys) == (
        "a",
        ("img", 3),
        "s",
        hashlib.sha256(b"\x01\x02" * 16).digest(),
    )
    assert to_event_extra_keys(None) is None


def test_prompt_embeds_blocks_past_the_embeds_hash_empty_bytes() -> None:
    """vLLM slices ``prompt_embeds[start:end]``; decode blocks past the prompt get sha256(b"")."""
    keys = extra_keys_for_block(2, 4, prompt_embeds=[b"x"] * 8)
    assert keys == (("prompt_embeds", hashlib.sha256(b"").digest()),)


def test_multimodal_scan_follows_vllm_not_plain_overlap() -> None:
    """vLLM's cursor, not an overlap test: nested items expose the difference.

    Block 0 stops at ``outer`` (it does not end there), so ``inner`` is never keyed; from
    block 1 on vLLM's early exit looks only at the *last* item (``inner``, ended at 10) and
    returns no keys although ``outer`` still covers tokens 16..39.
    """
    outer = MultiModalItem("outer", 0, 40)
    inner = MultiModalItem("inner", 5, 5)
    assert [extra_keys_for_block(i, 16, mm_items=[outer, inner]) for i in range(3)] == [
        (("mm", "outer", 0),),
        None,
        None,
    ]
    # An item spanning three blocks: negative offsets once it began earlier.
    wide = [MultiModalItem("w", 10, 30)]
    assert [extra_keys_for_block(i, 16, mm_items=wide) for i in range(4)] == [
        (("mm", "w", 10),),
        (("mm", "w", -6),),
        (("mm", "w", -22),),
        None,
    ]


def test_multimodal_with_lookahead_uses_the_widened_window() -> None:
    # Item [10, 33) ends inside block 1's lookahead window [16, 33): vLLM moves past it there,
    # so block 2 does not carry it although token 32 belongs to it.
    items = [MultiModalItem("img", 10, 23)]
    assert extra_keys_for_block(1, 16, mm_items=items, lookahead_tokens=1) == (("mm", "img", -6),)
    assert extra_keys_for_block(2, 16, mm_items=items, lookahead_tokens=1) is None


def test_pickle_memo_does_not_depend_on_caller_string_identity() -> None:
    """Name and path given as one object hash like two equal objects (vLLM's normal case)."""
    shared = "adapter-x"
    distinct = LoraKey(name=_copy(shared), path=_copy(shared))
    aliased = LoraKey(name=shared, path=shared)
    hasher = BlockHasher("sha256", 4)
    assert hasher.hash_blocks(TOKENS_1_40, lora=aliased) == hasher.hash_blocks(
        TOKENS_1_40, lora=distinct
    )
    # The caveat is real: pickling the aliased tuple naively gives other bytes.
    naive = pickle.dumps((b"", (1,), (("lora", shared, shared),)), protocol=5)
    fresh = pickle.dumps((b"", (1,), (("lora", _copy(shared), _copy(shared)),)), protocol=5)
    assert naive != fresh
    assert hasher.hash_blocks(TOKENS_1_40, lora=aliased) == reference_hashes(
        "sha256", None, 4, TOKENS_1_40, lora=distinct
    )


def test_token_container_types_hash_alike() -> None:
    hasher = BlockHasher("sha256", 16)
    expected = hasher.hash_blocks(TOKENS_1_40)
    assert hasher.hash_blocks(tuple(TOKENS_1_40)) == expected
    assert hasher.hash_blocks(range(1, 41)) == expected
    assert hasher.hash_blocks(array("l", TOKENS_1_40)) == expected


def test_numpy_integer_tokens_hash_like_ints() -> None:
    np = pytest.importorskip("numpy", reason="numpy is optional; only checks coercion")
    hasher = BlockHasher("sha256", 16)
    assert hasher.hash_blocks(np.arange(1, 41)) == hasher.hash_blocks(TOKENS_1_40)
    assert hasher.hash_blocks(list(np.arange(1, 41))) == hasher.hash_blocks(TOKENS_1_40)


def test_hash_block_tokens_empty_parent_means_root() -> None:
    fn = get_hash_fn_by_name("sha256")
    root = none_hash("sha256")
    block = TOKENS_1_40[:16]
    assert hash_block_tokens(fn, None, block, None, root=root).hex() == BLOCK0_PLAIN
    assert hash_block_tokens(fn, BlockHash(b""), block, None, root=root).hex() == BLOCK0_PLAIN


def test_coarser_view() -> None:
    hashes = [BlockHash(bytes([i]) * 32) for i in range(7)]
    assert coarser_view(hashes, 16, 16) == hashes
    assert coarser_view(hashes, 16, 32) == [hashes[1], hashes[3], hashes[5]]
    assert coarser_view(hashes, 16, 64) == [hashes[3]]
    with pytest.raises(HashConfigError, match="not a multiple of the hash block size 16"):
        coarser_view(hashes, 16, 40)
    with pytest.raises(HashConfigError, match="block size must be"):
        coarser_view(hashes, 0, 32)


# ------------------------------------------------------------------------------ errors


def test_unknown_algorithm_lists_valid_names() -> None:
    with pytest.raises(HashConfigError, match="sha256, sha256_cbor, xxhash, xxhash_cbor"):
        get_hash_fn_by_name("md5")
    with pytest.raises(HashConfigError, match="unknown hash algorithm 'sha512'"):
        BlockHasher("sha512")


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_xxhash_without_seed_explains_pythonhashseed(algo: str) -> None:
    with pytest.raises(HashConfigError, match=r"PYTHONHASHSEED=<value>.*same value"):
        none_hash(algo)
    with pytest.raises(HashConfigError, match="os.urandom"):
        BlockHasher(algo)


def test_seed_is_used_verbatim() -> None:
    assert none_hash("sha256", "0") != none_hash("sha256", "00")
    assert none_hash("sha256", "random") == get_hash_fn_by_name("sha256")("random")
    assert none_hash("sha256") == none_hash("sha256", None)
    assert none_hash("sha256").hex().startswith("066b1e89")


@pytest.mark.parametrize("seed", ["", "abc", "-1", "4294967296", " 1", "١"])
def test_seed_python_would_refuse_is_rejected(seed: str) -> None:
    with pytest.raises(HashConfigError, match="PYTHONHASHSEED"):
        none_hash("sha256", seed)


@pytest.mark.parametrize("block_size", [0, -16, 1.5, True, "16"])
def test_bad_block_size(block_size: object) -> None:
    with pytest.raises(HashConfigError, match="block size must be an int >= 1"):
        BlockHasher("sha256", block_size)  # type: ignore[arg-type]


@pytest.mark.parametrize("lookahead", [-1, 1.0])
def test_bad_lookahead(lookahead: object) -> None:
    with pytest.raises(HashConfigError, match="lookahead_tokens must be an int >= 0"):
        BlockHasher("sha256", 16, lookahead_tokens=lookahead)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1, 2, -3] + [0] * 13, "position 2 is -3"),
        ([1, 2.0] + [0] * 14, "position 1 is 2.0"),
        (["1"] + [0] * 15, "position 0 is '1'"),
        ([2**64] + [0] * 15, "position 0 is 18446744073709551616"),
        ("abcdefghijklmnopq", "got str"),
        (b"abcdefghijklmnopq", "got bytes"),
    ],
)
def test_bad_token_ids(tokens: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BlockHasher("sha256", 16).hash_blocks(tokens)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("salt", "message"),
    [
        ("", "must not be empty"),
        ("x" * 129, "has 129 characters"),
        ("a@b", "contains '@'"),
        ("a/b", "contains '/'"),
        ("a\\b", "contains"),
        ("a\x00b", "contains"),
        (7, "must be a string"),
    ],
)
def test_salt_vllm_would_reject(salt: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BlockHasher("sha256", 16).hash_blocks(TOKENS_1_40, cache_salt=salt)  # type: ignore[arg-type]


def test_longest_valid_salt_is_accepted() -> None:
    assert validate_cache_salt("x" * 128) == "x" * 128
    assert len(BlockHasher("sha256", 16).hash_blocks(TOKENS_1_40, cache_salt="x" * 128)) == 2


def test_start_block_and_parent_must_agree() -> None:
    hasher = BlockHasher("sha256", 16)
    whole = hasher.hash_blocks(TOKENS_1_40)
    with pytest.raises(ValueError, match="needs parent=<digest of block 0>"):
        hasher.hash_blocks(TOKENS_1_40, start_block=1)
    with pytest.raises(ValueError, match="block 0's parent is NONE_HASH"):
        hasher.hash_blocks(TOKENS_1_40, parent=whole[0])
    with pytest.raises(ValueError, match="32-byte sha256 digest"):
        hasher.hash_blocks(TOKENS_1_40, start_block=1, parent=BlockHash(b"\x00" * 16))
    with pytest.raises(ValueError, match="start_block must be an int >= 0"):
        hasher.hash_blocks(TOKENS_1_40, start_block=-1)
    assert hasher.hash_blocks(TOKENS_1_40, start_block=5, parent=whole[1]) == []


def test_bad_request_inputs() -> None:
    with pytest.raises(ValueError, match="LoraKey.path must be a non-empty string"):
        LoraKey("a", "")
    with pytest.raises(ValueError, match="offset must be an int >= 0"):
        MultiModalItem("img", -1, 3)
    with pytest.raises(ValueError, match="length must be an int >= 1"):
        MultiModalItem("img", 0, 0)
    with pytest.raises(ValueError, match="sorted by offset"):
        BlockHasher().hash_blocks(
            TOKENS_1_40, mm_items=[MultiModalItem("b", 20, 2), MultiModalItem("a", 1, 2)]
        )
    with pytest.raises(ValueError, match="sequence of bytes"):
        BlockHasher().hash_blocks(TOKENS_1_40, prompt_embeds=[1, 2, 3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="unknown extra key"):
        to_event_extra_keys((("tenant", "x"),))


def test_benchmark_smoke(tmp_path: Path) -> None:
    """The micro benchmark runs at a tiny size, so it cannot rot."""
    script = Path(__file__).resolve().parents[3] / "benchmarks" / "micro" / "bench_hashing.py"
    module = runpy.run_path(str(script))
    out = tmp_path / "bench.json"
    module["main"](["--repeats", "3", "--blocks", "2", "--json", str(out)])
    assert out.exists()
