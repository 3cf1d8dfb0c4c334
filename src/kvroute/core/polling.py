"""When discovery reads what, and how long it trusts what it read.

Owns the time decisions of discovery: when an engine replica's ``/health``, ``/v1/models``
and ``/metrics`` probes are due (:class:`ProbeSchedule`), how a fleet's probes are spread
over an interval (:func:`stagger`) and so how often the loop must look
(``PollIntervals.tick_s``), how long a read is trusted (:func:`is_fresh`), and when an
external provider's catalog is read again (:class:`CatalogSchedule`). Pure: ``now_s`` is
always an argument; ``shell/discovery.py`` and ``shell/external_pools.py`` do the reading.

Freshness: a context window (an engine's ``max_model_len`` on ``/v1/models``) or a
provider's catalog is trusted for ``window_ttl_s`` after it was read, and then dropped
rather than trusted forever: a swap slot can change the model behind a URL, and a provider's
catalog changes too. A catalog is read again once it is ``max(window_ttl_s -
models_interval_s, window_ttl_s / 2)`` old, so the new read lands before the old one
expires; a failed read is retried after ``models_interval_s``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

__all__ = [
    "MIN_TICK_S",
    "CatalogSchedule",
    "PollIntervals",
    "ProbeSchedule",
    "is_fresh",
    "stagger",
]

MIN_TICK_S: Final = 0.05
"""The discovery loop never wakes more often than this (unless woken on purpose)."""


@dataclass(frozen=True, slots=True)
class PollIntervals:
    """Discovery's intervals, from ``discovery.*`` in the config.

    Attributes:
        health_s: ``health_interval_s``.
        metrics_s: ``metrics_interval_s``.
        models_s: ``models_interval_s``.
        window_ttl_s: how long a window or a catalog is trusted after its read.
    """

    health_s: float
    metrics_s: float
    models_s: float
    window_ttl_s: float

    def tick_s(self, num_replicas: int) -> float:
        """How often the loop looks for due probes: the shortest interval divided among
        ``num_replicas`` (their probes are staggered by :func:`stagger`), not under
        ``MIN_TICK_S`` unless the shortest interval itself is."""
        shortest = min(self.health_s, self.metrics_s, self.models_s)
        return max(shortest / max(1, num_replicas), min(shortest, MIN_TICK_S))

    @property
    def catalog_refresh_s(self) -> float:
        """Age at which a good catalog is read again (before it expires)."""
        return max(self.window_ttl_s - self.models_s, self.window_ttl_s / 2)


def is_fresh(read_at_s: float | None, now_s: float, ttl_s: float) -> bool:
    """True when something read at ``read_at_s`` is younger than ``ttl_s`` at ``now_s``
    (False when it was never read)."""
    return read_at_s is not None and now_s - read_at_s < ttl_s


@dataclass(slots=True)
class ProbeSchedule:
    """When one engine replica's probes are due.

    A probe that is claimed is booked: its next one is an interval after ``now_s``. A forced
    round (start-up, ``refresh_now``) claims every probe whatever is due.

    Attributes:
        intervals: the fleet's intervals.
        next_health_s / next_metrics_s: when the next ``/health`` / ``/metrics`` is due.
        models_due: ``/v1/models`` should be read at the next chance (never read yet, or
            the window was invalidated); cleared by a good read.
        models_read_s: ``now_s`` of the last good ``/v1/models``.
    """

    intervals: PollIntervals
    next_health_s: float = float("-inf")
    next_metrics_s: float = float("-inf")
    models_due: bool = True
    models_read_s: float | None = None

    def claim_health(self, now_s: float, *, force: bool = False) -> bool:
        """True when ``/health`` is to be probed now (booking the next one)."""
        if not force and now_s < self.next_health_s:
            return False
        self.next_health_s = now_s + self.intervals.health_s
        return True

    def claim_metrics(self, now_s: float, *, force: bool = False) -> bool:
        """True when ``/metrics`` is to be read now (booking the next one)."""
        if not force and now_s < self.next_metrics_s:
            return False
        self.next_metrics_s = now_s + self.intervals.metrics_s
        return True

    def wants_models(self, now_s: float, *, force: bool = False) -> bool:
        """True when ``/v1/models`` is to be read now: forced, due, or a good read is
        ``models_s`` old. Nothing is booked: a failed read is tried again next round."""
        if force or self.models_due:
            return True
        read_s = self.models_read_s
        return read_s is not None and now_s - read_s >= self.intervals.models_s

    def on_models_read(self, now_s: float) -> None:
        """``/v1/models`` answered at ``now_s``."""
        self.models_due = False
        self.models_read_s = now_s

    def invalidate_models(self) -> None:
        """Read ``/v1/models`` at the next chance (the window may have changed)."""
        self.models_due = True

    def health_due_now(self, now_s: float) -> None:
        """Probe ``/health`` at the next chance (a replica taken out by a refusal)."""
        self.next_health_s = now_s

    def shift(self, fraction: float) -> None:
        """Move the next ``/health`` and ``/metrics`` later by ``fraction`` of their
        intervals."""
        self.next_health_s += self.intervals.health_s * fraction
        self.next_metrics_s += self.intervals.metrics_s * fraction


def stagger(schedules: Sequence[ProbeSchedule]) -> None:
    """Spread the next probes of ``schedules`` over the interval: schedule ``k`` of ``n`` is
    shifted by ``k / n`` of it.

    Why: a forced round probes every replica at once, and without this they would stay in
    step: every interval all answers would arrive together and be parsed back to back, one
    stall of the event loop that every request then in flight waits out (the router's p99).
    Staggered, each tick of the loop (:meth:`PollIntervals.tick_s`) handles about one
    replica, and no probe is later than before.
    """
    count = len(schedules)
    for k, schedule in enumerate(schedules):
        schedule.shift(k / count)


@dataclass(slots=True)
class CatalogSchedule:
    """When an external provider's catalog (``/v1/models``) is read, and whether a read is
    still trusted (module docstring).

    Attributes:
        intervals: the fleet's intervals.
        next_read_s: when the next read is due (at once at start).
    """

    intervals: PollIntervals
    next_read_s: float = float("-inf")

    def is_due(self, now_s: float, *, force: bool = False) -> bool:
        """True when a read is due (or forced)."""
        return force or now_s >= self.next_read_s

    def on_attempt(self, now_s: float) -> None:
        """A read starts at ``now_s``: if it fails, the next is ``models_s`` later."""
        self.next_read_s = now_s + self.intervals.models_s

    def on_read(self, now_s: float) -> None:
        """A read that started at ``now_s`` succeeded: read again before it expires."""
        self.next_read_s = now_s + self.intervals.catalog_refresh_s

    def is_fresh(self, read_at_s: float | None, now_s: float) -> bool:
        """True when a catalog read at ``read_at_s`` is still trusted at ``now_s``."""
        return is_fresh(read_at_s, now_s, self.intervals.window_ttl_s)
