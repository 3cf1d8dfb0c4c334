"""The engines' own cache counters as the router reads them (core/engine_cache.py)."""

from __future__ import annotations

from kvroute.core.engine_cache import CachingChange, EngineCacheCounters


def test_interval_and_total_hit_ratios_and_restarts_keep_totals_monotonic() -> None:
    c = EngineCacheCounters()
    assert c.observe(queries=1000, hits=100, preemptions=2, caching_enabled=True) == \
        CachingChange(None, True)
    assert c.queries_total == 0 and c.interval_hit_ratio is None  # history before us
    c.observe(queries=2000, hits=900, preemptions=3, caching_enabled=True)
    assert c.interval_hit_ratio == 0.8 and c.hit_ratio == 0.8 and c.preemptions_total == 1
    c.observe(queries=300, hits=30, preemptions=0, caching_enabled=True)  # engine restarted
    assert c.queries_total == 1300 and c.hits_total == 830 and c.preemptions_total == 1
    assert c.interval_hit_ratio == 0.1
    c.observe(queries=300, hits=30, preemptions=0, caching_enabled=True)  # idle interval
    assert c.interval_hit_ratio == 0.1


def test_caching_turned_off_is_a_change_once() -> None:
    c = EngineCacheCounters()
    assert c.observe(queries=None, hits=None, preemptions=None,
                     caching_enabled=False) == CachingChange(None, False)
    assert c.observe(queries=None, hits=None, preemptions=None, caching_enabled=False) is None
    assert c.observe(queries=None, hits=None, preemptions=None,
                     caching_enabled=None) is None  # not reported: nothing learned
    assert c.caching_enabled is False
    assert c.observe(queries=0, hits=0, preemptions=0,
                     caching_enabled=True) == CachingChange(False, True)
