"""The KV-event sequence machine: every transition, with facts in and decisions out."""

from __future__ import annotations

import pytest

from kvroute.core.event_sequence import (
    APPLY,
    EventSequence,
    Replayed,
    ReplayOutcome,
    ReplayPurpose,
    RequestReplay,
    ResetCause,
    ResetThenApply,
    SequenceState,
)
from kvroute.core.events import AllBlocksCleared, EventBatch


def batch(seq: int) -> EventBatch:
    return EventBatch(seq, float(seq), (AllBlocksCleared(),), 0)


def batches(first: int, stop: int) -> tuple[EventBatch, ...]:
    return tuple(batch(s) for s in range(first, stop))


def following(expected: int, *, can_replay: bool = True) -> EventSequence:
    """A machine in step with the live stream, ``expected`` next."""
    sequence = EventSequence(can_replay=can_replay, catch_up=False)
    assert sequence.receive_live(batch(expected - 1)) is APPLY
    assert sequence.expected == expected
    return sequence


def recovering(expected: int, live: int) -> EventSequence:
    """A machine replaying the gap ``[expected, live)``."""
    sequence = following(expected)
    assert sequence.receive_live(batch(live)) == RequestReplay(expected, live, ReplayPurpose.GAP)
    return sequence


# ---------------------------------------------------------------- the first live batch


def test_a_first_batch_of_zero_is_applied_and_followed() -> None:
    sequence = EventSequence(can_replay=True)
    assert (sequence.state, sequence.expected) == (SequenceState.NEW, None)
    assert sequence.receive_live(batch(0)) is APPLY
    assert (sequence.state, sequence.expected) == (SequenceState.FOLLOWING, 1)
    assert sequence.receive_live(batch(1)) is APPLY
    assert sequence.expected == 2


def test_a_late_first_batch_asks_to_catch_up_on_everything_before_it() -> None:
    sequence = EventSequence(can_replay=True)
    assert sequence.receive_live(batch(7)) == RequestReplay(0, 7, ReplayPurpose.CATCH_UP)
    assert sequence.state is SequenceState.CATCHING_UP and sequence.expected is None


@pytest.mark.parametrize(("can_replay", "catch_up"), [(False, True), (True, False)])
def test_a_late_first_batch_is_applied_without_catch_up_or_replay_socket(
    can_replay: bool, catch_up: bool
) -> None:
    sequence = EventSequence(can_replay=can_replay, catch_up=catch_up)
    assert sequence.receive_live(batch(7)) is APPLY
    assert sequence.expected == 8


def test_a_whole_catch_up_applies_every_buffered_batch_then_the_live_one() -> None:
    sequence = EventSequence(can_replay=True)
    sequence.receive_live(batch(3))
    assert [sequence.receive_replayed(batch(s)) for s in (0, 1, 2)] == [
        Replayed.KEPT, Replayed.KEPT, Replayed.COMPLETE]
    assert sequence.replay_ended() == ReplayOutcome(batch(3), batches(0, 3), None, None)
    assert (sequence.state, sequence.expected) == (SequenceState.FOLLOWING, 4)


def test_an_incomplete_catch_up_applies_the_tail_it_got_and_never_resets() -> None:
    """An engine that ran long no longer buffers batch 0: the owner's view starts empty, so
    what the engine still has is all there is to know."""
    sequence = EventSequence(can_replay=True)
    sequence.receive_live(batch(10))
    for s in range(6, 10):
        assert sequence.receive_replayed(batch(s)) is Replayed.KEPT
    assert sequence.replay_ended() == ReplayOutcome(
        batch(10), batches(6, 10), None,
        "the engine's replay buffer no longer holds batch 0 (the oldest it returned was 6)")
    assert sequence.expected == 11


def test_a_catch_up_that_times_out_keeps_no_reset_either() -> None:
    sequence = EventSequence(can_replay=True)
    sequence.receive_live(batch(4))
    sequence.receive_replayed(batch(0))
    outcome = sequence.replay_timed_out(2.0)
    assert outcome.reset is None and outcome.replayed == ()  # 0 does not reach up to 3
    assert outcome.problem == (
        "replay did not finish within 2.0s of waiting for the engine's answers")


# ---------------------------------------------------------------- the live stream


def test_a_gap_asks_for_a_replay_of_exactly_the_missed_batches() -> None:
    sequence = following(5)
    assert sequence.receive_live(batch(9)) == RequestReplay(5, 9, ReplayPurpose.GAP)
    assert sequence.state is SequenceState.RECOVERING and sequence.expected is None


def test_a_gap_without_a_replay_socket_resets_then_applies() -> None:
    sequence = following(5, can_replay=False)
    assert sequence.receive_live(batch(9)) == ResetThenApply(
        ResetCause.GAP_WITHOUT_REPLAY,
        "missed batches 5..8 and no replay endpoint is configured (set the engine's "
        "kv-events replay_endpoint to recover gaps)")
    assert sequence.expected == 10
    assert sequence.receive_live(batch(10)) is APPLY


@pytest.mark.parametrize("restarted_at", [0, 3, 4])
def test_a_sequence_going_backwards_is_a_restart_that_resets_then_applies(
    restarted_at: int
) -> None:
    """Even the last delivered number again (4) is a new publisher, not a duplicate: ZMQ
    does not repeat messages and a replay never overlaps the live stream."""
    sequence = following(5)
    assert sequence.receive_live(batch(restarted_at)) == ResetThenApply(
        ResetCause.RESTART,
        f"sequence went back from 4 to {restarted_at}: the engine's publisher restarted, so "
        "everything known about this replica is stale")
    assert sequence.expected == restarted_at + 1
    assert sequence.receive_live(batch(restarted_at + 1)) is APPLY


# ---------------------------------------------------------------- resuming (the durable stream)


def test_a_resumed_machine_follows_from_the_batch_after_the_stream_without_catching_up() -> None:
    sequence = EventSequence(can_replay=True, resume_after=11_999)
    assert (sequence.state, sequence.expected) == (SequenceState.FOLLOWING, 12_000)
    assert sequence.receive_live(batch(12_000)) is APPLY
    assert sequence.expected == 12_001


def test_a_resumed_machine_replays_the_gap_after_the_stream_from_the_engine() -> None:
    sequence = EventSequence(can_replay=True, resume_after=99)
    assert sequence.receive_live(batch(104)) == RequestReplay(100, 104, ReplayPurpose.GAP)
    for b in batches(100, 104):
        sequence.receive_replayed(b)
    outcome = sequence.replay_ended()
    assert outcome.reset is None and [b.seq for b in outcome.replayed] == [100, 101, 102, 103]


def test_a_resumed_machine_takes_a_number_at_or_below_the_stream_for_a_restart() -> None:
    sequence = EventSequence(can_replay=True, resume_after=99)
    action = sequence.receive_live(batch(99))
    assert isinstance(action, ResetThenApply) and action.cause is ResetCause.RESTART


def test_resuming_before_batch_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="resume_after"):
        EventSequence(can_replay=True, resume_after=-1)


# ---------------------------------------------------------------- gap recovery


def test_a_replay_that_fills_the_gap_applies_it_in_order_without_a_reset() -> None:
    sequence = recovering(5, 9)
    # The engine sends from the start on, past the gap too (the live stream carries those).
    got = [sequence.receive_replayed(batch(s)) for s in (5, 6, 7, 8)]
    assert got == [Replayed.KEPT] * 3 + [Replayed.COMPLETE]
    assert sequence.replay_ended() == ReplayOutcome(batch(9), batches(5, 9), None, None)
    assert (sequence.state, sequence.expected) == (SequenceState.FOLLOWING, 10)
    assert sequence.receive_live(batch(10)) is APPLY


def test_a_replay_received_out_of_order_is_applied_in_order() -> None:
    sequence = recovering(5, 8)
    assert [sequence.receive_replayed(batch(s)) for s in (7, 5, 6)] == [
        Replayed.KEPT, Replayed.KEPT, Replayed.COMPLETE]
    assert sequence.replay_ended().replayed == batches(5, 8)


def test_replayed_duplicates_and_batches_outside_the_gap_are_dropped() -> None:
    sequence = recovering(5, 8)
    assert sequence.receive_replayed(batch(4)) is Replayed.DUPLICATE  # the owner has it
    assert sequence.receive_replayed(batch(5)) is Replayed.KEPT
    assert sequence.receive_replayed(batch(5)) is Replayed.DUPLICATE  # already held
    assert sequence.receive_replayed(batch(8)) is Replayed.DUPLICATE  # the live one, waiting
    assert sequence.receive_replayed(batch(9)) is Replayed.DUPLICATE  # the live stream's
    assert sequence.receive_replayed(batch(6)) is Replayed.KEPT
    assert sequence.receive_replayed(batch(7)) is Replayed.COMPLETE
    assert sequence.replay_ended() == ReplayOutcome(batch(8), batches(5, 8), None, None)


def test_a_replay_short_of_the_gap_resets_then_applies_the_tail_it_got() -> None:
    sequence = recovering(5, 12)
    for s in (9, 10, 11):  # the engine's buffer starts at 9
        sequence.receive_replayed(batch(s))
    problem = "the engine's replay buffer no longer holds batch 5 (the oldest it returned was 9)"
    assert sequence.replay_ended() == ReplayOutcome(
        batch(12), batches(9, 12), f"could not recover batches 5..11: {problem}", problem)
    assert sequence.expected == 13


def test_only_the_contiguous_run_before_the_live_batch_follows_a_reset() -> None:
    """Batches before a hole cannot be applied in order after the reset; those after it can."""
    sequence = recovering(5, 10)
    for s in (5, 6, 8, 9):  # 7 is missing
        sequence.receive_replayed(batch(s))
    outcome = sequence.replay_ended()
    assert outcome.replayed == batches(8, 10)
    assert outcome.reset == (
        "could not recover batches 5..9: the engine's replay buffer no longer holds batch 7 "
        "(the oldest it returned was 5)")


def test_a_replay_that_returned_nothing_resets_and_applies_only_the_live_batch() -> None:
    sequence = recovering(5, 7)
    assert sequence.replay_ended() == ReplayOutcome(
        batch(7), (), "could not recover batches 5..6: the engine's replay buffer no longer "
        "holds batch 5 (it returned none of them)",
        "the engine's replay buffer no longer holds batch 5 (it returned none of them)")


def test_a_replay_that_times_out_resets_with_the_timeout_in_the_reason() -> None:
    sequence = recovering(5, 8)
    sequence.receive_replayed(batch(7))
    outcome = sequence.replay_timed_out(0.3)
    assert outcome.reset == ("could not recover batches 5..7: replay did not finish within "
                             "0.3s of waiting for the engine's answers")
    assert outcome.replayed == (batch(7),) and sequence.expected == 9


def test_a_malformed_reply_resets_with_what_was_wrong() -> None:
    sequence = recovering(5, 8)
    outcome = sequence.replay_malformed("bad msgpack")
    assert outcome.reset == "could not recover batches 5..7: malformed replay reply (bad msgpack)"
    assert outcome.replayed == ()


@pytest.mark.parametrize("end", ["timed_out", "malformed"])
def test_a_replay_ended_another_way_after_it_was_complete_is_still_complete(end: str) -> None:
    sequence = recovering(5, 7)
    sequence.receive_replayed(batch(5))
    sequence.receive_replayed(batch(6))
    outcome = sequence.replay_timed_out(1.0) if end == "timed_out" else \
        sequence.replay_malformed("late garbage")
    assert outcome == ReplayOutcome(batch(7), batches(5, 7), None, None)


def test_a_second_gap_after_a_recovery_is_measured_from_the_recovered_live_batch() -> None:
    sequence = recovering(5, 7)
    sequence.replay_ended()  # nothing came: reset, 7 applied
    assert sequence.receive_live(batch(10)) == RequestReplay(8, 10, ReplayPurpose.GAP)


# ---------------------------------------------------------------- misuse by the driver


def test_a_live_batch_during_a_replay_is_refused() -> None:
    sequence = recovering(5, 8)
    with pytest.raises(RuntimeError, match="live batch 9 received while recovering: end the "
                                           "replay for batch 8 first"):
        sequence.receive_live(batch(9))
    assert sequence.state is SequenceState.RECOVERING  # the refusal changed nothing
    assert sequence.replay_ended().live == batch(8)


@pytest.mark.parametrize("fact", ["replayed", "ended", "timed_out", "malformed"])
def test_replay_facts_without_a_replay_are_refused(fact: str) -> None:
    sequence = following(3)
    with pytest.raises(RuntimeError, match="no replay is under way .the stream is following."):
        if fact == "replayed":
            sequence.receive_replayed(batch(1))
        elif fact == "ended":
            sequence.replay_ended()
        elif fact == "timed_out":
            sequence.replay_timed_out(1.0)
        else:
            sequence.replay_malformed("x")
    assert sequence.receive_live(batch(3)) is APPLY
