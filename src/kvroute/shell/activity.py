"""Recent activity for the dashboard: routing decisions per second and the last refusals.

Owns two small bounded records the router's dashboard (``shell/dashboard.py``) shows and
``/metrics`` does not hold in a readable form: how many decisions each pool made in each of
the last ``horizon_s`` seconds, and the last ``max_refusals`` requests the router refused
(status, pool, a short reason; never prompt text). Updates are O(1) and run on the event
loop's thread, like every request-path call.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from kvroute.core.clock import Clock

__all__ = ["Activity", "Refusal"]


@dataclass(frozen=True, slots=True)
class Refusal:
    """One refused request: when (clock seconds), its HTTP status, its pool and why."""

    at_s: float
    status: int
    pool: str
    reason: str


class Activity:
    """Decisions per second (by pool) over a short horizon, and the last refusals."""

    __slots__ = ("_clock", "_seconds", "horizon_s", "predicted", "refusals")

    def __init__(self, clock: Clock, *, horizon_s: int = 60, max_refusals: int = 50) -> None:
        self._clock = clock
        self.horizon_s = horizon_s
        # (whole second, {pool: decisions}) oldest first, at most horizon_s + 1 of them.
        self._seconds: deque[tuple[int, dict[str, int]]] = deque(maxlen=horizon_s + 1)
        self.refusals: deque[Refusal] = deque(maxlen=max_refusals)
        # Per replica: [decisions, prompt tokens, predicted cached tokens] since the start.
        self.predicted: dict[str, list[int]] = {}

    def decided(self, pool: str, replica: str, cached_tokens: int, prompt_tokens: int) -> None:
        """One routing decision: ``cached_tokens`` of ``prompt_tokens`` predicted cached."""
        row = self.predicted.get(replica)
        if row is None:
            row = self.predicted[replica] = [0, 0, 0]
        row[0] += 1
        row[1] += prompt_tokens
        row[2] += cached_tokens
        second = int(self._clock.now())
        seconds = self._seconds
        if not seconds or seconds[-1][0] != second:
            seconds.append((second, {}))
        counts = seconds[-1][1]
        counts[pool] = counts.get(pool, 0) + 1

    def refused(self, status: int, pool: str, reason: str) -> None:
        self.refusals.append(Refusal(self._clock.now(), status, pool, reason[:160]))

    def predicted_hit_ratio(self, replica: str) -> float | None:
        """Predicted cached tokens over prompt tokens of the decisions that chose ``replica``."""
        row = self.predicted.get(replica)
        return row[2] / row[1] if row and row[1] else None

    def decisions_per_second(self, window_s: int = 10) -> dict[str, float]:
        """Each pool's mean decisions per second over the last ``window_s`` whole seconds
        (the current, unfinished second left out)."""
        now = int(self._clock.now())
        totals: dict[str, int] = {}
        for second, counts in self._seconds:
            if now - window_s <= second < now:
                for pool, n in counts.items():
                    totals[pool] = totals.get(pool, 0) + n
        return {pool: n / window_s for pool, n in totals.items()}

    def recent_refusals(self) -> list[dict[str, Any]]:
        """The last refusals, newest first, with their age in seconds."""
        now = self._clock.now()
        return [{"age_s": round(now - r.at_s, 1), "status": r.status, "pool": r.pool,
                 "reason": r.reason} for r in reversed(self.refusals)]
