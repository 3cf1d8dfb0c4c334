"""The block-hash memo holds nothing the garbage collector tracks: its keys, its values and the
dicts that hold them (``core.hash_memo``, module docstring; why:
``docs/benchmarks.md#garbage-collection-pauses``)."""

from __future__ import annotations

import gc
from array import array

import pytest

from kvroute.core.hash_memo import SPAN_BLOCKS, BlockHashMemo
from kvroute.core.hashing import BlockHasher


@pytest.mark.parametrize("per_block", [True, False])
@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_no_entry_key_value_or_segment_is_tracked(per_block: bool, algo: str) -> None:
    hasher = BlockHasher(algo, 4, seed="0" if algo == "xxhash" else None)
    memo = BlockHashMemo(hasher, max_entries=64, per_block=per_block)
    system = list(range(4 * SPAN_BLOCKS * 2 + 8))  # two spans and two blocks
    for turn in range(40):  # beyond the bound: segments fill, rotate and evict
        tokens = system + [1000 + turn] * 12
        salt = None if turn % 3 else f"tenant-{turn % 2}"
        for ids in (tokens, array("I", tokens), [2**40 + t for t in tokens]):
            assert memo.wire_hashes(ids, cache_salt=salt) == hasher.wire_hashes(
                ids, cache_salt=salt)
    assert memo.hits and memo.misses and len(memo) == 64
    segments = list(memo._memo.segments)
    entries = [item for segment in segments for item in segment.items()]
    assert len(entries) == 64
    tracked = [segment for segment in segments if gc.is_tracked(segment)]
    tracked += [key for key, _ in entries if gc.is_tracked(key)]
    tracked += [value for _, value in entries if gc.is_tracked(value)]
    assert not tracked, f"the memo holds {len(tracked)} objects the collector tracks"
    assert any(len(value) == SPAN_BLOCKS * len(hasher.root) for _, value in entries)  # spans
