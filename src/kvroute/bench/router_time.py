"""The router's own share of latency in a benchmark phase, read from its ``/metrics``.

Owns the arithmetic on ``kvroute_router_time_seconds`` (``shell/metrics.py``): the
histogram's buckets in one scrape, the difference between the scrapes before and after a
phase (what the phase added), and quantiles of that difference.

Why: a load generator on the same two cores as the router and the engines sees the router's
time plus the extra network hop plus whatever the scheduler adds, and the added p99 it
reports moves by several ms from one pass to the next. The router measures its own part
itself (request read → forwarded, engine's answer → written), so the benchmark can report
how much of the added latency is the router's code and how much is the machine.

Quantiles are interpolated linearly inside the bucket that holds them, as Prometheus'
``histogram_quantile`` does; with the metric's buckets (0.25 ms steps up to 2 ms) that is
exact to about a quarter of a millisecond there. A quantile in the ``+Inf`` bucket is
reported as the last finite bound. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Final

from kvroute.wire.prom import wanted_samples

__all__ = ["METRIC", "Buckets", "bucket_counts", "phase_counts", "quantile_ms"]

METRIC: Final = "kvroute_router_time_seconds"

Buckets = dict[float, float]
"""Upper bound (seconds, ``inf`` last) → cumulative count, as Prometheus exposes them."""


def bucket_counts(exposition: str, stage: str = "total") -> Buckets:
    """The cumulative bucket counts of ``stage`` in one ``/metrics`` text (empty if the
    router does not export the metric)."""
    samples, _ = wanted_samples(exposition, (METRIC + "_bucket",))
    out: Buckets = {}
    for sample in samples:
        if sample.name != METRIC + "_bucket" or sample.labels.get("stage") != stage:
            continue
        le = sample.labels.get("le")
        if le is None:
            continue
        bound = math.inf if le in ("+Inf", "Inf", "inf") else float(le)
        out[bound] = sample.value
    return dict(sorted(out.items()))


def phase_counts(before: Mapping[float, float], after: Mapping[float, float]) -> Buckets:
    """What a phase added to each cumulative bucket (a bucket missing before counts 0).

    Raises:
        ValueError: a count went down (the router restarted between the scrapes).
    """
    out: Buckets = {}
    for bound, count in sorted(after.items()):
        delta = count - before.get(bound, 0.0)
        if delta < 0:
            raise ValueError(f"{METRIC} bucket le={bound} went from {before.get(bound)} to "
                             f"{count}: the router restarted during the phase")
        out[bound] = delta
    return out


def quantile_ms(buckets: Mapping[float, float], q: float) -> float | None:
    """The ``q`` quantile (0 < q < 1) of cumulative ``buckets``, in ms; None if empty."""
    if not 0 < q < 1:
        raise ValueError(f"quantile {q} must be between 0 and 1")
    bounds: Sequence[float] = sorted(buckets)
    if not bounds:
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return 1e3 * lower_bound
            width = count - lower_count
            fraction = (rank - lower_count) / width if width > 0 else 1.0
            return 1e3 * (lower_bound + (bound - lower_bound) * fraction)
        lower_bound, lower_count = bound, count
    return 1e3 * lower_bound
