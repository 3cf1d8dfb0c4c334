"""Replica health as pure state machines: which probe results take a replica in or out.

Owns the hysteresis of an engine replica's health (:class:`ReplicaHealth`) and the simpler
rule for an external provider's endpoint (:class:`EndpointHealth`). Pure: no I/O, no clock
reads (``now_s`` is an argument), no logging; ``shell/discovery.py`` (engines) and
``shell/external_pools.py`` (endpoints) probe, report each result here, and log and export
the transition they get back.

Why hysteresis: one lost probe is not an outage (a GC pause, a full accept queue), and
flipping a replica out of routing drops its index entries, so a replica that was in goes out
only after ``unhealthy_after`` failures in a row. A replica never seen healthy is out at its
first failure: nothing says it ever worked. A refused connection is a stronger sign than a
lost probe (nothing listens on the port), so the proxy's report takes a replica out at once.

Theory of operation (``ReplicaHealth``; n = ``unhealthy_after``, m = ``healthy_after``)::

    up      input                      up after   transition
    None    success                    True       FIRST_UP   (whatever m is)
    None    failure                    False      FIRST_DOWN
    True    success                    True       NONE
    True    failure, fewer than n      True       NONE
    True    failure, the n-th          False      WENT_DOWN
    False   success, fewer than m      False      NONE
    False   success, the m-th          True       CAME_BACK
    False   failure                    False      NONE
    any     refused                    False      the failure's, and ``took_out`` unless
                                                  it was already False

A success resets the failure count and a failure the success count, so "in a row" is exact.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from kvroute.core.errors import ConfigError

__all__ = [
    "DEFAULT_HEALTHY_AFTER",
    "EndpointHealth",
    "HealthTransition",
    "Refusal",
    "ReplicaHealth",
]

DEFAULT_HEALTHY_AFTER: Final = 1
"""Consecutive good probes that bring a replica back (``discovery.healthy_after``)."""


class HealthTransition(enum.Enum):
    """What one probe result did to a replica's health."""

    NONE = "none"
    """Counted; in or out as before."""
    FIRST_UP = "first_up"
    """Never probed before, and it answered: in."""
    FIRST_DOWN = "first_down"
    """Never probed before, and it failed: out (unreachable at start-up)."""
    WENT_DOWN = "went_down"
    """It was in and failed ``unhealthy_after`` probes in a row: out."""
    CAME_BACK = "came_back"
    """It was out and answered ``healthy_after`` probes in a row: in again."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """What a refused connection did (:meth:`ReplicaHealth.on_refused`).

    Attributes:
        counted: the transition of the failed probe it counts as.
        took_out: the replica was not already out (it was in, or never probed).
    """

    counted: HealthTransition
    took_out: bool


class ReplicaHealth:
    """One engine replica's health: the hysteresis of the module docstring.

    Invariants: at most one of ``consecutive_failures`` and ``consecutive_successes`` is
    non-zero; ``up`` is None only until the first result.

    Attributes:
        up: in (True), out (False), or never probed (None).
        consecutive_failures / consecutive_successes: results in a row.
        last_ok_s: ``now_s`` of the last success; None before one.

    Args:
        unhealthy_after: failures in a row that take a replica that was in out
            (``discovery.unhealthy_after``).
        healthy_after: successes in a row that bring a replica that was out back in.

    Raises:
        ConfigError: a threshold below 1.
    """

    __slots__ = (
        "consecutive_failures",
        "consecutive_successes",
        "healthy_after",
        "last_ok_s",
        "unhealthy_after",
        "up",
    )

    def __init__(self, *, unhealthy_after: int,
                 healthy_after: int = DEFAULT_HEALTHY_AFTER) -> None:  # fmt: skip
        if unhealthy_after < 1:
            raise ConfigError(f"discovery.unhealthy_after must be >= 1, got {unhealthy_after}")
        if healthy_after < 1:
            raise ConfigError(f"discovery.healthy_after must be >= 1, got {healthy_after}")
        self.unhealthy_after = unhealthy_after
        self.healthy_after = healthy_after
        self.up: bool | None = None
        self.consecutive_failures = 0
        self.consecutive_successes = 0
        self.last_ok_s: float | None = None

    def on_success(self, now_s: float) -> HealthTransition:
        """A health probe answered at ``now_s``."""
        self.consecutive_failures = 0
        self.consecutive_successes += 1
        self.last_ok_s = now_s
        if self.up is None:
            self.up = True
            return HealthTransition.FIRST_UP
        if not self.up and self.consecutive_successes >= self.healthy_after:
            self.up = True
            return HealthTransition.CAME_BACK
        return HealthTransition.NONE

    def on_failure(self) -> HealthTransition:
        """A health probe failed (error status, timeout, no connection)."""
        self.consecutive_successes = 0
        self.consecutive_failures += 1
        if self.up is None:
            self.up = False
            return HealthTransition.FIRST_DOWN
        if self.up and self.consecutive_failures >= self.unhealthy_after:
            self.up = False
            return HealthTransition.WENT_DOWN
        return HealthTransition.NONE

    def on_refused(self) -> Refusal:
        """The proxy could not connect: a failed probe, and out at once whatever the count.

        It comes back like any replica that is out: after ``healthy_after`` successes.
        """
        took_out = self.up is not False
        counted = self.on_failure()
        # NOTE: on_failure keeps a replica that was in for unhealthy_after - 1 failures; a
        # refusal is enough on its own, so the count does not decide here.
        self.up = False
        return Refusal(counted, took_out)


@dataclass(slots=True)
class EndpointHealth:
    """An external provider's endpoint: in from the start, out when refused, back when probed.

    A provider has no ``/health`` and is judged by its answers, so nothing probes an
    endpoint that is in. Once out, it is probed every ``interval_s`` (the first probe
    ``interval_s`` after the refusal) and the first answer brings it back.

    Attributes:
        interval_s: ``discovery.health_interval_s``.
        healthy: in routing.
        next_probe_s: when an endpoint that is out may be probed next.
    """

    interval_s: float
    healthy: bool = True
    next_probe_s: float = float("inf")

    def on_refused(self, now_s: float) -> bool:
        """A connection was refused at ``now_s``: out; True when it was in until now."""
        self.next_probe_s = now_s + self.interval_s
        was_in, self.healthy = self.healthy, False
        return was_in

    def claim_probe(self, now_s: float) -> bool:
        """True when a probe is due now (and it is then booked: the next is one interval
        later); False when the endpoint is in, or its probe is not due yet."""
        if self.healthy or now_s < self.next_probe_s:
            return False
        self.next_probe_s = now_s + self.interval_s
        return True

    def on_probe_ok(self) -> None:
        """A probe answered: in."""
        self.healthy = True
