"""Spread-ahead: copy a resting session's context to a light replica before it returns.

A session's context is cached on the replica that served its last turn, so its next turn
goes there; when several long sessions rest on one replica and come back at about the same
time, they decode together over the sum of their contexts and every token of each is slower,
while other replicas sit idle (docs/benchmarks.md, "The whole turn"). Re-prefilling the turn
elsewhere at its return pays the whole prompt in its first token. Spread-ahead pays it in the
rest instead: when a session's request ends on a crowded replica, a ``max_tokens: 1`` copy of
its prompt is sent to an idle replica with KV room, in the background, so that at its return
the ordinary cost model (``core/policy.py``) finds the prefix on both and picks the replica
where it would not decode beside the others.

This module holds the decision only (pure: loads in, a target or a reason out). The walk
asks it when a session's request ends (``RequestWalk.end``) and turns a copy into a
``ShadowWarm`` note of scenario ``spread``, which the drivers send like any shadow warm-up
(``sim/fleet.py`` in virtual time, its prefill charged to the target engine;
``shell/shadow_warm.py`` live).

When a copy is planned (every condition must hold):

* the session's context is long (``min_tokens``): a short context barely slows a batch;
* the home replica is crowded: ``N`` other sessions rest there (with ``K`` tokens of
  context) and the chance that at least one of them comes back during this session's next
  turn, ``1 − exp(−N · window / rest)``, is at least ``overlap`` (``window``: the turn's
  decode time, its answer times a decode step beside one other long context; ``rest``: the
  fleet's learned mean rest between turns, ``core/load.py``);
* a target exists: a healthy replica of the same pool and version, other than home, with at
  most ``max_target_in_flight`` requests in flight, resting less context than home, whose KV
  holds the copy and its answer without evicting any resting session's blocks
  (``capacity − used − resting ≥ tokens + answer``; capacity unknown: no copy), and whose
  prefill of the copy ends well within the rest (``tokens / rate ≤ rest / 2``);
* the budget allows it: at most ``per_s`` copies a second on average (a bucket of ``burst``)
  and at most ``budget_tokens`` copy tokens in all.

Among targets the lightest wins (the least resting context, then the fewest in flight, then
the most free KV, then the one copied to longest ago): never list order. A copy always goes
under the session's own tenant scope and cache salt (the walk builds it from the session's
own request), so it can never be read by another tenant. What the copy carries is the
driver's: live, the prompt plus the answer as the next turn resends it (``wire/turn_copy.py``);
in the simulator, the prompt alone (a replayed trace's next turn never resends the tokens the
simulated engine answered, so home holds no more of it than the copy).

Once a copy is planned, the walk moves the session's rest to the target
(``LoadTracker.move_resting``, ``rest_on_copy``): its next turn is expected there, so other
requests' return and pressure terms, and the next copy's choice of target, count it there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from kvroute.core.load import DecodeTiming, ReplicaLoad
from kvroute.core.types import ReplicaId

__all__ = [
    "DEFAULT_SPREAD",
    "SpreadCopy",
    "SpreadPlanner",
    "SpreadSettings",
    "SpreadSkip",
]


@dataclass(frozen=True, slots=True)
class SpreadSettings:
    """Spread-ahead's switch and budget (module docstring); ``--policy-param
    kvroute.spread_ahead=1`` and the ``spread_*`` parameters of ``KvrouteCostPolicy``."""

    enabled: bool = True
    per_s: float = 1.0
    """Copies a second, on average, fleet-wide."""
    burst: float = 2.0
    """Copies the bucket holds (sent back to back at most)."""
    budget_tokens: float = math.inf
    """Copy tokens (prefill work) in all; ``inf``: no cap."""
    overlap: float = 0.3
    """The least chance that another resting session's turn overlaps this one's at home."""
    min_tokens: int = 8192
    """The shortest context worth copying."""
    max_target_in_flight: int = 0
    """A target's requests in flight at most (0: idle)."""
    rest_on_copy: bool = True
    """Count the session as resting on the copy's target, not its home, once a copy is
    planned (``LoadTracker.move_resting``)."""

    def __post_init__(self) -> None:
        if (self.per_s < 0 or self.burst < 1 or self.budget_tokens < 0
                or not 0 <= self.overlap <= 1 or self.min_tokens < 0
                or self.max_target_in_flight < 0):
            raise ValueError(
                "spread-ahead settings out of range (per_s >= 0, burst >= 1, budget_tokens >= "
                f"0, 0 <= overlap <= 1, min_tokens >= 0, max_target_in_flight >= 0): {self}")


DEFAULT_SPREAD: Final = SpreadSettings()


@dataclass(frozen=True, slots=True)
class SpreadCopy:
    """Copy the session's context to ``target``; ``overlap`` is the chance that made it."""

    target: ReplicaId
    tokens: int
    overlap: float


@dataclass(frozen=True, slots=True)
class SpreadSkip:
    """No copy, and why: ``off``, ``short``, ``alone`` (home is not crowded enough),
    ``no_target`` (no idle replica with KV room), ``rate`` or ``budget``."""

    reason: str


@dataclass(slots=True)
class SpreadPlanner:
    """Router-wide state of spread-ahead: the copy bucket, the tokens spent, the last copy
    to each target (one per router, like the warm-ahead planner)."""

    copies: int = 0
    tokens: int = 0
    _bucket: float = field(default=math.nan)
    _bucket_at_s: float = 0.0
    _last_to: dict[ReplicaId, float] = field(default_factory=dict)

    def plan(self, settings: SpreadSettings, *, tokens: int, answer_tokens: int,
             home: ReplicaLoad, targets: Mapping[ReplicaId, ReplicaLoad],
             timing: DecodeTiming, now_s: float) -> SpreadCopy | SpreadSkip:
        """Whether to copy a session that just ended on ``home`` (its load with the session
        itself left out of ``resting_sessions``), and where.

        Args:
            settings: the pool's spread-ahead settings.
            tokens: the session's cached context (its prompt) a copy would prefill.
            answer_tokens: its last answer's length (its next turn's decode, as a guess).
            home: the load of the replica it rests on, without the session itself.
            targets: the candidate replicas' loads (same pool and version, healthy, not home).
            timing: the pool's decode step model.
            now_s: the injected clock.
        """
        if not settings.enabled:
            return SpreadSkip("off")
        if tokens < max(1, settings.min_tokens):
            return SpreadSkip("short")
        others = home.resting_sessions
        if others <= 0:
            return SpreadSkip("alone")
        each = home.resting_other_tokens / others
        step = timing.step_s(2, tokens + each) * home.itl_scale
        window = max(1, answer_tokens) * step
        overlap = -math.expm1(-others * window / max(home.session_rest_s, 1e-9))
        if overlap < settings.overlap:
            return SpreadSkip("alone")
        home_crowd = home.resting_other_tokens
        best: tuple[tuple[float, float, float, float], ReplicaId] | None = None
        for name, load in targets.items():
            if load.num_in_flight > settings.max_target_in_flight:
                continue
            if not load.kv_capacity_tokens:
                continue  # KV room unknown: a copy could evict what it cannot see
            room = load.kv_capacity_tokens - load.kv_used_tokens - load.resting_session_tokens
            if room < tokens + answer_tokens:
                continue
            if load.resting_session_tokens >= home_crowd:
                continue
            if tokens / max(load.prefill_rate_tps, 1e-9) > home.session_rest_s / 2:
                continue
            key = (float(load.resting_session_tokens), float(load.num_in_flight),
                   -float(room), self._last_to.get(name, -math.inf))
            if best is None or key < best[0]:
                best = (key, name)
        if best is None:
            return SpreadSkip("no_target")
        if self.tokens + tokens > settings.budget_tokens:
            return SpreadSkip("budget")
        if math.isnan(self._bucket):
            self._bucket, self._bucket_at_s = settings.burst, now_s
        self._bucket = min(settings.burst,
                           self._bucket + settings.per_s * max(0.0, now_s - self._bucket_at_s))
        self._bucket_at_s = now_s
        if self._bucket < 1.0:
            return SpreadSkip("rate")
        self._bucket -= 1.0
        self.copies += 1
        self.tokens += tokens
        target = best[1]
        self._last_to[target] = now_s
        return SpreadCopy(target, tokens, overlap)
