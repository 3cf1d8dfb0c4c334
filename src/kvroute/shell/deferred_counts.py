"""Deferred metric counting: pending amounts kept in plain Python numbers, moved into
prometheus_client series only when the registry is read.

``shell/metrics.py``'s ``RouterMetrics`` counts through these for the methods called per
request or per KV-event batch. The reason: prometheus_client pays for thread safety and
generality on every update (``inc`` takes a lock, ``Histogram.observe`` walks the buckets
under locks, ``labels()`` validates and locks), which showed in the router's CPU per request
at saturation; a dict update costs a fraction of that
(``docs/benchmarks.md#deferred-metric-counting``), and the move costs one ``inc`` per label
tuple that changed since the last read (one per bucket for the histogram).

Owns:

* ``PendingCounts``: one labelled ``Counter``'s increments, summed per label tuple;
* ``LatencyTally``: one histogram child's observations, counted per bucket;
* ``DecisionTally``: one routing decision's three counters, sharing its pool's latencies;
* ``FlushingRegistry``: the registry that moves everything pending in before each read;
* ``check_histogram_layout``: the start-up check of the prometheus_client internals
  ``LatencyTally`` writes through.

Invariants:

- Readers see exact, current values. The registry is a ``FlushingRegistry``: its
  ``collect()`` (which ``render``, ``value``, ``generate_latest``, ``get_sample_value`` and
  any direct reader of ``registry`` go through) and its ``restricted_registry()`` move the
  pending amounts in first. Counter increments are ints, which floats add exactly (below
  2**53), so summing them before the ``inc`` gives the same value; a latency histogram's
  sum is kept as the running total of the observations in arrival order, the very float
  additions ``observe`` would have made, and its buckets are chosen by ``bisect_left`` on the
  histogram's own bounds (the first bound >= the value, as ``observe`` picks it). Latencies
  are finite (``perf_counter`` differences): a NaN, which ``observe`` counts in no bucket,
  would land in the first one here.
- Pending state is bounded: one tally per label tuple, and the label tuples are the same
  bounded set the series hold children for (``shell/metrics.py``'s NOTE on labels); nothing
  grows with the number of requests, so there is nothing to flush early.
- One thread: every update and every read runs on the router's event loop. A read from
  another thread (prometheus_client's own HTTP server, for one) could interleave a move with
  an update and lose the update; kvroute serves ``/metrics`` from the loop.
- The series' children are created at a label tuple's first count, not at the first move,
  so the label values are checked at the caller and ``*_created`` is the first count's time.

The histograms are written through prometheus_client's per-child ``_buckets`` (per-bucket,
not cumulative, values) and ``_sum``: there is no public call that adds n observations at
once. ``check_histogram_layout`` checks that layout on a probe histogram, and
``RouterMetrics()`` refuses to start if a prometheus_client release changed it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import RestrictedRegistry

__all__ = [
    "DecisionTally",
    "FlushingRegistry",
    "LatencyTally",
    "PendingCounts",
    "check_histogram_layout",
]

_PROBE_BUCKETS: Final[tuple[float, ...]] = (0.00001, 0.000025, 0.00005, 0.0001)
"""The layout check's histogram bounds (the routing-latency histogram's first four)."""


class PendingCounts:
    """One labelled ``Counter``'s increments not yet added to it, summed per label tuple.

    Invariant: ``amounts`` and ``_children`` have the same keys, one per label tuple ever
    counted; ``amounts[key]`` is what ``_children[key]`` still lacks (0 right after a flush).
    Keys are never removed: a label tuple seen once is likely seen again, and the set is
    bounded anyway.
    """

    __slots__ = ("_children", "_counter", "amounts")

    def __init__(self, counter: Counter) -> None:
        self._counter = counter
        self._children: dict[tuple[str, ...], Counter] = {}
        self.amounts: dict[tuple[str, ...], int] = {}

    def add(self, key: tuple[str, ...], amount: int) -> None:
        try:
            self.amounts[key] += amount
        except KeyError:
            self.start(key, amount)

    def start(self, key: tuple[str, ...], amount: int) -> None:
        """The first count of ``key``: its child is created now (see the module docstring)."""
        self._children[key] = self._counter.labels(*key)
        self.amounts[key] = amount

    def flush(self) -> None:
        amounts = self.amounts
        for key, amount in amounts.items():
            if amount:
                self._children[key].inc(amount)
                amounts[key] = 0


class LatencyTally:
    """One histogram child's observations not yet in it (a pool's routing latencies, a
    stage of the router's time).

    Invariant: ``counts[i]`` observations fell in bucket ``i`` (the first of ``bounds`` >=
    the value) since the last flush; ``total`` is the sum of every observation since start
    in arrival order, so it is the float ``observe`` would hold.

    Args:
        child: the histogram child the observations go to.
        bounds: its upper bounds as prometheus_client stores them (``+Inf`` last).
    """

    __slots__ = ("_child", "bounds", "counts", "total")

    def __init__(self, child: Histogram, bounds: tuple[float, ...]) -> None:
        self._child = child
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.total += seconds

    def flush(self) -> None:
        counts = self.counts
        if not any(counts):
            return
        buckets = self._child._buckets
        for i, n in enumerate(counts):
            if n:
                buckets[i].inc(n)
                counts[i] = 0
        self._child._sum.set(self.total)


class DecisionTally:
    """Decisions for one (pool, replica, reason, approximate) not yet in their counters.

    ``prompt_tokens`` and ``cached_tokens`` go to the pool's children, which the tallies of
    the pool's other replicas and reasons share; the pool's latencies are in ``latency``.
    """

    __slots__ = ("_cached", "_decisions", "_prompt", "cached_tokens", "count", "latency",
                 "prompt_tokens")

    def __init__(self, decisions: Counter, prompt: Counter, cached: Counter,
                 latency: LatencyTally) -> None:
        self._decisions = decisions
        self._prompt = prompt
        self._cached = cached
        self.latency = latency
        self.count = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def flush(self) -> None:
        if self.count:
            self._decisions.inc(self.count)
            self.count = 0
        if self.prompt_tokens:
            self._prompt.inc(self.prompt_tokens)
            self.prompt_tokens = 0
        if self.cached_tokens:
            self._cached.inc(self.cached_tokens)
            self.cached_tokens = 0


class FlushingRegistry(CollectorRegistry):
    """A registry that calls ``before_read`` ahead of every read of its series.

    ``collect()`` is the one path of ``generate_latest``, ``get_sample_value`` and direct
    readers; ``restricted_registry()`` (prometheus_client's exposition helpers given
    ``name[]``) reads the collectors itself, so its result gets the same hook.
    """

    def __init__(self, before_read: Callable[[], None]) -> None:
        super().__init__(auto_describe=True)
        self.before_read = before_read

    def collect(self) -> Iterable[Metric]:
        self.before_read()
        return super().collect()

    def restricted_registry(self, names: Iterable[str]) -> RestrictedRegistry:
        return _FlushingRestrictedRegistry(names, self)


class _FlushingRestrictedRegistry(RestrictedRegistry):
    def __init__(self, names: Iterable[str], registry: FlushingRegistry) -> None:
        super().__init__(names, registry)
        self._before_read = registry.before_read

    def collect(self) -> Iterable[Metric]:
        self._before_read()
        return super().collect()


def check_histogram_layout() -> None:
    """Refuse to run if prometheus_client's ``Histogram`` no longer keeps a child's
    per-bucket (not cumulative) values in ``_buckets``, by ``_upper_bounds``, and its sum in
    ``_sum``: ``LatencyTally.flush`` writes there (see the module docstring).

    Raises:
        RuntimeError: the layout is not the one ``LatencyTally`` writes.
    """
    bounds = (*_PROBE_BUCKETS, float("inf"))
    expected = [2.0 if bound == 0.00005 else 0.0 for bound in bounds]
    try:
        probe = Histogram("probe", "layout check", registry=None, buckets=_PROBE_BUCKETS)
        probe.observe(0.00003)
        probe.observe(0.00003)
        ok = (
            tuple(probe._upper_bounds) == bounds
            and [bucket.get() for bucket in probe._buckets] == expected
            and probe._sum.get() == 0.00003 + 0.00003
        )
    except AttributeError:
        ok = False
    if not ok:
        raise RuntimeError(
            "prometheus_client's Histogram internals changed (_upper_bounds, _buckets, "
            "_sum); kvroute.shell.metrics writes its routing-latency buckets through them"
        )
