"""Hit reports (vLLM's ``kv_cache_report_mode: "full"``) in the index, the LRU view and the
forwarded body."""

from __future__ import annotations

import json

from kvroute.core.clock import ManualClock
from kvroute.core.events import BlockRemoved, BlockStored, EventBatch
from kvroute.core.index import PrefixIndex, TenantScope
from kvroute.core.recency import BlockRecency
from kvroute.core.types import ReplicaId, TenantName, WireHash
from kvroute.wire.openai import parse_request
from kvroute.wire.relay import forward_body

R = ReplicaId("r0")
ACME = TenantScope(TenantName("acme"))
H = [WireHash(i) for i in range(100, 106)]


def batch(*events: object) -> EventBatch:
    return EventBatch(seq=0, ts=0.0, events=events)  # type: ignore[arg-type]


def stored(hashes: list[WireHash], parent: WireHash | None = None) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=parent,
                       token_ids=tuple(range(4 * len(hashes))), block_size=4)


def held(index: PrefixIndex) -> int:
    return index.match(H[:3], ACME).get(R).num_gpu_blocks if R in index.match(H[:3], ACME) \
        else 0


def test_a_re_announced_hit_is_a_touch_not_a_copy() -> None:
    for reports, left in ((False, 3), (True, 0)):
        index = PrefixIndex(clock=ManualClock())
        index.set_hit_reports(R, reports)
        index.apply_batch(R, batch(stored(H[:3])))
        index.apply_batch(R, batch(stored(H[:3])))  # the hit, re-announced from block 0
        index.apply_batch(R, batch(BlockRemoved(block_hashes=tuple(H[:3]))))
        # Without hit reports the second store reads as a copy, so one removal leaves them.
        assert held(index) == left


def test_a_store_with_a_parent_still_counts_copies() -> None:
    index = PrefixIndex(clock=ManualClock())
    index.set_hit_reports(R, True)
    index.apply_batch(R, batch(stored(H[:3]), stored(H[1:3], parent=H[0])))
    index.apply_batch(R, batch(BlockRemoved(block_hashes=tuple(H[1:3]))))
    assert held(index) == 3  # the second copies of H1, H2 remain


def test_hits_keep_a_reused_prefix_young_in_the_lru_view() -> None:
    for hits, position in ((False, 0.0), (True, 0.75)):
        recency = BlockRecency()
        recency.apply(R, batch(stored(H[:2])))   # the shared prefix
        recency.apply(R, batch(stored(H[2:5])))  # other blocks, later
        if hits:
            recency.apply(R, batch(stored(H[:2])))  # reused: re-announced
        recency.apply(R, batch(BlockRemoved(block_hashes=(H[0],))))  # stamps 1,2 | 3-5 | 6,7
        stats = recency.stats()
        assert stats.num_scored == 1
        assert stats.mean_position == position
        assert recency.least_recent(R, 1) == ([H[1]] if not hits else [H[2]])


def test_the_report_mode_is_added_to_vllm_xargs_keeping_the_clients_keys() -> None:
    raw = json.dumps({"model": "m", "prompt": "hi", "vllm_xargs": {"k": 1}}).encode()
    parsed = parse_request(raw, "completions")
    sent = json.loads(forward_body(raw, parsed, max_tokens=None, model="m", cache_salt=None,
                                   vllm_xargs={"kv_cache_report_mode": "full"}))
    assert sent["vllm_xargs"] == {"k": 1, "kv_cache_report_mode": "full"}
    mine = json.dumps({"model": "m", "prompt": "hi",
                       "vllm_xargs": {"kv_cache_report_mode": "incremental"}}).encode()
    assert forward_body(mine, parse_request(mine, "completions"), max_tokens=None, model="m",
                        cache_salt=None, vllm_xargs={"kv_cache_report_mode": "full"}) == mine
