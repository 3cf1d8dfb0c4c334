"""kvroute's block hashing reproduces vLLM 0.32.0/0.33.0 byte for byte.

Every vector in ``tests/data/vllm-vectors-0.32.json`` produced by vLLM's own functions (or
captured from a live 0.32.0 server) is its own test id, so a regression names the exact case.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvroute.core.hashing import (
    BlockHasher,
    LoraKey,
    MultiModalItem,
    coarser_view,
    extra_keys_for_block,
    get_hash_fn_by_name,
    get_serialize_fn_by_name,
    hash_block_tokens,
    none_hash,
    to_event_extra_keys,
)
from kvroute.core.types import BlockHash, to_wire_hash

VECTORS: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parents[1] / "data" / "vllm-vectors-0.32.json").read_text()
)


def _seed(seed_mode: str) -> str | None:
    if seed_mode == "default_seed":
        return None
    assert seed_mode.startswith("PYTHONHASHSEED="), f"unknown seed mode {seed_mode!r}"
    return seed_mode.removeprefix("PYTHONHASHSEED=")


def _as_json(value: object) -> object:
    """Tuples -> lists, as the vectors were written with ``json.dumps``."""
    if isinstance(value, tuple | list):
        return [_as_json(v) for v in value]
    return value


def _case_id(case: dict[str, Any]) -> str:
    return f"{case['seed_mode']}-{case['algo']}-{case['sequence']}-{case['variant']}"


BLOCK_CASES: list[dict[str, Any]] = VECTORS["block_hash_vectors"]
NONE_HASH_CASES = [
    (mode, algo, entry)
    for mode, per_algo in VECTORS["none_hash"].items()
    for algo, entry in per_algo.items()
]


def test_vector_file_is_the_expected_one() -> None:
    assert VECTORS["vllm_version"] == "0.32.0"
    assert VECTORS["pickle_protocol_used_by_vllm"] == 5
    assert len(BLOCK_CASES) == 72
    assert len(NONE_HASH_CASES) == 6


@pytest.mark.parametrize(
    ("seed_mode", "algo", "entry"), NONE_HASH_CASES, ids=[f"{m}-{a}" for m, a, _ in NONE_HASH_CASES]
)
def test_none_hash(seed_mode: str, algo: str, entry: dict[str, str]) -> None:
    seed = _seed(seed_mode)
    assert (seed or "vllm-none-hash") == entry["seed_string"]
    assert (
        get_serialize_fn_by_name(algo)(entry["seed_string"]).hex() == entry["serialized_seed_hex"]
    )
    assert none_hash(algo, seed).hex() == entry["none_hash_hex"]
    assert BlockHasher(algo, 16, seed).root.hex() == entry["none_hash_hex"]


@pytest.mark.parametrize("case", BLOCK_CASES, ids=[_case_id(c) for c in BLOCK_CASES])
def test_block_hash_vector(case: dict[str, Any]) -> None:
    seed = _seed(case["seed_mode"])
    lora = LoraKey(case["lora"]["lora_name"], case["lora"]["lora_path"]) if case["lora"] else None
    tokens: list[int] = case["token_ids"]
    block_size: int = case["block_size"]
    hasher = BlockHasher(case["algo"], block_size, seed)

    hashes = hasher.hash_blocks(tokens, cache_salt=case["cache_salt"], lora=lora)
    assert [h.hex() for h in hashes] == case["block_hashes_hex"]
    assert (
        hasher.wire_hashes(tokens, cache_salt=case["cache_salt"], lora=lora)
        == case["event_int_hashes"]
    )
    assert [to_wire_hash(h) for h in hashes] == case["event_int_hashes"]

    extra = [
        extra_keys_for_block(i, block_size, cache_salt=case["cache_salt"], lora=lora)
        for i in range(len(hashes))
    ]
    assert _as_json(extra) == case["extra_keys_per_block"]
    if hashes:
        assert (
            _as_json([to_event_extra_keys(e) for e in extra]) == case["event_extra_keys_per_block"]
        )
    else:
        assert case["event_extra_keys_per_block"] is None

    # The same chain through the single-block primitive, as vLLM's hash_block_tokens.
    hash_fn = get_hash_fn_by_name(case["algo"])
    parent: BlockHash | None = None
    for i, keys in enumerate(extra):
        block = tokens[i * block_size : (i + 1) * block_size]
        parent = hash_block_tokens(hash_fn, parent, block, keys, root=hasher.root)
        assert parent == hashes[i]

    if "block0_serialized_input_hex" in case:
        serialized = get_serialize_fn_by_name(case["algo"])(
            (hasher.root, tuple(tokens[:block_size]), extra[0])
        )
        assert serialized.hex() == case["block0_serialized_input_hex"]


def test_block0_serialized_inputs_are_covered_for_every_algorithm() -> None:
    covered = {c["algo"] for c in BLOCK_CASES if "block0_serialized_input_hex" in c}
    assert covered == {"sha256", "sha256_cbor", "xxhash", "xxhash_cbor"}


def test_multimodal_example() -> None:
    case = VECTORS["multimodal_example"]
    items = [MultiModalItem(f["identifier"], f["offset"], f["length"]) for f in case["mm_features"]]
    hasher = BlockHasher(case["algo"], case["block_size"], _seed(case["seed_mode"]))
    hashes = hasher.hash_blocks(case["token_ids"], cache_salt=case["cache_salt"], mm_items=items)
    assert [h.hex() for h in hashes] == case["block_hashes_hex"]
    extra = [
        extra_keys_for_block(i, case["block_size"], cache_salt=case["cache_salt"], mm_items=items)
        for i in range(len(hashes))
    ]
    assert _as_json(extra) == case["extra_keys_per_block"]
    assert _as_json([to_event_extra_keys(e) for e in extra]) == case["event_extra_keys_per_block"]


def test_coarser_block_view_example() -> None:
    case = VECTORS["coarser_block_view_example"]
    hasher = BlockHasher(case["algo"], case["hash_block_size"])
    fine = hasher.hash_blocks(case["token_ids"])
    assert [h.hex() for h in fine] == case["hashes_at_16_hex"]
    coarse = coarser_view(fine, case["hash_block_size"], case["group_block_size"])
    assert [h.hex() for h in coarse] == case["hashes_at_32_hex"]


LOOKAHEAD_CASES: list[dict[str, Any]] = VECTORS["lookahead_hash_examples_v0_33"]["cases"]


@pytest.mark.parametrize(
    "case",
    LOOKAHEAD_CASES,
    ids=[
        f"{c['algo']}-L{c['num_hash_lookahead_tokens']}-{'salt' if c['cache_salt'] else 'plain'}"
        for c in LOOKAHEAD_CASES
    ],
)
def test_lookahead_v0_33(case: dict[str, Any]) -> None:
    hasher = BlockHasher(
        case["algo"],
        case["block_size"],
        _seed(case["seed_mode"]),
        lookahead_tokens=case["num_hash_lookahead_tokens"],
    )
    hashes = hasher.hash_blocks(case["token_ids"], cache_salt=case["cache_salt"])
    assert [h.hex() for h in hashes] == case["block_hashes_hex"]
    # A block is hashed only once its lookahead tokens exist.
    lookahead = case["num_hash_lookahead_tokens"]
    exactly_two = case["token_ids"][: 2 * case["block_size"] + lookahead]
    assert hasher.hash_blocks(exactly_two, cache_salt=case["cache_salt"]) == hashes[:2]
    assert hasher.hash_blocks(exactly_two[:-1], cache_salt=case["cache_salt"]) == hashes[:1]


# --- live server capture (vllm serve 0.32.0, block size 32, sha256, no PYTHONHASHSEED) ---

LIVE = VECTORS["live_server_capture_v0_32"]
LIVE_EVENTS = [msg["payload_decoded"][1][0] for msg in LIVE["zmq_messages"]]
LIVE_PROMPT_A = list(range(201, 271))
LIVE_PROMPT_E = list(range(201, 301))


def test_live_capture_shape() -> None:
    assert [e["type"] for e in LIVE_EVENTS] == ["BlockStored"] * 4
    assert {e["block_size"] for e in LIVE_EVENTS} == {32}


def test_live_capture_request_a_plain() -> None:
    hasher = BlockHasher("sha256", 32)
    event = LIVE_EVENTS[0]
    assert hasher.wire_hashes(LIVE_PROMPT_A) == event["block_hashes"]
    assert event["token_ids"] == LIVE_PROMPT_A[:64]
    assert event["extra_keys"] == [None, None]


def test_live_capture_request_b_salted() -> None:
    hasher = BlockHasher("sha256", 32)
    event = LIVE_EVENTS[1]
    assert hasher.wire_hashes(LIVE_PROMPT_A, cache_salt="salt1") == event["block_hashes"]
    extra = [extra_keys_for_block(i, 32, cache_salt="salt1") for i in range(2)]
    assert _as_json([to_event_extra_keys(e) for e in extra]) == event["extra_keys"]


def test_live_capture_request_c_full_report_reannounces_a() -> None:
    event = LIVE_EVENTS[2]
    assert event["parent_block_hash"] is None
    assert BlockHasher("sha256", 32).wire_hashes(LIVE_PROMPT_A) == event["block_hashes"]


def test_live_capture_request_e_extends_a_with_chained_parent() -> None:
    hasher = BlockHasher("sha256", 32)
    event = LIVE_EVENTS[3]
    whole = hasher.hash_blocks(LIVE_PROMPT_E)
    assert len(whole) == 3
    assert to_wire_hash(whole[1]) == event["parent_block_hash"] == LIVE_EVENTS[0]["block_hashes"][1]
    assert [to_wire_hash(whole[2])] == event["block_hashes"]
    assert event["token_ids"] == LIVE_PROMPT_E[64:96]
    # Incremental, as the engine does once request A's blocks are known.
    a_hashes = hasher.hash_blocks(LIVE_PROMPT_A)
    assert hasher.hash_blocks(LIVE_PROMPT_E, start_block=2, parent=a_hashes[1]) == whole[2:]
