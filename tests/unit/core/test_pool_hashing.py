"""A pool's block hashing agreed from its engines' reports (``core.pool_hashing``).

Config overrides per field, the majority vote and its tie, adoption and re-adoption, the
config never replaced, and mismatches said once and cleared.
"""

from __future__ import annotations

import pytest

from kvroute.core.pool_hashing import (
    Hashing,
    HashingSource,
    Mismatch,
    MismatchChange,
    PoolHashing,
    approximate_reason,
    majority,
    reported_hashing,
)
from kvroute.core.types import ReplicaId

A: Hashing = (16, "sha256")
B: Hashing = (32, "sha256")
C: Hashing = (16, "sha256_cbor")
R0, R1, R2 = ReplicaId("r0"), ReplicaId("r1"), ReplicaId("r2")


# -- one replica's report ----------------------------------------------------------------------


def test_a_report_needs_both_values() -> None:
    def report(size: int | None, algo: str | None) -> Hashing | None:
        return reported_hashing(configured_block_size=None, configured_hash_algo=None,
                                block_size=size, hash_algo=algo)

    assert report(16, "sha256") == (16, "sha256")
    assert report(16, None) is None
    assert report(None, "sha256") is None
    assert report(None, None) is None


def test_config_overrides_each_field_of_the_engines_report() -> None:
    assert reported_hashing(configured_block_size=64, configured_hash_algo=None,
                            block_size=16, hash_algo="sha256") == (64, "sha256")
    assert reported_hashing(configured_block_size=None, configured_hash_algo="sha256_cbor",
                            block_size=16, hash_algo="sha256") == (16, "sha256_cbor")
    # The config completes an engine that reports only one of the two.
    assert reported_hashing(configured_block_size=None, configured_hash_algo="sha256",
                            block_size=16, hash_algo=None) == (16, "sha256")


# -- the vote ----------------------------------------------------------------------------------


def test_the_most_common_report_wins() -> None:
    assert majority([B, A, A]) == A
    assert majority([A, B, B, C]) == B


def test_a_tie_goes_to_the_report_first_in_config_order() -> None:
    assert majority([A, B]) == A
    assert majority([B, A]) == B
    assert majority([C, A, B, A, B, C]) == C


def test_a_vote_of_no_reports_is_a_bug_said_loudly() -> None:
    with pytest.raises(ValueError, match="majority of no reports"):
        majority([])


# -- adoption ----------------------------------------------------------------------------------


def test_nothing_is_adopted_without_a_report() -> None:
    h = PoolHashing()
    assert h.adopted is None and h.source is None
    assert h.choose([]) is None


def test_the_first_reports_are_adopted_by_majority() -> None:
    h = PoolHashing()
    assert h.choose([B, A, A]) == A


def test_engines_reports_that_still_include_the_adopted_pair_change_nothing() -> None:
    h = PoolHashing()
    h.adopt(A, HashingSource.ENGINES)
    assert h.choose([B, B, A]) is None  # the odd ones out are mismatches, not a new vote


def test_when_no_engine_reports_the_adopted_pair_any_more_it_is_re_adopted() -> None:
    h = PoolHashing()
    h.adopt(A, HashingSource.ENGINES)
    assert h.choose([B, C, B]) == B


def test_a_pair_from_the_config_is_never_replaced_by_reports() -> None:
    h = PoolHashing()
    h.adopt(A, HashingSource.CONFIG)
    assert h.choose([B, B, B]) is None
    assert (h.adopted, h.source) == (A, HashingSource.CONFIG)


def test_an_unusable_pair_makes_the_hashing_unknown_and_is_said_once() -> None:
    h = PoolHashing()
    h.adopt(A, HashingSource.ENGINES)
    assert h.unusable() is True
    assert h.adopted is None
    assert h.unusable() is False  # the same failure on the next round: already said
    assert h.choose([B]) == B  # unknown again, so the next reports are voted on
    h.adopt(B, HashingSource.ENGINES)
    assert h.unusable() is True  # a new failure after a good adoption is said again


# -- mismatches --------------------------------------------------------------------------------


def test_nothing_is_a_mismatch_while_nothing_is_adopted() -> None:
    h = PoolHashing()
    assert h.check({R0: A, R1: B}) == []
    assert h.mismatch(R0) is None and h.mismatch(R1) is None


def test_a_replica_that_hashes_otherwise_is_a_mismatch_said_once() -> None:
    h = PoolHashing()
    h.adopt(A, HashingSource.ENGINES)
    assert h.check({R0: B, R1: A, R2: A}) == [(R0, MismatchChange.NEW)]
    assert h.mismatch(R0) == Mismatch(reported=B, expected=A)
    assert h.mismatch(R1) is None
    assert h.check({R0: B, R1: A, R2: A}) == []  # the same mismatch: not said again
    assert h.mismatch(R0) == Mismatch(reported=B, expected=A)


def test_a_different_wrong_report_is_a_new_mismatch() -> None:
    h = PoolHashing()
    h.adopt(A, HashingSource.ENGINES)
    h.check({R0: B})
    assert h.check({R0: C}) == [(R0, MismatchChange.NEW)]
    assert h.mismatch(R0) == Mismatch(reported=C, expected=A)


def test_a_replica_that_reports_the_pools_hashing_again_is_cleared() -> None:
    h = PoolHashing()
    h.adopt(A, HashingSource.ENGINES)
    h.check({R0: B, R1: A})
    assert h.check({R0: A, R1: A}) == [(R0, MismatchChange.CLEARED)]
    assert h.mismatch(R0) is None
    assert h.check({R0: A, R1: A}) == []


def test_a_replica_without_a_report_keeps_its_mismatch() -> None:
    h = PoolHashing()
    h.adopt(A, HashingSource.ENGINES)
    h.check({R0: B})
    assert h.check({R0: None}) == []  # down: proves nothing
    assert h.mismatch(R0) == Mismatch(reported=B, expected=A)


def test_a_re_adoption_turns_the_old_majority_into_mismatches() -> None:
    h = PoolHashing()
    h.adopt(A, HashingSource.ENGINES)
    h.adopt(B, HashingSource.ENGINES)
    assert h.check({R0: B, R1: A}) == [(R1, MismatchChange.NEW)]
    assert h.mismatch(R1) == Mismatch(reported=A, expected=B)


def test_changes_come_in_the_order_of_the_reports() -> None:
    h = PoolHashing()
    h.adopt(A, HashingSource.ENGINES)
    h.check({R2: B})
    assert h.check({R0: C, R1: A, R2: A}) == [
        (R0, MismatchChange.NEW), (R2, MismatchChange.CLEARED),
    ]


# -- approximate mode --------------------------------------------------------------------------


def test_why_a_pool_routes_approximately() -> None:
    assert approximate_reason(exact_tokens=True, hashing=A) is None
    assert approximate_reason(exact_tokens=True, hashing=None) == (
        "block size and hash algorithm not yet read from its engines")
    # Without exact tokens the hashing does not matter, and the tokenizer is the reason given.
    for hashing in (A, None):
        assert approximate_reason(exact_tokens=False, hashing=hashing) == (
            "tokenizer: none (no exact prompt tokens)")
