"""Summary figures of a sample: its mean and its nearest-rank percentiles.

One definition for every report that quotes a latency's mean or p50/p90/p99 (the simulated
fleet, the tier benchmarks, the live client), so figures from different benchmarks are
computed the same way and can be compared. Pure: no I/O, so any ring may use it.

Percentiles are nearest-rank: the ``pct``-th percentile of ``n`` sorted values is the one at
rank ``ceil(n * pct / 100)`` (1-based, at least 1), always a value of the sample, never an
interpolation between two.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import overload

__all__ = ["mean", "percentile"]


@overload
def mean(values: Sequence[float]) -> float | None: ...
@overload
def mean(values: Sequence[float], empty: float) -> float: ...
def mean(values: Sequence[float], empty: float | None = None) -> float | None:
    """The arithmetic mean of ``values`` (``sum / len``); ``empty`` when there are none."""
    return sum(values) / len(values) if values else empty


@overload
def percentile(values: Iterable[float], pct: float) -> float | None: ...
@overload
def percentile(values: Iterable[float], pct: float, empty: float) -> float: ...
def percentile(values: Iterable[float], pct: float, empty: float | None = None) -> float | None:
    """The nearest-rank ``pct``-th percentile (``pct`` in 0..100) of ``values``, in any order.

    Returns ``empty`` when there are no values. The rank is ``ceil(n * pct / 100)`` computed
    as ``-(-n * pct // 100)``: exact for a whole ``pct``, where ``pct / 100 * n`` can round
    up past a whole rank (``pct`` 7, ``n`` 100 would give rank 8).
    """
    ordered = sorted(values)
    if not ordered:
        return empty
    rank = max(1, int(-(-len(ordered) * pct // 100)))
    return float(ordered[min(rank, len(ordered)) - 1])
