"""The simulated engine's block pool: null block, LRU free queue, copies, lazy eviction, reset."""

from __future__ import annotations

import pytest

from kvroute.core.errors import ConfigError
from kvroute.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvroute.core.types import BlockHash, WireHash, to_wire_hash
from kvroute.engine.blocks import BlockPool


def _h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "big"))


def _cache(pool: BlockPool, blocks: list[int], hashes: list[BlockHash], start: int = 0) -> None:
    bs = pool.block_size
    tokens = list(range(len(hashes) * bs))
    pool.cache_full_blocks(
        blocks, hashes, [to_wire_hash(h) for h in hashes], start, len(hashes), tokens,
        lora_name=None, cache_salt=None,
    )


def test_null_block_is_reserved_and_capacity_excludes_it() -> None:
    pool = BlockPool(num_gpu_blocks=5, block_size=4)
    assert pool.capacity == 4
    assert pool.num_free_blocks == 4
    assert pool.free_queue_order() == [1, 2, 3, 4]
    assert pool.get_new_blocks(4) == [1, 2, 3, 4]
    assert pool.usage() == 1.0
    pool.check_invariants()


@pytest.mark.parametrize("num_gpu_blocks,block_size", [(1, 16), (0, 16), (4, 0)])
def test_bad_sizes_are_config_errors(num_gpu_blocks: int, block_size: int) -> None:
    with pytest.raises(ConfigError):
        BlockPool(num_gpu_blocks=num_gpu_blocks, block_size=block_size)


def test_freed_blocks_join_the_tail_in_reverse_order() -> None:
    pool = BlockPool(num_gpu_blocks=6, block_size=2)
    first = pool.get_new_blocks(3)
    assert first == [1, 2, 3]
    pool.free_blocks(first)
    # Block 3 (the request's last) is the first of its blocks to be evicted.
    assert pool.free_queue_order() == [4, 5, 3, 2, 1]
    pool.check_invariants()


def test_touch_takes_a_free_cached_block_out_of_the_queue_and_back_to_the_tail() -> None:
    pool = BlockPool(num_gpu_blocks=5, block_size=2)
    blocks = pool.get_new_blocks(2)
    _cache(pool, blocks, [_h(10), _h(11)])
    pool.free_blocks(blocks)
    assert pool.free_queue_order() == [3, 4, 2, 1]
    pool.touch([1])
    assert pool.ref_cnt(1) == 1
    assert pool.free_queue_order() == [3, 4, 2]
    pool.touch([1])
    assert pool.ref_cnt(1) == 2
    pool.free_blocks([1])
    assert pool.free_queue_order() == [3, 4, 2]
    pool.free_blocks([1])
    assert pool.free_queue_order() == [3, 4, 2, 1]
    pool.check_invariants()


def test_store_event_carries_parent_tokens_and_untagged_keys() -> None:
    pool = BlockPool(num_gpu_blocks=5, block_size=2)
    blocks = pool.get_new_blocks(3)
    hashes = [_h(1), _h(2), _h(3)]
    wire = [to_wire_hash(h) for h in hashes]
    tokens = [7, 8, 9, 10, 11, 12]
    pool.cache_full_blocks(blocks, hashes, wire, 0, 1, tokens, lora_name="ad", cache_salt="s")
    pool.cache_full_blocks(blocks, hashes, wire, 1, 3, tokens, lora_name="ad", cache_salt="s")
    assert pool.take_events() == [
        BlockStored(
            block_hashes=(wire[0],), parent_block_hash=None, token_ids=(7, 8), block_size=2,
            lora_id=None, medium="GPU", lora_name="ad", extra_keys=(("ad", "s"),),
            group_idx=0, kv_cache_spec_kind="full_attention",
        ),
        BlockStored(
            block_hashes=(wire[1], wire[2]), parent_block_hash=wire[0],
            token_ids=(9, 10, 11, 12), block_size=2, lora_id=None, medium="GPU",
            lora_name="ad", extra_keys=(("ad",), ("ad",)), group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
    ]
    assert pool.take_events() == []


def test_salt_only_keys_are_on_block_zero() -> None:
    pool = BlockPool(num_gpu_blocks=5, block_size=2)
    blocks = pool.get_new_blocks(2)
    hashes = [_h(1), _h(2)]
    pool.cache_full_blocks(blocks, hashes, [to_wire_hash(h) for h in hashes], 0, 2, [1, 2, 3, 4],
                           lora_name=None, cache_salt="tenant")
    (event,) = pool.take_events()
    assert isinstance(event, BlockStored)
    assert event.extra_keys == (("tenant",), None)


def test_copies_of_one_hash_are_counted_and_evicted_one_by_one() -> None:
    pool = BlockPool(num_gpu_blocks=4, block_size=2)
    a = pool.get_new_blocks(1)
    b = pool.get_new_blocks(1)
    _cache(pool, a, [_h(5)])
    _cache(pool, b, [_h(5)])
    pool.take_events()
    assert pool.num_cached_copies(_h(5)) == 2
    assert pool.get_cached_block(_h(5)) == a[0]  # the oldest copy answers lookups
    pool.free_blocks(a)
    pool.free_blocks(b)
    assert pool.free_queue_order() == [3, 1, 2]
    assert pool.get_new_blocks(2) == [3, 1]  # block 3 was never cached: one removal
    wire = WireHash(to_wire_hash(_h(5)))
    assert pool.take_events() == [BlockRemoved(block_hashes=(wire,), medium="GPU", group_idx=0)]
    assert pool.num_cached_copies(_h(5)) == 1
    assert pool.get_cached_block(_h(5)) == 2
    pool.check_invariants()


def test_eviction_is_lazy_and_follows_the_free_queue() -> None:
    pool = BlockPool(num_gpu_blocks=4, block_size=2)
    blocks = pool.get_new_blocks(3)
    _cache(pool, blocks, [_h(1), _h(2), _h(3)])
    pool.take_events()
    pool.free_blocks(blocks)
    assert pool.take_events() == []  # freeing keeps the cache
    assert pool.get_cached_block(_h(1)) == 1
    pool.get_new_blocks(2)
    assert pool.take_events() == [
        BlockRemoved(block_hashes=(to_wire_hash(_h(3)),), medium="GPU", group_idx=0),
        BlockRemoved(block_hashes=(to_wire_hash(_h(2)),), medium="GPU", group_idx=0),
    ]
    assert pool.get_cached_block(_h(1)) == 1
    assert pool.get_cached_block(_h(2)) is None


def test_reset_fails_while_blocks_are_in_use_and_clears_when_idle() -> None:
    pool = BlockPool(num_gpu_blocks=4, block_size=2)
    blocks = pool.get_new_blocks(1)
    _cache(pool, blocks, [_h(1)])
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    assert pool.take_events() == []
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.get_cached_block(_h(1)) is None
    assert pool.cached_copies() == {}
    pool.get_new_blocks(3)
    assert pool.take_events() == []  # no removal for hashes the reset already dropped
    pool.check_invariants()


def test_over_allocation_and_double_free_are_internal_errors() -> None:
    pool = BlockPool(num_gpu_blocks=3, block_size=2)
    with pytest.raises(AssertionError, match="only 2 free"):
        pool.get_new_blocks(3)
    blocks = pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(AssertionError, match="freed more often"):
        pool.free_blocks(blocks)
