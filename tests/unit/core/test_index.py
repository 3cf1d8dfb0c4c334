"""Unit tests of the fleet prefix index: refcounts, media, predictions, scopes, bound, stats."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvroute.core.clock import ManualClock
from kvroute.core.errors import ScopeError
from kvroute.core.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvroute.core.index import (
    AdminCapability,
    FleetScope,
    PrefixIndex,
    PrefixMatch,
    TenantScope,
)
from kvroute.core.types import ReplicaId, TenantName, WireHash

A = ReplicaId("a")
B = ReplicaId("b")
C = ReplicaId("c")
T1 = TenantScope(TenantName("t1"))
T2 = TenantScope(TenantName("t2"))
FLEET = AdminCapability().fleet_scope()


def hs(*values: int) -> tuple[WireHash, ...]:
    return tuple(WireHash(v) for v in values)


def stored(*hashes: int, medium: str | None = "GPU") -> BlockStored:
    return BlockStored(hs(*hashes), None, (), 16, medium=medium)


def removed(*hashes: int, medium: str | None = "GPU") -> BlockRemoved:
    return BlockRemoved(hs(*hashes), medium=medium)


def batch(*events: BlockStored | BlockRemoved | AllBlocksCleared, seq: int = 0) -> EventBatch:
    return EventBatch(seq, 0.0, events)


def gpu(n: int) -> PrefixMatch:
    return PrefixMatch(num_gpu_blocks=n)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(100.0)


@pytest.fixture
def index(clock: ManualClock) -> PrefixIndex:
    return PrefixIndex(clock=clock)


def match(index: PrefixIndex, hashes: Sequence[int], scope: TenantScope | FleetScope = T1) -> dict[ReplicaId, PrefixMatch]:
    return index.match(hs(*hashes), scope)


# --- leading runs ----------------------------------------------------------------------


def test_match_counts_only_the_leading_run(index: PrefixIndex) -> None:
    index.apply_batch(A, batch(stored(1, 2, 3, 5)))  # holds 5 but not 4
    index.apply_batch(B, batch(stored(2, 3)))  # no block 0: no run at all
    assert match(index, [1, 2, 3, 4, 5]) == {A: gpu(3)}
    assert match(index, [2, 3]) == {A: gpu(2), B: gpu(2)}
    assert match(index, [9, 1]) == {}
    assert match(index, []) == {}


def test_match_on_an_empty_index_is_empty(index: PrefixIndex) -> None:
    assert match(index, [1, 2]) == {}


def test_runs_end_at_different_depths_across_chunks(index: PrefixIndex) -> None:
    request = list(range(1, 1001))
    depths = {ReplicaId(f"r{i}"): d for i, d in enumerate([1, 255, 256, 257, 600, 1000])}
    for replica, depth in depths.items():
        index.apply_event(replica, stored(*request[:depth]))
    assert match(index, request) == {r: gpu(d) for r, d in depths.items()}


def test_each_block_counts_under_its_best_medium(index: PrefixIndex) -> None:
    index.apply_batch(
        A,
        batch(
            stored(1, 2, 3, 4, medium="STORAGE"),
            stored(2, 3, medium="CPU"),
            stored(3, medium="GPU"),
        ),
    )
    assert match(index, [1, 2, 3, 4, 5]) == {A: PrefixMatch(1, 1, 2, 0)}
    assert match(index, [1, 2, 3, 4, 5])[A].num_blocks == 4


def test_medium_spellings_map_through_medium_from_wire(index: PrefixIndex) -> None:
    index.apply_event(A, stored(1, medium=None))  # older vLLM: device pool
    index.apply_event(A, stored(2, medium="cpu"))  # Mooncake store spelling
    index.apply_event(A, stored(3, medium="weird-tier"))  # unknown: least credit
    assert match(index, [1, 2, 3]) == {A: PrefixMatch(1, 1, 1, 0)}


def test_run_continues_across_a_medium_change(index: PrefixIndex) -> None:
    index.apply_event(A, stored(1, medium="CPU"))
    index.apply_event(A, stored(2, medium="GPU"))
    index.apply_event(A, stored(3, medium="CPU"))
    assert match(index, [1, 2, 3]) == {A: PrefixMatch(1, 2, 0, 0)}


# --- reference counting and removal ----------------------------------------------------


def test_two_copies_one_removed_is_still_held(index: PrefixIndex) -> None:
    index.apply_batch(A, batch(stored(1), stored(1)))
    assert index.stats().num_extra_copies == 1
    index.apply_event(A, removed(1))
    assert match(index, [1]) == {A: gpu(1)}
    assert index.stats().num_entries == 1
    index.apply_event(A, removed(1))
    assert match(index, [1]) == {}
    assert index.stats().num_entries == 0
    assert index.stats().num_hashes == 0


def test_three_copies_need_three_removals(index: PrefixIndex) -> None:
    index.apply_batch(A, batch(stored(1, 2), stored(1), stored(1), stored(2)))
    assert index.stats().num_extra_copies == 3
    for remaining in (2, 1):
        index.apply_event(A, removed(1))
        assert match(index, [1, 2]) == {A: gpu(2)}
        assert index.stats().num_extra_copies == remaining
    index.apply_event(A, removed(1))
    assert match(index, [1]) == {}
    assert match(index, [2]) == {A: gpu(1)}
    assert index.stats().num_removed_unknown == 0


def test_removal_is_per_medium(index: PrefixIndex) -> None:
    index.apply_event(A, stored(1, medium="GPU"))
    index.apply_event(A, stored(1, medium="CPU"))
    index.apply_event(A, removed(1, medium="GPU"))
    assert match(index, [1]) == {A: PrefixMatch(0, 1, 0, 0)}


def test_removing_unknown_hash_is_counted_not_raised(index: PrefixIndex) -> None:
    index.apply_event(A, stored(1))
    index.apply_batch(A, batch(removed(7), removed(1), removed(1), removed(1, medium="CPU")))
    stats = index.stats()
    assert stats.num_removed_unknown == 3  # 7 never stored, 1 removed twice, 1 never on CPU
    assert stats.num_entries == 0
    # Never below zero: a later store makes it held again with one copy.
    index.apply_event(A, stored(1))
    index.apply_event(A, removed(1))
    assert match(index, [1]) == {}


def test_removal_on_one_replica_leaves_the_others(index: PrefixIndex) -> None:
    index.apply_event(A, stored(1, 2))
    index.apply_event(B, stored(1, 2))
    index.apply_event(A, removed(2))
    assert match(index, [1, 2]) == {A: gpu(1), B: gpu(2)}


def test_all_blocks_cleared_clears_only_that_replica(index: PrefixIndex) -> None:
    index.apply_event(A, stored(1, 2))
    index.apply_event(A, stored(1, medium="CPU"))
    index.apply_event(A, stored(1))  # an extra copy
    index.apply_event(B, stored(1, 2))
    index.apply_batch(A, batch(stored(3), AllBlocksCleared(), stored(9)))
    assert match(index, [1, 2]) == {B: gpu(2)}
    assert match(index, [9]) == {A: gpu(1)}
    stats = index.stats()
    assert stats.num_entries_by_replica == {A: 1, B: 2}
    assert stats.num_extra_copies == 0
    assert stats.num_entries == 3


def test_clear_replica_keeps_it_known(index: PrefixIndex) -> None:
    index.apply_event(A, stored(1))
    index.clear_replica(A)
    assert index.replicas == (A,)
    assert index.stats().num_entries_by_replica == {A: 0}
    assert match(index, [1]) == {}


def test_remove_replica_forgets_it_and_reuses_its_slot(index: PrefixIndex) -> None:
    index.apply_event(A, stored(1, 2))
    index.apply_event(B, stored(1))
    index.remove_replica(A)
    index.remove_replica(ReplicaId("never-seen"))  # no-op
    assert index.replicas == (B,)
    assert match(index, [1, 2]) == {B: gpu(1)}
    index.apply_event(C, stored(2))  # takes A's old slot; A's bits must not leak into it
    assert match(index, [1, 2]) == {B: gpu(1)}
    assert match(index, [2]) == {C: gpu(1)}
    assert index.stats().num_entries_by_replica == {B: 1, C: 1}


def test_unknown_event_type_raises_type_error(index: PrefixIndex) -> None:
    with pytest.raises(TypeError, match="expected BlockStored, BlockRemoved or AllBlocksCleared"):
        index.apply_event(A, "BlockStored")  # type: ignore[arg-type]


def test_invalid_replica_id_is_refused(index: PrefixIndex) -> None:
    with pytest.raises(ValueError, match="non-empty str"):
        index.apply_event(ReplicaId(""), stored(1))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_entries": 0}, "max_entries must be a positive int"),
        ({"max_entries": True}, "max_entries must be a positive int"),
        ({"predicted_ttl_s": 0.0}, "predicted_ttl_s must be > 0"),
        ({"predicted_ttl_s": float("nan")}, "predicted_ttl_s must be > 0"),
    ],
)
def test_bad_configuration_is_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PrefixIndex(clock=ManualClock(), **kwargs)  # type: ignore[arg-type]


# --- predicted entries -----------------------------------------------------------------


def test_predicted_entries_count_until_their_ttl(clock: ManualClock) -> None:
    index = PrefixIndex(clock=clock, predicted_ttl_s=2.0)
    index.add_predicted(A, hs(1, 2), T1)
    assert match(index, [1, 2, 3]) == {A: PrefixMatch(0, 0, 0, 2)}
    clock.advance(1.999)
    assert match(index, [1, 2, 3]) == {A: PrefixMatch(0, 0, 0, 2)}
    clock.advance(0.001)
    assert match(index, [1, 2, 3]) == {}
    assert index.stats().num_predicted == 0


def test_rewriting_a_prediction_refreshes_its_expiry(clock: ManualClock) -> None:
    index = PrefixIndex(clock=clock, predicted_ttl_s=2.0)
    index.add_predicted(A, hs(1, 2), T1)
    clock.advance(1.5)
    index.add_predicted(A, hs(1), T1)
    clock.advance(1.0)  # the first write has expired; the refreshed hash 1 has not
    assert match(index, [1, 2]) == {A: PrefixMatch(0, 0, 0, 1)}
    assert index.stats().num_predicted == 1
    clock.advance(1.0)
    assert match(index, [1, 2]) == {}


def test_stored_blocks_outrank_predicted_and_runs_mix_them(index: PrefixIndex) -> None:
    index.apply_event(A, stored(1, medium="CPU"))
    index.add_predicted(A, hs(1, 2, 3), T1)
    index.apply_event(A, stored(3))
    assert match(index, [1, 2, 3, 4]) == {A: PrefixMatch(1, 1, 0, 1)}


def test_predictions_are_visible_only_to_their_tenant_and_the_fleet(index: PrefixIndex) -> None:
    index.add_predicted(A, hs(1, 2), T1)
    index.add_predicted(B, hs(1), T2)
    predicted = PrefixMatch(num_predicted_blocks=1)
    assert match(index, [1, 2], T1) == {A: PrefixMatch(num_predicted_blocks=2)}
    assert match(index, [1, 2], T2) == {B: predicted}
    assert match(index, [1, 2], TenantScope(TenantName("t3"))) == {}
    assert match(index, [1, 2], FLEET) == {A: PrefixMatch(num_predicted_blocks=2), B: predicted}


def test_fleet_written_predictions_are_invisible_to_tenants(index: PrefixIndex) -> None:
    index.add_predicted(A, hs(1), FLEET)
    assert match(index, [1], T1) == {}
    assert match(index, [1], FLEET) == {A: PrefixMatch(num_predicted_blocks=1)}


def test_stored_blocks_are_visible_to_every_scope(index: PrefixIndex) -> None:
    # Isolation of stored blocks comes from the salted hash chain, not from the index.
    index.apply_event(A, stored(1))
    assert match(index, [1], T1) == match(index, [1], T2) == match(index, [1], FLEET) == {A: gpu(1)}


def test_clearing_a_replica_drops_its_predictions(index: PrefixIndex) -> None:
    index.add_predicted(A, hs(1), T1)
    index.add_predicted(B, hs(1), T1)
    index.apply_event(A, AllBlocksCleared())
    assert match(index, [1]) == {B: PrefixMatch(num_predicted_blocks=1)}
    index.remove_replica(B)
    assert match(index, [1]) == {}
    assert index.stats().num_predicted == 0


def test_expiry_keeps_what_others_predicted_and_what_was_refreshed(clock: ManualClock) -> None:
    # A write's expiry removes exactly its own entries: not another replica's prediction of
    # the same block, not one a later write refreshed; a key listed twice counts once.
    index = PrefixIndex(clock=clock, predicted_ttl_s=2.0)
    index.add_predicted(A, hs(1, 2, 2, 3), T1)  # new keys, one listed twice
    index.add_predicted(B, hs(2, 4), T1)  # 2 is A's too
    clock.advance(1.0)
    index.add_predicted(A, hs(3), T1)  # refreshes A's 3
    assert index.stats().num_predicted == 5
    clock.advance(1.0)  # the first two writes expire
    assert match(index, [1]) == {}
    assert match(index, [2]) == {}
    assert match(index, [3]) == {A: PrefixMatch(num_predicted_blocks=1)}
    assert index.stats().num_predicted == 1
    index.add_predicted(B, hs(5, 6), T1)
    index.add_predicted(A, hs(5, 6), T1)  # the same keys on a second replica
    clock.advance(2.0)
    assert match(index, [3]) == match(index, [5]) == {}
    assert index.stats().num_predicted == 0


def test_add_predicted_with_no_hashes_registers_the_replica(index: PrefixIndex) -> None:
    index.add_predicted(A, (), T1)
    assert index.replicas == (A,)
    assert index.stats().num_predicted == 0


# --- scopes ----------------------------------------------------------------------------


@pytest.mark.parametrize("scope", [None, "t1", TenantName("t1"), object(), AdminCapability()])
def test_lookup_without_a_scope_object_raises(index: PrefixIndex, scope: object) -> None:
    index.apply_event(A, stored(1))
    with pytest.raises(ScopeError, match="needs a TenantScope"):
        index.match(hs(1), scope)  # type: ignore[arg-type]
    with pytest.raises(ScopeError, match="needs a TenantScope"):
        index.add_predicted(A, hs(1), scope)  # type: ignore[arg-type]
    assert index.stats().num_predicted == 0


def test_fleet_scope_needs_the_capability() -> None:
    with pytest.raises(ScopeError, match="cannot be constructed directly"):
        FleetScope()
    forged = object.__new__(FleetScope)  # bypasses __init__: no token
    with pytest.raises(ScopeError, match="needs a TenantScope"):
        PrefixIndex(clock=ManualClock()).match(hs(1), forged)


@pytest.mark.parametrize("tenant", ["", None, 7])
def test_tenant_scope_needs_a_tenant_name(tenant: object) -> None:
    with pytest.raises(ScopeError, match="non-empty tenant name"):
        TenantScope(tenant)  # type: ignore[arg-type]


# --- memory bound ----------------------------------------------------------------------


def test_memory_bound_drops_oldest_stored_hashes(clock: ManualClock) -> None:
    index = PrefixIndex(clock=clock, max_entries=4)
    index.apply_event(A, stored(1, 2))
    index.apply_event(B, stored(2, 3))  # 4 entries: at the bound
    assert index.stats().num_evicted_for_bound == 0
    index.apply_event(A, stored(4))  # 5 > 4: drop hash 1 (1 entry)
    stats = index.stats()
    assert stats.num_entries == 4
    assert stats.num_evicted_for_bound == 1
    assert match(index, [1]) == {}
    index.apply_event(C, stored(5))  # drop hash 2, held by A and B: 2 entries
    stats = index.stats()
    assert stats.num_entries == 3
    assert stats.num_evicted_for_bound == 3
    assert stats.num_entries_by_replica == {A: 1, B: 1, C: 1}
    assert match(index, [3]) == {B: gpu(1)}
    assert match(index, [4]) == {A: gpu(1)}


def test_memory_bound_evicts_extra_copies_with_the_hash(clock: ManualClock) -> None:
    index = PrefixIndex(clock=clock, max_entries=1)
    index.apply_batch(A, batch(stored(1), stored(1), stored(2)))
    assert match(index, [1]) == {}
    assert index.stats().num_extra_copies == 0
    index.apply_event(A, removed(1))  # the extra copy went with the hash
    assert index.stats().num_removed_unknown == 1


def test_memory_bound_batches_eviction_with_hysteresis(clock: ManualClock) -> None:
    index = PrefixIndex(clock=clock, max_entries=128)  # low watermark 126
    index.apply_event(A, stored(*range(128)))
    index.apply_event(A, stored(1000))
    stats = index.stats()
    assert stats.num_entries == 126
    assert stats.num_evicted_for_bound == 3
    assert match(index, [0]) == {} and match(index, [3]) == {A: gpu(1)}


def test_restored_hash_counts_as_new_for_eviction_order(clock: ManualClock) -> None:
    index = PrefixIndex(clock=clock, max_entries=2)
    index.apply_event(A, stored(1, 2))
    index.apply_event(A, removed(1))
    index.apply_event(A, stored(1))  # now younger than 2
    index.apply_event(A, stored(3))
    assert match(index, [2]) == {}
    assert match(index, [1]) == {A: gpu(1)}


def test_predicted_entries_have_the_same_bound(clock: ManualClock) -> None:
    index = PrefixIndex(clock=clock, max_entries=3, predicted_ttl_s=100.0)
    index.apply_event(A, stored(1, 2, 3))  # stored entries are bounded separately
    index.add_predicted(A, hs(10, 11), T1)
    index.add_predicted(B, hs(10), T1)
    assert index.stats().num_evicted_for_bound == 0
    index.add_predicted(A, hs(12), T2)  # 4 > 3: the oldest write (A: 10, 11) goes first
    stats = index.stats()
    assert stats.num_predicted == 2
    assert stats.num_evicted_for_bound == 2
    assert stats.num_entries == 3
    assert match(index, [10], T1) == {B: PrefixMatch(num_predicted_blocks=1)}
    assert match(index, [12], T2) == {A: PrefixMatch(num_predicted_blocks=1)}


@pytest.mark.parametrize("forget", ["clear", "remove"])
def test_a_write_from_before_a_clear_never_evicts_a_later_one(clock: ManualClock,
                                                              forget: str) -> None:
    """Found by the model test: with a clock that repeats an instant (the simulator's), the
    queued record of a write made before the replica was cleared looked like a later write
    of the same hash, and the bound evicted that later entry out of turn."""
    index = PrefixIndex(clock=clock, max_entries=3, predicted_ttl_s=100.0)
    index.add_predicted(A, hs(10), T1)
    if forget == "clear":
        index.clear_replica(A)
    else:
        index.remove_replica(A)
        index.apply_event(B, stored())  # B takes A's freed slot; A gets another one
    index.add_predicted(B, hs(10, 21), T1)  # the oldest live write
    index.add_predicted(A, hs(10, 11), T1)  # 4 > 3: B's write goes, A's stays whole
    stats = index.stats()
    assert stats.num_predicted == 2 and stats.num_evicted_for_bound == 2
    assert match(index, [10, 11], T1) == {A: PrefixMatch(num_predicted_blocks=2)}
    assert match(index, [21], T1) == {}


# --- stats -----------------------------------------------------------------------------


def test_stats_report_sizes_and_counters(index: PrefixIndex, clock: ManualClock) -> None:
    index.apply_batch(A, batch(stored(1, 2), stored(2, medium="CPU"), stored(1), removed(8)))
    index.apply_event(B, stored(1))
    index.add_predicted(C, hs(1, 2, 3), T1)
    index.add_predicted(C, hs(1), T2)
    stats = index.stats()
    assert stats.num_entries == 4
    assert stats.num_hashes == 2
    assert stats.num_entries_by_replica == {A: 3, B: 1, C: 0}
    assert stats.num_extra_copies == 1
    assert stats.num_removed_unknown == 1
    assert stats.num_evicted_for_bound == 0
    assert stats.num_predicted == 4
    clock.advance(10)
    assert index.stats().num_predicted == 0


def test_predictions_the_holder_already_has_leave_a_long_match_as_it_was(
        index: PrefixIndex) -> None:
    """A growing session's chunks: the replica its turns went to holds and predicts the same
    blocks (the chunk keeps its int keys), against predictions for a replica that holds them
    nowhere or only in part, or holds them on another medium (counted as before)."""
    chain = list(range(1000, 1000 + 1200))
    index.apply_event(A, stored(*chain[:900]))
    index.apply_event(A, stored(*chain[600:700], medium="CPU"))
    index.add_predicted(A, hs(*chain), T1)  # held to 900, predicted to 1200
    assert match(index, chain) == {A: PrefixMatch(900, 0, 0, 300)}
    index.add_predicted(B, hs(*chain[:520]), T1)  # B holds nothing: predicted only
    index.apply_event(B, stored(*chain[:10], medium="STORAGE"))
    assert match(index, chain) == {A: PrefixMatch(900, 0, 0, 300),
                                   B: PrefixMatch(0, 0, 10, 510)}
    index.apply_event(A, removed(*chain[300:310]))  # a gap: predicted fills it for A
    assert match(index, chain) == {A: PrefixMatch(890, 0, 0, 310),
                                   B: PrefixMatch(0, 0, 10, 510)}
    index.apply_event(A, removed(*chain[600:700]))  # CPU copies remain there
    assert match(index, chain) == {A: PrefixMatch(790, 100, 0, 310),
                                   B: PrefixMatch(0, 0, 10, 510)}
