"""Replica health hysteresis and the external endpoints' simpler rule (``core.health``).

Every row of the module's transition table, both thresholds at and around their value, and
the refusal hook that takes a replica out at once.
"""

from __future__ import annotations

import pytest

from kvroute.core.errors import ConfigError
from kvroute.core.health import (
    DEFAULT_HEALTHY_AFTER,
    EndpointHealth,
    HealthTransition,
    Refusal,
    ReplicaHealth,
)

T = HealthTransition


def health(unhealthy_after: int = 2, healthy_after: int = 1) -> ReplicaHealth:
    return ReplicaHealth(unhealthy_after=unhealthy_after, healthy_after=healthy_after)


def up_replica(unhealthy_after: int = 2, healthy_after: int = 1) -> ReplicaHealth:
    h = health(unhealthy_after, healthy_after)
    assert h.on_success(0.0) is T.FIRST_UP
    return h


def down_replica(unhealthy_after: int = 2, healthy_after: int = 1) -> ReplicaHealth:
    h = health(unhealthy_after, healthy_after)
    assert h.on_failure() is T.FIRST_DOWN
    return h


def test_a_replica_is_unknown_until_its_first_result() -> None:
    h = health()
    assert h.up is None
    assert (h.consecutive_failures, h.consecutive_successes, h.last_ok_s) == (0, 0, None)


@pytest.mark.parametrize("healthy_after", [1, 3])
def test_the_first_success_takes_a_new_replica_in_whatever_healthy_after_is(
    healthy_after: int,
) -> None:
    h = health(healthy_after=healthy_after)
    assert h.on_success(5.0) is T.FIRST_UP
    assert h.up is True and h.last_ok_s == 5.0 and h.consecutive_successes == 1


@pytest.mark.parametrize("unhealthy_after", [1, 2, 5])
def test_the_first_failure_takes_a_new_replica_out_whatever_unhealthy_after_is(
    unhealthy_after: int,
) -> None:
    h = health(unhealthy_after=unhealthy_after)
    assert h.on_failure() is T.FIRST_DOWN
    assert h.up is False and h.consecutive_failures == 1


@pytest.mark.parametrize("unhealthy_after", [1, 2, 3])
def test_a_replica_that_was_in_goes_out_at_exactly_unhealthy_after_failures(
    unhealthy_after: int,
) -> None:
    h = up_replica(unhealthy_after=unhealthy_after)
    for k in range(1, unhealthy_after):
        assert h.on_failure() is T.NONE, k
        assert h.up is True and h.consecutive_failures == k
    assert h.on_failure() is T.WENT_DOWN
    assert h.up is False and h.consecutive_failures == unhealthy_after


@pytest.mark.parametrize("healthy_after", [1, 2, 3])
def test_a_replica_that_was_out_comes_back_at_exactly_healthy_after_successes(
    healthy_after: int,
) -> None:
    h = down_replica(healthy_after=healthy_after)
    for k in range(1, healthy_after):
        assert h.on_success(float(k)) is T.NONE, k
        assert h.up is False and h.consecutive_successes == k
    assert h.on_success(9.0) is T.CAME_BACK
    assert h.up is True and h.consecutive_successes == healthy_after and h.last_ok_s == 9.0


def test_a_success_between_failures_restarts_the_count_in_a_row() -> None:
    h = up_replica(unhealthy_after=2)
    assert h.on_failure() is T.NONE
    assert h.on_success(1.0) is T.NONE
    assert (h.consecutive_failures, h.consecutive_successes) == (0, 1)
    assert h.on_failure() is T.NONE  # one in a row again, not two
    assert h.up is True
    assert h.on_failure() is T.WENT_DOWN


def test_a_failure_between_successes_restarts_the_count_back_in() -> None:
    h = down_replica(healthy_after=2)
    assert h.on_success(1.0) is T.NONE
    assert h.on_failure() is T.NONE
    assert (h.consecutive_failures, h.consecutive_successes) == (1, 0)
    assert h.on_success(2.0) is T.NONE
    assert h.up is False
    assert h.on_success(3.0) is T.CAME_BACK


def test_more_results_on_the_same_side_change_nothing() -> None:
    h = up_replica()
    assert h.on_success(1.0) is T.NONE and h.up is True
    down = down_replica(unhealthy_after=1)
    assert down.on_failure() is T.NONE and down.up is False
    assert down.consecutive_failures == 2


def test_last_ok_is_the_time_of_the_last_success_only() -> None:
    h = up_replica()
    h.on_success(7.0)
    h.on_failure()
    assert h.last_ok_s == 7.0


def test_a_refusal_takes_a_replica_that_was_in_out_at_once() -> None:
    h = up_replica(unhealthy_after=3)
    assert h.on_refused() == Refusal(T.NONE, took_out=True)  # one failure of three, yet out
    assert h.up is False and h.consecutive_failures == 1


def test_a_refusal_that_is_also_the_last_allowed_failure_reports_both() -> None:
    h = up_replica(unhealthy_after=2)
    h.on_failure()
    assert h.on_refused() == Refusal(T.WENT_DOWN, took_out=True)


def test_a_refusal_of_a_replica_never_probed_takes_it_out() -> None:
    assert health().on_refused() == Refusal(T.FIRST_DOWN, took_out=True)


def test_a_refusal_of_a_replica_already_out_takes_nothing_out() -> None:
    h = down_replica()
    assert h.on_refused() == Refusal(T.NONE, took_out=False)
    assert h.up is False and h.consecutive_failures == 2


def test_a_refused_replica_comes_back_after_healthy_after_successes() -> None:
    h = up_replica(healthy_after=2)
    h.on_refused()
    assert h.on_success(1.0) is T.NONE
    assert h.on_success(2.0) is T.CAME_BACK


@pytest.mark.parametrize(("unhealthy_after", "healthy_after", "key"), [
    (0, 1, "discovery.unhealthy_after must be >= 1, got 0"),
    (2, 0, "discovery.healthy_after must be >= 1, got 0"),
])
def test_a_threshold_below_one_names_the_key(unhealthy_after: int, healthy_after: int,
                                              key: str) -> None:  # fmt: skip
    with pytest.raises(ConfigError, match=key):
        ReplicaHealth(unhealthy_after=unhealthy_after, healthy_after=healthy_after)


def test_one_good_probe_brings_a_replica_back_by_default() -> None:
    h = ReplicaHealth(unhealthy_after=1)
    assert h.healthy_after == DEFAULT_HEALTHY_AFTER == 1
    h.on_failure()
    assert h.on_success(1.0) is T.CAME_BACK


# -- external endpoints ------------------------------------------------------------------------


def test_an_endpoint_is_in_from_the_start_and_never_probed_while_in() -> None:
    e = EndpointHealth(interval_s=2.0)
    assert e.healthy
    assert not e.claim_probe(0.0)
    assert not e.claim_probe(1e9)


def test_a_refused_endpoint_is_out_and_probed_one_interval_later() -> None:
    e = EndpointHealth(interval_s=2.0)
    assert e.on_refused(10.0) is True
    assert not e.healthy
    assert not e.claim_probe(11.9)
    assert e.claim_probe(12.0)
    assert not e.claim_probe(12.0)  # booked: the next one is an interval later
    assert not e.claim_probe(13.9)
    assert e.claim_probe(14.0)


def test_a_second_refusal_reports_nothing_new_and_pushes_the_probe_back() -> None:
    e = EndpointHealth(interval_s=2.0)
    e.on_refused(10.0)
    assert e.on_refused(11.0) is False
    assert not e.claim_probe(12.0)
    assert e.claim_probe(13.0)


def test_an_endpoint_whose_probe_answers_is_back_in() -> None:
    e = EndpointHealth(interval_s=2.0)
    e.on_refused(0.0)
    assert e.claim_probe(2.0)
    e.on_probe_ok()
    assert e.healthy
    assert not e.claim_probe(100.0)
