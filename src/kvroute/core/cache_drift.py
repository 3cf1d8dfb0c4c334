"""The feedback loop: cached tokens the router predicted against those the engine reports.

Owns, per pool, the comparison of every answered request's *predicted* cached tokens (the
prefix the index said the chosen replica holds) with the *measured* ones (the engine's
``usage.prompt_tokens_details.cached_tokens``, vLLM's ``num_cached_tokens``), and the drift
alarm built on it. A drifting index — a block size or hash seed that differs from the
engines', an adapter or ``cache_salt`` the router does not hash, lost KV events — degrades
routing silently: the router keeps sending requests where it believes their prefixes are.
This is what makes that visible and bounded.

Theory of operation
-------------------

One sample per answered request whose engine reported ``cached_tokens``:

* ``error = (measured − predicted) / prompt_tokens``, signed, in [-1, 1]: negative when the
  router over-predicted (it believed in blocks the engine did not have), positive when it
  under-predicted (the engine had blocks the router did not see). Every sample feeds the
  histogram (``CacheDriftMonitor.error_counts``).
* The sample *disagrees* when ``|measured − predicted|`` exceeds the tolerance:
  ``max(tolerance_blocks × block_size, tolerance_fraction × prompt_tokens)``. Some
  disagreement is normal — a sibling's blocks predicted while its prefill still runs, an
  eviction between the decision and the engine's scheduling, an engine that caches a block
  the router learns of a few milliseconds later — so one sample proves nothing.
* Samples where both are 0 say nothing about the index (a unique prompt) and are left out of
  the alarm's window (they would dilute a real drift on traffic with little reuse).
* The alarm *enters* when the window of the last ``window`` informative samples holds at
  least ``min_samples`` and the share that disagree reaches ``threshold``; it then clears the
  window and *leaves* once at least ``min_samples`` new samples disagree at under half the
  threshold (hysteresis: a pool does not flap at the boundary).

While the alarm is on, the shell puts the pool into approximate mode (``RouterCore.
set_pool_drifting``: text chunks and predicted entries, the declared fallback) and keeps
comparing the *exact* index's prediction for the chosen replica (a shadow prediction, not
used to route) with what the engine reports, so it can tell when the two agree again.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Final

from kvroute.core.errors import ConfigError

__all__ = [
    "ERROR_BOUNDS",
    "CacheDriftMonitor",
    "CacheDriftSettings",
    "DriftSample",
    "DriftTransition",
]

ERROR_BOUNDS: Final[tuple[float, ...]] = (
    -1.0, -0.5, -0.25, -0.1, -0.02, 0.02, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip
"""Upper bounds of the error histogram's buckets ((measured − predicted) / prompt tokens):
the two around 0 hold the agreeing samples, the outer ones whole-prompt misses."""


@dataclass(frozen=True, slots=True)
class CacheDriftSettings:
    """The alarm's settings (``cache_drift:`` in the router's config).

    Attributes:
        enabled: compare at all (the histogram and the alarm).
        threshold: share of disagreeing samples in the window that sets the alarm off.
        window: informative samples the share is computed over.
        min_samples: samples needed before the alarm may enter, or leave.
        tolerance_blocks / tolerance_fraction: a sample agrees within the larger of these
            many blocks or this share of its prompt.
        approximate_on_alarm: put the pool into approximate mode while the alarm is on.
    """

    enabled: bool = True
    threshold: float = 0.5
    window: int = 64
    min_samples: int = 16
    tolerance_blocks: int = 2
    tolerance_fraction: float = 0.1
    approximate_on_alarm: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ConfigError(f"cache_drift.threshold={self.threshold!r} must be in (0, 1]: the "
                              "share of disagreeing requests that sets the alarm off")
        if not 1 <= self.min_samples <= self.window:
            raise ConfigError(
                f"cache_drift needs 1 <= min_samples <= window, got min_samples="
                f"{self.min_samples} window={self.window}"
            )
        if self.tolerance_blocks < 0 or not 0.0 <= self.tolerance_fraction <= 1.0:
            raise ConfigError(
                f"cache_drift.tolerance_blocks={self.tolerance_blocks} must be >= 0 and "
                f"tolerance_fraction={self.tolerance_fraction!r} in [0, 1]"
            )


@dataclass(frozen=True, slots=True)
class DriftSample:
    """One answered request: what the router predicted and what the engine reported."""

    predicted_tokens: int
    measured_tokens: int
    prompt_tokens: int
    block_size: int

    @property
    def error(self) -> float:
        """``(measured − predicted) / prompt_tokens``, clipped to [-1, 1]."""
        if self.prompt_tokens <= 0:
            return 0.0
        raw = (self.measured_tokens - self.predicted_tokens) / self.prompt_tokens
        return max(-1.0, min(1.0, raw))


class DriftTransition(enum.Enum):
    ENTERED = "entered"
    LEFT = "left"


class CacheDriftMonitor:
    """One pool's comparison and alarm (module docstring). Pure: samples in, transitions out.

    Invariant: ``alarm`` changes only inside ``observe``, which returns the transition.
    """

    __slots__ = (
        "_recent",
        "agree",
        "alarm",
        "error_counts",
        "error_sum",
        "measured_total",
        "num_samples",
        "over",
        "predicted_total",
        "settings",
        "under",
    )

    def __init__(self, settings: CacheDriftSettings) -> None:
        self.settings = settings
        self._recent: deque[bool] = deque(maxlen=settings.window)
        self.alarm = False
        self.num_samples = 0
        self.agree = 0
        self.over = 0
        self.under = 0
        self.predicted_total = 0
        self.measured_total = 0
        self.error_counts = [0] * (len(ERROR_BOUNDS) + 1)  # the last is +Inf (never used)
        self.error_sum = 0.0

    @property
    def drift_ratio(self) -> float:
        """Share of the window's informative samples that disagree (0 when empty)."""
        recent = self._recent
        return sum(recent) / len(recent) if recent else 0.0

    @property
    def window_samples(self) -> int:
        return len(self._recent)

    def observe(self, sample: DriftSample) -> DriftTransition | None:
        """Count one sample; the alarm's transition, if this sample made one."""
        self.num_samples += 1
        self.predicted_total += sample.predicted_tokens
        self.measured_total += sample.measured_tokens
        error = sample.error
        self.error_sum += error
        for i, bound in enumerate(ERROR_BOUNDS):
            if error <= bound:
                self.error_counts[i] += 1
                break
        s = self.settings
        gap = sample.measured_tokens - sample.predicted_tokens
        tolerance = max(s.tolerance_blocks * sample.block_size,
                        s.tolerance_fraction * sample.prompt_tokens)
        disagrees = abs(gap) > tolerance
        if not disagrees:
            self.agree += 1
        elif gap < 0:
            self.over += 1
        else:
            self.under += 1
        if sample.predicted_tokens == 0 and sample.measured_tokens == 0:
            return None
        self._recent.append(disagrees)
        if len(self._recent) < s.min_samples:
            return None
        ratio = self.drift_ratio
        if not self.alarm and ratio >= s.threshold:
            self.alarm = True
            self._recent.clear()  # leaving needs min_samples fresh samples
            return DriftTransition.ENTERED
        if self.alarm and ratio < s.threshold / 2:
            self.alarm = False
            return DriftTransition.LEFT
        return None
