"""What each engine says of its own prefix cache: hit rate, preemptions, caching on or off.

Owns the per-replica reading of vLLM's cumulative counters (``vllm:prefix_cache_queries``,
``vllm:prefix_cache_hits``, ``vllm:num_preemptions``) and of ``enable_prefix_caching`` in
``vllm:cache_config_info``, as discovery polls them from ``/metrics``:

* totals that only grow: a counter that goes *down* means the engine restarted, and its new
  value is all that happened since (Prometheus' ``rate()`` rule), so the router's exported
  totals stay monotonic across engine restarts;
* the hit rate of the last interval between two reads (hits / queried tokens, both deltas),
  and of everything seen since the router started;
* whether prefix caching is on. An engine whose ``cache_config_info`` says
  ``enable_prefix_caching="False"`` never serves a cached block, whatever the index holds
  (its KV events, if any, describe blocks it will not reuse), so the router must never credit
  it with hits. ``observe`` returns the change so the shell can say so loudly and tell
  ``RouterCore.set_prefix_caching``.

Pure: readings in, state and changes out.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CachingChange", "EngineCacheCounters"]


@dataclass(frozen=True, slots=True)
class CachingChange:
    """Prefix caching went from ``was`` to ``now`` (None: not reported)."""

    was: bool | None
    now: bool | None


def _delta(previous: float | None, current: float) -> float:
    """How much a cumulative counter grew since ``previous`` (a drop is a restart)."""
    if previous is None:
        return 0.0
    return current - previous if current >= previous else current


class EngineCacheCounters:
    """One replica's engine-side cache counters (module docstring)."""

    __slots__ = ("_last_hits", "_last_preemptions", "_last_queries", "caching_enabled",
                 "hits_total", "interval_hit_ratio", "preemptions_total", "queries_total",
                 "readings")

    def __init__(self) -> None:
        self._last_queries: float | None = None
        self._last_hits: float | None = None
        self._last_preemptions: float | None = None
        self.queries_total = 0.0
        self.hits_total = 0.0
        self.preemptions_total = 0.0
        self.interval_hit_ratio: float | None = None
        self.caching_enabled: bool | None = None
        self.readings = 0

    @property
    def hit_ratio(self) -> float | None:
        """Hits over queried tokens since the router started watching (None: no query)."""
        return self.hits_total / self.queries_total if self.queries_total > 0 else None

    def observe(self, *, queries: float | None, hits: float | None,
                preemptions: float | None, caching_enabled: bool | None) -> CachingChange | None:
        """Take one ``/metrics`` reading; the change of ``caching_enabled``, if any.

        A counter the engine does not export (None) leaves its total as it was.
        """
        self.readings += 1
        if queries is not None and hits is not None:
            dq = _delta(self._last_queries, queries)
            dh = _delta(self._last_hits, hits)
            if self._last_queries is not None and dq > 0:
                self.interval_hit_ratio = min(1.0, max(0.0, dh / dq))
            self.queries_total += dq
            self.hits_total += dh
            self._last_queries, self._last_hits = queries, hits
        if preemptions is not None:
            self.preemptions_total += _delta(self._last_preemptions, preemptions)
            self._last_preemptions = preemptions
        was = self.caching_enabled
        if caching_enabled is not None and caching_enabled != was:
            self.caching_enabled = caching_enabled
            return CachingChange(was, caching_enabled)
        return None
