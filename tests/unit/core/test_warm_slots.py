"""WarmSlots: the in-flight guards of warm-ahead, as bookkeeping without I/O.

One warm-up per session in flight (a later stage replaces a job not yet sent, or waits behind
the one being sent, coalesced to the latest stage), and at most ``per_replica`` warm-ups per
target replica. The guards are generic over the job: these tests use a plain record.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvroute.core.errors import ConfigError
from kvroute.core.types import ReplicaId
from kvroute.core.warm_slots import Offer, WarmSlots

R0, R1 = ReplicaId("l0"), ReplicaId("l1")


@dataclass(frozen=True, slots=True)
class Job:
    session_id: str
    stage: int


def test_a_sessions_first_job_starts_and_its_last_forgets_the_session() -> None:
    slots = WarmSlots[Job](1)
    first = Job("a", 0)
    assert slots.offer(first) == (Offer.START, None)
    assert "a" in slots and len(slots) == 1
    assert slots.current("a") is first
    assert slots.commit("a") is first
    assert slots.advance("a") is None
    assert "a" not in slots and len(slots) == 0


def test_a_later_stage_replaces_a_job_not_yet_sent() -> None:
    slots = WarmSlots[Job](1)
    stage0, stage1 = Job("a", 0), Job("a", 1)
    slots.offer(stage0)
    assert slots.offer(stage1) == (Offer.REPLACED, stage0)
    assert slots.commit("a") is stage1
    assert slots.advance("a") is None


def test_a_later_stage_waits_behind_the_one_being_sent_coalesced_to_the_latest() -> None:
    slots = WarmSlots[Job](1)
    stage0, stage1, stage2 = Job("a", 0), Job("a", 1), Job("a", 2)
    slots.offer(stage0)
    slots.commit("a")
    assert slots.offer(stage1) == (Offer.QUEUED, None)
    assert slots.offer(stage2) == (Offer.QUEUED, stage1)  # the older waiting stage is dropped
    assert slots.current("a") is stage0  # never two of one session in flight
    assert slots.advance("a") is stage2
    # The waiting job became current and is not committed: a newer stage replaces it.
    stage3 = Job("a", 3)
    assert slots.offer(stage3) == (Offer.REPLACED, stage2)
    assert slots.commit("a") is stage3
    assert slots.advance("a") is None


def test_sessions_are_independent() -> None:
    slots = WarmSlots[Job](1)
    a, b = Job("a", 0), Job("b", 0)
    assert slots.offer(a)[0] is Offer.START
    slots.commit("a")
    assert slots.offer(b)[0] is Offer.START
    assert (slots.current("a"), slots.current("b")) == (a, b)


def test_drop_forgets_a_session_with_its_waiting_Job() -> None:
    slots = WarmSlots[Job](1)
    slots.offer(Job("a", 0))
    slots.commit("a")
    slots.offer(Job("a", 1))
    slots.drop("a")
    assert "a" not in slots
    slots.drop("a")  # idempotent: a cancelled task may drop twice
    with pytest.raises(KeyError):
        slots.current("a")


@pytest.mark.parametrize("bound", [1, 2, 3])
def test_at_most_per_replica_warm_ups_per_replica(bound: int) -> None:
    slots = WarmSlots[Job](bound)
    for i in range(bound):
        assert slots.has_room([R0])
        assert slots.acquire(R0), i
    assert slots.in_flight(R0) == bound
    assert not slots.has_room([R0])
    assert not slots.acquire(R0)  # refused: nothing taken
    assert slots.in_flight(R0) == bound
    assert slots.has_room([R0, R1])  # another replica of the pool still has room
    slots.release(R0)
    assert slots.in_flight(R0) == bound - 1
    assert slots.acquire(R0)


def test_no_replica_means_no_room() -> None:
    assert not WarmSlots[Job](1).has_room([])


def test_releasing_more_than_taken_is_a_bug_said_loudly() -> None:
    slots = WarmSlots[Job](1)
    slots.acquire(R0)
    slots.release(R0)
    assert slots.in_flight(R0) == 0
    with pytest.raises(AssertionError, match="released more often than taken"):
        slots.release(R0)


def test_a_bound_below_one_names_the_key_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"max_in_flight_per_replica must be >= 1, got 0; .*"
                                          r"warm_ahead.enabled: false"):
        WarmSlots[Job](0)


def test_a_dropped_session_starts_afresh_on_its_next_offer() -> None:
    slots = WarmSlots[Job](1)
    slots.offer(Job("a", 0))
    slots.commit("a")
    slots.drop("a")
    later = Job("a", 1)
    assert slots.offer(later) == (Offer.START, None)
    assert slots.current("a") is later


def test_releasing_a_replica_never_taken_is_a_bug_said_loudly() -> None:
    slots = WarmSlots[Job](2)
    slots.acquire(R0)
    with pytest.raises(AssertionError, match="slot of l1 released more often than taken"):
        slots.release(R1)
    assert slots.in_flight(R0) == 1  # the other replica's count is untouched
