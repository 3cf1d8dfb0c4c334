"""Discovery's time decisions (``core.polling``): probe schedules, stagger, tick, freshness
and the external catalog's schedule. Time is only ever an argument."""

from __future__ import annotations

import math

import pytest

from kvroute.core.polling import (
    MIN_TICK_S,
    CatalogSchedule,
    PollIntervals,
    ProbeSchedule,
    is_fresh,
    stagger,
)

INTERVALS = PollIntervals(health_s=2.0, metrics_s=4.0, models_s=30.0, window_ttl_s=900.0)


# -- freshness ---------------------------------------------------------------------------------


def test_a_read_is_fresh_until_exactly_its_ttl() -> None:
    assert is_fresh(100.0, 100.0, 900.0)
    assert is_fresh(100.0, 999.9, 900.0)
    assert not is_fresh(100.0, 1000.0, 900.0)


def test_something_never_read_is_never_fresh() -> None:
    assert not is_fresh(None, 0.0, math.inf)


# -- one replica's probes ----------------------------------------------------------------------


def test_every_probe_is_due_at_first() -> None:
    s = ProbeSchedule(INTERVALS)
    assert s.claim_health(0.0)
    assert s.claim_metrics(0.0)
    assert s.wants_models(0.0)


def test_a_claimed_probe_is_due_again_one_interval_later() -> None:
    s = ProbeSchedule(INTERVALS)
    assert s.claim_health(10.0) and s.claim_metrics(10.0)
    assert not s.claim_health(11.9) and not s.claim_metrics(13.9)
    assert s.claim_health(12.0)
    assert s.claim_metrics(14.0)


def test_a_forced_round_claims_every_probe_and_books_the_next_from_now() -> None:
    s = ProbeSchedule(INTERVALS)
    s.claim_health(10.0)
    s.claim_metrics(10.0)
    s.on_models_read(10.0)
    assert s.claim_health(10.5, force=True) and s.claim_metrics(10.5, force=True)
    assert s.wants_models(10.5, force=True)
    assert (s.next_health_s, s.next_metrics_s) == (12.5, 14.5)


def test_models_are_read_until_a_read_succeeds_then_every_models_interval() -> None:
    s = ProbeSchedule(INTERVALS)
    assert s.wants_models(0.0) and s.wants_models(1.0)  # a failed read books nothing
    s.on_models_read(1.0)
    assert (s.models_due, s.models_read_s) == (False, 1.0)
    assert not s.wants_models(30.9)
    assert s.wants_models(31.0)


def test_an_invalidated_window_makes_models_due_at_once() -> None:
    s = ProbeSchedule(INTERVALS)
    s.on_models_read(0.0)
    s.invalidate_models()
    assert s.wants_models(0.1)
    s.on_models_read(0.2)
    assert not s.wants_models(0.3)


def test_a_refusal_makes_health_due_now() -> None:
    s = ProbeSchedule(INTERVALS)
    s.claim_health(10.0)
    s.health_due_now(10.5)
    assert s.claim_health(10.5)


# -- a fleet's probes --------------------------------------------------------------------------


def test_stagger_spreads_replica_k_of_n_by_k_over_n_of_each_interval() -> None:
    schedules = [ProbeSchedule(INTERVALS) for _ in range(4)]
    for s in schedules:
        s.claim_health(100.0)
        s.claim_metrics(100.0)
    stagger(schedules)
    assert [s.next_health_s for s in schedules] == [102.0, 102.5, 103.0, 103.5]
    assert [s.next_metrics_s for s in schedules] == [104.0, 105.0, 106.0, 107.0]


def test_stagger_leaves_a_probe_never_booked_due_at_once() -> None:
    schedules = [ProbeSchedule(INTERVALS) for _ in range(2)]
    stagger(schedules)
    assert schedules[1].next_health_s == -math.inf
    assert schedules[1].claim_health(0.0)


def test_stagger_of_no_replicas_is_nothing() -> None:
    stagger([])


@pytest.mark.parametrize(("num_replicas", "tick"), [
    (0, 2.0),   # no replica: the shortest interval
    (1, 2.0),
    (4, 0.5),   # 2.0 s among four staggered replicas
    (100, MIN_TICK_S),  # never under the floor
])
def test_the_loop_ticks_the_shortest_interval_divided_among_the_replicas(
    num_replicas: int, tick: float,
) -> None:
    assert INTERVALS.tick_s(num_replicas) == pytest.approx(tick)


def test_an_interval_shorter_than_the_floor_is_the_tick() -> None:
    fast = PollIntervals(health_s=0.02, metrics_s=1.0, models_s=1.0, window_ttl_s=1.0)
    assert fast.tick_s(10) == pytest.approx(0.02)


# -- an external provider's catalog ------------------------------------------------------------


def test_a_catalog_is_read_at_once_and_a_failed_read_retried_after_models_interval() -> None:
    c = CatalogSchedule(INTERVALS)
    assert c.is_due(0.0)
    c.on_attempt(0.0)
    assert not c.is_due(29.9)
    assert c.is_due(30.0)
    assert c.is_due(1.0, force=True)


@pytest.mark.parametrize(("ttl", "models", "refresh"), [
    (900.0, 30.0, 870.0),  # the TTL less one models interval: lands before it expires
    (40.0, 30.0, 20.0),    # never sooner than half the TTL
])
def test_a_good_catalog_is_read_again_before_it_expires(ttl: float, models: float,
                                                        refresh: float) -> None:  # fmt: skip
    c = CatalogSchedule(PollIntervals(health_s=1.0, metrics_s=1.0, models_s=models,
                                      window_ttl_s=ttl))
    c.on_attempt(100.0)
    c.on_read(100.0)
    assert not c.is_due(100.0 + refresh - 0.1)
    assert c.is_due(100.0 + refresh)
    assert c.is_fresh(100.0, 100.0 + refresh)
    assert not c.is_fresh(100.0, 100.0 + ttl)
