"""Model-bound cache scenarios as route settings: upgrade, A/B split, failover.

Every operation that changes the weights behind a route has a recompute bill: the tokens a
session had cached that it must prefill again (docs/model-bound-caches.md). This module holds
the settings of the three scenarios a route can declare (``routes.<name>`` in the config) and
the pure state each one keeps between requests; ``core/walk.py`` applies them to every walk,
and both drivers (``shell/forward.py``, ``sim/fleet.py``) carry out the shadow warm-ups they
ask for and count the bills the walk notes.

* **Upgrade** (:class:`UpgradeSettings`): when a pool's replicas disagree on their version
  (``core/versions.py``), the newest version takes no traffic until it is *ready*: it holds
  at least ``ready_share`` of the pool's healthy replicas, and each of its replicas has been
  warmed in shadow, as it joined, with the hottest live prefixes not warmed yet (the latest
  prompts of the sessions seen most recently, which hold the shared system prompts too)
  within ``warm_budget_tokens`` per replica (0: no warming). Then new sessions go to it and,
  with ``move_sessions``, every other session moves at its next turn (a turn boundary;
  nothing in flight moves). Replicas come back from a restart one by one: warming each as it
  joins spreads the warm-ups over the new version's replicas (and their KV capacity) instead
  of piling them on the first one back.
* **A/B split** (:class:`AbSplitSettings`): each request of the route goes to one arm (a pool)
  chosen by weight; ``sticky`` chooses once per session (by a hash of the session key,
  remembered in the session record, so a session never flips mid-conversation even when the
  weights change). Token ids a client sent in the body are valid for one tokenizer only: such
  a request may use an arm other than the route's first only when the two pools' tokenizers
  are proven identical (:class:`ScenarioState.tokenizers_match`).
* **Failover** (:class:`FailoverSettings`): the route's ``primary`` pool is replaced by its
  ``backup`` (local, or an external provider) while the primary has no healthy replica or
  every healthy one has at least ``saturated_waiting`` requests waiting; it comes back after
  the primary has been healthy and unsaturated for ``back_after_s`` (hysteresis:
  :class:`FailoverSwitch`). With ``warm_budget_tokens``, a local backup is warmed in shadow
  every ``warm_interval_s`` with the latest prompts of the sessions active since the last
  warm-up, hottest first, within the budget.

The bill of a move (:func:`recompute_bill`): the prefix the session had cached where it was
(its last prompt, whole blocks, never the last token) minus what the new place is expected to
hold. Shadow warm-ups are billed separately (``warm tokens``): they are the price paid to make
the bill smaller.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kvroute.core.errors import ConfigError
from kvroute.core.types import PoolName, ReplicaId

__all__ = [
    "AbArm",
    "AbSplitSettings",
    "FailoverSettings",
    "FailoverSwitch",
    "HotSession",
    "HotSessions",
    "RouteScenarios",
    "ScenarioState",
    "UpgradeProgress",
    "UpgradeSettings",
    "choose_arm",
    "recompute_bill",
    "version_salt",
]

DEFAULT_MAX_HOT: Final = 1024
"""Sessions remembered for shadow warming, per route (LRU). Only routes that warm in shadow
keep them, and the live router keeps each one's parsed request (its whole prompt): the bound
is what a warm-up can use (a few hundred thousand tokens per replica are tens of sessions),
not every session of a busy route."""


# --- settings -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UpgradeSettings:
    """A route's rolling-upgrade behaviour (module docstring).

    Attributes:
        warm_budget_tokens: prompt tokens each replica of the new version is warmed with
            as it joins, before the version takes traffic (0: no warming, cold).
        move_sessions: sessions on an older version move to the new one at their next turn
            (False: they stay until their version has no healthy replica left).
        warm_timeout_s: a warm-up round counts as done this long after it started even if
            not every warm-up answered (a lost warm-up never blocks an upgrade).
        ready_share: the share of the pool's healthy replicas the new version must hold
            before it takes traffic (0.5: half; lower for a canary).
    """

    warm_budget_tokens: int = 0
    move_sessions: bool = True
    warm_timeout_s: float = 60.0
    ready_share: float = 0.5


@dataclass(frozen=True, slots=True)
class AbArm:
    """One arm of an A/B split: a pool and its share of the traffic (any positive weight)."""

    pool: PoolName
    weight: float


@dataclass(frozen=True, slots=True)
class AbSplitSettings:
    """A weighted split of a route's traffic between pools (module docstring)."""

    arms: tuple[AbArm, ...]
    sticky: bool = True

    def __post_init__(self) -> None:
        if len(self.arms) < 2:
            raise ConfigError("an A/B split needs at least two arms (pools with weights)")
        if any(not arm.weight > 0 for arm in self.arms):
            raise ConfigError("every A/B arm needs a weight > 0")
        if len({arm.pool for arm in self.arms}) != len(self.arms):
            raise ConfigError("A/B arms must name distinct pools")


@dataclass(frozen=True, slots=True)
class FailoverSettings:
    """A backup pool for a route's primary (module docstring)."""

    primary: PoolName
    backup: PoolName
    saturated_waiting: int = 8
    back_after_s: float = 30.0
    warm_budget_tokens: int = 0
    warm_interval_s: float = 30.0


@dataclass(frozen=True, slots=True)
class RouteScenarios:
    """A route's model-bound cache settings. ``version_salt``: every request's
    ``cache_salt`` also names the version it is served by (:func:`version_salt`), on the
    engines and in the index alike, so no shared KV store can hand one version's blocks to
    another."""

    upgrade: UpgradeSettings | None = None
    ab_split: AbSplitSettings | None = None
    failover: FailoverSettings | None = None
    version_salt: bool = False

    @property
    def any(self) -> bool:
        return (self.upgrade is not None or self.ab_split is not None
                or self.failover is not None or self.version_salt)


NO_SCENARIOS: Final = RouteScenarios()


# --- pure decisions -------------------------------------------------------------------------


def _unit(text: str) -> float:
    """A stable number in [0, 1) from ``text`` (SHA-256, not Python's salted ``hash``: the
    same session takes the same arm in every router process and after a restart)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2.0**64


def choose_arm(split: AbSplitSettings, key: str) -> AbArm:
    """The arm ``key`` (a session key when sticky, a request id otherwise) falls in."""
    total = sum(arm.weight for arm in split.arms)
    point = _unit(key) * total
    for arm in split.arms:
        point -= arm.weight
        if point < 0:
            return arm
    return split.arms[-1]


def version_salt(version: str, tenant_salt: str | None) -> str:
    """The ``cache_salt`` of a request served by ``version`` (and its tenant's salt, if
    any): 32 hex characters, inside vLLM's ``cache_salt`` rules. Different versions never
    share a salt, so never a block hash."""
    seed = f"{tenant_salt or ''}\x1f{version}".encode()
    return hashlib.sha256(b"kvroute-version\x1f" + seed).hexdigest()[:32]


def recompute_bill(previous_prompt_tokens: int, num_prompt_tokens: int, block_size: int,
                   cached_now: int) -> int:
    """Tokens re-prefilled because a session moved: the prefix it had cached where it was
    (its last prompt, in whole blocks, never this prompt's last token) minus what the new
    place is expected to hold (``cached_now``). 0 when nothing was lost."""
    if previous_prompt_tokens <= 0 or num_prompt_tokens <= 1 or block_size <= 0:
        return 0
    had = min(previous_prompt_tokens, num_prompt_tokens - 1) // block_size * block_size
    return max(0, had - cached_now)


class FailoverSwitch:
    """The primary/backup state of one failover route, with hysteresis.

    Goes to the backup at once when the primary is not usable; comes back only after the
    primary has been usable for ``back_after_s`` without interruption, so a primary that
    flaps does not drag sessions back and forth (each move is a full re-prefill)."""

    __slots__ = ("active", "back_after_s", "ok_since", "switches")

    def __init__(self, back_after_s: float) -> None:
        self.back_after_s = back_after_s
        self.active = False
        self.ok_since: float | None = None
        self.switches = 0

    def update(self, now_s: float, primary_usable: bool) -> bool:
        """The primary's state now; returns True while the backup takes the route."""
        if not primary_usable:
            self.ok_since = None
            if not self.active:
                self.active = True
                self.switches += 1
            return True
        if self.ok_since is None:
            self.ok_since = now_s
        if self.active and now_s - self.ok_since >= self.back_after_s:
            self.active = False
            self.switches += 1
        return self.active

    def force(self, now_s: float) -> None:
        """Every primary replica failed this request: switch now, whatever the probes say."""
        self.update(now_s, primary_usable=False)


# --- shadow warming -------------------------------------------------------------------------


@dataclass(slots=True)
class HotSession:
    """A session's latest prompt as a shadow warm-up would resend it.

    ``payload`` is the driver's own (the live router keeps the parsed request, the simulator
    the workload request); the core never looks inside it."""

    key: str
    pool: PoolName
    tokens: int
    token_ids: Sequence[int] | None
    tenant: str
    tenant_salt: str | None
    payload: Any
    last_seen_s: float
    turns: int = 1


class HotSessions:
    """The latest prompt of the sessions seen most recently, bounded (LRU)."""

    __slots__ = ("_items", "max_sessions")

    def __init__(self, max_sessions: int = DEFAULT_MAX_HOT) -> None:
        self.max_sessions = max_sessions
        self._items: OrderedDict[str, HotSession] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def touch(self, item: HotSession) -> None:
        old = self._items.pop(item.key, None)
        if old is not None:
            item.turns = old.turns + 1
        self._items[item.key] = item
        while len(self._items) > self.max_sessions:
            self._items.popitem(last=False)

    def hottest(self, budget_tokens: int, *, pool: PoolName | None = None,
                since_s: float = float("-inf"),
                skip: Container[str] = ()) -> list[HotSession]:
        """The most recent sessions (of ``pool``, seen at or after ``since_s``, not in
        ``skip``) whose prompts fit in ``budget_tokens`` together, most recent first; a
        prompt larger than what is left of the budget is skipped, not cut."""
        chosen: list[HotSession] = []
        left = budget_tokens
        for item in reversed(self._items.values()):
            if item.last_seen_s < since_s:
                break  # most recent first: the rest are older still
            if (pool is not None and item.pool != pool) or item.key in skip:
                continue
            if item.tokens <= left:
                chosen.append(item)
                left -= item.tokens
            if left <= 0:
                break
        return chosen


@dataclass(slots=True)
class UpgradeProgress:
    """A new version's way to traffic: its replicas warmed one round each as they join
    (``pending`` warm-ups out, the last round started at ``round_s``), ready once it holds
    its share of the pool and no warm-up is out."""

    version: str
    started_s: float
    pending: int = 0
    ready: bool = False
    warm_tokens: int = 0
    round_s: float = float("-inf")
    warmed_replicas: set[ReplicaId] = field(default_factory=set)
    warmed_sessions: set[str] = field(default_factory=set)


@dataclass(slots=True)
class ScenarioState:
    """What one route's scenarios remember between requests (one per route and router).

    Attributes:
        settings: the route's scenario settings.
        hot: the sessions a shadow warm-up would warm.
        failover: the primary/backup switch, when the route has a failover.
        upgrades: pool → the newest version's progress.
        last_backup_warm_s: when the backup was last warmed in shadow.
        tokenizers_match: pools whose tokenizers are proven identical (token ids of one are
            valid for the other); drivers set it from tokenizer fingerprints.
    """

    settings: RouteScenarios
    hot: HotSessions = field(default_factory=HotSessions)
    failover: FailoverSwitch | None = None
    upgrades: dict[PoolName, UpgradeProgress] = field(default_factory=dict)
    last_backup_warm_s: float = float("-inf")
    tokenizers_match: set[frozenset[PoolName]] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.failover is None and self.settings.failover is not None:
            self.failover = FailoverSwitch(self.settings.failover.back_after_s)

    def ids_shareable(self, a: PoolName, b: PoolName) -> bool:
        return a == b or frozenset((a, b)) in self.tokenizers_match

    def upgrade_target(self, pool: PoolName, newest: str, now_s: float) -> UpgradeProgress:
        """The progress of ``newest`` in ``pool`` (a new one when ``newest`` is new)."""
        progress = self.upgrades.get(pool)
        if progress is None or progress.version != newest:
            progress = self.upgrades[pool] = UpgradeProgress(newest, now_s)
        upgrade = self.settings.upgrade
        if (upgrade is not None and progress.pending > 0
                and now_s - progress.round_s >= upgrade.warm_timeout_s):
            progress.pending = 0  # lost warm-ups never block the upgrade
        return progress

    def warm_finished(self, pool: PoolName, version: str) -> None:
        """One shadow warm-up of ``version`` in ``pool`` answered (or failed)."""
        progress = self.upgrades.get(pool)
        if progress is None or progress.version != version:
            return
        progress.pending = max(0, progress.pending - 1)


def primary_usable(healthy: Sequence[ReplicaId], waiting: Mapping[ReplicaId, int | None],
                   saturated_waiting: int) -> bool:
    """The primary can take the route: a healthy replica with fewer than
    ``saturated_waiting`` requests waiting (unknown waiting counts as not saturated)."""
    for replica in healthy:
        count = waiting.get(replica)
        if count is None or count < saturated_waiting:
            return True
    return False
