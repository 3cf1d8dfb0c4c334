"""Time as an injected dependency.

``core`` never reads the wall clock: every component that needs time takes a ``Clock``.
The live server passes a monotonic clock from ``shell``; the simulator and the tests pass a
``ManualClock`` they advance themselves, so the same decisions replay identically.
"""

from __future__ import annotations

from typing import Protocol


class Clock(Protocol):
    """A source of monotonic seconds."""

    def now(self) -> float:
        """Seconds since an arbitrary, fixed origin; never decreases."""
        ...


class ManualClock:
    """A clock that moves only when told to (virtual time and tests)."""

    __slots__ = ("_now",)

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds`` (must be >= 0)."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go backwards (advance by {seconds})")
        self._now += seconds

    def set(self, when: float) -> None:
        """Jump to ``when``, which must not be earlier than the current time."""
        if when < self._now:
            raise ValueError(f"a clock cannot go backwards ({when} < {self._now})")
        self._now = when
