"""The C block-hash chain (``core/_blockhash.c``) against the Python reference: the same
pickle bytes and the same digests for any ids, block size and parent.

The C extension is optional at install time; these tests are skipped with a reason when it
was not built (the pure-Python path is then the only one, and the golden vectors of
``test_hashing.py`` / ``tests/conformance`` cover it), except under CI (``KVROUTE_CI=1``),
whose ``pip install -e .`` must have built it.
"""

from __future__ import annotations

import hashlib
import importlib
import pickle
from array import array
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from required import skip_unless_required

from kvroute.core import native_hashing
from kvroute.core.hashing import BlockHasher
from kvroute.core.native_hashing import sha256_chain, sha256_chain_python
from kvroute.core.types import to_wire_hash


@pytest.fixture(scope="module")
def native() -> ModuleType:
    try:
        return importlib.import_module("kvroute.core._blockhash")
    except ImportError:
        skip_unless_required("the C block hash", "the C extension kvroute.core._blockhash "
                             "was not built (pip install -e . builds it; it needs a C compiler)")

# Every pickle opcode boundary for non-negative ints: BININT1, BININT2, BININT, LONG1 sizes.
EDGES = (0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40 - 1,
         2**55, 2**63 - 1, 2**63, 2**64 - 1)
token = st.one_of(st.sampled_from(EDGES), st.integers(0, 2**64 - 1), st.integers(0, 70_000))


def test_the_extension_is_the_one_in_use(native: ModuleType) -> None:
    assert native_hashing.NATIVE


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(token, min_size=1, max_size=70), bs=st.integers(1, 40),
       parent=st.binary(min_size=0, max_size=255))
def test_pickle_bytes_equal_cpythons(native: ModuleType, ids: list[int], bs: int,
                                     parent: bytes) -> None:
    bs = min(bs, len(ids))
    expected = pickle.dumps((parent, tuple(ids[:bs]), None), 5)
    assert native.pickle_block(parent, array("Q", ids), 8, bs) == expected


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(token, max_size=300), bs=st.integers(1, 33), seed=st.binary(min_size=32,
                                                                               max_size=32))
def test_chain_equals_the_python_loop(native: ModuleType, ids: list[int], bs: int,
                                      seed: bytes) -> None:
    wide = array("Q", ids)
    expected = sha256_chain_python(seed, wide, bs)
    assert sha256_chain(seed, wide, bs) == expected
    # The same chain, spelled out from hashlib and pickle (what vLLM computes).
    prev, digests = seed, []
    for s in range(0, len(ids) - bs + 1, bs):
        prev = hashlib.sha256(pickle.dumps((prev, tuple(ids[s : s + bs]), None), 5)).digest()
        digests.append(prev)
    assert expected == (digests, [to_wire_hash(d) for d in digests])


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 2**32 - 1), max_size=400), bs=st.integers(1, 20),
       cut=st.integers(0, 30))
def test_uint32_arrays_and_resumed_chains(native: ModuleType, ids: list[int], bs: int,
                                          cut: int) -> None:
    """The tokenizer's ``array('I')`` hashes as a list of the same ids; a chain resumed from
    block ``cut`` equals the tail of the whole one."""
    hasher = BlockHasher("sha256", bs, None)
    whole = hasher.hash_blocks(ids)
    assert hasher.hash_blocks(array("I", ids)) == whole
    assert hasher.wire_hashes(array("I", ids)) == [to_wire_hash(d) for d in whole]
    if 0 < cut < len(whole):
        digests, wires = hasher.hash_blocks_and_wires(array("I", ids), start_block=cut,
                                                      parent=whole[cut - 1])
        assert digests == whole[cut:]
        assert wires == [to_wire_hash(d) for d in whole[cut:]]


def test_bad_ids_get_the_same_errors() -> None:
    hasher = BlockHasher("sha256", 2, None)
    for bad, needle in (([1, -1, 3, 4], "position 1"), ([1, 2, 2**64, 4], "position 2"),
                        ([1, 2.0, 3, 4], "position 1")):
        with pytest.raises(ValueError, match=needle):
            hasher.hash_blocks(bad)
    with pytest.raises(ValueError, match="sequence of ints"):
        hasher.hash_blocks(b"abcd")


def test_bad_arguments_to_the_extension_are_refused(native: ModuleType) -> None:
    with pytest.raises(ValueError, match="32-byte"):
        native.sha256_chain(b"x" * 31, array("I", [1, 2]), 4, 1)
    with pytest.raises(ValueError, match="block_size"):
        native.sha256_chain(b"x" * 32, array("I", [1, 2]), 4, 0)
    with pytest.raises(TypeError, match="4- or 8-byte"):
        native.sha256_chain(b"x" * 32, array("I", [1, 2]), 2, 1)


def test_without_the_extension_the_hasher_gives_the_same_hashes(
        native: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback of an install without a compiler: the same digests through BlockHasher."""
    ids = array("I", [(i * 7919) % 70_000 for i in range(16 * 50 + 5)])
    hasher = BlockHasher("sha256", 16, None)
    with_c = hasher.hash_blocks_and_wires(ids)
    monkeypatch.setattr(native_hashing, "_native", None)
    assert hasher.hash_blocks_and_wires(ids) == with_c
    assert hasher.hash_blocks(list(ids)) == with_c[0]
